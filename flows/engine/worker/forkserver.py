"""The fork server: `python -m pt2flow.flows.engine.worker.forkserver FD PATH` does what a worker
does before its first model once (process.prepare: the start-up sys.path pinned, file reads
watched, torch and the stages imported), plus, before the first worker that will export, torch's
first export (stages/warmup.py: the lazy imports and first-use caches a worker's first model would
pay, about 3-5 s of CPU), then forks a worker for each request of the processes connected to it.
A worker forked here is what `python -m pt2flow.flows.engine.worker.process` would be after its
imports (and, for one that exports, a first export), started in a few milliseconds instead of
seconds (a pool's second worker, a worker replacing one that crashed, the next run's workers, in
this process or in any other of the same interpreter and environment: two `pt2flow run`s, a test
session and its CLI subprocesses). It never imports a model: every model's modules are imported
in a worker.

FD is a listening Unix socket (SOCK_SEQPACKET) bound at PATH, in the user's private runtime
folder; the process that started the server bound it (flows/engine/orchestrator/launcher.py).
Each process connects; the server greets each connection with ("ready", pid, names of the
top-level modules it imported, the folder it started in), which the orchestrator checks a
worker's folder against. Requests and replies are pickled tuples, one message each:

- ("fork", env, cwd, exports) with two file descriptors (the worker's connection, its log): a
  worker in a session of its own, its stdout and stderr on the log, `env` as its environment
  (exactly), `cwd` its folder and, in place of the server's own folder, the first entry of its
  sys.path and of the pinned start-up path; reply ("forked", pid). `exports`: the worker will
  export (a run's, audit's), so the server does its warm-up first if it has not yet; a worker that
  only imports models or loads artifacts (`pt2flow validate`'s, check-compat's) is forked without;
- ("poll", pid): reply ("status", returncode or None), as subprocess's poll gives it (-N for a
  signal), for a worker forked on this connection; a worker is reaped here only when polled, so
  its pid names it until its orchestrator has seen it end.

A connection that ends (its process exited, crashed or was killed) takes the workers forked on it
with it: the server kills them (they watch the server, not the orchestrator: a forked worker's
parent is the server). The server answers ("stale", why) to a fork when what it imported is no
longer what a fresh worker would import (a package installed or removed, a pt2flow source file
edited): it unlinks PATH first (the next process starts a fresh server there), forks no more, and
exits once no worker forked here is left. It exits after its linger (`--linger S`, the starting
process's PT2FLOW_FORK_SERVER_LINGER_S, 60 s by default) with no process connected and no worker
left, and after IDLE_SECONDS without a request and no worker left. Single-threaded: it never
forks with a lock held.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

IDLE_SECONDS = 600.0  # no request for this long and no worker left: it exits, clients connected or not
LINGER_SECONDS = 60.0  # no client connected and no worker left for this long: it exits
TICK_SECONDS = 1.0
MAX_MESSAGE = 1 << 20


def _sources() -> dict[str, int]:
    """The mtimes of the pt2flow modules this process imported (an edited source is a stale server)."""
    state = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and name.startswith("pt2flow"):
            try:
                state[path] = os.stat(path).st_mtime_ns
            except OSError:
                state[path] = -1
    return state


def _stale(started_with: Any, sources: dict[str, int]) -> str | None:
    from pt2flow.stages.distributions import path_state

    if path_state() != started_with:
        return "a package was installed or removed since the fork server started"
    if _sources() != sources:
        return "a pt2flow source file changed since the fork server started"
    return None


def _status(pid: int) -> int | None:
    """The worker's exit as subprocess.Popen.returncode gives it (reaping it), or None while it runs."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -signal.SIGKILL  # not ours, or reaped already: it is gone
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def _as_started(env: dict[str, str], cwd: str, start_folder: str) -> None:
    """Make this forked worker what `python -m` with `env` in `cwd` would be: its folder, not the
    server's, first on sys.path and on the pinned start-up path, and inductor's compile threads
    (read when torch._inductor.config was imported, in the server) decided from `env`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if cwd != start_folder:
        from pt2flow.stages.distributions import replace_import_path_entry

        sys.path[:] = [cwd if entry == start_folder else entry for entry in sys.path]
        replace_import_path_entry(start_folder, cwd)
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = config.decide_compile_threads()  # type: ignore[attr-defined]


def _child(
    closing: list[socket.socket], fds: list[int], env: dict[str, str], cwd: str, start_folder: str, orchestrator: int
) -> None:
    """In the forked worker: become what a worker started on its own is, then serve. Never returns."""
    code = 1
    try:
        for each in closing:  # the server's listening socket and every client's connection are not the worker's
            each.close()
        conn_fd, log_fd = fds
        os.setsid()  # its own process group: killing it stops its compilers too
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        _as_started(env, cwd, start_folder)
        from multiprocessing.connection import Connection

        from pt2flow.flows.engine.worker import process

        sys.argv = [process.__file__, str(conn_fd), str(orchestrator)]  # as `python -m ...process FD PARENT` has it
        process.watch(
            os.getppid()
        )  # this server: a worker goes with it (and with its orchestrator: the server stops it)
        code = process.serve(Connection(conn_fd))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


class _Listener:
    """The socket clients connect to, at `path` in the runtime folder: the server leaves it (and
    unlinks the path, if it is still its own) when it retires or exits, so the next client starts
    a fresh server there."""

    def __init__(self, fd: int, path: str) -> None:
        self.sock: socket.socket | None = socket.socket(fileno=fd)
        self.path = path
        try:
            self.inode: int | None = os.stat(path).st_ino
        except OSError:
            self.inode = None

    def close(self) -> None:
        if self.sock is None:
            return
        from pt2flow.flows.engine.common.protocol import fork_server_lock

        try:
            with fork_server_lock(self.path):  # the lock a client holds while it starts a server here
                if self.inode is not None and os.stat(self.path).st_ino == self.inode:
                    os.unlink(self.path)
        except OSError:
            pass
        self.sock.close()
        self.sock = None


def main(fd: int, path: str, linger: float = LINGER_SECONDS, own_folder: bool = False) -> int:
    """Serve the clients that connect to the listening socket `fd` (bound at `path`); `linger`:
    seconds it stays once no client is connected and no worker is left; `own_folder`: the folder
    it started in is an empty one of its own (flows/engine/orchestrator/launcher.py made it),
    removed when it exits."""
    import faulthandler

    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its clients decide when their workers stop
    listener = _Listener(fd, path)
    from pt2flow.flows.engine.worker import process
    from pt2flow.stages.distributions import path_state

    process.prepare()
    from pt2flow.flows.engine.common.heap import freeze_kept_objects
    from pt2flow.stages.warmup import warm_up

    freeze_kept_objects()  # torch and the stages: never walked by a worker's collections

    started_with, sources = path_state(), _sources()
    warm = False
    start_folder = os.getcwd()
    ready = pickle.dumps(("ready", os.getpid(), sorted({name.partition(".")[0] for name in sys.modules}), start_folder))
    clients: dict[socket.socket, set[int]] = {}  # each connection and the workers forked for it, not yet reported ended
    orphans: set[int] = set()  # workers of clients that went away: killed, reaped here
    retiring = False
    last = time.monotonic()  # the last request, or the last client leaving

    def leave(conn: socket.socket) -> None:
        nonlocal last
        for pid in clients.pop(conn):  # a client that went away (ended, crashed, killed) takes its workers with it
            _kill(pid)
            orphans.add(pid)
        conn.close()
        last = time.monotonic()

    def sockets() -> list[socket.socket]:
        """The connections and the listening socket: what the server watches, and what a forked worker closes."""
        return [*clients, *([listener.sock] if listener.sock is not None else [])]

    try:
        while True:
            orphans -= {pid for pid in orphans if _status(pid) is not None}
            working = bool(orphans) or any(clients.values())
            idle = time.monotonic() - last
            if not working and (retiring or (not clients and idle >= linger) or idle >= IDLE_SECONDS):
                return 0
            readable, _, _ = select.select(sockets(), [], [], TICK_SECONDS)
            for conn in readable:
                if conn is listener.sock:
                    try:
                        accepted, _ = conn.accept()
                        accepted.send(ready)
                    except OSError:
                        continue
                    clients[accepted] = set()
                    continue
                try:
                    data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 2)
                except OSError:
                    data, fds = b"", []
                if not data:
                    leave(conn)
                    continue
                last = time.monotonic()
                request = pickle.loads(data)
                if request[0] == "fork":
                    why = _stale(started_with, sources)
                    if why:
                        for each in fds:
                            os.close(each)
                        retiring = True
                        listener.close()  # first: the client told next starts a fresh server
                        _reply(conn, ("stale", why))
                        continue
                    _, env, cwd, exports = request
                    if exports and not warm:
                        warm_up()  # torch's first export done here once, not in every forked worker (stages/warmup.py)
                        freeze_kept_objects()  # and the caches it filled
                        warm = True
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(sockets(), fds, env, cwd, start_folder, _peer(conn))
                    for each in fds:
                        os.close(each)
                    clients[conn].add(pid)
                    _reply(conn, ("forked", pid))
                elif request[0] == "poll":
                    pid = request[1]
                    returncode = _status(pid) if pid in clients[conn] else -signal.SIGKILL  # not this client's: gone
                    if returncode is not None:
                        clients[conn].discard(pid)
                    _reply(conn, ("status", returncode))
                else:
                    _reply(conn, ("error", f"unknown fork server request {request[0]!r}"))
        return 0
    finally:
        for conn in list(clients):
            leave(conn)
        listener.close()
        if own_folder:
            try:
                os.rmdir(start_folder)
            except OSError:
                pass


def _peer(conn: socket.socket) -> int:
    """The process id of the client on `conn` (as the kernel saw it connect)."""
    try:
        pid, _uid, _gid = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        return int(pid)
    except OSError:
        return 0


def _reply(conn: socket.socket, message: tuple[Any, ...]) -> None:
    try:
        conn.send(pickle.dumps(message))
    except OSError:
        pass  # the client went away: its end is seen on the next select


if __name__ == "__main__":
    args = sys.argv[1:]
    linger = float(args[args.index("--linger") + 1]) if "--linger" in args else LINGER_SECONDS
    code = main(int(args[0]), args[1], linger, own_folder="--own-folder" in args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch's interpreter teardown takes half a second and frees nothing the OS would not
