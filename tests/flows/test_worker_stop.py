"""How the supervisor tells an interrupt from a crash (flows/engine/orchestrator/supervisor.py, issue 31), on real
worker processes: a worker that dies while the run is being interrupted is `Interrupted` (no
stage failure is recorded for it), whichever of the two the waiting thread saw first; a worker
stopped by SIGTERM (a scheduler stopping every process) is an interrupt once the orchestrator's
own handler has set the flag, and otherwise a crash that names SIGTERM, never the OOM killer."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from pt2flow.flows.engine.common.messages import Describe
from pt2flow.flows.engine.orchestrator.supervisor import Budget, Interrupted, Worker, WorkerLost

pytestmark = pytest.mark.integration  # real worker processes


def _ready_worker(stopping: Callable[[], bool]) -> Worker:
    worker = Worker(threads=1, stopping=stopping)
    assert worker.call(Describe())[1]["pid"] == worker.pid  # started and answering
    return worker


def test_a_worker_killed_by_the_interrupt_is_an_interrupt_even_if_its_death_is_seen_first() -> None:
    """The interrupt sets the flag, then kills: a thread that looked at the flag just before
    (False) and then sees the worker gone must still call it an interrupt, not a SIGKILL crash."""
    looks: list[bool] = []

    def stopping() -> bool:  # False at the wait's first look, True from then on
        looks.append(bool(looks))
        return looks[-1]

    worker = _ready_worker(lambda: False)
    worker.stopping = stopping
    os.killpg(worker.pid, signal.SIGKILL)
    worker.process.wait(timeout=30)
    try:
        with pytest.raises(Interrupted):
            worker._wait(Budget())
        assert looks[0] is False and len(looks) >= 2
    finally:
        worker.close()


def test_sigterm_to_a_worker_is_an_interrupt_when_the_run_is_stopping() -> None:
    """SIGTERM reaches the worker first; the orchestrator's handler sets the flag a moment later."""
    flag = threading.Event()
    worker = _ready_worker(flag.is_set)
    try:
        os.kill(worker.pid, signal.SIGTERM)
        threading.Timer(0.5, flag.set).start()
        started = time.monotonic()
        with pytest.raises(Interrupted):
            worker._wait(Budget())
        assert time.monotonic() - started < 10
        # it stopped its group and exits 143; on a busy machine the flag may be set before that
        # exit is seen (the wait does not wait for it: the run is stopping), so it is waited for here
        assert worker.process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        worker.close()


def test_sigterm_to_a_worker_alone_is_a_crash_naming_sigterm() -> None:
    worker = _ready_worker(lambda: False)
    try:
        os.kill(worker.pid, signal.SIGTERM)
        with pytest.raises(WorkerLost) as lost:
            worker._wait(Budget())
        assert lost.value.error_class == "crash" and lost.value.returncode == 143
        assert "stopped by SIGTERM" in lost.value.message and "OOM" not in lost.value.message, lost.value.message
    finally:
        worker.close()


def test_a_model_that_starts_after_the_interrupt_gets_no_fresh_pool() -> None:
    """CI: SIGTERM 3 s into a run, before the model's task thread had started. The interrupt
    stopped the pool; the model's task, starting a moment later, found it unusable and started a
    fresh one, whose worker ran the hung model while the unwinding main thread waited on it
    past the test's 60 s. A stopped pool is now the end of the run for every model that asks."""
    from pt2flow.flows.engine.orchestrator import pool as pools

    pool = pools.start_pool(1)
    try:
        pools.interrupt_pool()
        with pytest.raises(Interrupted):
            pools.shared_pool()
        with pytest.raises(Interrupted):
            pools.start_pool(1)
        assert pools._pool is pool and len(pool.pids()) == 1  # no worker was started in its place
    finally:
        pools.stop_pool()
    assert pools._pool is None  # stopped: the next run in this process (serve) starts afresh
