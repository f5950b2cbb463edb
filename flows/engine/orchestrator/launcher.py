"""How a worker process is started: forked from a fork server (flows/engine/worker/forkserver.py)
that imported torch and the stages once, or, where none can serve, as `python -m
pt2flow.flows.engine.worker.process` of its own (the same worker, seconds of imports later).

A fork server serves one interpreter and one environment (every variable but the volatile
ones: pt2flow's own and Prefect's, which no import of the server reads, and inductor's compile
threads, which a forked worker reads again): a worker forked from it gets exactly the
environment it would have been started with. It is shared by every process of this user that
asks for the same interpreter and environment: its socket is named by a digest of the two in a
private runtime folder (runtime_folder()), the first process to ask starts it (under a lock on
that name, so two asking at once start one), and each process's workers end with that process's
connection. It starts in an empty folder of its own and serves any folder: a worker forked for a
folder has it first on sys.path, as `python -m` there would, unless the folder holds a module
named like one the server imported (a worker started there would import that one instead) or
PYTHONPATH has a relative entry; such a folder gets a server started in it. A server outlives the
process that started it by its linger (PT2FLOW_FORK_SERVER_LINGER_S, 60 s: the next run's workers
start in milliseconds, not after seconds of torch import) and leaves by itself then, when its
interpreter's packages or pt2flow's sources change, and after its idle time.
PT2FLOW_FORK_WORKERS=0 starts every worker on its own.

The worker's handle, LaunchedProcess, is what supervisor.Worker uses of subprocess.Popen: pid,
poll(), wait(timeout), returncode. The fork happens in a thread, so the orchestrator goes on
while a new fork server imports torch, as it does while a worker started on its own does.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from importlib.machinery import all_suffixes
from typing import Any
from collections.abc import Callable

from pt2flow.flows.engine.common.protocol import FORK_SERVER_PROTOCOL, fork_server_lock

FORK_VARIABLE = "PT2FLOW_FORK_WORKERS"
LINGER_VARIABLE = "PT2FLOW_FORK_SERVER_LINGER_S"
DEFAULT_LINGER_S = 60.0
# variables a worker gets after its fork, not a reason for another fork server: pt2flow's own
# (PT2FLOW_*: its torch threads, the run's storage options, a test's crash point; pt2flow reads
# them when it acts, never while the server imports), Prefect's (PREFECT_*: a run's API URL; neither
# the server nor a worker imports Prefect), the one pytest sets per test, and inductor's compile
# threads (a pool of two sets it for its workers; inductor reads it when its config is imported,
# and a forked worker reads it again: forkserver.py, _as_started), the AWS SDK's (AWS_*: botocore
# reads them when a worker opens an S3 store, not at any import; a test session's S3 server set
# them and started a second server beside the first), and the terminal's size (COLUMNS, LINES:
# read when something is printed). Every other variable may be read by an import (torch reads its
# own, Python PYTHON*, OpenMP OMP_* when torch loads it), so it is part of the server's identity.
VOLATILE_PREFIXES = ("PT2FLOW_", "PREFECT_", "AWS_")
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_COMPILE_THREADS", "COLUMNS", "LINES"})
SUFFIXES = sorted(all_suffixes(), key=len, reverse=True)  # .cpython-311-x86_64-linux-gnu.so before .so
MAX_SERVERS = 2  # fork servers this process keeps a connection to (one per environment); it leaves the oldest
READY_TIMEOUT = 300.0
POLL_SECONDS = 0.05
MAX_MESSAGE = 1 << 20


class ServerUnavailable(Exception):
    """The fork server cannot fork: it did not start or went away (start the worker on its own),
    or it is stale (`stale`: fork it from a fresh server)."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


def _volatile(name: str) -> bool:
    return name.startswith(VOLATILE_PREFIXES) or name in VOLATILE


def forking_enabled() -> bool:
    return os.environ.get(FORK_VARIABLE, "1").strip() not in ("0", "false", "no", "off")


