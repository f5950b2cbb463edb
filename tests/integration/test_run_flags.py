"""Every documented runner flag of `pt2flow run` with a bad value, on a store with nothing in it
and on one where every stage is cached (the run the index settles alone, without Prefect or a
worker): exit 2, a short error naming what is wrong, no traceback, and nothing recorded (issue 31).
An unreachable Dask scheduler is one of them: checked before any work, even when nothing is left
to build, naming the address and how long it was waited for (PT2FLOW_DASK_CONNECT_TIMEOUT_S keeps
the wait short here)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import cli_in_process, run_cli, run_json, write_config

pytestmark = pytest.mark.integration

CONNECT_S = 1.5
MODEL = {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}


def _closed_port() -> int:
    """A port nothing listens on: bound once by the kernel's choice, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cases(port: int) -> dict[str, tuple[list[str], list[str]] | tuple[list[str], list[str], dict[str, str]]]:
    """name -> (flags, words the error must contain[, variables of the run])."""
    closed = f"tcp://127.0.0.1:{port}"
    return {
        "unknown runner": (["--runner", "bogus"], ["--runner", "bogus"]),
        "closed port": (
            ["--runner", "dask", "--dask-address", closed],
            [closed, f"limit {CONNECT_S:g} s", "Dask scheduler"],
        ),
        "garbage address": (
            ["--runner", "dask", "--dask-address", "not an address::"],
            ["not an address::", "Dask scheduler"],
        ),
        "address without a port": (
            ["--runner", "dask", "--dask-address", "scheduler"],
            ["--dask-address scheduler", "Dask scheduler"],
        ),
        "address without dask": (["--dask-address", closed], ["--dask-address needs --runner dask"]),
        "zero workers": (["--workers", "0"], ["--workers must be at least 1"]),
        "negative workers": (["--workers", "-1"], ["--workers must be at least 1"]),
        "workers not a number": (["--workers", "many"], ["--workers", "many"]),
        "workers variable not a number": (
            [],
            ["PT2FLOW_WORKERS must be a whole number", "'many'"],
            {"PT2FLOW_WORKERS": "many"},
        ),
        "negative no-worker timeout": (
            ["--runner", "dask", "--no-worker-timeout", "-5"],
            ["--no-worker-timeout must be more than 0"],
        ),
        "zero no-worker timeout": (
            ["--runner", "dask", "--no-worker-timeout", "0"],
            ["--no-worker-timeout must be more than 0"],
        ),
        "no-worker timeout not a number": (
            ["--runner", "dask", "--no-worker-timeout", "soon"],
            ["--no-worker-timeout", "soon"],
        ),
        "no-worker timeout without dask": (["--no-worker-timeout", "5"], ["--no-worker-timeout needs --runner dask"]),
        "missing python": (["--python", "/nonexistent/python3"], ["/nonexistent/python3"]),
        "python with dask": (["--runner", "dask", "--python", sys.executable], ["--python", "dask"]),
    }


def _check_refusals(config: Path, store: str, env: dict[str, str]) -> None:
    """Every case refused by `main(ARGS)` in this process, as the console script calls it: each
    is refused before Prefect or a worker starts (flows/api/running.py prepare_run and the CLI's
    own checks). The console script's own refusals (its exit code, stdout, stderr) are the
    test's last three runs."""
    before = len(ArtifactStore(store).index.read(["record_id"]).to_pylist()) if Path(store).exists() else 0
    for name, (flags, words, *variables) in _cases(_closed_port()).items():
        started = time.monotonic()
        proc = cli_in_process(
            ["run", str(config), "--store", store, *flags], env={**env, **(variables[0] if variables else {})}
        )
        took = time.monotonic() - started
        said = proc.stderr.strip()
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{name}:\n{proc.stderr[-3000:]}"
        lines = [line for line in said.splitlines() if line.strip()]  # click's own: usage, hint, error
        assert 0 < len(lines) <= 3 and proc.stdout == "", f"{name}: {said!r} / {proc.stdout[-500:]!r}"
        for word in words:
            assert word in said, f"{name}: {word!r} not in {said!r}"
        assert took < 60, f"{name} took {took:.0f} s"
    after = len(ArtifactStore(store).index.read(["record_id"]).to_pylist()) if Path(store).exists() else 0
    assert after == before  # nothing ran


def test_bad_runner_flags_are_usage_errors_cold_and_fully_cached(tmp_path: Path) -> None:
    env = {"PT2FLOW_DASK_CONNECT_TIMEOUT_S": str(CONNECT_S)}
    config = write_config(tmp_path / "c.yaml", [MODEL], stages=["trace", "serialize"])
    store = str(tmp_path / "store")
    _check_refusals(config, store, env)

    code, doc, stderr = run_json(["run", str(config), "--store", store])
    assert code == 0, stderr[-3000:]
    code, again, stderr = run_json(["run", str(config), "--store", store])
    assert code == 0 and again["workers"] == 0 and all(s["cached"] for s in again["models"][0]["stages"].values()), (
        stderr[-3000:]
    )
    _check_refusals(config, store, env)  # every stage cached: the index would settle the run alone

    # the closed port waited for the configured time (not Dask's 30 s), and said so
    port = _closed_port()
    started = time.monotonic()
    proc = run_cli(
        ["run", str(config), "--store", store, "--runner", "dask", "--dask-address", f"tcp://127.0.0.1:{port}"], env=env
    )
    assert proc.returncode == 2 and time.monotonic() - started < 25, proc.stderr[-2000:]
    assert f"no Dask scheduler answered at --dask-address tcp://127.0.0.1:{port} within " in proc.stderr, proc.stderr
    bad = run_cli(
        ["run", str(config), "--store", store, "--runner", "dask", "--dask-address", f"tcp://127.0.0.1:{port}"],
        env={"PT2FLOW_DASK_CONNECT_TIMEOUT_S": "never"},
    )
    assert bad.returncode == 2 and "PT2FLOW_DASK_CONNECT_TIMEOUT_S must be a number" in bad.stderr, bad.stderr
    usage = run_cli(["run", str(config), "--store", store, "--workers", "many"])  # click's own refusal, from the binary
    assert (
        usage.returncode == 2 and usage.stdout == "" and "'many'" in usage.stderr and "Traceback" not in usage.stderr
    ), usage.stderr


def test_a_live_scheduler_passes_the_check(tmp_path: Path) -> None:
    """The check connects and lets go: a real scheduler at the address, the cached run goes on."""
    distributed = pytest.importorskip("distributed")
    config = write_config(tmp_path / "c.yaml", [MODEL], stages=["trace"])
    store = str(tmp_path / "store")
    code, _, stderr = run_json(["run", str(config), "--store", store])
    assert code == 0, stderr[-3000:]
    with distributed.LocalCluster(
        n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        code, doc, stderr = run_json(
            ["run", str(config), "--store", store, "--runner", "dask", "--dask-address", cluster.scheduler_address],
            env={"PT2FLOW_DASK_CONNECT_TIMEOUT_S": "10"},
        )
    assert code == 0 and doc["summary"]["ok"] == 1 and doc["workers"] == 0, stderr[-3000:]
