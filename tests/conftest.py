"""Shared fixtures: a project-local Prefect home, a private Prefect server, CLI runner, config writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session", autouse=True)
def _prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test (and every subprocess it starts) uses a throwaway PREFECT_HOME, telemetry off."""
    home = tmp_path_factory.mktemp("prefect-home")
    saved = {
        k: os.environ.get(k)
        for k in (
            "PREFECT_HOME",
            "PREFECT_SERVER_ANALYTICS_ENABLED",
            "DO_NOT_TRACK",
            "PREFECT_API_URL",
            "PT2FLOW_PREFECT_SERVER_IDLE_S",
            "PYTHONPATH",
        )
    }
    os.environ["PREFECT_HOME"] = str(home)
    # the import path every subprocess gets (cli_env), here too: the workers of runs in this process
    # and of commands run in it are forked from one fork server (its environment is its identity)
    os.environ["PYTHONPATH"] = _with_root(os.environ.get("PYTHONPATH", ""))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["DO_NOT_TRACK"] = "1"
    # the session's shared Prefect server is stopped when the session ends (below); its idle time is
    # only for a session that is killed. 120 s made a worker's server stop during its long tests
    # without a Prefect run (the README walk, a fleet's CLI run of its own): fc32 started one
    # worker's server four times, about 20 s of CPU each
    os.environ["PT2FLOW_PREFECT_SERVER_IDLE_S"] = "900"
    os.environ.pop("PREFECT_API_URL", None)
    yield home
    stop_shared_server(home)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def stop_shared_server(home: Path) -> None:
    """Stop the shared Prefect server of a PREFECT_HOME (flows/engine/services/prefect_server.py), if one runs."""
    from pt2flow.flows.engine.services.prefect_runtime import stop_shared_server as stop

    stop(home)


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[str]:
    """One private Prefect API server for the in-process flow tests of the session."""
    from pt2flow.flows.engine.services import prefect_runtime

    with prefect_runtime.prefect_api() as url:
        yield url


