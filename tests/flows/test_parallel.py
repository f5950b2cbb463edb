"""Parallel fleets with real processes (`pt2flow run` itself, whose pid is not a worker's):
Prefect's process pool and a Dask LocalCluster, each with a failing model in the fleet; then the
fleet's artifacts in the Prefect UI (the fleet run in this process: run_in_process)."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_the_next_model_waits_for_a_worker_without_being_charged_for_it(tmp_path: Path) -> None:
    """With one worker the orchestrator runs one model ahead of it (flows/fleet.py _task_runner):
    three models whose factories take 3 s each; the third one's tasks start once the first model
    to get the worker is done, and wait for the second one's 3 s. The wait is neither its
    stage's seconds nor part of its time limit: its records start when the others' last ones
    end (the index's own timestamps: one worker did one model after the other) and say it built
    in about its own 3 s, and its limit of 5.5 s (its 3 s and the wait would pass it) holds. The
    two models waiting at once take the worker in the config's order (WorkerPool.set_order)."""
    models = [
        {
            "name": f"slow{i}",
            "factory": "tests.models:slow_build",
            "kwargs": {"seconds": 3.0, "hidden": 12 + i},
            "inputs": {"x": {"shape": [2, 8]}},
            **({"limits": {"timeout_s": 5.5}} if i == 2 else {}),
        }
        for i in range(3)
    ]
    config = write_config(tmp_path / "fleet.yaml", models, stages=["trace"])
    store = tmp_path / "store"
    code, document = run_in_process(config, store=str(store), workers=1)
    assert code == 0, document
    rows = ArtifactStore(str(store)).index.read(["model", "stage", "seconds", "started_at", "ended_at"]).to_pylist()
    runs = {(r["model"], r["stage"]): r for r in rows}
    # one worker takes the models in the config's order, though two of them wait for it at once
    assert sorted(("slow0", "slow1", "slow2"), key=lambda m: runs[(m, "source")]["started_at"]) == [
        "slow0",
        "slow1",
        "slow2",
    ], rows
    last = runs[("slow2", "source")]
    assert last["started_at"] >= max(runs[(m, "trace")]["ended_at"] for m in ("slow0", "slow1")), rows
    assert 3.0 <= last["seconds"] < 5.0, rows  # its own build, not the wait
    assert abs((last["ended_at"] - last["started_at"]).total_seconds() - last["seconds"]) < 0.5, rows


def _heartbeat_thread_in_a_flow(env: dict[str, str]) -> bool:
    """Whether a flow run under prefect_api() (this session's shared server) has Prefect's
    heartbeat thread running: a fresh process with `env` added, so no setting of this one leaks in."""
    probe = (
        "import threading\n"
        "from prefect import flow\n"
        "from pt2flow.flows.engine.services import prefect_runtime\n"
        "@flow\n"
        "def probe():\n"
        "    return any(getattr(getattr(t, '_args', (None,))[0] if getattr(t, '_args', None) else None,"
        " '__name__', '') == 'heartbeat_loop' for t in threading.enumerate())\n"
        "with prefect_runtime.prefect_api():\n"
        "    print(probe())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=cli_env(env), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1] == "True"


def test_flows_on_pt2flows_own_server_send_no_heartbeats_unless_asked() -> None:
    """Prefect's flow heartbeats feed automations, which pt2flow's servers do not run; their thread
    held the end of every run for up to a second. A user's heartbeat setting is kept."""
    assert _heartbeat_thread_in_a_flow({}) is False
    assert _heartbeat_thread_in_a_flow({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}) is True