def runtime_folder() -> str:
    """The folder of this user's fork servers' sockets: $XDG_RUNTIME_DIR/pt2flow, else
    /tmp/pt2flow-UID, mode 0700 (a process that can connect can have code run as this user);
    one that is not this user's alone is not used (a folder of this process's own instead, shared
    with no one)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(runtime, "pt2flow") if runtime and os.path.isabs(runtime) else f"/tmp/pt2flow-{os.getuid()}"
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        status = os.lstat(folder)
        if (
            stat.S_ISDIR(status.st_mode)
            and status.st_uid == os.getuid()
            and not status.st_mode & 0o077
            and len(folder) < 80
        ):
            return folder
    except OSError:
        pass
    global _private
    if _private is None:
        _private = tempfile.mkdtemp(prefix="pt2flow-")
        atexit.register(shutil.rmtree, _private, True)
    return _private


_private: str | None = None


class ForkServer:
    """A connection to the fork server of one interpreter, environment and folder, shared by every
    process that asks for it (a socket named by a digest of the three in runtime_folder()): the
    first one starts it; requests on a connection are serialized by a lock."""

    def __init__(self, python: str, env: dict[str, str], cwd: str | None, path: str) -> None:
        """The server at `path` (socket_path) started in `cwd`, or (None) in an empty folder of
        its own that serves any folder."""
        self.path = path
        self.folder: str | None = None  # its own empty folder (None: started in `cwd`), from its "ready" message
        self._cwd = cwd
        self.pid: int | None = None
        self.process: subprocess.Popen[bytes] | None = None  # when this process started it
        self.modules: frozenset[str] = frozenset()  # the top-level modules it imported (its "ready" message)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._broken: str | None = None  # why it answers nothing more
        self._retired: str | None = (
            None  # why it forks no more for this process (its workers' ends are still polled through it)
        )
        self._workers = 0  # forked through this connection, their end not yet seen
        try:
            self.sock = self._connect(python, env, cwd)
        except OSError as exc:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._broken = f"it could not be reached or started ({exc})"
            self._ready.set()
            return
        threading.Thread(
            target=self._await_ready, args=(python, env, cwd), name="pt2flow-forkserver-start", daemon=True
        ).start()

    @property
    def cwd(self) -> str | None:
        """The folder it started in."""
        self._ready.wait(READY_TIMEOUT)
        return self.folder or self._cwd

    def _connect(self, python: str, env: dict[str, str], cwd: str | None) -> socket.socket:
        """A connection to the server at self.path, started first (under the path's lock, so two
        processes asking at once start one) if none listens there."""
        with fork_server_lock(self.path):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self.path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):  # none, or one that is gone
                pass
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                listener.bind(self.path)
                listener.listen(64)
                self._start(python, env, cwd, listener)
            finally:
                listener.close()
            sock.connect(self.path)
            return sock

    def _start(self, python: str, env: dict[str, str], cwd: str | None, listener: socket.socket) -> None:
        folder = (
            tempfile.mkdtemp(prefix="pt2flow-forkserver-") if cwd is None else None
        )  # the server removes it when it exits
        argv = [
            python,
            "-m",
            "pt2flow.flows.engine.worker.forkserver",
            str(listener.fileno()),
            self.path,
            "--linger",
            str(_linger()),
        ]
        try:
            os.unlink(self.path + ".log")  # a server retiring from this path may still write to its own
        except FileNotFoundError:
            pass
        with open(self.path + ".log", "wb") as log:
            self.process = subprocess.Popen(
                argv + (["--own-folder"] if folder else []),
                pass_fds=[listener.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd=folder or cwd,
                start_new_session=True,  # a terminal's Ctrl-C is the orchestrator's to handle; it outlives this process
            )

    def _await_ready(self, python: str, env: dict[str, str], cwd: str | None) -> None:
        try:
            data = self._greeting()
            if data == b"":  # connected as it retired (it closes its socket unaccepted): once more, to its successor
                self.sock.close()
                self.sock = self._connect(python, env, cwd)
                data = self._greeting()
            message = pickle.loads(data) if data else None
            if not message or message[0] != "ready":
                self._broken = "it did not start" + self._tail()
            else:
                self.pid, self.modules = message[1], frozenset(message[2])
                self.folder = message[3] if self._cwd is None else None
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            self._broken = f"it did not start ({exc})" + self._tail()
        finally:
            self._ready.set()

    def _greeting(self) -> bytes | None:
        """The server's first message on this connection: b"" if it closed it, None if none came in time."""
        readable, _, _ = select.select([self.sock], [], [], READY_TIMEOUT)
        return self.sock.recv(MAX_MESSAGE) if readable else None

    def _tail(self) -> str:
        try:
            with open(self.path + ".log", "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 2000))
                text = log.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""
        return f": {text}" if text else ""

    def shadowed_in(self, folder: str) -> bool:
        """Whether `folder` holds a file or folder named like a module this server imported: a
        worker started there (the folder first on its sys.path) could import that one instead."""
        self._ready.wait(READY_TIMEOUT)
        try:
            return not _importable(folder).isdisjoint(self.modules)
        except OSError:
            return True

    @property
    def usable(self) -> bool:
        """Whether it forks: started (or starting), not stale, not retired, not gone (it left
        after its idle time: its end of the connection is closed)."""
        if self.process is not None:
            self.process.poll()  # reaped, if it was this process's child and left
        if self._broken is not None or self._retired is not None:
            return False
        if not self._ready.is_set() or not self._lock.acquire(blocking=False):
            return True  # starting, or a request in flight: it answers
        try:
            ended, _, _ = select.select(
                [self.sock], [], [], 0
            )  # nothing is sent unasked after "ready": readable is its end
            if ended:
                self._broken = "it went away"
            return not ended
        finally:
            self._lock.release()

    def fork(self, env: dict[str, str], cwd: str, fds: list[int], exports: bool = True) -> int:
        """A worker forked with `env` in `cwd` on `fds` (its connection, its log): its pid.
        `exports`: it will export (the server warms up first, once)."""
        if self._retired is not None:
            raise ServerUnavailable(self._retired, stale=True)
        reply = self._request(("fork", env, cwd, exports), fds)
        if reply[0] == "stale":
            self._retired = reply[1]
            raise ServerUnavailable(reply[1], stale=True)
        with self._lock:
            self._workers += 1
        return int(reply[1])

    def poll(self, pid: int) -> int | None:
        """The worker's returncode (reaped), or None while it runs."""
        returncode = self._request(("poll", pid))[1]
        if returncode is not None:
            self._ended()
        return returncode

    def _ended(self) -> None:
        with self._lock:
            self._workers -= 1
            done = self._retired is not None and self._workers <= 0
        if done:
            self.stop()

    def _request(self, message: tuple[Any, ...], fds: list[int] | None = None) -> tuple[Any, ...]:
        self._ready.wait(READY_TIMEOUT)
        if self._broken is not None:
            raise ServerUnavailable(self._broken)
        with self._lock:
            try:
                socket.send_fds(self.sock, [pickle.dumps(message)], fds or [])
                data = self.sock.recv(MAX_MESSAGE)
            except OSError as exc:
                self._broken = f"it went away ({exc})"
                raise ServerUnavailable(self._broken) from None
        if not data:
            self._broken = "it went away" + self._tail()
            raise ServerUnavailable(self._broken)
        return pickle.loads(data)

    def retire(self) -> None:
        """Fork no more through it; leave it once this process's last worker from it is gone."""
        with self._lock:
            self._retired = self._retired or "retired"
            done = self._workers <= 0
        if done:
            self.stop()

    def stop(self) -> None:
        """Leave it now: the server stops every worker it forked for this process (and exits after
        its linger if no other process uses it)."""
        self._broken = self._retired = "stopped"
        try:
            self.sock.close()  # the server sees the end of this connection
        except OSError:
            pass


def _linger() -> float:
    """How long a server this process starts stays once no process uses it (PT2FLOW_FORK_SERVER_LINGER_S)."""
    value = os.environ.get(LINGER_VARIABLE, "").strip()
    try:
        return max(0.0, float(value)) if value else DEFAULT_LINGER_S
    except ValueError:
        return DEFAULT_LINGER_S


_servers: dict[tuple[Any, ...], ForkServer] = {}
_servers_lock = threading.Lock()


def _importable(folder: str) -> set[str]:
    """The names `import NAME` could find in `folder`: packages (folders named as identifiers)
    and modules (files with a suffix Python imports: .py, .pyc, extension modules)."""
    names = set()
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                if entry.name.isidentifier():
                    names.add(entry.name)
                continue
            for suffix in SUFFIXES:
                if entry.name.endswith(suffix):
                    names.add(entry.name[: -len(suffix)])
                    break
    return names


def _relative_import_path(env: dict[str, str]) -> bool:
    """Whether PYTHONPATH has an entry that a worker resolves against its folder."""
    value = env.get("PYTHONPATH", "")
    return bool(value) and any(not os.path.isabs(entry) for entry in value.split(os.pathsep))


def socket_path(python: str, env: dict[str, str], cwd: str | None) -> str:
    """The socket of the server that forks workers of `python` with `env` (its volatile variables
    aside) started in `cwd` (None: a folder of its own), named by a digest of the three."""
    identity = (FORK_SERVER_PROTOCOL, python, cwd, tuple(sorted((k, v) for k, v in env.items() if not _volatile(k))))
    return os.path.join(runtime_folder(), hashlib.sha256(repr(identity).encode()).hexdigest()[:24])


def _server_for(python: str, env: dict[str, str], cwd: str) -> ForkServer:
    """The server that forks a worker with `env` in `cwd`: the environment's server of no folder,
    unless `cwd` shadows one of its modules or PYTHONPATH is relative (then a server started in `cwd`)."""
    kept = {k: v for k, v in env.items() if not _volatile(k)}
    if not _relative_import_path(kept):
        server = _server_of(python, kept, None)
        if not server.shadowed_in(cwd):
            return server
    return _server_of(python, kept, cwd)


def _server_of(python: str, kept: dict[str, str], cwd: str | None) -> ForkServer:
    """This process's connection to the server of `kept` (the environment without its volatile
    variables) in `cwd`: the one it has, or a new one (its socket found or its server started)."""
    key = (python, cwd, tuple(sorted(kept.items())))
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.usable:
            _servers[key] = _servers.pop(key)  # most recently used last
            return server
        if server is not None:  # stale (it retires by itself) or gone; a worker forked from it still polls it
            del _servers[key]
        while len(_servers) >= MAX_SERVERS:
            oldest = next(iter(_servers))
            _servers.pop(oldest).retire()
        server = ForkServer(python, kept, cwd, socket_path(python, kept, cwd))
        _servers[key] = server
        return server


def stop_servers() -> None:
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()


atexit.register(stop_servers)


def _forget_servers() -> None:
    """In a child forked from this process: the servers and their sockets are the parent's."""
    global _servers, _servers_lock
    _servers = {}
    _servers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_servers)


