"""Running a model's stages: the orchestrator's side, without Prefect.

`run_model` walks the configured stages; each stage's body (`run_stage`) computes its key, looks
it up (the planner's hit first), and otherwise sends the work to the model's worker process
(flows/engine/orchestrator/supervisor.py). A worker that crashes, runs past its time or over its memory fails only
this model's current stage, recorded as `crash`, `timeout` or `out_of_memory` with the tail of its
stderr. flows/engine/orchestrator/model_flow.py wraps each stage in a Prefect task; a model the planner
settled from the index runs here directly, with no Prefect import at all.
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.orchestrator.bookkeeping import StageRun
from pt2flow.flows.engine.common.messages import Produced, StageRequest
from pt2flow.flows.engine.common.context import Limits, Outcome, RunContext, StageFailed, TransientStageError
from pt2flow.flows.engine.common.documents import (
    Artifacts,
    BenchmarkSummary,
    ModelResult,
    StageView,
    ValidationSummary,
    Verdict,
)
from pt2flow.flows.engine.lineage.events import StageLineage
from pt2flow.flows.engine.orchestrator.planner import Plan, chain_stages, plan_model, plan_slot, source_key
from pt2flow.flows.engine.orchestrator.pool import Lease, WorkerPool
from pt2flow.flows.engine.orchestrator.supervisor import Budget, Worker, WorkerLost
from pt2flow.flows.engine.orchestrator.stage_keys import blocked, gather, parent_keys, stage_key
from pt2flow.flows import pipeline
from pt2flow.flows.pipeline import get as get_stage, document_slots
from pt2flow.flows.pipeline.stage import TIMINGS
from pt2flow.storage.records import IndexRecord
from pt2flow.stages.vocabulary import ErrorClass

StageCall = Callable[[str, ResolvedModel, RunContext, Mapping[str, Outcome]], Outcome]
# given a stage's outcome, the stage that runs next: (stage, model, its inputs); None when none
# follows in its chain; LAST when the model has no more work for a worker
Successor = Callable[[Outcome], "tuple[str, ResolvedModel, Mapping[str, Outcome]] | str | None"]
LAST = "last"


@dataclass
class ModelRun:
    """What the stage tasks of one model share in this thread: its plan, its worker lease and
    its time budget."""

    plan: Plan
    lease: Lease | None
    limits: Limits
    started: float
    records: list[IndexRecord] | None = None  # collect index records here instead of appending each
    # the stage that follows the one running now, given its outcome: (stage, model, inputs), or
    # None when nothing follows (set by the stage loop before each stage; see Ahead)
    successor: Successor | None = None
    ahead: Ahead | None = None  # a stage's work the worker is doing before its task began

    def take_ahead(self, stage: str, key: str) -> Ahead | None:
        """The work sent ahead for this stage and key; work sent ahead for anything else (a
        stage Prefect runs again, a model that ends early) is waited for and dropped first, so
        that what the worker answers next is this stage's."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or (ahead.stage == stage and ahead.key == key):
            return ahead
        ahead.drop()
        return None

    def budget(self, stage: str) -> Budget:
        deadlines = []
        if self.limits.timeout_s is not None:
            deadlines.append(
                (
                    self.started + self.limits.timeout_s,
                    f"the model ran past its time limit of {self.limits.timeout_s:g} s (limits.timeout_s)",
                )
            )
        stage_limit = self.limits.stage_budget(stage)
        if stage_limit is not None:
            deadlines.append(
                (
                    time.monotonic() + stage_limit,
                    f"{stage} ran past its time limit of {stage_limit:g} s (limits.stage_timeout_s.{stage})",
                )
            )
        deadline, reason = min(deadlines) if deadlines else (None, "")
        memory_gb = self.limits.memory_gb if self.limits.memory_gb is not None else default_memory_gb()
        memory = int(memory_gb * 2**30)
        return Budget(deadline=deadline, deadline_reason=reason, memory_bytes=memory)


@functools.cache
def default_memory_gb() -> float:
    """A worker tree may use 90% of the machine's memory unless `limits.memory_gb` says otherwise:
    pt2flow stops it (out_of_memory) before the kernel's OOM killer picks a victim. (The
    machine's total: asked once per process, not before every stage.)"""
    import psutil

    return 0.9 * psutil.virtual_memory().total / 2**30


