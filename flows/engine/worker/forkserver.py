"""The fork server: `python -m pt2flow.flows.engine.worker.forkserver FD` does what a worker does
before its first model once (process.prepare: the start-up sys.path pinned, file reads watched,
torch and the stages imported), plus, before the first worker that will export, torch's first
export (stages/warmup.py: the lazy imports and first-use caches a worker's first model would pay,
about 3-5 s of CPU), then forks a worker for each request on the socket FD. A worker forked here
is what `python -m pt2flow.flows.engine.worker.process` would be after its imports (and, for one
that exports, a first export), started in a few milliseconds instead of seconds of torch import
(a pool's second worker, a worker replacing one that crashed, the next run's workers in a process
that runs many: `serve`, a test session). It never imports a model: every model's modules are imported in a worker.

Requests and replies are pickled tuples on a SOCK_SEQPACKET socket (one message each). Once
ready, the server says so: ("ready", pid, names of the top-level modules it imported), which the
orchestrator checks a worker's folder against (flows/engine/orchestrator/launcher.py).

- ("fork", env, cwd, exports) with two file descriptors (the worker's connection, its log): a
  worker in a session of its own, its stdout and stderr on the log, `env` as its environment
  (exactly), `cwd` its folder and, in place of the server's own folder, the first entry of its
  sys.path and of the pinned start-up path; reply ("forked", pid). `exports`: the worker will
  export (a run's, audit's), so the server does its warm-up first if it has not yet; a worker that
  only imports models or loads artifacts (`pt2flow validate`'s, check-compat's) is forked without;
- ("poll", pid): reply ("status", returncode or None), as subprocess's poll gives it (-N for a
  signal); a worker is reaped here only when polled, so its pid names it until the orchestrator
  has seen it end;
- ("retire",): exit once no worker forked here is left (another environment took its place).

The server answers ("stale", why) to a fork when what it imported is no longer what a fresh
worker would import (a package installed or removed, a pt2flow source file edited), and exits:
the orchestrator starts a fresh one. It exits on its own after IDLE_SECONDS without a request and
with no worker left, and at once when the orchestrator goes away (the socket's end), stopping its
workers (they also watch it: process.watch). Single-threaded: it never forks with a lock held.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import sys
import traceback
from typing import Any

IDLE_SECONDS = 600.0
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


def _child(sock: socket.socket, fds: list[int], env: dict[str, str], cwd: str, start_folder: str) -> None:
    """In the forked worker: become what a worker started on its own is, then serve. Never returns."""
    code = 1
    try:
        sock.close()
        conn_fd, log_fd = fds
        os.setsid()  # its own process group: killing it stops its compilers too
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        _as_started(env, cwd, start_folder)
        from multiprocessing.connection import Connection

        from pt2flow.flows.engine.worker import process

        sys.argv = [process.__file__, str(conn_fd), str(os.getppid())]  # as `python -m ...process FD PARENT` has it
        process.watch(os.getppid())  # this server: it goes when the orchestrator does
        code = process.serve(Connection(conn_fd))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(fd: int, own_folder: bool = False) -> int:
    """Serve on socket `fd`; `own_folder`: the folder it started in is an empty one of its own
    (flows/engine/orchestrator/launcher.py made it), removed when it exits."""
    import faulthandler

    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when it stops
    sock = socket.socket(fileno=fd)
    from pt2flow.flows.engine.worker import process
    from pt2flow.stages.distributions import path_state

    process.prepare()
    from pt2flow.stages.warmup import warm_up

    started_with, sources = path_state(), _sources()
    warm = False
    start_folder = os.getcwd()
    workers: set[int] = set()
    retiring = False

    def reply(message: tuple[Any, ...]) -> None:
        sock.send(pickle.dumps(message))

    reply(("ready", os.getpid(), sorted({name.partition(".")[0] for name in sys.modules})))
    try:
        while not (retiring and not workers):
            readable, _, _ = select.select([sock], [], [], IDLE_SECONDS)
            if not readable:
                if workers:
                    continue
                return 0  # idle: nothing to fork, nothing left to report on
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
            if not data:
                return 0  # the orchestrator is gone
            request = pickle.loads(data)
            if request[0] == "fork":
                why = _stale(started_with, sources)
                if why:
                    for each in fds:
                        os.close(each)
                    reply(("stale", why))
                    retiring = True
                    continue
                _, env, cwd, exports = request
                if exports and not warm:
                    warm_up()  # torch's first export done here once, not in every forked worker (stages/warmup.py)
                    warm = True
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(sock, fds, env, cwd, start_folder)
                for each in fds:
                    os.close(each)
                workers.add(pid)
                reply(("forked", pid))
            elif request[0] == "poll":
                returncode = _status(request[1])
                if returncode is not None:
                    workers.discard(request[1])
                reply(("status", returncode))
            elif request[0] == "retire":
                retiring = True
            else:
                reply(("error", f"unknown fork server request {request[0]!r}"))
        return 0
    finally:
        for pid in workers:  # the orchestrator is gone: so are its workers
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        if own_folder:
            try:
                os.rmdir(start_folder)
            except OSError:
                pass


if __name__ == "__main__":
    code = main(int(sys.argv[1]), own_folder="--own-folder" in sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch's interpreter teardown takes half a second and frees nothing the OS would not
