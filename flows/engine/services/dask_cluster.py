"""The orchestrator's watch over the models it gave a Dask cluster (docs/architecture.md §8).

A model's limits are enforced by the supervised worker process under its Dask worker; when that
Dask worker is gone (and every other with it), nothing would. So the orchestrator keeps two
clocks of its own and fails what they run out on, with class `timeout`:

- each model's time limit (`limits.timeout_s`) from when its Dask task started (the task
  announces itself through a Dask event, `STARTED_TOPIC`), plus `LIMIT_GRACE_S` for the worker
  to stop and record it first;
- the cluster's workers: once it has had none for `no_worker_timeout_s` (config
  `dask.no_worker_timeout_s`, `run --no-worker-timeout`), every model not done fails.

Neither torch nor Prefect: the Dask client is passed in.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping

from pt2flow.stages.vocabulary import ErrorClass

STARTED_TOPIC = "pt2flow-model-started"
LIMIT_GRACE_S = 60.0  # the worker's own stop and record (a stack dump, a kill, an index write) first
NO_WORKER_SETTING = "dask.no_worker_timeout_s, run --no-worker-timeout"


def announce_start(run_id: str, model: str) -> None:
    """On a Dask worker: tell the orchestrator that `model`'s task started (no-op elsewhere)."""
    distributed = sys.modules.get("distributed")
    if distributed is None:
        return
    try:
        worker = distributed.get_worker()
    except ValueError:  # not in a Dask task
        return
    worker.log_event(STARTED_TOPIC, {"run_id": run_id, "model": model, "worker": str(worker.address)})


@dataclass(frozen=True)
class GaveUp:
    """A model the orchestrator stopped waiting for: always `timeout`, with the reason."""

    error_class: ErrorClass
    message: str


class ClusterWatch:
    """Started models and the cluster's workers, as the orchestrator sees them; `check` says
    which of the models still pending it gives up on."""

    def __init__(
        self,
        client: Any,
        run_id: str,
        time_limits: Mapping[str, float | None],
        no_worker_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.time_limits = dict(time_limits)
        self.no_worker_timeout_s = no_worker_timeout_s
        self.clock = clock
        self.started: dict[str, tuple[float, str]] = {}  # model -> (when the orchestrator heard, Dask worker)
        self.no_worker_since: float | None = None
        self.address = str(getattr(getattr(client, "scheduler", None), "address", "") or "")
        client.subscribe_topic(STARTED_TOPIC, self._on_started)

    def _on_started(self, event: tuple[float, Mapping[str, Any]]) -> None:
        """Called on the client's event loop for every announcement (of any run on the cluster)."""
        _, message = event
        if (
            isinstance(message, Mapping)
            and message.get("run_id") == self.run_id
            and message.get("model") in self.time_limits
        ):
            self.started[str(message["model"])] = (self.clock(), str(message.get("worker") or "?"))

    def workers(self) -> int:
        """Workers the scheduler has now (0 when it cannot be asked)."""
        try:
            return len(self.client.nthreads())
        except Exception:  # the scheduler is unreachable: nothing can be placed either
            return 0

    def close(self) -> None:
        try:
            self.client.unsubscribe_topic(STARTED_TOPIC)
        except Exception:
            pass

    def check(self, pending: list[str]) -> dict[str, GaveUp]:
        """The pending models to give up on now, each with its reason."""
        now = self.clock()
        if self.workers() == 0:
            self.no_worker_since = now if self.no_worker_since is None else self.no_worker_since
        else:
            self.no_worker_since = None
        if self.no_worker_since is not None and now - self.no_worker_since >= self.no_worker_timeout_s:
            return {name: self._no_worker(name) for name in pending}
        gave_up = {}
        for name in pending:
            limit = self.time_limits.get(name)
            if name in self.started and limit is not None and now > self.started[name][0] + limit + LIMIT_GRACE_S:
                worker = self.started[name][1]
                gave_up[name] = GaveUp(
                    ErrorClass.TIMEOUT,
                    f"the model ran past its time limit of {limit:g} s (limits.timeout_s) on Dask worker {worker}, which did not "
                    f"stop it within {LIMIT_GRACE_S:g} s more; the orchestrator stopped waiting for it",
                )
        return gave_up

    def _no_worker(self, name: str) -> GaveUp:
        cluster = f"the Dask cluster{' at ' + self.address if self.address else ''}"
        if name in self.started:
            where = f"it was running on Dask worker {self.started[name][1]}, which is gone"
        else:
            where = "it was never started on a worker"
        return GaveUp(
            ErrorClass.TIMEOUT,
            f"{cluster} had no worker for {self.no_worker_timeout_s:g} s ({NO_WORKER_SETTING}); {where}",
        )