@dataclass
class Ahead:
    """A stage's work sent to the model's worker as soon as the stage before it came back, before
    that one's index record and Prefect task end and this one's Prefect task start (about 10 ms
    of the orchestrator's that the worker used to wait through between two stages; it now works
    through them). Sent only after a cache miss for its key; its task (run_stage) then waits for
    the answer, on the stage's clock that started when it was sent. Nothing else is sent to the
    worker before that answer is taken (ModelRun.take_ahead), and a model that ends without it
    waits for it and drops it (the blob the worker published has no record: a later run computes
    it again), so no stage ever reads another's answer."""

    stage: str
    key: str
    run: StageRun
    worker: Worker
    budget: Budget

    def drop(self) -> None:
        try:
            self.worker.receive(self.budget)
        except WorkerLost:
            pass  # gone: the next stage sent to it finds out, or the pool replaces it


def _send_ahead(model_run: ModelRun, ctx: RunContext, outcome: Outcome, successor: Successor | None) -> bool:
    """Send the model's next stage to its worker now (Ahead), when one follows `outcome`'s stage,
    has a worker already, and is not settled by the index. Anything that goes wrong here is left
    to that stage's own task, which does all of it again and reports the failure. True when this
    was the model's last stage for a worker (its successor says LAST)."""
    lease = model_run.lease
    if successor is None or lease is None or lease.worker is None or model_run.ahead is not None:
        return False
    try:
        following = successor(outcome)
        if not isinstance(following, tuple):
            return following == LAST
        stage, model, inputs = following
        spec = get_stage(stage)
        key = stage_key(spec, model, inputs)
        run = StageRun(stage, model, ctx, key, parent_keys(spec, inputs), records=model_run.records)
        if not key or run.lookup(model_run.plan.hit(plan_slot(stage, model), key)) is not None:
            return False
        budget = model_run.budget(stage)
        lease.worker.send(StageRequest(stage, spec.compute, model, ctx, dict(inputs), key), budget)
    except Exception:  # noqa: BLE001 - its task does it again, and says what failed
        logging.getLogger("pt2flow").debug("not sent ahead", exc_info=True)
        return False
    model_run.ahead = Ahead(stage, key, run, lease.worker, budget)
    return False


_current = threading.local()


def _model_run() -> ModelRun:
    run = getattr(_current, "run", None)
    if run is None:
        raise RuntimeError("stage tasks run inside run_model")
    return run


def _retries_left() -> bool:
    """Whether the Prefect task running this stage will be retried after a transient error."""
    if "prefect" not in sys.modules:  # a direct call: nobody retries
        return False
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context is not None and context.task_run.run_count <= context.task.retries


def run_stage(stage: str, model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome]) -> Outcome:
    """Key, cache lookup, then the worker: the body of every stage task. Every failure, the
    orchestrator's own storage errors included, ends as a recorded StageFailed."""
    from pt2flow.storage import StorageError
    from pt2flow.storage.retry import is_transient

    model_run = _model_run()
    spec = get_stage(stage)
    lineage = StageLineage(ctx, model, stage, inputs)  # OpenLineage START / COMPLETE / FAIL (off unless configured)
    lineage.start()
    try:
        key = (model_run.plan.source_key or "") if stage == "source" else stage_key(spec, model, inputs)
        ahead = model_run.take_ahead(stage, key)
        run = (
            ahead.run
            if ahead is not None
            else StageRun(stage, model, ctx, key, parent_keys(spec, inputs), records=model_run.records)
        )
        try:
            outcome = _attempt(run, model_run, inputs, spec.compute, ahead)
        except StorageError as exc:
            if is_transient(exc) and _retries_left():
                raise TransientStageError(str(exc)) from exc  # not recorded: the retry records the outcome
            raise run.fail(ErrorClass.STORAGE, str(exc)) from None
    except StageFailed as failed:
        lineage.end(failed.outcome)
        raise
    except BaseException:
        lineage.end(None, aborted=True)
        raise
    lineage.end(outcome)
    return outcome


