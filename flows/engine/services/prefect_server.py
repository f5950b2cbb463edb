"""The shared local Prefect API server (docs/architecture.md §8, "Prefect's server"): started by the
first run of a PREFECT_HOME, reused by every later run, stopped after it has served no run for a
while. A fresh server takes 3-6 s to answer; reusing one takes a health check.

    python -m pt2flow.flows.engine.services.prefect_server PORT PREFECT_HOME IDLE_SECONDS
    python3 -I flows/engine/services/prefect_server.py stop [--if-idle] PREFECT_HOME...   (make clean)

detaches (fork, new session; the starting run does not wait for it), writes its state file
(`pt2flow-server.json` in PREFECT_HOME: pid, port, URL, interpreter and Prefect version) and runs
Prefect's API app under uvicorn. A run holds a lease while it uses the server: a file named by
its pid in `pt2flow-server.leases/`. Every few seconds the server drops the leases of processes
that are gone; once none has been held for IDLE_SECONDS (or at once, when no run holds one and
another server has taken over the state file) it stops, and removes its state file.
Its environment holds only what Prefect reads (no storage options, no credentials of any run).

A PREFECT_HOME without a database gets a copy of an empty one that Prefect migrated before
(`seed_database`): migrating a new SQLite database is most of a fresh server's start (about 8 s of
CPU here, against milliseconds for a copy). The empty database is made once per Prefect version, in
a scratch PREFECT_HOME of its own, and kept in ~/.cache/pt2flow/prefect-db/ ($XDG_CACHE_HOME).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

WATCH_SECONDS = 2.0
DATABASE = "prefect.db"  # Prefect's default database in PREFECT_HOME (sqlite+aiosqlite)
MIGRATE = "import asyncio; from prefect.server.database import provide_database_interface; asyncio.run(provide_database_interface().create_db())"
STATE = "pt2flow-server.json"
LEASES = "pt2flow-server.leases"


def environment() -> str:
    """The Python environment a server runs in, as its identity: the real path of sys.prefix (a
    venv reached through a symlink is the same venv; two venvs of one base interpreter are not)."""
    return os.path.realpath(sys.prefix)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_leases(folder: Path) -> int:
    """The leases of live processes (those of dead ones are removed)."""
    live = 0
    for lease in folder.glob("*"):
        try:
            pid = int(lease.name)
        except ValueError:
            continue
        if _alive(pid):
            live += 1
        else:
            lease.unlink(missing_ok=True)
    return live


def _superseded(state: Path) -> bool:
    """Another server's state file is there now (one of another interpreter or Prefect version
    took over this PREFECT_HOME): no new run will find this one."""
    try:
        return json.loads(state.read_text()).get("pid") != os.getpid()
    except (OSError, ValueError):
        return False


def _watch(server: Any, folder: Path, idle: float, state: Path) -> None:
    last = time.monotonic()
    while not server.should_exit:
        time.sleep(WATCH_SECONDS)
        if live_leases(folder):
            last = time.monotonic()
        elif time.monotonic() - last > idle or _superseded(state):
            server.should_exit = True
            _remove_state(state)


def _remove_state(state: Path) -> None:
    try:
        if json.loads(state.read_text()).get("pid") == os.getpid():
            state.unlink()
    except (OSError, ValueError):
        pass


def template_folder() -> Path:
    """Where the migrated empty databases are kept (one per Prefect version)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pt2flow" / "prefect-db"


