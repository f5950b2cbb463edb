"""The pool of supervised workers a process runs its models' stages on (engine/orchestrator/supervisor.py
is one worker: its process, its calls, their deadlines and memory): how many workers, how many
torch threads each, when one is replaced by a fresh one, the order models take them in (a fleet
with one worker runs in its config's order), and the process's one pool, which an interrupt stops
without taking a lock (docs/architecture.md, "Isolation").
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from pt2flow.flows.engine.common.messages import NewModel
from pt2flow.flows.engine.orchestrator.supervisor import POLL_SECONDS, Interrupted, Worker

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
