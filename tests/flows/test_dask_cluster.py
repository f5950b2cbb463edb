"""A real Dask cluster (`dask scheduler` and `dask worker` processes started here) losing its
workers mid-run. Losing one worker process is survived (its nanny starts another and Dask runs
the model again); losing every worker (the `dask worker` launcher killed) must not hang the run:
once the cluster has had no worker for --no-worker-timeout seconds, the models not done fail
with `timeout` and the run ends with exit 1 and its whole document."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import psutil
import pytest

from tests.conftest import BIN, cli_env, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "serialize", "validate"]
X = {"x": {"shape": [3, 8]}}
HEALTHY = [
    {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": X},
    {"name": "mlp-wide", "factory": "tests.models:tiny_mlp", "kwargs": {"hidden": 32}, "inputs": X},
]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A `dask scheduler` and a `dask worker --nworkers 2` launcher, real processes; the markers
    the hostile models write go under tmp_path."""
    env = cli_env(
        {"PT2FLOW_TEST_HANG_MARKER": str(tmp_path / "hanging"), "PT2FLOW_TEST_PAUSE_MARKER": str(tmp_path / "pausing")}
    )
    scheduler_file = tmp_path / "scheduler.json"
    logs = tmp_path / "dask-logs"
    logs.mkdir()
    scheduler = subprocess.Popen(
        [
            str(BIN / "dask"),
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(scheduler_file),
        ],
        stdout=open(logs / "scheduler.log", "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    started: list[subprocess.Popen[Any]] = [scheduler]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(scheduler_file.read_text())["address"]
        launcher = subprocess.Popen(
            [str(BIN / "dask"), "worker", address, "--nworkers", "2", "--nthreads", "1", "--no-dashboard"],
            stdout=open(logs / "worker.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        started.append(launcher)
        yield {"address": address, "launcher": launcher, "env": env}
    finally:
        for proc in reversed(started):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _start_run(
    tmp_path: Path, models: list[dict[str, Any]], cluster: dict[str, Any], *extra: str, **top: Any
) -> tuple[subprocess.Popen[Any], Path, Path]:
    config = write_config(tmp_path / "fleet.yaml", models, stages=STAGES, **top)
    out, err = tmp_path / "out.json", tmp_path / "err.log"
    proc = subprocess.Popen(
        [
            str(BIN / "pt2flow"),
            "run",
            str(config),
            "--store",
            str(tmp_path / "store"),
            "--runner",
            "dask",
            "--dask-address",
            cluster["address"],
            *extra,
            "--json",
        ],
        stdout=open(out, "w"),
        stderr=open(err, "w"),
        env=cluster["env"],
    )
    return proc, out, err


def _wait_for(path: Path, proc: subprocess.Popen[Any], seconds: float = 240) -> list[int]:
    """The process ids the model wrote to `path` once it is there."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().strip():
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.2)
    raise AssertionError(f"{path.name} never appeared (run exited {proc.poll()})")


def test_a_cluster_that_loses_every_worker_fails_what_is_left_and_ends(tmp_path: Path, cluster: dict[str, Any]) -> None:
    stuck = {
        "name": "stuck",
        "factory": "tests.hostile_models:announced_hang",
        "inputs": X,
        "limits": {"timeout_s": 600},
    }
    proc, out, err = _start_run(tmp_path, [stuck, *HEALTHY], cluster, dask={"no_worker_timeout_s": 10})
    try:
        _wait_for(tmp_path / "hanging", proc)  # stuck is inside its worker, under a Dask worker
        os.killpg(cluster["launcher"].pid, signal.SIGKILL)  # the launcher and every Dask worker of it
        proc.wait(timeout=180)  # liveness only: the configured wait is 10 s, the model's limit 600 s
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    document = json.loads(out.read_text())
    by_name = {m["name"]: m for m in document["models"]}
    assert list(by_name) == ["stuck", "mlp", "mlp-wide"]
    assert document["summary"]["ok"] + document["summary"]["failed"] == 3
    assert by_name["stuck"]["status"] == "failed" and by_name["stuck"]["error_class"] == "timeout"
    assert "had no worker for 10 s (dask.no_worker_timeout_s" in by_name["stuck"]["error"]
    assert "it was running on Dask worker tcp://" in by_name["stuck"]["error"]
    for model in document["models"]:  # each either finished before the loss or was given up on
        assert model["status"] == "ok" or (model["error_class"] == "timeout" and "had no worker" in model["error"]), (
            model
        )


def test_a_cluster_that_loses_one_worker_process_runs_every_model(tmp_path: Path, cluster: dict[str, Any]) -> None:
    paused = {"name": "paused", "factory": "tests.hostile_models:announced_pause", "inputs": X}
    proc, out, err = _start_run(tmp_path, [paused, *HEALTHY], cluster)
    try:
        pid, orchestrator = _wait_for(
            tmp_path / "pausing", proc
        )  # paused's supervised worker and the Dask worker it serves
        dask_worker = psutil.Process(orchestrator)
        assert pid != orchestrator and dask_worker.pid != cluster["launcher"].pid
        assert cluster["launcher"].pid in [p.pid for p in dask_worker.parents()]  # one of the launcher's Dask workers
        dask_worker.kill()  # its nanny starts another; Dask runs the model again there
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    document = json.loads(out.read_text())
    assert [m["status"] for m in document["models"]] == ["ok", "ok", "ok"], document["models"]
    assert int(document["models"][0]["worker"].rsplit(":", 1)[1]) != pid  # paused ran again elsewhere


@pytest.mark.parametrize(
    "args,message",
    [
        (["--no-worker-timeout", "5"], "--no-worker-timeout needs --runner dask"),
        (["--runner", "dask", "--no-worker-timeout", "0"], "--no-worker-timeout must be more than 0 seconds"),
    ],
)
def test_a_no_worker_timeout_needs_the_dask_runner_and_a_positive_time(
    tmp_path: Path, args: list[str], message: str
) -> None:
    from tests.conftest import run_cli

    config = write_config(tmp_path / "c.yaml", HEALTHY, stages=STAGES)
    proc = run_cli(["run", str(config), "--store", str(tmp_path / "store"), *args])
    assert proc.returncode == 2 and proc.stderr.strip() == f"pt2flow: error: {message}", proc.stderr
    bad = write_config(tmp_path / "bad.yaml", HEALTHY, stages=STAGES, dask={"no_worker_timeout_s": -1})
    proc = run_cli(["validate", str(bad)])
    assert proc.returncode == 2 and "dask.no_worker_timeout_s" in proc.stderr, proc.stderr
