"""Supervised worker processes: every stage of every model runs in one, never in the orchestrator.
This module is one worker (its process, its calls, their deadlines and memory); the pool of them
a run takes workers from is engine/orchestrator/pool.py.

Why not a library: concurrent.futures' ProcessPoolExecutor (and Prefect's ProcessPoolTaskRunner,
built on it) and loky fail every in-flight future when one worker dies (BrokenProcessPool /
TerminatedWorkerError), so one segfault would fail healthy models; Dask's nanny restarts a dead
worker, but has no per-task deadline, does not stop a task's compiler subprocesses, measures
only the worker's own memory and reports neither the signal nor the stage. The supervisor here
is small: a subprocess per worker in its own process group, a pipe, a deadline, psutil for the
memory of the whole process tree (docs/architecture.md, "Isolation").
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any
from collections.abc import Callable

import psutil

from pt2flow.flows.engine.common.messages import ReplyT, Request, Stop
from pt2flow.flows.engine.orchestrator.launcher import launch
from pt2flow.stages.vocabulary import ErrorClass

POLL_SECONDS = 0.05
# a worker stopped by a signal that stops runs (SIGTERM from a scheduler or systemd, which signal
# every process; SIGINT) is an interrupt once the orchestrator's own handler has set the pool's
# flag: this long it is given to do so before the death counts as a crash
STOP_SIGNAL_GRACE_S = 3.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
MEMORY_SAMPLE_SECONDS = 0.2
STARTUP_TIMEOUT = 300.0
STDERR_TAIL_BYTES = 16000  # a faulthandler dump of a deep torch stack runs to ~10 kB


class Interrupted(BaseException):
    """The run was interrupted (Ctrl-C, SIGTERM): the model threads stop waiting on their workers
    at once, and nothing is recorded for the stage they were in (a BaseException, as
    KeyboardInterrupt is, so that no handler of stage failures records it)."""


class WorkerLost(Exception):
    """The worker stopped before it answered: `error_class` says why (crash, timeout, out_of_memory)."""

    def __init__(self, error_class: ErrorClass, message: str, stderr_tail: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.stderr_tail = stderr_tail
        self.returncode = returncode


def stopped_by_signal(returncode: int | None) -> bool:
    """Whether a worker ended because it was told to stop (SIGTERM, SIGINT): killed by one, or
    exited 128 + its number (worker.py's handler, after stopping its compilers)."""
    return returncode is not None and (-returncode in STOP_SIGNALS or returncode - 128 in STOP_SIGNALS)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is gone"
    if returncode - 128 in STOP_SIGNALS:
        return f"was stopped by {signal.Signals(returncode - 128).name} (exit code {returncode}), sent by something other than this run"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if -returncode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class Budget:
    """What one call may use: an absolute deadline (time.monotonic) and a memory ceiling."""

    deadline: float | None = None
    deadline_reason: str = ""
    memory_bytes: int | None = None


@functools.cache
def _children_files() -> bool:
    """Whether this kernel has /proc/PID/task/TID/children (asked once per process)."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")


def process_tree(pid: int) -> list[int] | None:
    """`pid` and every process under it, read from each thread's /proc/PID/task/TID/children
    (Linux): a few small reads, where psutil's children(recursive=True) reads the parent of every
    process on the machine (2-10 ms a call with 70-300 processes, and a run's model threads sample
    their worker's memory five times a second). A child forked or reaped during the walk may be
    missed, as it may by psutil: the next sample sees it. None where the files do not exist."""
    if not _children_files():
        return None
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            threads = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # gone
        for thread in threads:
            try:
                with open(f"/proc/{current}/task/{thread}/children") as children:
                    todo.extend(int(child) for child in children.read().split())
            except OSError:
                pass
    return found


class Worker:
    """One worker process, started at once (it imports torch while the orchestrator does other
    work) and used by one model at a time."""

    def __init__(
        self,
        threads: int | None,
        env: dict[str, str] | None = None,
        stopping: Callable[[], bool] = lambda: False,
        python: str | None = None,
        exports: bool = True,
    ) -> None:
        """`python`: the interpreter to start (default: this one); another environment's must
        have pt2flow installed (flows/engine/environment/interpreter.py checks that before a run).
        `exports=False`: a worker that only imports models or loads artifacts, which a fork server
        forks without doing torch's first export first (flows/engine/worker/forkserver.py)."""
        self.stopping = stopping  # the pool's 'stop now' flag, polled while waiting
        parent_sock, child_sock = socket.socketpair()
        self.log = tempfile.TemporaryFile(prefix="pt2flow-worker-")
        child_env = {**os.environ, **(env or {}), "PT2FLOW_WORKER": "1"}
        if threads:
            child_env["PT2FLOW_WORKER_THREADS"] = str(threads)
        # forked from the fork server that imported torch once, or started on its own (launcher.py)
        self.process = launch(python, child_env, child_sock.detach(), os.getpid(), self.log, self.stopping, exports)
        self.conn = Connection(parent_sock.detach())
        self.ready = False
        self.models = 0  # models it has started (Lease.get): the pool replaces it after pool.models_per_worker()
        self._offset = 0
        self._stop_sent = False
        self._unanswered = 0  # answers to post()ed messages not yet read

    @property
    def pid(self) -> int:
        """The worker's pid (waits for its fork, a few milliseconds once the fork server is up)."""
        return self.process.pid

    # -- calls -------------------------------------------------------------------------------
    def call(self, message: Request[ReplyT], budget: Budget = Budget()) -> ReplyT:
        """Send `message`, wait for the answer within `budget`; WorkerLost if the worker dies,
        runs out of time or memory (it is then killed, with its whole process tree)."""
        self.send(message, budget)
        return self.receive(budget)

    def send(self, message: Request[Any], budget: Budget = Budget()) -> None:
        """Send `message` without waiting for its answer (`receive` takes it): the orchestrator
        starts a model's next stage this way while it records the one before
        (flows/engine/orchestrator/runner.py, Ahead). The worker's start is waited for within
        `budget`. WorkerLost as `call`."""
        self._offset = self._log_size()
        if not self.ready:
            self._wait(budget, startup=True)
            self.ready = True
        try:
            self.conn.send(message)
        except OSError:
            raise self._lost(ErrorClass.CRASH, "before the stage started") from None

    def receive(self, budget: Budget = Budget()) -> Any:
        """The answer to the message sent last, waited for within `budget`; WorkerLost as `call`."""
        while self._unanswered:  # answers to `post`ed messages come first, in order
            self._wait(budget)
            self._unanswered -= 1
        return self._wait(budget)

    def post(self, message: Request[Any]) -> None:
        """Send `message` and leave its answer unread (a NewModel: it always answers ok); the
        next `receive` reads it first and drops it. WorkerLost as `call`."""
        self.send(message)
        self._unanswered += 1

    def _wait(self, budget: Budget, startup: bool = False) -> Any:
        next_sample = 0.0
        startup_deadline = time.monotonic() + STARTUP_TIMEOUT if startup else None
        while True:
            self._raise_if_interrupted()  # before looking at the process: the interrupt killed it
            try:
                if self.conn.poll(POLL_SECONDS):
                    return self.conn.recv()
            except (EOFError, OSError):
                raise self._lost(ErrorClass.CRASH, "") from None
            if self.process.poll() is not None:
                raise self._lost(ErrorClass.CRASH, "")
            now = time.monotonic()
            if budget.deadline is not None and now > budget.deadline:
                self.kill(dump_stacks=True)
                raise self._lost(ErrorClass.TIMEOUT, budget.deadline_reason)
            if startup_deadline is not None and now > startup_deadline:
                self.kill()
                raise self._lost(ErrorClass.CRASH, f"did not start within {STARTUP_TIMEOUT:.0f} s")
            if budget.memory_bytes is not None and now >= next_sample:
                next_sample = now + MEMORY_SAMPLE_SECONDS
                used = self.memory_bytes()
                if used > budget.memory_bytes:
                    self.kill(dump_stacks=True)
                    raise self._lost(
                        "out_of_memory",
                        f"its processes used {used / 2**30:.2f} GiB, over the limit of {budget.memory_bytes / 2**30:.2f} GiB",
                    )

    def _lost(self, error_class: ErrorClass, reason: str) -> WorkerLost:
        """Why the worker is gone, as the exception to raise; raises Interrupted instead when the
        run is being interrupted (the interrupt killed it, or the signal that stops the run
        reached it too: Ctrl-C or a scheduler's SIGTERM to every process), which records nothing."""
        self._raise_if_interrupted()
        try:
            returncode = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            returncode = self.process.returncode
        self._raise_if_interrupted()
        if stopped_by_signal(returncode):
            grace = time.monotonic() + STOP_SIGNAL_GRACE_S
            while time.monotonic() < grace:
                self._raise_if_interrupted()
                time.sleep(POLL_SECONDS)
        if error_class == "crash":
            message = f"the worker process (pid {self.pid}) {describe_exit(returncode)}" + (
                f" {reason}" if reason else ""
            )
        else:
            message = f"{reason}; its worker process (pid {self.pid}) and everything it started were stopped"
        return WorkerLost(error_class, message, self.stderr_tail(), returncode)

    def _raise_if_interrupted(self) -> None:
        if self.stopping():
            raise Interrupted(f"the run was interrupted; worker process {self.pid} stopped")

    # -- state -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def memory_bytes(self) -> int:
        """Resident memory of the worker and every process under it (compilers included)."""
        pids = process_tree(self.pid)
        if pids is None:  # no /proc/PID/task/TID/children here: psutil walks every process's parent
            try:
                root = psutil.Process(self.pid)
                pids = [root.pid, *(child.pid for child in root.children(recursive=True))]
            except psutil.Error:
                return 0
        total = 0
        for pid in pids:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return total

    def _log_size(self) -> int:
        try:
            return os.fstat(self.log.fileno()).st_size
        except OSError:
            return 0

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        """What the worker wrote to stdout/stderr since the current call began (the end of it)."""
        end = self._log_size()
        start = max(self._offset, end - limit)
        try:
            data = os.pread(self.log.fileno(), end - start, start)
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def kill(self, dump_stacks: bool = False) -> None:
        """Stop the worker and every process it started, at once (dump_stacks: first have it
        print where each of its threads is, for the stderr tail)."""
        if dump_stacks and self.alive:
            try:
                os.kill(self.pid, signal.SIGUSR1)
                time.sleep(0.3)
            except ProcessLookupError:
                pass
        try:
            descendants = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in descendants:  # a compiler that left the group
            try:
                proc.kill()
            except psutil.Error:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill_group_now(self) -> None:
        """SIGKILL the worker's process group, taking no lock and waiting for nothing (safe in a
        signal handler); kill() or close() reaps it later."""
        if self.process.returncode is None and self.process.started:  # not yet reaped: its pid still names its group
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def ask_to_stop(self) -> None:
        """Tell the worker to exit, without waiting for it (close() waits, then kills its group)."""
        if self.alive and not self._stop_sent:
            try:
                self.conn.send(Stop())
            except OSError:
                pass
            self._stop_sent = True

    def close(self) -> None:
        if self.alive:
            self.ask_to_stop()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.conn.close()
        self.log.close()