def _attempt(
    run: StageRun, model_run: ModelRun, inputs: Mapping[str, Outcome], compute: str, ahead: Ahead | None = None
) -> Outcome:
    stage = run.stage
    successor, model_run.successor = model_run.successor, None  # what follows, once this stage has computed
    if run.key and ahead is None:
        hit = run.cached(model_run.plan.hit(plan_slot(stage, run.model), run.key))
        if hit is not None:
            return hit
    if model_run.lease is None:
        raise run.fail(ErrorClass.INTERNAL, f"pt2flow bug: {stage} of a model planned as fully cached has work to do")
    try:
        if ahead is not None:  # sent when the stage before came back
            worker = ahead.worker
            status, payload = worker.receive(ahead.budget)
        else:
            worker = model_run.lease.get()
            if model_run.lease.waited:  # the model's clock and its stage's start once it has a worker
                model_run.started += model_run.lease.waited
                run.later(model_run.lease.waited)
                model_run.lease.waited = 0.0
            request = StageRequest(stage, compute, run.model, run.ctx, dict(inputs), run.key)
            status, payload = worker.call(request, model_run.budget(stage))
    except WorkerLost as lost:
        details = {"stderr_tail": lost.stderr_tail, "returncode": lost.returncode}
        message = (
            f"{lost.message} during {stage}" if lost.error_class == ErrorClass.CRASH else f"{stage}: {lost.message}"
        )
        raise run.fail(lost.error_class, message, details=details) from None
    if isinstance(payload, Produced):
        if stage == "source":  # the manifest the worker read is the one the key must cover
            run.key = source_key(payload.details["manifest"])
        outcome = run.produced(payload)
        # the worker starts the next stage while this one is recorded
        last = _send_ahead(model_run, run.ctx, outcome, successor)
        run.record(outcome)
        if last:  # the next model may have the worker while this model's tasks end (records stay in order)
            model_run.lease.release()
        return outcome
    if payload.transient and _retries_left():
        raise TransientStageError(payload.error)  # not recorded: the retry records the outcome
    details = dict(payload.details)
    tail = worker.stderr_tail()
    if tail.strip():
        details["stderr_tail"] = tail
    raise run.fail(payload.error_class, payload.error, details=details, report=payload.report)


def run_model(
    model: ResolvedModel,
    ctx: RunContext,
    plan: Plan | None = None,
    pool: WorkerPool | None = None,
    *,
    tasks: Mapping[str, StageCall] | None = None,
    records: list[IndexRecord] | None = None,
) -> ModelResult:
    """Run the configured stages for one model; never raises for a model's own failure.

    pool: where stage work goes (None: the plan must settle every stage from the index);
    tasks: stage name -> callable wrapping run_stage (Prefect tasks); None calls it directly;
    records: collect the index records here (the caller appends them at once) instead of
    appending one file per stage.
    """
    logger = run_logger()
    plan = plan or plan_model(model, ctx)
    if pool is None:
        logger.info("%s: settled from the index", model.name)
    lease = None if pool is None else Lease(pool, model.name)
    call: Callable[[str], StageCall] = (lambda s: run_stage) if tasks is None else (lambda s: tasks[s])
    result = ModelResult(name=model.name)
    outcomes: dict[str, Outcome] = {}
    tolerated: dict[str, Outcome] = {}  # failed stages the model does not require (ResolvedModel.tolerates_failure)
    current = "source"
    _current.run = ModelRun(plan, lease, model.limits, time.monotonic(), records)
    try:
        if model.generate is None:  # the chain's first stage follows the source
            _current.run.successor = _chain_successor(model, "source", ctx.stages, {}, tolerated, ends_model=True)
        outcomes["source"] = call("source")("source", model, ctx, {})
        result.source = outcomes["source"].artifact
        slots = {stage: slot for slot, stage in document_slots().items()}
        if model.generate is not None:  # a generative model: the chain per component, then validate once
            validating = _run_components(model, ctx, call, result, outcomes, slots, tolerated)
            if validating is not None:
                current = validating
                logger.info("%s: %s", model.name, validating)
                inputs = {"source": outcomes["source"], **{name: o for name, o in outcomes.items() if "/" in name}}
                _current.run.successor = _last
                outcomes[validating] = call(validating)(validating, model, ctx, inputs)
                result.stages[validating] = StageView.of(outcomes[validating])
        else:
            _run_chain(model, None, ctx.stages, ctx, call, outcomes, result.stages, result.artifacts, slots, tolerated)
    except ChainFailed as failed:
        result.fail(failed.stage, failed.outcome)
        if failed.component is None:  # the model's own chain
            outcomes[failed.stage] = failed.outcome
            logger.warning("%s failed at %s (%s): %s", model.name, failed.stage, result.error_class, result.error)
        else:
            result.error = component_error(model, failed.component, failed.outcome)
            logger.warning("%s failed at %s/%s: %s", model.name, failed.component, failed.stage, result.error)
    except StageFailed as failure:  # the source, or a generative model's validation
        outcomes[current] = failure.outcome
        if current != "source":
            result.stages[current] = StageView.of(failure.outcome)
        result.fail(current, failure.outcome)
        logger.warning("%s failed at %s (%s): %s", model.name, current, result.error_class, result.error)
    finally:
        ahead, _current.run = _current.run.ahead, None
        try:
            if ahead is not None:  # the model ended before the stage sent ahead was taken
                ahead.drop()
        finally:  # an interrupt while waiting for it still gives the worker back
            if lease is not None:
                if lease.pid is not None:
                    result.worker = f"{socket.gethostname()}:{lease.pid}"
                lease.release()
    add_trace_and_validation(result, outcomes, tolerated)
    return result


