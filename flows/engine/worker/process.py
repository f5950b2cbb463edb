"""A worker process: `python -m pt2flow.flows.engine.worker.process FD PARENT` runs stages sent over the connection on
file descriptor FD until told to stop or its parent goes away. Never imports Prefect.

It leads its own process group (the supervisor starts it in a new session), so killing the
group also stops the compiler subprocesses inductor starts. When the supervisor dies, the
watchdog thread stops the whole group; SIGTERM stops the rest of it and exits 143 (the
supervisor tells that stop from a crash, flows/engine/orchestrator/supervisor.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from collections.abc import Iterator
from typing import Any


def _stop_group(*_args: object) -> None:
    """Kill this worker's process group (itself and its compilers), now."""
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(1)


def _stopped(signum: int, _frame: object) -> None:
    """SIGTERM (a scheduler or systemd stopping every process of a job): kill the
    rest of this worker's process group (its compilers), then exit 128 + signum, so that the
    supervisor tells a stop from a crash (a SIGKILL of the whole group would read as the OOM
    killer's)."""
    try:
        import psutil

        me, group = os.getpid(), os.getpgid(0)
        for proc in psutil.process_iter():
            try:
                if proc.pid != me and os.getpgid(proc.pid) == group:
                    proc.kill()
            except (psutil.Error, OSError):
                pass
    finally:
        os._exit(128 + signum)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            _stop_group()


def _set_threads() -> None:
    threads = os.environ.get("PT2FLOW_WORKER_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(fd: int, parent: int) -> int:
    """A worker started on its own (`python -m`): it watches its parent, prepares, then serves."""
    from pt2flow.flows.engine.common.heap import freeze_kept_objects

    watch(parent)
    prepare()
    freeze_kept_objects()
    return serve(Connection(fd))


def watch(parent: int) -> None:
    """The process-level set-up every worker runs first, started on its own or forked from the
    fork server (flows/engine/worker/forkserver.py): stack dumps, signals, the parent watchdog."""
    # a segfault prints the Python stack to stderr; SIGUSR1 (sent before a worker is stopped for
    # time or memory) prints where every thread is: both end up in the failed model's stderr tail
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when a worker stops
    threading.Thread(target=_watch_parent, args=(parent,), name="pt2flow-watchdog", daemon=True).start()


def prepare() -> None:
    """What a worker does before its first model, in this order (the fork server does it once,
    and forks its workers after): pin the start-up sys.path the dependency manifest resolves
    against, watch file reads (stages/reads.py: import-time reads too), import torch and the
    stages."""
    from pt2flow.stages.distributions import pin_import_path
    from pt2flow.stages.reads import install as watch_reads

    pin_import_path()
    watch_reads()
    import pt2flow.stages.trace  # noqa: F401  (torch and the stages: once per worker, before the first model)
    import pt2flow.flows.engine.worker.compute  # noqa: F401
    import pt2flow.storage.faults  # noqa: F401


def _imports_seen() -> dict[str, object]:
    """Describe's view of imports: the first sys.path entry, the pinned start-up path, inductor's
    compile threads, whether Prefect was imported (a worker never imports it)."""
    import torch._inductor.config

    from pt2flow.stages.distributions import import_path

    return {
        "path0": sys.path[0],
        "import_path": list(import_path()),
        "prefect": "prefect" in sys.modules,
        "compile_threads": torch._inductor.config.compile_threads,
    }


_PROFILE: Any = None


@contextlib.contextmanager
def _profiled() -> Iterator[None]:
    """With PT2FLOW_PROFILE_DIR set (bench/profile_fleet.py), the block runs under cProfile and
    this worker's totals so far are written to DIR/worker-PID.prof after it; else nothing."""
    global _PROFILE
    folder = os.environ.get("PT2FLOW_PROFILE_DIR")
    if not folder:
        yield
        return
    import cProfile

    if _PROFILE is None:
        _PROFILE = cProfile.Profile()
    _PROFILE.enable()
    try:
        yield
    finally:
        _PROFILE.disable()
        _PROFILE.dump_stats(os.path.join(folder, f"worker-{os.getpid()}.prof"))


def serve(conn: Connection) -> int:
    """Answer the orchestrator's messages on `conn` until told to stop or it goes away."""
    from pt2flow.flows.engine.common import messages
    from pt2flow.flows.engine.common.heap import freeze_kept_objects
    from pt2flow.flows.engine.worker import compute
    from pt2flow.storage.faults import crash_point

    _set_threads()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 0
        match message:
            case messages.Stop():
                # nothing is left to finish: skip the interpreter's teardown (torch's takes half a
                # second), which the supervisor waits for; it kills the process group after
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            case messages.StageRequest():  # one stage of one model
                with _profiled():
                    reply: object = compute.run_stage(message)
                sys.stdout.flush()
                sys.stderr.flush()
            case messages.CheckArtifact():  # check-compat: one artifact (flows/engine/maintenance/compat.py)
                crash_point("before_compat_check")
                reply = compute.check_artifact(message)
            case messages.RebuildRecord():  # pt2flow audit: one program record rebuilt (flows/engine/maintenance/audit.py)
                from pt2flow.flows.engine.worker.rebuild import rebuild

                reply = rebuild(message)
            case messages.InspectModel():  # pt2flow validate: one model's modules and forward() (flows/engine/orchestrator/preflight.py)
                from pt2flow.flows.engine.worker.model_check import inspect_model

                reply = inspect_model(message.model)
            case messages.NewModel():
                compute.forget_programs()
                freeze_kept_objects()  # what the last model's stages imported and cached (flows/engine/common/heap.py)
                reply = ("ok", None)
            case messages.Describe():  # tests and benchmarks: what this worker sees (pid, parent, folder, env)
                reply = (
                    "ok",
                    {
                        "pid": os.getpid(),
                        "ppid": os.getppid(),
                        "cwd": os.getcwd(),
                        "environ": dict(os.environ),
                        "threads": os.environ.get("PT2FLOW_WORKER_THREADS"),
                        "torch_threads": _torch_threads(),
                        # torch's first export done before this worker's first model (a fork server's warm-up)
                        "warm": "torch._dynamo.eval_frame" in sys.modules,
                        # objects kept out of the garbage collector's walks (flows/engine/common/heap.py)
                        "gc_frozen": gc.get_freeze_count(),
                        **_imports_seen(),
                    },
                )
            case _:  # an orchestrator of another protocol: say so rather than hang it
                reply = (
                    "failed",
                    {"error_class": "internal", "error": f"unknown worker message {type(message).__name__}"},
                )
        conn.send(reply)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
