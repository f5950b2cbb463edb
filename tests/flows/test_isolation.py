"""One model can never take the fleet down: a model that segfaults, one that calls os._exit, one
that hangs past its time limit and one that runs over its memory limit, in a fleet with healthy
models before and after them, with every runner. Real processes really die; nothing is mocked.

Each run also checks that no process it started is left behind: every process of the run
(CLI, Prefect server, worker processes, Dask workers) inherits a unique token in its
environment, and none may carry it once the CLI has exited.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import run_json, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "serialize", "validate"]
X = {"x": {"shape": [3, 8]}}
FLEET = [
    {"name": "healthy-first", "factory": "tests.models:tiny_mlp", "inputs": X},
    {"name": "segfault", "factory": "tests.hostile_models:segfault", "inputs": X},
    {"name": "hard-exit", "factory": "tests.hostile_models:hard_exit", "inputs": X},
    {"name": "hang", "factory": "tests.hostile_models:hang", "inputs": X, "limits": {"timeout_s": 6}},
    {"name": "memory-hog", "factory": "tests.hostile_models:memory_hog", "inputs": X, "limits": {"memory_gb": 1.5}},
    {"name": "healthy-last", "factory": "tests.models:tiny_mlp", "kwargs": {"hidden": 32}, "inputs": X},
]


FORK_SERVER = "pt2flow.flows.engine.worker.forkserver"
# psutil's create_time is the boot time, a whole second in /proc/stat, plus the start in clock
# ticks: up to a second early. A worker forked within a second of `since` (the run's start got
# faster) read as older than the test and was never seen: the wait for it ran out its 120 s.
CREATE_TIME_SLACK_S = 1.0


def processes_with(token: str, since: float) -> list[str]:
    """The processes carrying `token` in their environment, and the workers forked since `since`."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get("PT2FLOW_TEST_TOKEN") == token:
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])[:200]}")
        except (psutil.Error, OSError):
            continue
    return found + forked_since(since)


def forked_since(since: float) -> list[str]:
    """The workers forked since `since` by a fork server of this test session: a forked worker's
    environment (as the system shows it) is its server's, which no run's token is part of; the
    server itself serves any run of its environment and stays a while after one
    (flows/engine/orchestrator/launcher.py)."""
    found = []
    mine = os.environ.get("PYTEST_XDIST_WORKER")
    for proc in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        try:
            command = " ".join(proc.info["cmdline"] or [])
            if (
                FORK_SERVER not in command
                or proc.info["create_time"] < since - CREATE_TIME_SLACK_S
                or proc.info["status"] == psutil.STATUS_ZOMBIE
            ):
                continue
            parent = proc.parent()
            if (
                parent is not None
                and FORK_SERVER in " ".join(parent.cmdline())
                and proc.environ().get("PYTEST_XDIST_WORKER") == mine
            ):
                found.append(f"{proc.pid} (a worker forked by fork server {parent.pid}): {command[:200]}")
        except (psutil.Error, OSError):
            continue
    return found


