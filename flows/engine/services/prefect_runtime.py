"""Prefect's environment and the API server a run talks to (shared, or a private one).

Import this before prefect: it sets quiet, offline defaults without overriding what the user set:
no telemetry; Prefect's console logging only at CRITICAL (pt2flow reports failures itself) while
INFO still reaches the Prefect API and UI.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "CRITICAL",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
    "PREFECT_UI_ENABLED": "false",
}


# pt2flow's servers (shared and private) do not register Prefect's block types at start (about 2 s
# of CPU in a new PREFECT_HOME): runs use no blocks, and a user's own `prefect server start`
# registers them in the same database. A PREFECT_API_BLOCKS_REGISTER_ON_START of the user's is kept.
NO_BLOCKS = ("PREFECT_API_BLOCKS_REGISTER_ON_START", "false")

# pt2flow's servers record task runs in batches: Prefect's task run recorder writes each task run
# event (three per stage: pending, running, completed) in a transaction of its own by default, and
# that was half of a server's CPU during a fleet (a 20-model run's 140 task runs: 9-11 s of the
# server's CPU, 4.7-5.2 s batched, the same task runs and states in the database). Batched, a task
# run's row reaches the database within a second of its event (the recorder flushes every second,
# and when the server stops). A user's own settings of these are kept.
BATCHED_TASK_RUNS = (
    ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "200"),
    ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "1"),  # whole seconds (Prefect reads it as an int)
)


# pt2flow's servers run without the services that serve what they never hold (their UI is off;
# runs make no deployments, schedules, work pools, pauses, concurrency leases or automations):
# the event persister (every task run's three state events, written again as rows of their own
# beside the task run recorder's: 60 of the 87 MB six 100-model runs wrote) and the triggers
# service (every event evaluated against automations, there are none) cost the server CPU per
# stage; the scheduler, late runs, foreman, pause expirations and repossessor poll for work that
# never comes (an idle server used 2-7 % of a core). bench/profile_fleet.py, 40 small models, one
# worker: the server's CPU 3.7 -> 2.4 s. Task runs, flow runs, logs and artifacts are recorded as
# before; a later `prefect server start` on the same PREFECT_HOME shows them, without the runs'
# events in its event feed. A user's own settings of these are kept.
IDLE_SERVICES = tuple(
    (f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
    for service in (
        "EVENT_PERSISTER",
        "TRIGGERS",
        "SCHEDULER",
        "LATE_RUNS",
        "FOREMAN",
        "PAUSE_EXPIRATIONS",
        "REPOSSESSOR",
    )
)


# A flow run on pt2flow's servers sends no heartbeats. Prefect emits a flow run's heartbeat event
# every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (180) for automations that mark a run whose
# heartbeats stop as crashed; these servers run no triggers service (IDLE_SERVICES above), so the
# events went nowhere, and the thread sending them is joined when the flow ends, sleeping in steps
# of a second: 0-1 s (0.5 on average) at the end of every run, in-process flows included. A
# user's own server (PREFECT_API_URL) or heartbeat setting is kept.
HEARTBEAT_SETTINGS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


def own_server_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The Prefect settings a run on one of pt2flow's servers uses (heartbeats off, unless `env`
    sets their frequency)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    if any(key in env for key in HEARTBEAT_SETTINGS):
        return {}
    return {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}


def server_defaults(env: dict[str, str]) -> dict[str, str]:
    """`env` with pt2flow's server settings where it has none of its own (NO_BLOCKS,
    BATCHED_TASK_RUNS, IDLE_SERVICES)."""
    for key, value in (NO_BLOCKS, *BATCHED_TASK_RUNS, *IDLE_SERVICES):
        env.setdefault(key, value)
    return env


def prepare_environment() -> None:
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)


prepare_environment()


# ---------------------------------------------------------------------------------------------
# Prefect API server


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except Exception:
        return False


def server_log_path() -> Path:
    path = prefect_home()
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path / "pt2flow-server.log"
    except OSError:
        return Path(tempfile.gettempdir()) / "pt2flow-server.log"


SERVER_MODE_ENV = "PT2FLOW_PREFECT_SERVER"  # shared (default) | private
SERVER_IDLE_ENV = "PT2FLOW_PREFECT_SERVER_IDLE_S"
DEFAULT_SERVER_IDLE_S = 900.0
# what a shared server's environment keeps of the starting run's (no storage options, no credentials)
_SERVER_ENV_KEEP = ("PATH", "HOME", "LANG", "TMPDIR", "TZ", "DO_NOT_TRACK", "SSL_CERT_FILE", "VIRTUAL_ENV")


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or str(Path.home() / ".prefect"))


@contextlib.contextmanager
def prefect_api(timeout: float = 90.0, while_starting: Callable[[], Any] | None = None) -> Iterator[str]:
    """Use PREFECT_API_URL when set; otherwise the shared local Prefect server of PREFECT_HOME
    (flows/engine/services/prefect_server.py: started by the first run, reused by the next ones, gone
    after PT2FLOW_PREFECT_SERVER_IDLE_S seconds without a run), or with PT2FLOW_PREFECT_SERVER=private
    a server of this run's own, stopped when it ends.

    One server serves every worker process (they inherit PREFECT_API_URL), instead of each
    starting its own on the same SQLite file. Its output goes to a log file under PREFECT_HOME,
    so SQLite "database is locked" retries never reach the user's terminal.
    """
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    process = None
    lease: Path | None = None
    if os.environ.get(SERVER_MODE_ENV, "shared") == "private":
        process, api_url = _start_server(timeout, while_starting)
    else:
        api_url, lease = _shared_server(timeout, while_starting)
    os.environ["PREFECT_API_URL"] = api_url
    # Worker processes inherit the URL; none of them may start an ephemeral server of its own
    # (an orphaned one would outlive the run and keep its stdout pipe open).
    saved_ephemeral = os.environ.get("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE")
    os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
    try:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api_url, **own_server_settings(os.environ)}):
            yield api_url
    finally:
        _drain_prefect()
        os.environ.pop("PREFECT_API_URL", None)
        if saved_ephemeral is None:
            os.environ.pop("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", None)
        else:
            os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = saved_ephemeral
        if process is not None:
            _stop(process)
        if lease is not None:
            lease.unlink(missing_ok=True)


def _shared_server(timeout: float, while_starting: Callable[[], Any] | None) -> tuple[str, Path]:
    """The URL of PREFECT_HOME's shared server (started now if none answers) and this run's
    lease on it. Under a lock: concurrent runs start one server between them."""
    import fcntl
    from importlib import metadata

    from pt2flow.flows.engine.services.prefect_server import LEASES, STATE, environment

    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    leases = home / LEASES
    leases.mkdir(exist_ok=True)
    lease = leases / str(os.getpid())
    lease.touch()  # before anything: a server starting now must not find itself idle
    wanted = {"environment": environment(), "prefect": metadata.version("prefect")}
    with open(home / "pt2flow-server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _read_state(home / STATE)
        if not (state and all(state.get(k) == v for k, v in wanted.items()) and _healthy(state["url"])):
            return _start_shared(home, lease, timeout, while_starting), lease
    if while_starting is not None:  # after the lock: another run starting now does not wait for this
        while_starting()
    return str(state["url"]), lease


def _start_shared(home: Path, lease: Path, timeout: float, while_starting: Callable[[], Any] | None) -> str:
    """Start PREFECT_HOME's shared server (under the caller's lock) and wait for it to answer:
    its URL. `while_starting` runs while it boots."""
    from pt2flow.flows.engine.services.prefect_server import STATE

    log_path = server_log_path()
    for _attempt in range(3):
        port = _free_port()
        api_url = f"http://127.0.0.1:{port}/api"
        _spawn_shared(port, home, log_path)
        if while_starting is not None:  # useful work while the server boots on another core
            while_starting()
            while_starting = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not _healthy(api_url):
            time.sleep(0.1)
        state = _read_state(home / STATE)
        if state and state.get("url") == api_url and _healthy(api_url):
            return api_url
    lease.unlink(missing_ok=True)
    raise RuntimeError(f"the Prefect server did not start; see {log_path}")


def stop_shared_server(home: str | os.PathLike[str] | None = None) -> bool:
    """SIGTERM the shared Prefect server of `home` (default: PREFECT_HOME), if one runs; True if
    one was signalled. It stops as after an idle period (flows/engine/services/prefect_server.py)."""
    import signal

    from pt2flow.flows.engine.services.prefect_server import STATE

    state = _read_state(Path(home) / STATE if home is not None else prefect_home() / STATE)
    try:
        os.kill(int(state["pid"]), signal.SIGTERM)  # type: ignore[index]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _spawn_shared(port: int, home: Path, log_path: Path) -> None:
    """Start the shared server (it detaches at once; this waits only for its first process)."""
    env = {k: v for k, v in os.environ.items() if k in _SERVER_ENV_KEEP or k.startswith(("PREFECT_", "LC_", "XDG_"))}
    env.pop("PREFECT_API_URL", None)
    env.update(
        {
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            "PREFECT_HOME": str(home),
        }
    )
    server_defaults(env)
    idle = os.environ.get(SERVER_IDLE_ENV) or str(DEFAULT_SERVER_IDLE_S)
    with open(log_path, "ab") as log:
        subprocess.run(
            [sys.executable, "-m", "pt2flow.flows.engine.services.prefect_server", str(port), str(home), idle],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            timeout=60,
            check=False,
        )


def _start_server(timeout: float, while_starting: Callable[[], Any] | None) -> tuple[subprocess.Popen[bytes], str]:
    """A private Prefect server answering on a free port, and its API URL: three tries, each
    given `timeout` seconds to become healthy; RuntimeError after that."""
    log_path = server_log_path()
    for _attempt in range(3):
        port = _free_port()
        api_url = f"http://127.0.0.1:{port}/api"
        process = _spawn_server(port, log_path)
        if while_starting is not None:  # useful work while the server boots on another core
            while_starting()
            while_starting = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None and not _healthy(api_url):
            time.sleep(0.1)
        if process.poll() is None and _healthy(api_url):
            return process, api_url
        _stop(process)
    raise RuntimeError(f"the Prefect server did not start; see {log_path}")


def _spawn_server(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Prefect's API server (uvicorn, no UI) on `port`, its output appended to `log_path`."""
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    server_defaults(env)
    log = open(log_path, "ab")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    log.close()
    return process


def _die_with_parent() -> None:
    """In the server's child process: SIGTERM it when pt2flow dies (even by SIGKILL), so no
    private server outlives its run. Linux only; elsewhere the server is stopped on exit."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _drain_prefect(timeout: float = 15.0) -> None:
    """Send Prefect's buffered logs and events before the server goes away (else they retry for a minute)."""
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=timeout)
    except Exception:
        pass
    try:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=timeout)
    except Exception:
        pass


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
