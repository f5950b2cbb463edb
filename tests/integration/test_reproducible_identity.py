"""Every shipped config (configs/*.yaml) run into two fresh stores: `pt2flow audit` passes on each
store with every program record rebuilt in a fresh worker (the stored blob loaded back and the
stage run again give the recorded fingerprint), and both stores hold the same archive (serialize
sha256) and the same program fingerprints for every model. An identity that depended on the
process (an address, a counter, a program kept in memory instead of read back from the store)
fails here (issue 29: tiny-encoder's blobs, multi-head's and residual-regressor-train's rebuilt
functionalize/decompose, a training archive with another ID in every store).

Only the stages audit covers run (trace, functionalize, decompose, serialize): audit rebuilds no
aot_compile, onnx, executorch or validate record (docs/architecture.md §5, "Audit")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, run_json

pytestmark = pytest.mark.integration

AUDITED = "trace,functionalize,decompose,serialize"
SHIPPED = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def test_every_shipped_config_is_covered() -> None:
    assert SHIPPED == ["demo.yaml", "failures.yaml", "targets.yaml"]


def _programs(audit: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(r["model"], r["stage"]): r["fingerprint"] for r in audit["records"]}


@pytest.fixture(scope="module", params=SHIPPED)
def two_stores(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The config run into two fresh stores, each audited (every record, --sample 1.0)."""
    config = ROOT / "configs" / request.param
    folder = tmp_path_factory.mktemp(config.stem)
    found: dict[str, Any] = {"config": request.param, "runs": [], "audits": []}
    for label in ("first", "second"):
        store = folder / label
        code, run, stderr = run_json(["run", str(config), "--store", str(store), "--stages", AUDITED], timeout=1500)
        assert code in (0, 1) and "Traceback" not in stderr, stderr[-3000:]
        code, audit, stderr = run_json(["audit", "--store", str(store), "--config", str(config), "--sample", "1.0"], timeout=1500)
        found["runs"].append(run)
        found["audits"].append((code, audit, stderr))
    return found


def test_audit_rebuilds_every_record_of_a_fresh_store(two_stores: dict[str, Any]) -> None:
    for code, audit, stderr in two_stores["audits"]:
        failed = [(r["model"], r["stage"], r["problem"]) for r in audit.get("records", []) if r["status"] != "ok"]
        assert code == 0 and failed == [], (two_stores["config"], failed, stderr[-3000:])
        records = audit["sample"]["records"]
        assert records > 0 and audit["sample"]["checked"] == records
        assert audit["summary"] == {"ok": records, "failed": 0, "rebuilt": records}
        for entry in audit["records"]:
            assert entry["stored"] == entry["rebuilt"] == entry["fingerprint"], entry


def test_two_fresh_stores_hold_the_same_archives_and_programs(two_stores: dict[str, Any]) -> None:
    first, second = two_stores["runs"]
    archives = [{m["name"]: m["artifacts"].get("serialized") for m in run["models"]} for run in (first, second)]
    statuses = [{m["name"]: (m["status"], m["failed_stage"]) for m in run["models"]} for run in (first, second)]
    assert statuses[0] == statuses[1]
    ok = sorted(name for name, (status, _) in statuses[0].items() if status == "ok")
    assert ok and all(archives[0][name] for name in ok), archives[0]
    assert archives[0] == archives[1]
    programs = [_programs(audit) for _, audit, _ in two_stores["audits"]]
    assert programs[0] == programs[1]
    # every model that ran ok was audited (the shipped failures all fail at trace: no program record)
    assert {model for model, _ in programs[0]} == set(ok)
