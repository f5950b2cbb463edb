"""Process-level set-up: Prefect's environment, a private API server, storage options and stores.

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
from typing import Any, Callable, Iterator, Mapping

_OPTIONS_ENV = "PT2FLOW_STORAGE_OPTIONS"

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "CRITICAL",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
    "PREFECT_UI_ENABLED": "false",
}


def prepare_environment() -> None:
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)


prepare_environment()


# ---------------------------------------------------------------------------------------------
# storage options: never in Prefect parameters, results or the index; children inherit them
# through the environment of the process that started them.

_options: dict[str, dict[str, Any]] = {}


def set_storage_options(store_url: str, options: Mapping[str, Any]) -> None:
    _options[store_url] = dict(options)
    os.environ[_OPTIONS_ENV] = json.dumps(_options)


def storage_options(store_url: str) -> dict[str, Any]:
    if store_url in _options:
        return dict(_options[store_url])
    raw = os.environ.get(_OPTIONS_ENV)
    if raw:
        try:
            return dict(json.loads(raw).get(store_url, {}))
        except (ValueError, AttributeError):
            return {}
    return {}


_stores: dict[str, Any] = {}


def open_store(store_url: str) -> Any:
    """The process's ArtifactStore for a URL (one per process, so index file caches are shared)."""
    from pt2flow.storage import ArtifactStore

    store = _stores.get(store_url)
    if store is None:
        store = ArtifactStore(store_url, storage_options(store_url))
        _stores[store_url] = store
    return store


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
    home = os.environ.get("PREFECT_HOME") or str(Path.home() / ".prefect")
    path = Path(home)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path / "pt2flow-server.log"
    except OSError:
        return Path(tempfile.gettempdir()) / "pt2flow-server.log"


@contextlib.contextmanager
def prefect_api(timeout: float = 90.0, while_starting: Callable[[], Any] | None = None) -> Iterator[str]:
    """Use PREFECT_API_URL when set; otherwise run a private ephemeral Prefect server for this run.

    One server serves every worker process (they inherit PREFECT_API_URL), instead of each
    starting its own on the same SQLite file. Its output goes to a log file under PREFECT_HOME,
    so SQLite "database is locked" retries never reach the user's terminal.
    """
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    process, api_url = _start_server(timeout, while_starting)
    os.environ["PREFECT_API_URL"] = api_url
    # Worker processes inherit the URL; none of them may start an ephemeral server of its own
    # (an orphaned one would outlive the run and keep its stdout pipe open).
    saved_ephemeral = os.environ.get("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE")
    os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
    try:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            yield api_url
    finally:
        _drain_prefect()
        os.environ.pop("PREFECT_API_URL", None)
        if saved_ephemeral is None:
            os.environ.pop("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", None)
        else:
            os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = saved_ephemeral
        _stop(process)


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
    log = open(log_path, "ab")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on",
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
