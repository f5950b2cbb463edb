"""The Python API (pt2flow.flows.api) on real runs: `run` returns the typed run document, a store
answers what the CLI answers (the same values as its --json), and errors are the CLI's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pt2flow.flows import api
from tests.conftest import ROOT, cli_env, run_json, write_config

pytestmark = pytest.mark.integration

# a fresh interpreter runs the fleet (workers, Prefect's ephemeral server), as a notebook would
RUN_SCRIPT = """
import json, sys
from pt2flow.flows import api
doc = api.run(sys.argv[1], store=sys.argv[2], workers=1)
print(json.dumps({"type": type(doc).__name__, "failed": doc.summary.failed, "doc": doc.model_dump(mode="json")}))
"""


def _api_run(config: Path, store: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", RUN_SCRIPT, str(config), str(store)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("api")
    (work / "failure_models.py").write_text((ROOT / "configs" / "failure_models.py").read_text())
    config = write_config(
        work / "c.yaml",
        [
            {
                "name": "healthy",
                "factory": "failure_models:healthy_mlp",
                "inputs": {"input": {"shape": [3, 8]}},
                "dynamic_shapes": {"input": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 8}},
            },
            {
                "name": "data-dependent",
                "factory": "failure_models:data_dependent_branch",
                "inputs": {"x": {"shape": [2, 8]}},
            },
        ],
        stages=["trace", "functionalize", "decompose", "serialize", "validate"],
    )
    first = _api_run(config, work / "store")
    second = _api_run(config, work / "store")  # unchanged: settled from the index
    code, cli_doc, stderr = run_json(["run", str(config), "--store", str(work / "store")])  # and once through the CLI
    assert code == 1, stderr[-3000:]
    return {
        "work": work,
        "config": config,
        "store": str(work / "store"),
        "first": first,
        "second": second,
        "cli": cli_doc,
    }


def test_run_returns_the_typed_run_document(runs: dict) -> None:
    first, second = runs["first"], runs["second"]
    assert first["type"] == second["type"] == "RunDocument"
    assert first["failed"] == 1
    by_name = {m["name"]: m for m in first["doc"]["models"]}
    assert by_name["healthy"]["status"] == "ok" and by_name["data-dependent"]["error_class"] == "data_dependent"
    assert all(
        s["cached"] for s in next(m for m in second["doc"]["models"] if m["name"] == "healthy")["stages"].values()
    )
    # the same document the CLI prints: the unchanged third run went through `pt2flow run --json`
    cli_doc = runs["cli"]
    assert cli_doc.keys() == first["doc"].keys()
    assert [m.keys() for m in cli_doc["models"]] == [m.keys() for m in second["doc"]["models"]]


def test_store_queries_answer_as_the_cli(runs: dict, tmp_path: Path) -> None:
    store = api.open_store(runs["store"])
    healthy = next(m for m in runs["first"]["doc"]["models"] if m["name"] == "healthy")
    archive = healthy["artifacts"]["serialized"]
    rows = store.ls(model="healthy", stage="serialize", limit=0)
    code, cli_rows, _ = run_json(
        ["ls", "--model", "healthy", "--stage", "serialize", "--limit", "0", "--store", runs["store"]]
    )
    assert code == 0 and [r["record_id"] for r in rows] == [r["record_id"] for r in cli_rows]
    assert store.count(status="failed") == 3  # the data-dependent trace failure, recorded by each of the three runs
    shown = store.show(archive[:10])
    assert shown["sha256"] == archive and len(shown["recorded_in_runs"]) == 3
    assert [r["stage"] for r in store.lineage(archive)["ancestors"]] == [
        "source",
        "trace",
        "functionalize",
        "decompose",
    ]
    code, cli_lineage, _ = run_json(["lineage", archive, "--store", runs["store"]])
    assert store.lineage(archive) == cli_lineage
    assert store.diff(archive, archive)["fingerprint"]["same"] is True
    got = store.get(str(tmp_path / "healthy.pt2"), model="healthy")
    assert got["sha256"] == archive and (tmp_path / "healthy.pt2").stat().st_size == got["size"]
    drift = store.compare()
    assert drift["runs"]["b"]["run_id"] == store.run_id() and sorted(m["model"] for m in drift["models"]) == [
        "data-dependent",
        "healthy",
    ]
    assert store.verify()["corrupt"] == []


def test_errors_are_the_clis(runs: dict, tmp_path: Path) -> None:
    store = api.open_store(runs["store"])
    with pytest.raises(api.InvalidId):
        store.show("xyz")
    with pytest.raises(api.RecordNotFound):
        store.show("0" * 64)
    with pytest.raises(api.UsageError, match="give an artifact ID or a model"):
        store.get(str(tmp_path / "x"))
    with pytest.raises(api.UsageError, match="no store at"):
        api.open_store(str(tmp_path / "no-such-store"))
    with pytest.raises(api.UsageError, match="is a file: give the folder"):
        (tmp_path / "a-file").write_text("")
        api.repro(store, "data-dependent", str(tmp_path / "a-file"))
    with pytest.raises(api.UsageError, match="--workers must be at least 1"):
        api.run(runs["config"], store=runs["store"], workers=0)
    with pytest.raises(api.UsageError, match="runner must be one of"):
        api.run(runs["config"], store=runs["store"], runner="threads")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodels: []\n")
    with pytest.raises(api.ConfigError) as info:
        api.run(bad)
    assert "bad.yaml" in info.value.render()


def test_repro_check_compat_and_schema_from_python(runs: dict, tmp_path: Path) -> None:
    store = api.open_store(runs["store"])
    written = api.repro(store, "data-dependent", str(tmp_path / "repro"))
    assert written["stage"] == "trace" and (tmp_path / "repro" / "repro.py").is_file()
    report = api.check_compat(store, runs["first"]["doc"]["run_id"])
    (healthy,) = [m for m in report["models"] if m["name"] == "healthy"]
    assert healthy["status"] == "ok" and healthy["archive"]["matches"] is True and healthy["archive"]["samples"] == 3
    assert api.config_schema()["properties"]["version"] == {"const": 1}
