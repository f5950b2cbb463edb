"""The orchestrator's side of one stage run: timing, cache hits, index records, failures.

Workers compute and publish blobs; every index record of a stage is written here, so a worker
that dies mid-stage still gets its failure recorded (docs/architecture.md, "Isolation").
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, UTC
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from pt2flow.flows.engine.common import stores
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.context import Outcome, RunContext, StageFailed
from pt2flow.flows.engine.orchestrator.planner import cached_outcome, find_cached
from pt2flow.flows.engine.orchestrator.stage_keys import options_json
from pt2flow.flows.engine.environment.interpreter import current_environment
from pt2flow.flows.engine.orchestrator.records import stage_record
from pt2flow.storage import StorageError
from pt2flow.storage.records import IndexRecord
from pt2flow.stages.vocabulary import ErrorClass

if TYPE_CHECKING:
    from pt2flow.flows.engine.worker.compute import Produced


def _now() -> datetime:
    return datetime.now(UTC)


class StageRun:
    """The bookkeeping around one stage of one model."""

    def __init__(
        self,
        stage: str,
        model: ResolvedModel,
        ctx: RunContext,
        key: str,
        parents: list[str],
        records: list[IndexRecord] | None = None,
    ) -> None:
        self.stage = stage
        self.records = records  # None: append each record to the index at once
        self.model = model
        self.ctx = ctx
        self.key = key
        self.parents = parents
        self.store = stores.open_store(ctx.store_url)
        self.started = _now()
        self.clock = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.clock

    def later(self, seconds: float) -> None:
        """Start the stage's clock (and its record's start) `seconds` later: the time its model
        waited for a worker is not the stage's."""
        self.clock += seconds
        self.started += timedelta(seconds=seconds)

    def cached(self, planned: Mapping[str, Any] | None = None) -> Outcome | None:
        """The outcome of an earlier run of this exact key that settles it: ok with a blob that
        still verifies, or a deterministic failure (raised as StageFailed). `planned`: the
        planner's hit for this key, so the index is not read twice."""
        hit = self.lookup(planned)
        if hit is None:
            return None
        own = hit["run_id"] == self.ctx.run_id and hit["model"] == self.model.name and hit["stage"] == self.stage
        if self.ctx.force and not own:
            return None
        outcome = cached_outcome(hit, self.key, own=own, clock=self.clock)
        if not own:  # a retried attempt does not record its stage a second time
            self.record(outcome, source_row=hit)
        if not outcome.ok:
            raise StageFailed(outcome)  # a known failure, reported again as it was
        return outcome

    def lookup(self, planned: Mapping[str, Any] | None = None) -> Mapping[str, Any] | None:
        """The index record that would settle this key (`cached` serves it), without recording
        anything; None where the stage has work to do."""
        # with --force, only this run's own record counts: an earlier attempt of this task
        # (retried by Prefect) that did the work and recorded it
        if planned is not None and not self.ctx.force:
            return planned
        return find_cached(
            self.store,
            self.key,
            run_id=self.ctx.run_id if self.ctx.force else None,
            failures=not self.ctx.retry_failed,
            model=self.model.name,
        )

    def produced(self, produced: Produced) -> Outcome:
        """The outcome of what a worker computed and stored, not yet recorded (`record` does:
        runner._attempt first sends the model's next stage to the worker)."""
        return Outcome(
            status="ok",
            seconds=round(self.seconds(), 6),
            artifact=produced.artifact,
            size=produced.size,
            uri=produced.uri,
            key=self.key,
            fingerprint=produced.fingerprint or produced.artifact,
            details=dict(produced.details),
            warnings=list(produced.warnings),
            blob_stat=produced.blob_stat,
        )

    def fail(
        self,
        error_class: ErrorClass,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        report: bytes | None = None,
    ) -> StageFailed:
        outcome = Outcome.failure(self.key, error_class, message, seconds=self.seconds(), details=details)
        if report is not None:
            try:
                ref = self.store.put_blob(report)
                outcome.artifact, outcome.size, outcome.uri = ref.digest, ref.size, ref.uri
                outcome.details["report_sha256"] = ref.digest
            except StorageError:
                pass  # the failure itself is what matters; the report is a bonus
        try:
            self.record(outcome)
        except StorageError as exc:
            outcome.error = f"{message} (and its index record could not be written: {exc})"
        return StageFailed(outcome)

    def record(self, outcome: Outcome, source_row: Mapping[str, Any] | None = None) -> None:
        record = stage_record(
            run_id=self.ctx.run_id,
            model=self.model,
            stage=self.stage,
            outcome=outcome,
            parents=self.parents,
            options=options_json(self.model, self.stage),
            env=current_environment(),
            started=self.started,
            ended=_now(),
            source_row=source_row,
        )
        if self.records is not None:
            self.records.append(record)
        else:
            self.store.index.append([record])