class LaunchedProcess:
    """A worker process, forked by a fork server or started on its own (`fallback`), with the
    part of subprocess.Popen's interface the supervisor uses."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        conn_fd: int,
        log: Any,
        stopping: Callable[[], bool] = lambda: False,
        exports: bool = True,
    ) -> None:
        self.args = argv
        self.exports = exports
        self.returncode: int | None = None
        self._pid: int | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._server: ForkServer | None = None
        self._started = threading.Event()
        self._stopping = stopping
        self._error: Exception | None = None
        cwd = os.getcwd()
        if forking_enabled():
            threading.Thread(target=self._fork, args=(env, cwd, conn_fd, log), name="pt2flow-fork", daemon=True).start()
        else:
            self._start_alone(env, conn_fd, log)

    def _fork(self, env: dict[str, str], cwd: str, conn_fd: int, log: Any) -> None:
        try:
            server = _server_for(self.args[0], env, cwd)
            try:
                pid = server.fork(env, cwd, [conn_fd, log.fileno()], self.exports)
            except ServerUnavailable as exc:
                if not exc.stale:
                    raise
                server = _server_for(self.args[0], env, cwd)  # a fresh one, once
                pid = server.fork(env, cwd, [conn_fd, log.fileno()], self.exports)
            self._server, self._pid = server, pid
            os.close(conn_fd)
            if self._stopping():  # the run was interrupted while this worker was being forked
                try:
                    os.killpg(self._pid, signal.SIGKILL)
                except OSError:
                    pass
        except Exception:  # noqa: BLE001 (no server could fork it: the worker starts on its own, as it always could)
            try:
                self._start_alone(env, conn_fd, log)
            except Exception as exc:  # noqa: BLE001 (raised where its pid is asked for, as Popen raises)
                self._error = exc
        finally:
            self._started.set()

    def _start_alone(self, env: dict[str, str], conn_fd: int, log: Any) -> None:
        self._popen = subprocess.Popen(
            self.args,
            pass_fds=[conn_fd],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,  # its own process group: killing it stops its compilers too
        )
        os.close(conn_fd)
        self._pid = self._popen.pid
        self._started.set()

    @property
    def pid(self) -> int:
        self._started.wait()
        if self._pid is None:
            raise self._error or RuntimeError("the worker process did not start")
        return self._pid

    @property
    def started(self) -> bool:
        """Whether the process exists yet (its pid is known)."""
        return self._started.is_set() and self._pid is not None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._started.is_set():
            return None  # still being forked: as alive as a process still importing torch
        if self._popen is not None:
            self.returncode = self._popen.poll()
        elif self._server is not None and self._pid is not None:  # started: the server reported its pid
            try:
                self.returncode = self._server.poll(self._pid)
            except ServerUnavailable:
                self.returncode = self._gone()
        return self.returncode

    def _gone(self) -> int | None:
        """The fork server went away before this worker's end was reported: alive while its pid
        is, else ended (by a kill: nothing else is known)."""
        try:
            os.kill(self.pid, 0)
            return None
        except ProcessLookupError:
            return -signal.SIGKILL
        except PermissionError:
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(POLL_SECONDS)


def launch(
    python: str | None,
    env: dict[str, str],
    conn_fd: int,
    parent: int,
    log: Any,
    stopping: Callable[[], bool],
    exports: bool = True,
) -> LaunchedProcess:
    """Start a worker on the connection `conn_fd` (closed here once the worker holds it) with
    `env`, its stdout and stderr on `log`; `exports`: whether it will export (a forked one then
    comes from a warm server)."""
    argv = [python or sys.executable, "-m", "pt2flow.flows.engine.worker.process", str(conn_fd), str(parent)]
    return LaunchedProcess(argv, env, conn_fd, log, stopping, exports)
