"""Failures grouped by root cause, and OpenLineage events, on a real fleet run twice (issue 22).

The fleet (tests/failure_models.py): six models fail at trace for three causes, two models each,
every pair with different names, widths and batch sizes: a data-dependent branch in a shared
block (gated-*), a custom op without a fake kernel (opaque-*), and a data-dependent expert index
(routed-*: the same error class as gated-*, another cause). One model (mlp, with weights) exports.

Run 1 sends its OpenLineage events over the client's HTTP transport to a real HTTP server started
here; run 2, after the gated block is fixed (its `safe` kwarg), sends them to a closed port.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from collections.abc import Iterator
from urllib.parse import urlsplit

import jsonschema
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import ROOT, cli_env, run_cli, run_cli_into_closed_pipe, run_json, write_config

pytestmark = pytest.mark.integration

SCHEMA = json.loads((Path(__file__).parent / "openlineage_run_event.schema.json").read_text())
PAIRS = {
    "gated": ("gated-small", "gated-wide"),
    "opaque": ("opaque-small", "opaque-wide"),
    "routed": ("routed-a", "routed-b"),
}


def fleet(folder: Path, *, fixed: bool) -> Path:
    torch.manual_seed(0)
    from tests.models import tiny_mlp

    save_file({k: v.contiguous() for k, v in tiny_mlp().state_dict().items()}, str(folder / "mlp.safetensors"))
    safe = {"kwargs": {"safe": True}} if fixed else {}
    return write_config(
        folder / "fleet.yaml",
        [
            {
                "name": "gated-small",
                "factory": "tests.failure_models:gated_small",
                "inputs": {"x": {"shape": [2, 4]}},
                **safe,
            },
            {
                "name": "gated-wide",
                "factory": "tests.failure_models:gated_wide",
                "inputs": {"x": {"shape": [5, 6]}},
                **safe,
            },
            {
                "name": "opaque-small",
                "factory": "tests.failure_models:opaque_small",
                "inputs": {"x": {"shape": [3, 4]}},
            },
            {"name": "opaque-wide", "factory": "tests.failure_models:opaque_wide", "inputs": {"x": {"shape": [2, 24]}}},
            {"name": "routed-a", "factory": "tests.failure_models:routed_a", "inputs": {"x": {"shape": [3, 4]}}},
            {"name": "routed-b", "factory": "tests.failure_models:routed_b", "inputs": {"x": {"shape": [4, 10]}}},
            {
                "name": "mlp",
                "factory": "tests.models:tiny_mlp",
                "inputs": {"x": {"shape": [2, 8]}},
                "weights": "mlp.safetensors",
            },
        ],
        store="store",
        stages=["trace", "serialize", "validate"],
    )


class Collector(ThreadingHTTPServer):
    """An OpenLineage collector: keeps every event POSTed to /api/v1/lineage."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.paths: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                collector.paths.append(self.path)
                collector.events.append(json.loads(body))
                self.send_response(201)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def closed_port() -> int:
    """A port on this machine nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("failure-groups")
    store = str(folder / "store")
    collector = Collector()
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    lineage = {"OPENLINEAGE_NAMESPACE": "fleet-test"}
    try:
        code1, doc1, err1 = run_json(
            ["run", str(fleet(folder, fixed=False))], env={**lineage, "OPENLINEAGE_URL": collector.url}
        )
        events = list(collector.events)
        _, failures1, _ = run_json(["failures", "--store", store])
        code2, doc2, err2 = run_json(
            ["run", str(fleet(folder, fixed=True))], env={**lineage, "OPENLINEAGE_URL": collector.url}
        )
        events2 = collector.events[len(events) :]
    finally:
        collector.shutdown()
        collector.server_close()
    _, failures2, _ = run_json(["failures", "--store", store])
    # run 3: nothing changed, so the index settles every model (no Prefect), and the collector is down
    code3, doc3, err3 = run_json(
        ["run", str(folder / "fleet.yaml")], env={**lineage, "OPENLINEAGE_URL": f"http://127.0.0.1:{closed_port()}"}
    )
    yield {
        "folder": folder,
        "store": store,
        "code1": code1,
        "doc1": doc1,
        "err1": err1,
        "events": events,
        "paths": list(collector.paths),
        "failures1": failures1,
        "code2": code2,
        "doc2": doc2,
        "err2": err2,
        "events2": events2,
        "failures2": failures2,
        "code3": code3,
        "doc3": doc3,
        "err3": err3,
    }


def by_models(groups: list[dict[str, Any]], field: str = "models") -> dict[tuple[str, ...], dict[str, Any]]:
    return {tuple(sorted(g[field])): g for g in groups}


def test_three_causes_make_three_groups_each_with_its_models(runs: dict[str, Any]) -> None:
    assert runs["code1"] == 1, runs["err1"][-3000:]
    report = runs["failures1"]
    assert report["run_id"] == runs["doc1"]["run_id"] and report["against"] is None
    groups = by_models(report["groups"])
    assert set(groups) == set(PAIRS.values()), [(g["models"], g["signature"]) for g in report["groups"]]
    assert report["summary"] == {"failures": 6, "groups": 3, "new": 3, "persisting": 0, "gone": 0, "fixed_models": 0}
    gated, opaque, routed = (groups[PAIRS[k]] for k in ("gated", "opaque", "routed"))
    # derived from each failure, not from its class: gated and routed share a class, not a cause
    assert gated["error_class"] == routed["error_class"] == "data_dependent" and gated["id"] != routed["id"]
    assert opaque["error_class"] == "unsupported_op" and opaque["subject"] == "op pt2flow_failing::mystery"
    assert (
        gated["where"] == "tests.failure_models:SharedGate.forward"
        and routed["where"] == "tests.failure_models:Router.forward"
    )
    assert opaque["where"] == "tests.failure_models:Opaque.forward"
    assert gated["subject"] == "data-dependent Eq(u, 1)", gated["subject"]  # u0 / u3: symbol numbers gone
    for g in report["groups"]:
        assert g["status"] == "new" and g["count"] == 2 and g["stage"] == "trace"
        assert g["repro"].startswith("pt2flow repro ") and g["representative"]["model"] in g["models"]
        assert not any(name in g["signature"] for name in ("small", "wide", "routed-", "/tmp", "0x"))
        # the representative's draft_export report, grouped the same way, names the same cause
        assert g["draft_report"] and g["draft_report"][0]["subject"] == g["subject"], g["draft_report"]
    # the run's own document carries the same groups (the typed RunDocument's dump, key order
    # included), and so does its summary on the terminal
    from pt2flow.flows.engine.common.documents import RunDocument

    assert list(runs["doc1"])[-1] == "failure_groups"
    assert json.dumps(RunDocument.model_validate(runs["doc1"]).model_dump(mode="json")) == json.dumps(runs["doc1"])
    assert by_models(runs["doc1"]["failure_groups"]).keys() == groups.keys()
    assert {g["id"] for g in runs["doc1"]["failure_groups"]} == {g["id"] for g in report["groups"]}
    text = run_cli(["failures", runs["doc1"]["run_id"], "--store", runs["store"]])
    assert text.returncode == 0 and text.stdout.count("[new]") == 3 and "gated-small, gated-wide" in text.stdout, (
        text.stdout
    )
    # a group's repro command, run as printed, writes a torch-only script that raises the group's error again
    command = shlex.split(opaque["repro"])
    assert command[:2] == ["pt2flow", "repro"] and command[-2:] == ["--store", runs["store"]]
    made = run_cli(command[1:], cwd=runs["folder"])
    assert made.returncode == 0, made.stderr
    script = runs["folder"] / command[command.index("-o") + 1] / "repro.py"
    raised = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=runs["folder"], env=cli_env()
    )
    assert raised.returncode != 0 and "pt2flow_failing::mystery" in raised.stderr, raised.stderr[-2000:]


def test_the_fixed_cause_is_gone_the_next_run(runs: dict[str, Any]) -> None:
    assert runs["code2"] == 1, runs["err2"][-3000:]
    doc2, report = runs["doc2"], runs["failures2"]
    assert {m["name"] for m in doc2["models"] if m["status"] == "ok"} == {"gated-small", "gated-wide", "mlp"}
    assert report["against"] == runs["doc1"]["run_id"]
    first = {g["id"]: g for g in runs["failures1"]["groups"]}
    now = {g["id"]: g for g in report["groups"]}
    assert now.keys() == first.keys()
    status = {tuple(sorted(g["models"] or g["models_against"])): g["status"] for g in report["groups"]}
    assert status == {PAIRS["gated"]: "gone", PAIRS["opaque"]: "persisting", PAIRS["routed"]: "persisting"}
    gone = by_models(report["groups"], "models_against")[PAIRS["gated"]]
    assert gone["models"] == [] and gone["repro"] is None
    assert (
        report["summary"]["groups"] == 2 and report["summary"]["gone"] == 1 and report["summary"]["fixed_models"] == 2
    )
    # the run summary and the drift report show the same groups
    assert {g["id"]: g["status"] for g in doc2["failure_groups"]} == {i: g["status"] for i, g in now.items()}
    code, drift, _ = run_json(["report", runs["doc1"]["run_id"], doc2["run_id"], "--store", runs["store"]])
    assert code == 0 and {g["id"]: g["status"] for g in drift["failure_groups"]} == {
        i: g["status"] for i, g in now.items()
    }
    # --against names the other run; a closed stdout ends the command without a traceback
    _, same, _ = run_json(
        ["failures", runs["doc2"]["run_id"][:17], "--against", runs["doc1"]["run_id"], "--store", runs["store"]]
    )
    assert {g["id"]: g["status"] for g in same["groups"]} == {i: g["status"] for i, g in now.items()}
    cut = run_cli_into_closed_pipe(["failures", "--store", runs["store"], "--json"])
    assert cut.returncode == 141 and "Traceback" not in cut.stderr, cut.stderr
    # the run's summary on the terminal, the fleet's Prefect markdown artifact and the HTML page show the groups
    import io

    from rich.console import Console

    from pt2flow.flows.cli.summary import render_run

    out = io.StringIO()
    render_run(doc2, Console(file=out, width=220))
    summary = out.getvalue()
    assert "4 failures in 2 groups by root cause; 1 group of the previous run gone" in summary, summary
    assert (
        "[gone] data_dependent at trace: data-dependent Eq(u, 1) · tests.failure_models:SharedGate.forward — was gated-small, gated-wide"
        in summary
    )
    from pt2flow.flows.engine.common.documents import RunDocument
    from pt2flow.flows.fleet import fleet_markdown

    markdown = fleet_markdown(RunDocument.model_validate(doc2), None, doc2["failure_groups"])
    rows = [
        line
        for line in markdown.split("## Failure groups", 1)[1].split("##", 1)[0].splitlines()
        if line.startswith("| ")
    ]
    assert len(rows) == 1 + 3 and sum(row.startswith("| gone | 2: gated-small, gated-wide |") for row in rows) == 1, (
        markdown
    )
    page = runs["folder"] / "failures.html"
    assert run_cli(["failures", doc2["run_id"], "--store", runs["store"], "--html", str(page)]).returncode == 0
    assert page.read_text().count("<tr class=") == 3 and "opaque-small, opaque-wide" in page.read_text()


def test_openlineage_events_validate_and_carry_the_lineage_digests(runs: dict[str, Any]) -> None:
    events = runs["events"]
    assert set(runs["paths"]) == {"/api/v1/lineage"}
    validator = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    ours = json.loads((ROOT / "docs" / "openlineage-facets.json").read_text())  # pt2flow's own facets, as documented
    run_facet = jsonschema.Draft202012Validator({**ours, "$ref": "#/$defs/Pt2flowRunFacet"})
    blob_facet = jsonschema.Draft202012Validator({**ours, "$ref": "#/$defs/Pt2flowBlobFacet"})
    for event in events:
        validator.validate(event)
        run_facet.validate(event["run"]["facets"]["pt2flow"])
        for blob in event["inputs"] + event["outputs"]:
            if "pt2flow" in blob["facets"]:  # the weights file at START: its digest is not known yet
                blob_facet.validate(blob["facets"]["pt2flow"])
        for uri in [event["producer"], event["schemaURL"], *(f["_schemaURL"] for f in event["run"]["facets"].values())]:
            assert urlsplit(uri).scheme, uri  # format "uri", which jsonschema checks only with an extra package
    # every stage of every model: START, then COMPLETE (or FAIL) under one runId, in the fleet's namespace
    runs_by_id: dict[str, list[str]] = {}
    for event in events:
        runs_by_id.setdefault(event["run"]["runId"], []).append(event["eventType"])
        assert event["job"]["namespace"] == "fleet-test"
    assert sorted(runs_by_id.values()) == sorted([["START", "COMPLETE"]] * 10 + [["START", "FAIL"]] * 6)
    assert len(events) == 2 * (7 + 7 + 1 + 1)  # source and trace of each model; serialize and validate of mlp
    jobs = {(e["job"]["name"], e["eventType"]): e for e in events}
    failed = jobs[("opaque-wide.trace", "FAIL")]["run"]["facets"]
    assert failed["pt2flow"]["error_class"] == "unsupported_op" and "mystery" in failed["errorMessage"]["message"]
    assert (
        failed["processing_engine"]["version"] == torch.__version__
        and failed["pt2flow"]["versions"]["torch"] == torch.__version__
    )
    assert failed["pt2flow"]["cache"] == "miss" and failed["parent"]["job"]["name"] == "fleet"
    assert {f["_producer"] for k, f in failed.items() if k != "tags"} == {
        "https://pypi.org/project/pt2flow/"
    }  # the client adds `tags`
    verdict = jobs[("mlp.validate", "COMPLETE")]
    assert verdict["run"]["facets"]["pt2flow"]["validation"]["passed"] is True
    assert verdict["outputs"][0]["facets"]["pt2flow"]["kind"] == "report"
    assert (
        verdict["outputs"][0]["facets"]["version"]["datasetVersion"]
        == next(m for m in runs["doc1"]["models"] if m["name"] == "mlp")["stages"]["validate"]["artifact"]
    )

    # the digests `pt2flow lineage` shows for the archive are the datasets' versions
    serialized = next(m for m in runs["doc1"]["models"] if m["name"] == "mlp")["artifacts"]["serialized"]
    code, lineage, _ = run_json(["lineage", serialized, "--store", runs["store"]])
    assert code == 0

    def versions(event: dict[str, Any], side: str) -> set[str]:
        return {d["facets"]["version"]["datasetVersion"] for d in event[side] if "version" in d.get("facets", {})}

    chain = {r["stage"]: r for r in lineage["ancestors"]}
    assert set(chain) == {"source", "trace"} and lineage["id"].startswith(serialized[:8])
    for stage, record in chain.items():
        assert record["sha256"] in versions(jobs[(f"mlp.{stage}", "COMPLETE")], "outputs"), stage
    assert serialized in versions(jobs[("mlp.serialize", "COMPLETE")], "outputs")
    assert chain["source"]["weights_digest"] in versions(jobs[("mlp.source", "COMPLETE")], "outputs")
    assert chain["source"]["weights_digest"] in versions(
        jobs[("mlp.source", "COMPLETE")], "inputs"
    )  # the config's file
    assert chain["source"]["sha256"] in versions(jobs[("mlp.trace", "COMPLETE")], "inputs")
    assert chain["trace"]["sha256"] in versions(jobs[("mlp.serialize", "COMPLETE")], "inputs")
    archive = next(
        d
        for d in jobs[("mlp.serialize", "COMPLETE")]["outputs"]
        if d["facets"]["version"]["datasetVersion"] == serialized
    )
    assert archive["facets"]["pt2flow"]["kind"] == "archive" and archive["name"].endswith(
        f"/blobs/sha256/{serialized[:2]}/{serialized}"
    )
    assert archive["namespace"] == "file"


def test_cached_stages_emit_what_they_served(runs: dict[str, Any]) -> None:
    """Run 2 rebuilt the fixed models and served the rest from the index: the served blobs are
    the datasets, with the cache decision in the pt2flow facet."""
    events = {(e["job"]["name"], e["eventType"]): e for e in runs["events2"]}
    first = {(e["job"]["name"], e["eventType"]): e for e in runs["events"]}
    archive = events[("mlp.serialize", "COMPLETE")]
    assert archive["run"]["facets"]["pt2flow"]["cache"] == "hit"
    assert archive["outputs"] == first[("mlp.serialize", "COMPLETE")]["outputs"]  # the same blob, served
    cached_failure = events[("routed-b.trace", "FAIL")]["run"]["facets"]
    assert (
        cached_failure["pt2flow"]["cache"] == "cached_failure"
        and cached_failure["pt2flow"]["error_class"] == "data_dependent"
    )
    assert (
        events[("gated-wide.serialize", "COMPLETE")]["run"]["facets"]["pt2flow"]["cache"] == "miss"
    )  # fixed: built now
    assert len(runs["events2"]) == 2 * (7 + 7 + 3 + 3) and "OpenLineage" not in runs["err2"]


def test_a_collector_that_is_down_costs_one_warning(runs: dict[str, Any]) -> None:
    err = runs["err3"]
    assert runs["code3"] == 1 and len(runs["doc3"]["models"]) == 7, err[-3000:]
    assert all(s["cached"] for m in runs["doc3"]["models"] for s in m["stages"].values())
    warnings = [line for line in err.splitlines() if "OpenLineage:" in line]
    assert len(warnings) == 1, err[-3000:]
    # the collector refused (its retries spent) or had taken nothing when the run ended: one line either way
    assert (
        "cannot send events to the collector" in warnings[0] or "took no event" in warnings[0]
    ) and "dropped" in warnings[0]
    assert runs["doc3"]["run_id"] in warnings[0] and "Traceback" not in err
    # the runs with a live collector had nothing to warn about
    assert "OpenLineage" not in runs["err1"] + runs["err2"]
