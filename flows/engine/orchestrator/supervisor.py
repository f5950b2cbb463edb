"""Supervised worker processes: every stage of every model runs in one, never in the orchestrator.

Why not a library: concurrent.futures' ProcessPoolExecutor (and Prefect's ProcessPoolTaskRunner,
built on it) and loky fail every in-flight future when one worker dies (BrokenProcessPool /
TerminatedWorkerError), so one segfault would fail healthy models; Dask's nanny restarts a dead
worker, but has no per-task deadline, does not stop a task's compiler subprocesses, measures
only the worker's own memory and reports neither the signal nor the stage. The supervisor here
is small: a subprocess per worker in its own process group, a pipe, a deadline, psutil for the
memory of the whole process tree (docs/architecture.md, "Isolation").
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any
from collections.abc import Callable

import psutil

from pt2flow.flows.engine.common.messages import NewModel, ReplyT, Request, Stop
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

# A worker is replaced by a fresh one (forked from the fork server, torch imported and its first
# export done) after this many models. torch keeps objects from every export for the life of the
# process (about 1,400 more gc-tracked objects per small model, measured with torch 2.13), and
# each model's stages got slower with them: 582 ms for a tiny MLP after 100 models in one
# process, 658 ms after 400; in a 1,000-model fleet on 2 workers, the last 100 models took 22 %
# longer than the first 100. A fork costs a few milliseconds and the worker's first model pays
# nothing the fork server did not do. PT2FLOW_MODELS_PER_WORKER sets another count.
MODELS_PER_WORKER = 50
MODELS_PER_WORKER_VARIABLE = "PT2FLOW_MODELS_PER_WORKER"


def models_per_worker() -> int:
    """How many models a worker runs before it is replaced (PT2FLOW_MODELS_PER_WORKER, else
    MODELS_PER_WORKER); ValueError, naming the variable, for anything but a whole number of at least 1."""
    return _count_from_environment(MODELS_PER_WORKER_VARIABLE) or MODELS_PER_WORKER


def _count_from_environment(name: str, role: str = "") -> int | None:
    """The whole number of at least 1 in variable `name`; None when it is unset or empty;
    ValueError naming the variable (and its `role`) for anything else."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    count = int(value) if value.isdigit() else 0
    if count < 1:
        raise ValueError(f"{name} must be a whole number of at least 1{role}, not {value!r}")
    return count


def _models_per_worker_or_default() -> int:
    """models_per_worker(), read when a worker comes back (a run checked the variable before it
    started: prepare_run), MODELS_PER_WORKER where it is not a valid count."""
    try:
        return models_per_worker()
    except ValueError:
        return MODELS_PER_WORKER


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
        self.models = 0  # models it has started (Lease.get): the pool replaces it after models_per_worker()
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


class WorkerPool:
    """`size` workers, reused across models (torch is imported once per worker); a worker that
    died or was stopped, or has run models_per_worker() models, is replaced by a fresh one for
    the next model."""

    def __init__(
        self, size: int, threads: int | None = None, env: dict[str, str] | None = None, python: str | None = None
    ) -> None:
        self.size = max(1, size)
        self.python = python or sys.executable
        self.threads = threads
        self.env = dict(env or {})
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._all: list[Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.stopping = False  # set by interrupt(): a plain attribute, so a signal handler may set it
        # the models of a run in the order they take a worker (set_order): the orchestrator runs
        # one model ahead of the pool, and the one waiting must not take a worker before the
        # models the config names first (with one worker, a fleet runs in its config's order)
        self._turns: list[str] = []
        self._turn = threading.Condition()
        for _ in range(self.size):
            self._idle.put(self._spawn())

    def _spawn(self) -> Worker:
        # a pool shut down under a call in flight (the CLI stopping the workers of an interrupted
        # run) interrupts that call too: the stage did not fail, it was stopped
        worker = Worker(self.threads, self.env, stopping=lambda: self.stopping or self._closed, python=self.python)
        with self._lock:
            self._all.append(worker)
        return worker

    def set_order(self, models: list[str]) -> None:
        """The models of the run starting, in the order they are to take a worker."""
        with self._turn:
            self._turns = list(models)
            self._turn.notify_all()

    def leave_turn(self, model: str | None) -> None:
        """`model` takes no worker (more): the next one in the order may."""
        with self._turn:
            if model in self._turns:
                self._turns.remove(model)
                self._turn.notify_all()

    def acquire(self, model: str | None = None) -> Worker:
        """An idle worker for `model`, once every model before it in set_order's order has had
        one or is done (a model not in the order does not wait its turn)."""
        with self._turn:
            while model in self._turns and self._turns[0] != model:
                if self.stopping:
                    raise Interrupted("the run was interrupted before this model got a worker")
                self._turn.wait(POLL_SECONDS)
        try:
            while True:
                if self.stopping:
                    raise Interrupted("the run was interrupted before this model got a worker")
                try:
                    worker = self._idle.get(timeout=POLL_SECONDS)
                    break
                except queue.Empty:
                    continue
        finally:
            self.leave_turn(model)
        if not worker.alive:
            self._retire(worker)
            worker = self._spawn()
        return worker

    def release(self, worker: Worker) -> None:
        if self._closed or self.stopping:
            return
        if worker.alive and worker.models < _models_per_worker_or_default():
            self._idle.put(worker)
        else:  # replaced now, so the next model finds a worker already starting (then this one is stopped)
            self._idle.put(self._spawn())
            self._retire(worker)

    def _retire(self, worker: Worker) -> None:
        worker.close()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)

    @property
    def usable(self) -> bool:
        return not (self._closed or self.stopping)

    def pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._all]

    def interrupt(self) -> None:
        """Stop now, from a signal handler or an unwinding main thread: set the flag that every
        wait on a worker polls and kill every worker's process group. Takes no lock (the
        interrupted thread may hold one) and waits for nothing; shutdown() reaps them later."""
        self.stopping = True
        for worker in list(self._all):  # a copy made in one step under the GIL
            worker.kill_group_now()

    def shutdown(self) -> None:
        """Stop every worker (and its compilers) now; in-flight calls end with WorkerLost."""
        self._closed = True
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for worker in workers:  # all told at once: they exit side by side
            worker.ask_to_stop()
        for worker in workers:
            worker.close()


