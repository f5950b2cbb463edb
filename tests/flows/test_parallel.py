"""Parallel fleets with real processes (`pt2flow run` itself, whose pid is not a worker's):
Prefect's process pool and a Dask LocalCluster, each with a failing model in the fleet; then the
fleet's artifacts in the Prefect UI (the fleet run in this process: run_in_process)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, cli_env, run_in_process, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]


def _fleet(tmp_path: Path) -> Path:
    return write_config(
        tmp_path / "fleet.yaml",
        [
            {
                "name": "mlp",
                "factory": "tests.models:tiny_mlp",
                "inputs": {"x": {"shape": [3, 8]}},
                "dynamic_shapes": {"x": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 8}},
            },
            {"name": "branchy", "factory": "tests.models:data_dependent", "inputs": {"x": {"shape": [4]}}},
            {"name": "counter", "factory": "tests.models:buffer_counter", "inputs": {"x": {"shape": [2, 8]}}},
            {
                "name": "mlp-wide",
                "factory": "tests.models:tiny_mlp",
                "kwargs": {"hidden": 32},
                "inputs": {"x": {"shape": [3, 8]}},
            },
        ],
        stages=STAGES,
    )


def _run(args: list[str]) -> tuple[int, int, dict[str, Any], str]:
    """Files, not pipes, for the output: a stray grandchild holding a pipe cannot hang the test."""
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(
            [str(BIN / "pt2flow"), *args, "--json"], stdout=out_file, stderr=err_file, text=True, env=cli_env()
        )
        proc.wait(timeout=900)
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    try:
        return proc.returncode, proc.pid, json.loads(out), err
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not JSON: {out[:1000]}\n{err[-3000:]}") from exc


def _check_fleet(document: dict[str, Any], store: Path) -> set[str]:
    by_name = {m["name"]: m for m in document["models"]}
    assert [m["name"] for m in document["models"]] == ["mlp", "branchy", "counter", "mlp-wide"]
    assert document["summary"]["ok"] == 3 and document["summary"]["failed"] == 1
    assert by_name["branchy"]["status"] == "failed"
    assert by_name["branchy"]["failed_stage"] == "trace" and by_name["branchy"]["error_class"] == "data_dependent"
    for name in ("mlp", "counter", "mlp-wide"):
        assert by_name[name]["status"] == "ok", by_name[name]
        assert by_name[name]["validation"]["passed"] is True
        assert set(by_name[name]["stages"]) == set(STAGES)
    # every record of the run is in the one index, and every ok artifact verifies
    records = ArtifactStore(str(store)).index.read(columns=["run_id", "model", "stage", "status", "sha256"]).to_pylist()
    mine = [r for r in records if r["run_id"] == document["run_id"]]
    assert {r["model"] for r in mine} == {"mlp", "branchy", "counter", "mlp-wide"}
    assert len([r for r in mine if r["status"] == "ok" and r["stage"] == "validate"]) == 3
    return {m["worker"] for m in document["models"]}


def _two_worker_run(tmp_path: Path, runner: str) -> tuple[int, set[int]]:
    """Run the fleet on 2 workers of `runner`, check it; the CLI's pid and the workers' pids."""
    store = tmp_path / "store"
    code, pid, document, stderr = _run(
        ["run", str(_fleet(tmp_path)), "--store", str(store), "--workers", "2", "--runner", runner]
    )
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    workers = _check_fleet(document, store)
    return pid, {int(w.rsplit(":", 1)[1]) for w in workers}


def test_two_worker_process_pool_with_a_failing_model(tmp_path: Path) -> None:
    pid, pids = _two_worker_run(tmp_path, "process")
    assert pid not in pids, "models ran in the CLI process, not in workers"
    assert len(pids) == 2, pids  # two worker processes shared the four models


def test_dask_local_cluster_with_a_failing_model(tmp_path: Path) -> None:
    pid, pids = _two_worker_run(tmp_path, "dask")
    assert pid not in pids and 1 <= len(pids) <= 2, pids


def test_fleet_run_publishes_table_and_markdown_artifacts(tmp_path: Path) -> None:
    store = tmp_path / "store"
    # no --workers: PT2FLOW_WORKERS is the default (the suite sets it to 1 under xdist)
    code, document = run_in_process(
        _fleet(tmp_path), store=str(store), only=["mlp", "branchy"], env={"PT2FLOW_WORKERS": "2"}
    )
    assert code == 1 and document["workers"] == 2, document

    import asyncio

    from pt2flow.flows.engine.services import prefect_runtime

    async def latest(key: str, run_id: str | None = None) -> Any:
        """The newest artifact `key` of this run (other runs on the same Prefect server publish
        under the same key: each names its run in the description)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
        from prefect.client.schemas.sorting import ArtifactSort

        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                sort=ArtifactSort.CREATED_DESC,
                limit=50,
            )
            return next(a for a in found if (run_id or document["run_id"]) in (a.description or ""))

    with prefect_runtime.prefect_api():
        table = asyncio.run(latest("pt2flow-fleet-models"))
        markdown = asyncio.run(latest("pt2flow-fleet-summary"))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert {r["model"]: r["status"] for r in rows} == {"mlp": "ok", "branchy": "failed"}
    assert next(r for r in rows if r["model"] == "branchy")["error_class"] == "data_dependent"
    assert document["run_id"] in markdown.data
    assert "**1 ok**, **1 failed**" in markdown.data
    assert "| branchy | trace | data_dependent |" in markdown.data
    assert "drift report" not in markdown.data  # the store's first run has nothing to compare with

    # a second run of the same fleet (branchy's known failure tried again, so that the run has work
    # and goes through Prefect): its summary compares with the first, nothing regressed
    code, second = run_in_process(_fleet(tmp_path), store=str(store), only=["mlp", "branchy"], retry_failed=True)
    assert code == 1, second
    with prefect_runtime.prefect_api():
        markdown = asyncio.run(latest("pt2flow-fleet-summary", second["run_id"]))
    assert second["run_id"] in markdown.data
    assert f"`{document['run_id']}` → `{second['run_id']}`" in markdown.data
    assert "No regressions" in markdown.data
