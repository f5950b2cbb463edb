"""The typed documents dump the contract's JSON (docs/architecture.md §4) key for key, in order,
and a dump validated back gives the same document; the index record derives the Parquet schema."""

from __future__ import annotations

import json

import pyarrow as pa

from pt2flow.flows.engine.common.documents import ModelResult, Outcome, RunDocument, RunSummary, StageView
from pt2flow.flows.engine.orchestrator.runner import add_trace_and_validation
from pt2flow.storage.index import COLUMNS, JSON_COLUMNS, SCHEMA, records_to_table
from pt2flow.storage.records import IndexRecord

SHA = "a" * 64


def round_trips(model: type, document: dict) -> None:
    """`document`, through JSON text and back through `model`, dumps to itself in the same key order."""
    loaded = json.loads(json.dumps(document))
    dumped = model.model_validate(loaded).model_dump(mode="json")
    assert dumped == loaded
    assert json.dumps(dumped) == json.dumps(loaded)  # key order included


def test_stage_views_have_the_contract_keys() -> None:
    ok = StageView.of(Outcome(seconds=1.5, artifact=SHA, key="k")).model_dump(mode="json")
    assert ok == {"status": "ok", "cached": False, "seconds": 1.5, "artifact": SHA}
    assert list(ok) == ["status", "cached", "seconds", "artifact"]
    warned = StageView.of(Outcome(cached=True, seconds=0.1, artifact=SHA, warnings=["w"])).model_dump(mode="json")
    assert list(warned) == ["status", "cached", "seconds", "artifact", "warnings"] and warned["warnings"] == ["w"]
    failed = Outcome.failure("k", "unsupported_op", "no", seconds=0.25)
    failed.artifact = SHA  # the failure's report blob
    view = StageView.of(failed).model_dump(mode="json")
    assert view == {
        "status": "failed",
        "cached": False,
        "seconds": 0.25,
        "artifact": None,
        "error_class": "unsupported_op",
        "error": "no",
        "report": SHA,
    }
    assert list(view) == ["status", "cached", "seconds", "artifact", "error_class", "error", "report"]
    plain = StageView.of(Outcome.failure("k", "timeout", "slow", seconds=1)).model_dump(mode="json")
    assert list(plain) == ["status", "cached", "seconds", "artifact", "error_class", "error"]
    for document in (ok, warned, view, plain):
        round_trips(StageView, document)


def test_model_results_have_the_contract_keys() -> None:
    result = ModelResult(name="m", source=SHA, worker="host:1")
    trace = Outcome(artifact=SHA, details={"strategy": "static"})
    validate = Outcome(
        artifact=SHA,
        details={"validation": {"passed": True, "max_abs_err": 0.0, "max_rel_err": 1e-9, "samples": 3, "extra": 1}},
    )
    result.stages["trace"] = StageView.of(trace)
    result.artifacts.serialized = SHA
    add_trace_and_validation(result, {"trace": trace, "validate": validate})
    ok = result.model_dump(mode="json")
    assert list(ok) == [
        "name",
        "status",
        "failed_stage",
        "error_class",
        "error",
        "stages",
        "artifacts",
        "validation",
        "worker",
        "source",
        "trace_strategy",
        "static_fallback",
    ]
    assert ok["artifacts"] == {"serialized": SHA, "compiled": None}
    assert ok["validation"] == {"passed": True, "max_abs_err": 0.0, "max_rel_err": 1e-9, "samples": 3}
    assert ok["trace_strategy"] == "static" and ok["static_fallback"] is True

    failed = ModelResult(name="f")
    failed.fail("source", Outcome.failure("k", "crash", "died", seconds=1, details={"stderr_tail": "boom"}))
    add_trace_and_validation(failed, {})
    dumped = failed.model_dump(mode="json")
    assert list(dumped) == [
        "name",
        "status",
        "failed_stage",
        "error_class",
        "error",
        "stages",
        "artifacts",
        "validation",
        "worker",
        "stderr_tail",
        "trace_strategy",
        "static_fallback",
    ]
    assert (dumped["status"], dumped["failed_stage"], dumped["error_class"], dumped["error"]) == (
        "failed",
        "source",
        "crash",
        "died",
    )
    assert dumped["trace_strategy"] is None and dumped["static_fallback"] is False and dumped["validation"] is None

    crashed = ModelResult.crashed("c", "the model flow ended without a result: None").model_dump(mode="json")
    assert crashed == {
        "name": "c",
        "status": "failed",
        "failed_stage": None,
        "error_class": "internal",
        "error": "the model flow ended without a result: None",
        "stages": {},
        "artifacts": {"serialized": None, "compiled": None},
        "validation": None,
        "worker": None,
    }
    for document in (ok, dumped, crashed):
        round_trips(ModelResult, document)


def test_run_document_keys() -> None:
    document = RunDocument(
        run_id="r",
        store="/s",
        summary=RunSummary(ok=0, failed=1, seconds=0.5),
        models=[ModelResult.crashed("c", "x")],
        workers=0,
    )
    dumped = document.model_dump(mode="json")
    assert list(dumped) == ["run_id", "store", "summary", "models", "workers", "python"]
    assert list(dumped["summary"]) == ["ok", "failed", "seconds", "partial"]  # partial: added after the contract's keys
    round_trips(RunDocument, dumped)


def test_the_index_schema_follows_from_the_record() -> None:
    assert COLUMNS[0] == "schema_version" and SCHEMA.field("schema_version").type == pa.int16()
    assert list(COLUMNS[1:]) == list(IndexRecord.__dataclass_fields__)
    assert all(field.nullable for field in SCHEMA)
    assert JSON_COLUMNS == {
        "op_histogram",
        "signature",
        "range_constraints",
        "validation",
        "options",
        "kwargs",
        "details",
    }
    record = IndexRecord(record_id="r1", model="m", parent_keys=("k1",), warnings=(), seconds=1.0)
    table = records_to_table([record, {"record_id": "r2", "model": "n"}])
    assert table.schema == SCHEMA
    rows = table.to_pylist()
    assert rows[0]["parent_keys"] == ["k1"] and rows[0]["warnings"] == [] and rows[0]["schema_version"] == 1
    assert rows[1]["parent_keys"] is None and rows[1]["model"] == "n"