def seed_database(home: str) -> str:
    """Give PREFECT_HOME `home` a database before the server opens it, when it has none: a copy of
    an empty database Prefect migrated (made here first when there is none for this Prefect
    version). Only Prefect's default database of `home` is seeded (not one named by
    PREFECT_API_DATABASE_CONNECTION_URL or a profile). Returns "exists", "copied", "made and
    copied", or why nothing was done ("not the default database", "no template: ..."); the server
    then migrates as it always does."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    target = Path(home) / DATABASE
    if (
        url is None
        or url.get_secret_value() != f"sqlite+aiosqlite:///{settings.home}/{DATABASE}"
        or Path(settings.home) != Path(home)
    ):
        return "not the default database"
    if target.exists():
        return "exists"
    template = template_folder() / f"prefect-{metadata.version('prefect')}.db"
    made = ""
    if not template.is_file():
        problem = _make_template(template)
        if problem:
            return f"no template: {problem}"
        made = "made and "
    partial = target.with_name(f".{DATABASE}.{os.getpid()}")
    shutil.copyfile(template, partial)
    os.replace(partial, target)
    return made + "copied"


def _make_template(template: Path) -> str | None:
    """Migrate an empty database in a scratch PREFECT_HOME (Prefect's own create_db, as its server
    does at start) and keep it as `template`; why not, or None."""
    template.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=template.parent))
    try:
        env = {k: v for k, v in os.environ.items() if not k.endswith("DATABASE_CONNECTION_URL")}
        env["PREFECT_HOME"] = str(scratch)
        done = subprocess.run(
            [sys.executable, "-c", MIGRATE],
            env=env,
            cwd=scratch,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=300,
            check=False,
        )
        made = scratch / DATABASE
        wal = scratch / f"{DATABASE}-wal"
        if done.returncode != 0 or not made.is_file():
            return f"migrating exited {done.returncode}: {done.stderr.decode(errors='replace')[-500:]}"
        if wal.exists() and wal.stat().st_size:
            return "the migrated database left a write-ahead log"
        os.replace(made, template)  # atomic: a concurrent maker's copy is as good
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(port: int, home: str, idle: float) -> int:
    if os.fork() > 0:  # the starting run waits for this parent only; the server lives on
        os._exit(0)
    os.setsid()
    try:
        print(f"pt2flow: Prefect database of {home}: {seed_database(home)}", flush=True)
    except Exception as exc:  # never a reason not to serve: Prefect migrates a new database itself
        print(f"pt2flow: Prefect database of {home} not seeded: {type(exc).__name__}: {exc}", flush=True)
    import uvicorn

    state = Path(home) / STATE
    folder = Path(home) / LEASES
    folder.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}/api"
    payload = {
        "pid": os.getpid(),
        "port": port,
        "url": url,
        "python": sys.executable,
        "environment": environment(),
        "prefect": metadata.version("prefect"),
    }
    tmp = state.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, state)
    config = uvicorn.Config(
        "prefect.server.api.server:create_app",
        factory=True,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    threading.Thread(target=_watch, args=(server, folder, idle, state), name="pt2flow-idle", daemon=True).start()
    try:
        server.run()
    finally:
        _remove_state(state)
    return 0


def _is_server(pid: int) -> bool:
    """Whether `pid` is a server of this module (not a process that reused a dead server's pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"pt2flow.flows.engine.services.prefect_server" in cmdline.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: trust the state file
        return _alive(pid)


def stop(home: str, *, if_idle: bool = False) -> str:
    """SIGTERM the shared server of PREFECT_HOME `home`: "stopped", "none" (no server runs
    there) or "busy" (`if_idle` and a live run holds a lease on it: left to stop by itself)."""
    import signal

    try:
        pid = int(json.loads((Path(home) / STATE).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return "none"
    if not _is_server(pid):
        return "none"
    if if_idle and live_leases(Path(home) / LEASES):
        return "busy"
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "none"
    return "stopped"


def stop_command(argv: list[str]) -> int:
    """`python3 -I flows/engine/services/prefect_server.py stop [--if-idle] HOME...` (make clean): the
    standard library only, so it runs without the venv, which clean removes."""
    if_idle = "--if-idle" in argv
    for home in (a for a in argv if a != "--if-idle"):
        done = stop(home, if_idle=if_idle)
        if done == "stopped":
            print(f"stopped pt2flow's Prefect server of {home}")
        elif done == "busy":
            print(f"pt2flow's Prefect server of {home} serves a run: left running (it stops after its idle time)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["stop"]:
        sys.exit(stop_command(sys.argv[2:]))
    sys.exit(main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3])))