class ChainFailed(Exception):
    """A stage of a model's chain failed, and the model requires its artifact: the model fails
    with its class; a generative model's component named in the message (`decode:
    dynamic_shape: ...`)."""

    def __init__(self, component: str | None, stage: str, outcome: Outcome) -> None:
        super().__init__(f"{component}/{stage}" if component else stage)
        self.component, self.stage, self.outcome = component, stage, outcome


def _run_chain(
    model: ResolvedModel,
    component: str | None,
    stages: Sequence[str],
    ctx: RunContext,
    call: Callable[[str], StageCall],
    got: dict[str, Outcome],
    views: dict[str, StageView],
    artifacts: Artifacts,
    slots: Mapping[str, str],
    tolerated: dict[str, Outcome],
) -> None:
    """`stages` in order for the model (component None) or one of its components (the scoped
    model `M/component`), each given what it needs from `got`, where its outcome goes; its view
    into `views`, its artifact into `artifacts` under its slot. The one stage loop of models and
    components alike.

    A stage that fails raises ChainFailed unless the model may do without its artifact
    (`require:`, ResolvedModel.tolerates_failure): then it goes into `tolerated` (a component's
    error naming the component), and it, and every stage that needs it, is skipped from then on
    (for the later components too); the other stages go on."""
    logger = run_logger()
    scoped = model if component is None else model.of_component(component)
    for index, stage in enumerate(stages):
        if stage in tolerated or blocked(get_stage(stage), got):  # what it needs was not built, and the model goes on
            logger.info("%s: %s skipped: the model does without it", scoped.name, stage)
            continue
        logger.info("%s: %s", scoped.name, stage)
        _model_run().successor = _chain_successor(
            scoped, stage, stages[index + 1 :], got, tolerated, ends_model=component is None
        )
        try:
            got[stage] = call(stage)(stage, scoped, ctx, gather(get_stage(stage), got))
        except StageFailed as failure:
            views[stage] = StageView.of(failure.outcome)
            if not model.tolerates_failure(stage):
                raise ChainFailed(component, stage, failure.outcome) from None
            tolerated[stage] = (
                failure.outcome
                if component is None
                else failure.outcome.model_copy(update={"error": component_error(model, component, failure.outcome)})
            )
            logger.warning(
                "%s: %s failed (%s), not required: going on: %s",
                scoped.name,
                stage,
                failure.outcome.error_class,
                failure.outcome.error,
            )
            continue
        views[stage] = StageView.of(got[stage])
        if stage in slots:
            artifacts.put(slots[stage], got[stage].artifact)


def _chain_successor(
    scoped: ResolvedModel,
    stage: str,
    rest: Sequence[str],
    got: Mapping[str, Outcome],
    tolerated: Mapping[str, Outcome],
    *,
    ends_model: bool,
) -> Successor:
    """What `_run_chain` runs after `stage` once it gave an outcome: the first of `rest` it would
    not skip, with the inputs it would gather (a stage that succeeded changes neither
    `tolerated` nor anything but its own entry in `got`); after the last, LAST where the chain
    is the model's whole work (`ends_model`: not a generative model's component), else None."""

    def successor(outcome: Outcome) -> tuple[str, ResolvedModel, Mapping[str, Outcome]] | str | None:
        seen = {**got, stage: outcome}
        for following in rest:
            if following not in tolerated and not blocked(get_stage(following), seen):
                return following, scoped, gather(get_stage(following), seen)
        return LAST if ends_model else None

    return successor