# ---------------------------------------------------------------------------------------------
# the process's pool: the orchestrator's (local runner) or a Dask worker's (one worker each)

_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


WORKERS_VARIABLE = "PT2FLOW_WORKERS"


def workers_from_environment() -> int | None:
    """PT2FLOW_WORKERS: the worker count where --workers is not given, when it is set (a machine
    whose cores other jobs share: a CI runner, a test suite's parallel workers, a container whose
    affinity shows the host's cores). ValueError, naming the variable, for anything but a whole
    number of at least 1."""
    return _count_from_environment(WORKERS_VARIABLE, " (the default for --workers)")


def default_workers(models: int) -> int:
    """Worker processes for `models` models when --workers is not given: PT2FLOW_WORKERS where it
    is set, else one per core and at most one per 3 GiB of available memory (a torch worker's
    working set); at most one per model either way."""
    configured = workers_from_environment()
    if configured is not None:
        return max(1, min(models, configured))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = psutil.virtual_memory().available // (3 * 2**30)
    return max(1, min(models, cores, memory))


def worker_threads(size: int) -> int:
    """torch threads per worker: the cores shared out, at least one each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, size))


def start_pool(size: int, python: str | None = None) -> WorkerPool:
    """Start this process's pool of `size` workers under `python` (default: this interpreter),
    replacing a smaller one or one of another interpreter."""
    global _pool
    python = python or sys.executable
    with _pool_lock:
        _refuse_if_interrupted(_pool)
        if _pool is not None and _pool.size >= size and _pool.usable and _pool.python == python:
            return _pool
        if _pool is not None:
            _pool.shutdown()
        env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if size > 1 else {}  # N compiles side by side
        _pool = WorkerPool(size, threads=worker_threads(size), env=env, python=python)
        return _pool


def shared_pool(size: int = 1, python: str | None = None) -> WorkerPool:
    with _pool_lock:
        existing = _pool
    _refuse_if_interrupted(existing)
    if existing is not None and existing.usable and existing.python == (python or sys.executable):
        return existing
    return start_pool(size, python)


def _refuse_if_interrupted(pool: WorkerPool | None) -> None:
    """Interrupted when `pool` was interrupted: a model task that starts after the interrupt (its
    thread was still being scheduled) must not start a fresh pool in place of the stopped one,
    whose worker would run its stages while the unwinding main thread waits on it (CI saw a
    SIGTERM 3 s into a run wait out a hung model's 600 s that way). stop_pool() clears it."""
    if pool is not None and pool.stopping:
        raise Interrupted("the run was interrupted before this model started")


def interrupt_pool() -> None:
    """The run was interrupted: stop this process's workers now, without taking a lock (safe in
    a signal handler, and in a main thread that unwinds while model threads wait on workers)."""
    pool = _pool
    if pool is not None:
        pool.interrupt()


def stop_pool() -> None:
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown()


atexit.register(stop_pool)


@dataclass
class Lease:
    """The worker a model's stages run on, acquired at its first stage with work and released
    (or replaced, if it died) when the model is done. `waited`: the seconds that acquisition
    spent waiting for another model to release a worker (the model's thread runs one model ahead
    of the pool: flows/fleet.py _task_runner), which count toward neither the model's time limit
    nor its stage's seconds (runner._attempt)."""

    pool: WorkerPool
    model: str | None = None  # its turn in the pool's order (WorkerPool.set_order)
    worker: Worker | None = None
    waited: float = 0.0
    pid: int | None = None  # the last worker's, kept after release (the model document names it)

    def get(self) -> Worker:
        if self.worker is None:
            asked = time.monotonic()
            self.worker = self.pool.acquire(self.model)
            self.waited = time.monotonic() - asked
            self.worker.models += 1
            self.pid = self.worker.pid
            self.worker.post(NewModel())
        return self.worker

    def release(self) -> None:
        """Give the worker back (the model needs none any more: its last stage's work came back);
        a second call does nothing."""
        self.pool.leave_turn(self.model)  # a model done without a worker lets the next one have its turn
        if self.worker is not None:
            self.pool.release(self.worker)
            self.worker = None
