"""Every ExportDB case shipped with the installed torch (torch._export.db.examples), written as a
pt2flow config and run by the real `pt2flow run --json` through trace, functionalize,
decompose, serialize and validate: every case is expressible, every case ExportDB marks
supported ends ok (or with the specific class EXPECTED_FAILURES explains), none ends internal.
ExportDB through aot_compile is a benchmark, not a test (bench/exportdb_compile.py,
`make bench-exportdb-compile`).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import yaml

from tests import exportdb
from tests.conftest import run_cli, run_json

pytestmark = pytest.mark.integration

# Supported cases that end in another state than ok, with the reason. Empty with torch 2.13:
# every supported case exports, lowers to core ATen, round-trips and matches eager.
EXPECTED_FAILURES: dict[str, tuple[str, str]] = {}

# Cases ExportDB marks not supported yet, and what pt2flow makes of them.
NOT_SUPPORTED_OUTCOMES = {
    # round() of a dynamic size cannot be traced symbolically: both strictnesses fail with a
    # dynamic-shape error, the ladder exports static shapes, and the run says so
    "dynamic_shape_round": "static_fallback",
}

STATIC_FORBIDDEN = "dynamic_shape_round-no-static"

# a detection-style signature written in YAML, with a dynamic batch on the tensors inside a list
NESTED = {
    "name": "nested-inputs",
    "factory": "tests.models:nested_inputs",
    "inputs": {
        "images": [{"shape": [3, 4]}, {"shape": [3, 4]}],
        "meta": {"bias": {"shape": [3]}},
        "pair": {"tuple": [{"shape": [3]}, 2.0]},
        "scale": 0.5,
        "mode": "with-pair",
    },
    "dynamic_shapes": {"images": [{0: "batch"}, {0: "batch"}]},
    "dims": {"batch": {"min": 1, "max": 12}},
}


@pytest.fixture(scope="module")
def exportdb_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("exportdb")
    extra = exportdb.write_escape_hatches(folder)
    forbidden, _ = exportdb.entry("dynamic_shape_round", exportdb.cases()["dynamic_shape_round"])
    forbidden = {**forbidden, "name": STATIC_FORBIDDEN, "stages": {"trace": {"fallback": {"static": False}}}}
    config = exportdb.write_fleet(folder, extra=[*extra, forbidden, NESTED])
    store = folder / "store"
    code, document, stderr = run_json(["run", str(config), "--store", str(store)], timeout=1200)
    assert "Traceback" not in stderr, stderr[-4000:]
    return {"code": code, "document": document, "config": config, "store": store, "stderr": stderr}


def _by_name(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in run["document"]["models"]}


def test_every_case_is_expressible_and_none_is_internal(exportdb_run: dict[str, Any]) -> None:
    cases = exportdb.cases()
    models = _by_name(exportdb_run)
    assert set(cases) <= set(models), "every ExportDB case is in the generated config and the run"
    tally = Counter(m["error_class"] or "ok" for m in (models[n] for n in cases))
    static = sum(1 for n in cases if models[n].get("static_fallback"))
    print(
        f"\nExportDB with the installed torch: {len(cases)} cases, "
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
        + f" (of them {static} with a static-shape fallback)"
    )
    assert "internal" not in tally and "config" not in tally
    for name, case in cases.items():
        outcome = models[name]
        if case.support_level.name == "SUPPORTED":
            expected = EXPECTED_FAILURES.get(name, ("ok", ""))[0]
            got = outcome["error_class"] or outcome["status"]
            assert got == expected, f"{name}: {outcome['failed_stage']} {outcome['error_class']}: {outcome['error']}"
            if outcome["status"] == "ok":
                assert outcome["static_fallback"] is False, f"{name} exported only with static shapes"
                assert outcome["validation"]["passed"] is True
        else:
            assert name in NOT_SUPPORTED_OUTCOMES, f"{name} is new in ExportDB: decide what pt2flow should make of it"
    # the run's exit code says whether every model succeeded
    assert exportdb_run["code"] == (0 if all(m["status"] == "ok" for m in models.values()) else 1)


def test_inputs_of_every_container_kind_reach_forward(exportdb_run: dict[str, Any]) -> None:
    models = _by_name(exportdb_run)
    config = yaml.safe_load(exportdb_run["config"].read_text())
    entries = {m["name"]: m for m in config["models"]}
    # a tuple of tensors, *args as a list, **kwargs by name; a list of tensors; a string; a dict in a tuple
    assert "tuple" in entries["fn_with_kwargs"]["inputs"]["tuple0"] and isinstance(
        entries["fn_with_kwargs"]["inputs"]["myargs"], list
    )
    assert isinstance(entries["list_unpack"]["inputs"]["args"], list)
    assert entries["tensor_setattr"]["inputs"]["attr"] == "attr"
    assert isinstance(entries["pytree_flatten"]["inputs"]["x"]["tuple"][0], dict)
    for name in (
        "fn_with_kwargs",
        "list_unpack",
        "tensor_setattr",
        "pytree_flatten",
        "user_input_mutation",
        "assume_constant_result",
    ):
        assert models[name]["status"] == "ok", models[name]
        assert models[name]["validation"]["samples"] == 3
    # a dynamic dim on a tensor the program keeps dynamic: cond_operands' x
    assert (
        models["cond_operands"]["static_fallback"] is False
        and models["cond_operands"]["trace_strategy"] == "configured"
    )


def test_escape_hatches_inputs_factory_and_files(exportdb_run: dict[str, Any]) -> None:
    models = _by_name(exportdb_run)
    for name in ("fn_with_kwargs-inputs-factory", "pytree_flatten-inputs-file", "dictionary-safetensors"):
        assert models[name]["status"] == "ok", models[name]
        assert models[name]["validation"]["passed"] is True
    # the example inputs are made once per model (issue 43): the factory ran once in the whole
    # run, at the source stage, though trace and validate use its inputs too
    calls = (exportdb_run["config"].parent / "inputs_factory_calls.log").read_text().split()
    assert len(calls) == 1, calls

    # the same model traced on inputs from a factory / a file as on the YAML spec of the same
    # structure and shapes: the same program (graph, signature, weights)
    def fingerprint(name: str) -> str:
        rc, record, _ = run_json(
            ["show", models[name]["stages"]["trace"]["artifact"], "--store", str(exportdb_run["store"])]
        )
        assert rc == 0 and record["stage"] == "trace" and record["model"] == name
        return record["fingerprint"]

    for variant, yaml_case in (
        ("fn_with_kwargs-inputs-factory", "fn_with_kwargs"),
        ("pytree_flatten-inputs-file", "pytree_flatten"),
        ("dictionary-safetensors", "dictionary"),
    ):
        assert fingerprint(variant) == fingerprint(yaml_case), variant


def test_unbounded_symbols_are_recorded_as_open_bounds(exportdb_run: dict[str, Any]) -> None:
    models = _by_name(exportdb_run)
    artifact = models["assume_constant_result"]["stages"]["trace"]["artifact"]
    rc, record, _ = run_json(["show", artifact, "--store", str(exportdb_run["store"])])
    assert rc == 0
    ranges = record["range_constraints"]
    ranges = json.loads(ranges) if isinstance(ranges, str) else ranges
    # .item() makes an unbacked symbol; unbounded ends are null, bounded ends numbers
    assert [None, None] in ranges.values(), ranges
    assert any(lo is not None and hi is not None for lo, hi in ranges.values()), ranges


def test_input_mutation_is_validated_not_called_nondeterministic(exportdb_run: dict[str, Any]) -> None:
    outcome = _by_name(exportdb_run)["user_input_mutation"]
    assert outcome["status"] == "ok" and outcome["error_class"] is None
    report_digest = outcome["stages"]["validate"]["artifact"]
    report = json.loads((exportdb_run["store"] / "blobs" / "sha256" / report_digest[:2] / report_digest).read_text())
    assert report["nondeterministic"] is False and report["passed"] is True


def test_static_fallback_is_visible_and_can_be_forbidden(exportdb_run: dict[str, Any]) -> None:
    models = _by_name(exportdb_run)
    fell_back = models["dynamic_shape_round"]
    assert fell_back["status"] == "ok"
    assert fell_back["trace_strategy"] == "static" and fell_back["static_fallback"] is True
    forbidden = models[STATIC_FORBIDDEN]
    assert forbidden["status"] == "failed" and forbidden["failed_stage"] == "trace"
    assert forbidden["error_class"] == "dynamic_shape"
    assert "static fallback forbidden" in forbidden["error"]
    assert forbidden["static_fallback"] is False and forbidden["trace_strategy"] is None

    # the summary table of a second (fully cached) run marks it too
    config, store = exportdb_run["config"], exportdb_run["store"]
    proc = run_cli(
        ["run", str(config), "--store", str(store), "--only", "dynamic_shape_round", "--only", "class_method"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[1]: line for line in proc.stdout.splitlines() if line.startswith("│")}
    assert "static!" in rows["dynamic_shape_round"] and "static!" not in rows["class_method"]
    assert "1 model exported with static shapes" in proc.stdout

    # and the drift report between the two runs
    rc, report, stderr = run_json(["report", "--store", str(store)])
    assert rc == 0, stderr[-2000:]
    entry = next(m for m in report["models"] if m["model"] == "dynamic_shape_round")
    assert entry["status"]["b"]["static_fallback"] is True and entry["status"]["b"]["trace_strategy"] == "static"
    other = next(m for m in report["models"] if m["model"] == "class_method")
    assert other["status"]["b"]["static_fallback"] is False
    text = run_cli(["report", "--store", str(store)]).stdout
    assert text.count("static!") == 1  # the one model of the two runs that fell back, and only it


def test_a_dynamic_dim_inside_a_list_through_the_cli(exportdb_run: dict[str, Any]) -> None:
    outcome = _by_name(exportdb_run)["nested-inputs"]
    assert outcome["status"] == "ok", outcome
    assert outcome["trace_strategy"] == "configured" and outcome["static_fallback"] is False
    digest = outcome["stages"]["validate"]["artifact"]
    report = json.loads((exportdb_run["store"] / "blobs" / "sha256" / digest[:2] / digest).read_text())
    # validated at the example batch, at the dim's min and at its max
    assert [p["sizes"] for p in report["plan"]] == [{}, {"batch": 1}, {"batch": 12}]
    assert report["passed"] is True


def test_check_compat_reloads_every_archive_and_matches_the_stored_outputs(exportdb_run: dict[str, Any]) -> None:
    """check-compat on the whole ExportDB run: every archive loads in a worker process (not the
    one that built it) and, where validate could store its inputs and outputs, computes them again."""
    run_id = exportdb_run["document"]["run_id"]  # other tests add runs to this store
    code, report, stderr = run_json(["check-compat", run_id, "--store", str(exportdb_run["store"])], timeout=1200)
    assert "Traceback" not in stderr, stderr[-4000:]
    built = {m["name"] for m in exportdb_run["document"]["models"] if m["artifacts"].get("serialized")}
    checked = {m["name"]: m for m in report["models"]}
    assert set(checked) == built and len(built) >= 30, (sorted(set(checked) ^ built), len(built))
    bad = {
        n: (m["error_class"], (m["archive"]["error"] or "")[:200]) for n, m in checked.items() if m["status"] != "ok"
    }
    assert code == 0 and not bad, bad
    compared = [m for m in checked.values() if m["archive"]["matches"] is not None]
    assert all(m["archive"]["matches"] for m in compared)
    # every ok model had its samples stored, except where validate said why not
    unstored = {n: m["note"] for n, m in checked.items() if m["archive"]["matches"] is None}
    assert all(note for note in unstored.values()), unstored
    print(
        f"\ncheck-compat on ExportDB: {len(checked)} archives load, {len(compared)} re-run on stored samples; not stored: {unstored}"
    )