def _last(outcome: Outcome) -> str:
    """The successor of a model's last stage (a generative model's validation)."""
    return LAST


def component_error(model: ResolvedModel, component: str, outcome: Outcome) -> str:
    """A component's failure as the model reports it: `prefill: dynamic_shape: ...`, with the
    way out when a dynamic cache has no maximum."""
    error = f"{component}: {outcome.error_class}: {outcome.error}"
    if (
        outcome.error_class == ErrorClass.DYNAMIC_SHAPE
        and model.generate is not None
        and model.generate.cache == "dynamic"
    ):
        error += " (generate: cache: static bounds the prompt and cache axes by max_cache_len)"
    return error


def _run_components(
    model: ResolvedModel,
    ctx: RunContext,
    call: Callable[[str], StageCall],
    result: ModelResult,
    outcomes: dict[str, Outcome],
    slots: Mapping[str, str],
    tolerated: dict[str, Outcome],
) -> str | None:
    """Every component of a generative model through the export chain (the configured stages but
    the validating ones), each as the component-scoped model `M/component`: keyed, cached and
    recorded as a model's program is. Their outcomes go into `outcomes` as `component/stage`
    (validate's inputs), their views into the document's `components`. Returns the validating
    stage to run next for the model itself (None: there is none).

    A stage that fails for one component fails the model (ChainFailed, the component named)
    unless the model may do without its artifact (`_run_chain`): then that artifact kind is
    unusable for the model and skipped for the later components; the other stages and kinds go
    on (planner._plan_components walks the same way)."""
    from pt2flow.flows.config.models import components_of
    from pt2flow.flows.engine.common.documents import ComponentResult

    chain, after = chain_stages(ctx.stages)
    result.components = {}
    # in call order, from the model (the source records them)
    for component in components_of(outcomes["source"].details):
        got: dict[str, Outcome] = {"source": outcomes["source"]}
        view = result.components[component] = ComponentResult()
        try:
            _run_chain(model, component, chain, ctx, call, got, view.stages, view.artifacts, slots, tolerated)
        finally:
            outcomes.update({f"{component}/{stage}": o for stage, o in got.items() if stage != "source"})
    return after[0] if after else None


def add_trace_and_validation(
    result: ModelResult, outcomes: Mapping[str, Outcome], tolerated: Mapping[str, Outcome] | None = None
) -> None:
    """The trace strategy (where the ladder gave up dynamic shapes, say so where the user looks,
    docs/architecture.md §4) and the validation summary of a model's outcomes, with a failed
    verdict for each artifact whose stage failed without failing the model (`tolerated`); such
    a failure, or a failed verdict, makes an ok model `partial`."""
    trace = outcomes.get(pipeline.entry().name)
    strategy = trace.details.get("strategy") if trace is not None and trace.ok else None
    result.trace_strategy = strategy
    result.static_fallback = strategy == "static"
    validate = outcomes.get(pipeline.publisher_name("report") or "")
    validation = validate.details.get("validation") if validate is not None else None
    if validation:
        result.validation = ValidationSummary(
            **{
                k: validation[k]
                for k in ("passed", "max_abs_err", "max_rel_err", "samples", *ValidationSummary.optional)
                if k in validation
            }
        )
    for stage, outcome in (tolerated or {}).items():
        kind = get_stage(stage).artifact or stage
        if result.validation is None:
            result.validation = ValidationSummary(passed=False, max_abs_err=None, max_rel_err=None, samples=None)
        result.validation.passed = False
        result.validation.verdicts = {
            **(result.validation.verdicts or {}),
            kind: Verdict(passed=False, error_class=outcome.error_class, error=f"{stage} failed: {outcome.error}"),
        }
    if (
        result.status == "ok" and result.validation is not None and result.validation.failed_artifacts()
    ):  # only artifacts the model does not require failed
        result.status = "partial"
    timed = outcomes.get(pipeline.publisher_name(TIMINGS) or "")
    if timed is not None and timed.ok and timed.details.get(TIMINGS):
        result.timings = BenchmarkSummary(**timed.details[TIMINGS])


def run_logger() -> Any:
    """The Prefect run logger inside a flow or task run, else the plain `pt2flow` logger."""
    if "prefect" in sys.modules:
        try:
            from prefect import get_run_logger

            return get_run_logger()
        except Exception:
            pass
    return logging.getLogger("pt2flow")