def assert_nothing_left(token: str, since: float, grace: float = 15.0) -> None:
    deadline = time.monotonic() + grace
    while (left := processes_with(token, since)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes left running after the CLI exited: {left}"


@pytest.mark.parametrize("runner,workers", [("local", "1"), ("process", "2"), ("dask", "2")])
def test_crashing_hanging_and_hoarding_models_fail_alone(tmp_path: Path, runner: str, workers: str) -> None:
    """With the local runner and one worker (models in config order, one at a time) a second
    healthy model goes before the segfault: the two healthy ones and the segfault share the one
    worker process (reused across models, torch imported once), the models after the crash run
    in replacements, and healthy-last in another process than the segfault."""
    reuse = (runner, workers) == ("local", "1")
    fleet = [FLEET[0], {**FLEET[0], "name": "healthy-second"}, *FLEET[1:]] if reuse else FLEET
    healthy = [m["name"] for m in fleet if m["factory"] == "tests.models:tiny_mlp"]
    config = write_config(tmp_path / "hostile.yaml", fleet, stages=STAGES)
    token = uuid.uuid4().hex
    started, since = time.monotonic(), time.time()
    code, document, stderr = run_json(
        ["run", str(config), "--store", str(tmp_path / "store"), "--runner", runner, "--workers", workers],
        env={"PT2FLOW_TEST_TOKEN": token},
        timeout=600,
    )
    elapsed = time.monotonic() - started
    assert code == 1, stderr[-3000:]
    by_name = {m["name"]: m for m in document["models"]}
    assert [m["name"] for m in document["models"]] == [m["name"] for m in fleet]
    assert document["summary"] == {**document["summary"], "ok": len(healthy), "failed": 4}
    assert document["workers"] == int(workers)
    if reuse:
        by_worker = [
            by_name[name]["worker"] for name in ("healthy-first", "healthy-second", "segfault", "healthy-last")
        ]
        assert by_worker[0] == by_worker[1] == by_worker[2], by_worker  # the segfault killed the shared worker
        assert by_worker[3] != by_worker[2]
        assert int(by_worker[0].rsplit(":", 1)[1]) != os.getpid()

    for name in healthy:
        assert by_name[name]["status"] == "ok", by_name[name]
        assert by_name[name]["validation"]["passed"] is True
        assert set(by_name[name]["stages"]) == set(STAGES)

    expected = {
        "segfault": ("crash", "was killed by SIGSEGV during trace"),
        "hard-exit": ("crash", "exited with code 3 during trace"),
        "hang": ("timeout", "trace: the model ran past its time limit of 6 s (limits.timeout_s)"),
        "memory-hog": ("out_of_memory", "over the limit of 1.50 GiB"),
    }
    for name, (error_class, message) in expected.items():
        model = by_name[name]
        assert (model["status"], model["failed_stage"], model["error_class"]) == ("failed", "trace", error_class), model
        assert message in model["error"], model["error"]
        assert model["stages"]["trace"]["error_class"] == error_class
    # where it died: faulthandler's stack in the stderr tail (the segfault itself; the hang and the
    # hog were asked for their stacks before they were stopped). The segfault and the hog fail in
    # the model's own code; the hang's 6 s count from the model's start, and on a loaded machine
    # they can run out while torch is still preparing the trace: its stack shows the trace stage,
    # not necessarily the model's frame (CI once stopped it in torch's make_fake_inputs)
    for name in ("segfault", "memory-hog"):
        assert "misbehave" in by_name[name]["stderr_tail"], by_name[name]["stderr_tail"][-2000:]
    assert "Current thread" in by_name["hang"]["stderr_tail"], by_name["hang"]["stderr_tail"][-2000:]
    assert "stages/trace.py" in by_name["hang"]["stderr_tail"], by_name["hang"]["stderr_tail"][-2000:]
    assert by_name["hang"]["stages"]["trace"]["seconds"] < 30

    # every failure is in the index with its class and stage
    records = (
        ArtifactStore(str(tmp_path / "store"))
        .index.read(["run_id", "model", "stage", "status", "error_class"])
        .to_pylist()
    )
    failed = {
        (r["model"], r["stage"], r["error_class"])
        for r in records
        if r["run_id"] == document["run_id"] and r["status"] == "failed"
    }
    assert failed == {(name, "trace", cls) for name, (cls, _) in expected.items()}

    assert elapsed < 300, f"the run took {elapsed:.0f} s"
    assert_nothing_left(token, since)


def _start_stuck_run(tmp_path: Path, token: str, marker: Path) -> Any:
    import signal
    import subprocess

    from tests.conftest import BIN, cli_env

    stuck = {
        "name": "stuck",
        "factory": "tests.hostile_models:announced_hang",
        "inputs": X,
        "limits": {"timeout_s": 600},
    }
    config = write_config(tmp_path / "stuck.yaml", [stuck], stages=STAGES)
    return subprocess.Popen(
        [str(BIN / "pt2flow"), "run", str(config), "--store", str(tmp_path / "store"), "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env({"PT2FLOW_TEST_TOKEN": token, "PT2FLOW_TEST_HANG_MARKER": str(marker)}),
        # as a command run in a terminal: a test run as a background job (CI, nohup) passes SIGINT
        # on ignored, and Python then leaves Ctrl-C ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupt(proc: Any, sig: int) -> str:
    """Send `sig`; the CLI must exit within a generous 60 s (a hung model's limit is 600 s). If it
    does not, its threads' stacks (SIGUSR1: the CLI's faulthandler) are in the failure."""
    import signal
    import subprocess

    try:
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
        raise AssertionError(
            f"the run did not end within 60 s of {signal.Signals(sig).name}; its stacks then:\n{stderr[-12000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
    return str(stderr)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_an_interrupted_run_stops_its_workers_and_their_children(tmp_path: Path, sig: str) -> None:
    """SIGTERM (as a scheduler sends) or Ctrl-C while a model hangs inside its worker (the hang
    announces itself, so the signal always lands while the orchestrator waits on that worker):
    the CLI exits 130 with one line, and neither the worker nor anything else of the run is
    left. It used to wait out the model's 600 s limit: the main thread, unwinding, joined the
    model's thread, which still waited on the hung worker."""
    import signal

    token, marker, since = uuid.uuid4().hex, tmp_path / "hanging", time.time()
    proc = _start_stuck_run(tmp_path, token, marker)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not marker.exists() and proc.poll() is None:
        time.sleep(0.2)
    assert marker.exists(), "the model never reached its worker"
    stderr = _interrupt(proc, getattr(signal, sig))
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "pt2flow: interrupted; worker processes stopped", stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert_nothing_left(token, since)


@pytest.mark.parametrize("after", [0.0, 0.7, 1.5, 3.0])
def test_a_run_interrupted_while_starting_ends_as_interrupted(tmp_path: Path, after: float) -> None:
    """SIGTERM at any moment of start-up (the run has begun: its Prefect server or a worker is
    starting; then importing Prefect, planning, the flow starting) ends the same way: 130 and
    one line, never a traceback (a KeyboardInterrupt raised inside a library that wraps it in
    its own error included), nothing left running."""
    import signal

    token, marker, since = uuid.uuid4().hex, tmp_path / "hanging", time.time()
    proc = _start_stuck_run(tmp_path, token, marker)
    deadline = time.monotonic() + 120
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and not (psutil.Process(proc.pid).children() or forked_since(since))
    ):
        time.sleep(0.05)  # begun: its Prefect server or a fork server is starting, or a worker was forked
    time.sleep(after)
    stderr = _interrupt(proc, signal.SIGTERM)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "pt2flow: interrupted; worker processes stopped", stderr[-2000:]
    assert_nothing_left(token, since)
