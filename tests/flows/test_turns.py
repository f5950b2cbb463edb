"""The workers' turns on a machine's cores (flows/engine/worker/turns.py), with real processes
holding the lock files: a quiet stage (the benchmark) starts only after the running stage work
ends, and stage work that asks while it runs waits until it is done."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

HOLD = """
import sys, time
from pt2flow.flows.engine.worker.turns import machine_turn
quiet, seconds, log = sys.argv[1] == "quiet", float(sys.argv[2]), sys.argv[3]
print("asking", flush=True)
with machine_turn(quiet=quiet):
    with open(log, "a") as out:
        out.write(f"{sys.argv[4]} start {time.time()}\\n")
    time.sleep(seconds)
    with open(log, "a") as out:
        out.write(f"{sys.argv[4]} end {time.time()}\\n")
"""


def _hold(quiet: bool, seconds: float, log: Path, name: str, env: dict[str, str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, "quiet" if quiet else "shared", str(seconds), str(log), name],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "asking"
    return process


def _events(log: Path) -> dict[str, float]:
    lines = [line.split() for line in log.read_text().splitlines()]
    return {f"{name} {what}": float(at) for name, what, at in lines}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "PT2FLOW_CACHE_DIR": str(tmp_path / "cache")}


def test_a_quiet_stage_waits_for_running_work_and_work_asking_meanwhile_waits_for_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    log = tmp_path / "log"
    first = _hold(False, 1.5, log, "work1", env)
    time.sleep(0.3)  # work1 holds its shared turn
    quiet = _hold(True, 1.0, log, "bench", env)
    time.sleep(0.3)  # the benchmark waits for work1, at the turnstile's far side
    second = _hold(False, 0.2, log, "work2", env)
    for process in (first, quiet, second):
        assert process.wait(timeout=30) == 0
    at = _events(log)
    assert at["bench start"] >= at["work1 end"]  # not while work1 ran
    assert at["work2 start"] >= at["bench end"]  # work2 asked while the benchmark waited: it went after


def test_stage_work_shares_the_machine(tmp_path: Path, env: dict[str, str]) -> None:
    log = tmp_path / "log"
    first = _hold(False, 1.0, log, "a", env)
    second = _hold(False, 1.0, log, "b", env)
    for process in (first, second):
        assert process.wait(timeout=30) == 0
    at = _events(log)
    assert at["b start"] < at["a end"] and at["a start"] < at["b end"]  # side by side


def test_without_a_writable_cache_folder_stages_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder the worker cannot make (here a file stands where it would go): no turns,
    and the stage runs, quiet or not."""
    from pt2flow.flows.engine.worker.turns import machine_turn

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PT2FLOW_CACHE_DIR", str(blocker))
    ran = []
    for quiet in (False, True):
        with machine_turn(quiet=quiet):
            ran.append(quiet)
    assert ran == [False, True]
