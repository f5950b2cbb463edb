"""An interrupted run records no failure for the stage it stopped (issue 31): Ctrl-C in a terminal
sends SIGINT to the whole foreground process group, so the CLI runs here in a session of its own
and the test signals that group (os.killpg), as a terminal does. It used to record the stage a
model was in as `crash`, "killed by SIGKILL (the kernel's OOM killer…)": the model thread saw its
worker die from the interrupt's kill before it saw the interrupt. The next run re-runs that stage
and passes, and the failure groups of the runs never list the interrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, cli_env, run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

X = {"x": {"shape": [3, 8]}}


def _start(config: Path, store: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "pt2flow"), "run", str(config), "--store", str(store), "--json", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # an Inductor cache of its own: from the session's (tests/session.py), a program another
        # test compiled is a cache hit, no compiler ever runs and there is nothing to interrupt
        env=cli_env({"TORCHINDUCTOR_CACHE_DIR": str(store.parent / "inductor-cache"), **(env or {})}),
        start_new_session=True,  # its own process group, as a shell's foreground job
        # a test run in the background passes SIGINT on ignored; a terminal's job has it as default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _ctrl_c(proc: subprocess.Popen[str]) -> str:
    """SIGINT to the CLI's whole process group, as Ctrl-C in its terminal; the CLI must exit soon."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return str(stderr)


def _records(store: Path) -> list[dict[str, Any]]:
    if not store.exists():
        return []
    return (
        ArtifactStore(str(store))
        .index.read(["run_id", "model", "stage", "status", "cached", "error_class", "error_message"])
        .to_pylist()
    )


def _interrupted_then_rerun(
    tmp_path: Path,
    models: list[dict[str, Any]],
    stages: list[str],
    ready: Any,
    stage: str,
    env: dict[str, str] | None = None,
) -> None:
    config = write_config(tmp_path / "c.yaml", models, stages=stages)
    store = tmp_path / "store"
    proc = _start(config, store, env)
    deadline = time.monotonic() + 300
    reached = False  # as seen while waiting: asked again, a compiler between two g++ calls reads as not compiling
    while time.monotonic() < deadline and proc.poll() is None and not reached:
        reached = ready(proc)
        if not reached:
            time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    assert reached, f"the run never reached {stage}"
    stderr = _ctrl_c(proc)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "pt2flow: interrupted; worker processes stopped", stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    interrupted = _records(store)
    failed = [r for r in interrupted if r["status"] != "ok"]
    assert failed == [], failed  # no crash, no OOM: nothing failed, the user stopped it
    assert not [r for r in interrupted if r["stage"] == stage and r["model"] == models[0]["name"]]

    # the next run: what it records is under test, not the CLI (the interrupted one was the binary)
    code, doc = run_in_process(config, store=str(store))
    assert code == 0, doc
    model = next(m for m in doc["models"] if m["name"] == models[0]["name"])
    assert model["stages"][stage]["status"] == "ok" and model["stages"][stage]["cached"] is False  # re-run, not settled
    assert not doc.get("failure_groups"), doc.get("failure_groups")  # no group came (nor went)
    code, failures, stderr = run_json(["failures", "--store", str(store)])
    assert failures["summary"]["gone"] == 0 and failures["summary"]["failures"] == 0, failures


def _compiling(proc: subprocess.Popen[str]) -> bool:
    """A C++ compiler runs under one of the CLI's workers: aot_compile is under way."""
    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in procs:
        try:
            if os.path.basename(child.cmdline()[0]) in {"g++", "c++", "cc1plus", "clang++", "gcc", "cc"}:
                return True
        except (psutil.Error, IndexError):
            continue
    return False


@pytest.mark.compile
def test_ctrl_c_during_aot_compile_records_no_crash(tmp_path: Path) -> None:
    """Two models compiling side by side, Ctrl-C to the process group while a compiler runs."""
    models = [
        {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": X},
        {"name": "other", "factory": "tests.models:regressor", "inputs": {"x": {"shape": [4, 4]}, "y": {"shape": [4]}}},
    ]
    _interrupted_then_rerun(tmp_path, models, ["trace", "aot_compile"], _compiling, "aot_compile")


def test_ctrl_c_during_a_slow_trace_records_no_crash(tmp_path: Path) -> None:
    """The same, cheaper: one model sleeps inside its trace (it announces it) while another runs."""
    marker = tmp_path / "tracing"
    models = [
        {"name": "slow", "factory": "tests.hostile_models:announced_slow_trace", "inputs": X},
        {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": X},
    ]
    _interrupted_then_rerun(
        tmp_path,
        models,
        ["trace", "serialize"],
        lambda _proc: marker.exists(),
        "trace",
        env={"PT2FLOW_TEST_SLOW_MARKER": str(marker)},
    )