def _with_root(path: str) -> str:
    """PYTHONPATH `path` with the repository first (tests.models' factories resolve through it)."""
    entries = [entry for entry in path.split(os.pathsep) if entry and entry != str(ROOT)]
    return os.pathsep.join([str(ROOT), *entries])


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env["PYTHONPATH"] = _with_root(env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


# commands that run in the test's process (run_cli): they read, check or tidy a local store and
# start no Prefect (audit, check-compat and repro do their torch work in worker processes of their
# own, as from the console script); each start of the console script costs about a second of CPU
# (Python, click, pyarrow, the stage plugins), and the suite runs a few hundred of them
IN_PROCESS = frozenset(
    {
        "ls",
        "show",
        "lineage",
        "diff",
        "report",
        "failures",
        "get",
        "schema",
        "validate",
        "verify",
        "gc",
        "audit",
        "check-compat",
        "repro",
    }
)


def run_cli(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 900,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`pt2flow ARGS`: the installed console script in a real subprocess (killed after `timeout`),
    or, for a query or maintenance command (IN_PROCESS) on a local store with no variables of its
    own, the same `main(ARGS)` called in this process with its stdout and stderr captured
    (`cli_in_process`). A test of what happens to the process itself passes variables of its own
    (a crash point, S3 credentials) or uses run_cli_into_closed_pipe."""
    if args and args[0] in IN_PROCESS and env is None and not any("s3://" in str(a) for a in args):
        return cli_in_process(args, cwd=cwd)
    return subprocess.run(
        [str(BIN / "pt2flow"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=str(cwd or ROOT),
    )


def cli_in_process(
    args: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`main(ARGS)` of pt2flow's CLI in this process, as the console script runs it: the same
    variables a subprocess would get (cli_env, plus `env`), in the same folder (the repository's unless `cwd`),
    its stdout and stderr captured (bytes written to stdout.buffer, as `get -o -` writes, decoded
    as UTF-8) and its exit code returned; every variable and the folder restored after."""
    import contextlib
    import io

    from pt2flow.flows.cli import main as cli_main

    support = sys.modules.get("pt2flow.flows.cli.support")
    if support is not None and hasattr(support, "opened_store"):
        support.opened_store = None  # the store an earlier command opened is no hint for this one's errors
    wanted = cli_env(env)
    saved = dict(os.environ)
    before = os.getcwd()
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(wanted)
        os.chdir(str(cwd or ROOT))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main.main(list(args))
    finally:
        os.chdir(before)
        os.environ.clear()
        os.environ.update(saved)
    out.flush()
    stdout = out.buffer.getvalue().decode("utf-8", errors="replace")  # type: ignore[attr-defined]
    return subprocess.CompletedProcess(["pt2flow", *args], code, stdout, err.getvalue())


def run_cli_into_closed_pipe(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """`pt2flow ARGS` writing into a pipe whose reader, a real process (`true`), has already
    exited, as `pt2flow ls --json | head` meets once head has read its lines: every write fails."""
    read_end, write_end = os.pipe()
    try:
        subprocess.run(["true"], stdin=read_end, check=True)  # the reader comes and goes
    finally:
        os.close(read_end)  # now no process holds the read end
    try:
        proc = subprocess.run(
            [str(BIN / "pt2flow"), *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            env=cli_env(env),
            cwd=str(ROOT),
        )
    finally:
        os.close(write_end)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr)


def run_json(args: Sequence[str], **kwargs: Any) -> tuple[int, dict[str, Any], str]:
    """Run a `--json` command; returns (exit code, parsed stdout, stderr). stdout must be one JSON document."""
    return json_result(run_cli([*args, "--json"], **kwargs))


def json_result(proc: subprocess.CompletedProcess[str]) -> tuple[int, dict[str, Any], str]:
    """A finished `--json` command as (exit code, parsed stdout, stderr); stdout must be one JSON document."""
    try:
        document = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"stdout is not one JSON document ({exc}):\n{proc.stdout[:2000]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        ) from exc
    return proc.returncode, document, proc.stderr


def run_in_process(
    config: str | os.PathLike[str], *, env: Mapping[str, str] | None = None, **options: Any
) -> tuple[int, dict[str, Any]]:
    """`pt2flow run CONFIG --json` with the fleet run from this process, as the CLI runs it
    (pt2flow.flows.api.running: prepare_run, then execute; the stage work in worker processes):
    the exit code the CLI would give (0, 1; 2 for a config or usage error, nothing run) and the
    run document as the CLI prints it (`{"error": MESSAGE}` for exit 2). `options` are
    prepare_run's (store, only, stages, force, retry_failed, workers, runner, ...); `env` is set
    in this process for the run (the workers inherit it). For tests of what a fleet does
    (caching, selection, failures, retention); the CLI's own tests run the binary (run_cli),
    which costs a Python start and Prefect's import per run."""
    from pt2flow.flows.api.running import execute, prepare_run
    from pt2flow.flows.config import ConfigError
    from pt2flow.flows.options import UsageError

    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        try:
            prepared = prepare_run(config, **options)
        except (ConfigError, UsageError) as exc:
            return 2, {"error": str(exc)}
        document = json.loads(json.dumps(execute(prepared), default=str))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return (0 if document["summary"]["failed"] == 0 else 1), document


def run_as_cli(config: str | os.PathLike[str], **options: Any) -> subprocess.CompletedProcess[str]:
    """run_in_process in the shape of a finished `pt2flow run CONFIG --json`: its exit code and the
    document on stdout; stderr empty (the run logs to this process). For a fixture whose tests
    read a run's document and exit code, not what the binary printed."""
    code, document = run_in_process(config, **options)
    return subprocess.CompletedProcess(["pt2flow", "run", str(config), "--json"], code, json.dumps(document), "")


def run_plain_script(script: str, *args: object, timeout: float = 300) -> dict[str, Any]:
    """`script` run by this interpreter as `python -c` with PATH alone in its environment (no
    variable of pt2flow's or the tests'), `args` as its arguments: the JSON line it printed last.
    How the tests run an artifact as a user's own script would, without pt2flow."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_config(path: Path, models: list[dict[str, Any]], **top: Any) -> Path:
    """Write a version-1 config; factories in tests.models resolve through PYTHONPATH=ROOT."""
    config = {"version": 1, **top, "models": models}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def cli() -> Any:
    return run_cli


from tests.s3 import moto_s3  # noqa: E402,F401  (session fixture shared by storage and integration tests)
from tests.fleets import _generative_fleet, _targets_fleet, generative_fleet, targets_fleet  # noqa: E402,F401  (built once per session)
from tests.session import (  # noqa: E402,F401  (the suite's plumbing: inductor cache, xdist groups, time per tier)
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_teardown,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
