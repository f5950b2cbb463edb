"""One model through the stages: a Prefect flow with one Prefect task per stage.

The tasks run in the orchestrating process and do the bookkeeping (key, cache lookup, index
record); the stage's torch work goes to the model's worker process (flows/engine/pool.py).
A worker that crashes, runs past its time or over its memory fails only this model's current
stage, recorded as `crash`, `timeout` or `out_of_memory` with the tail of its stderr.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from flows.config import ResolvedModel
from flows.engine.bookkeeping import StageRun
from flows.engine.context import Limits, Outcome, RunContext, StageFailed, TransientStageError
from flows.engine.planner import Plan, plan_model, source_key
from flows.engine.pool import Budget, Lease, WorkerLost, WorkerPool
from flows.engine.registry import SOURCE, STAGE_SPECS

# A stage task is retried, by Prefect, only after a transient storage error (the store's own
# RetryPolicy gave up: an outage longer than its backoff). The retry looks the stage up in the
# index and the store again, so what the failed attempt already published is reused, not redone.
STAGE_RETRIES = 2
STAGE_RETRY_DELAY_SECONDS = 1.0


@dataclass
class ModelRun:
    """What the stage tasks of one model share in this thread: its plan, its worker lease and
    its time budget."""

    plan: Plan
    lease: Lease | None
    limits: Limits
    started: float

    def budget(self, stage: str) -> Budget:
        deadlines = []
        if self.limits.timeout_s is not None:
            deadlines.append((self.started + self.limits.timeout_s, f"the model ran past its time limit of {self.limits.timeout_s:g} s (limits.timeout_s)"))
        stage_limit = self.limits.stage_budget(stage)
        if stage_limit is not None:
            deadlines.append((time.monotonic() + stage_limit, f"{stage} ran past its time limit of {stage_limit:g} s (limits.stage_timeout_s.{stage})"))
        deadline, reason = min(deadlines) if deadlines else (None, "")
        memory_gb = self.limits.memory_gb if self.limits.memory_gb is not None else default_memory_gb()
        memory = int(memory_gb * 2**30)
        return Budget(deadline=deadline, deadline_reason=reason, memory_bytes=memory)


def default_memory_gb() -> float:
    """A worker tree may use 90% of the machine's memory unless `limits.memory_gb` says otherwise:
    pt2flow stops it (out_of_memory) before the kernel's OOM killer picks a victim."""
    import psutil

    return 0.9 * psutil.virtual_memory().total / 2**30


_current = threading.local()


def _model_run() -> ModelRun:
    run = getattr(_current, "run", None)
    if run is None:
        raise RuntimeError("stage tasks run inside run_model")
    return run


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    return isinstance(state.data, TransientStageError)


def _retries_left() -> bool:
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context is not None and context.task_run.run_count <= context.task.retries


def run_stage(stage: str, model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome]) -> Outcome:
    """Key, cache lookup, then the worker: the body of every stage task. Every failure, the
    orchestrator's own storage errors included, ends as a recorded StageFailed."""
    from storage import StorageError
    from storage.fs import is_transient

    model_run = _model_run()
    spec = SOURCE if stage == "source" else STAGE_SPECS[stage]
    key = (model_run.plan.source_key or "") if stage == "source" else spec.key(model, inputs)
    run = StageRun(stage, model, ctx, key, spec.parent_keys(inputs))
    try:
        return _attempt(run, model_run, inputs)
    except StorageError as exc:
        if is_transient(exc) and _retries_left():
            raise TransientStageError(str(exc)) from exc  # not recorded: the retry records the outcome
        raise run.fail("storage", str(exc)) from None


def _attempt(run: StageRun, model_run: ModelRun, inputs: Mapping[str, Outcome]) -> Outcome:
    stage = run.stage
    if run.key:
        hit = run.cached(model_run.plan.hit(stage, run.key))
        if hit is not None:
            return hit
    if model_run.lease is None:
        raise run.fail("internal", f"pt2flow bug: {stage} of a model planned as fully cached has work to do")
    try:
        worker = model_run.lease.get()
        status, payload = worker.call(("stage", stage, run.model, run.ctx, dict(inputs), run.key), model_run.budget(stage))
    except WorkerLost as lost:
        details = {"stderr_tail": lost.stderr_tail, "returncode": lost.returncode}
        message = f"{lost.message} during {stage}" if lost.error_class == "crash" else f"{stage}: {lost.message}"
        raise run.fail(lost.error_class, message, details=details) from None
    if status == "ok":
        if stage == "source":  # the manifest the worker read is the one the key must cover
            run.key = source_key(payload["details"]["manifest"])
        return run.published(payload)
    if payload.get("transient") and _retries_left():
        raise TransientStageError(payload["error"])  # not recorded: the retry records the outcome
    details = dict(payload.get("details") or {})
    tail = worker.stderr_tail()
    if tail.strip():
        details["stderr_tail"] = tail
    raise run.fail(payload["error_class"], payload["error"], details=details, report=payload.get("report"))


_TASK_KW: dict[str, Any] = dict(
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=STAGE_RETRIES,
    retry_delay_seconds=STAGE_RETRY_DELAY_SECONDS,
    retry_condition_fn=_retry_transient,
)

# One Prefect task per stage, named after it, so the UI shows which stage of which model failed.
STAGE_TASKS = {name: task(name=name, **_TASK_KW)(run_stage) for name in ("source", *STAGE_SPECS)}


def _stage_view(outcome: Mapping[str, Any]) -> dict[str, Any]:
    view = {
        "status": outcome["status"],
        "cached": bool(outcome.get("cached")),
        "seconds": outcome.get("seconds"),
        "artifact": outcome.get("artifact") if outcome["status"] == "ok" else None,
    }
    if outcome.get("warnings"):
        view["warnings"] = list(outcome["warnings"])
    if outcome["status"] != "ok":
        view["error_class"] = outcome.get("error_class")
        view["error"] = outcome.get("error")
        if outcome.get("artifact"):
            view["report"] = outcome["artifact"]
    return view


def empty_result(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "status": "ok",
        "failed_stage": None,
        "error_class": None,
        "error": None,
        "stages": {},
        "artifacts": {"serialized": None, "compiled": None},
        "validation": None,
        "worker": None,
    }


def run_model(model: ResolvedModel, ctx: RunContext, plan: Plan | None = None, pool: WorkerPool | None = None, *, direct: bool = False) -> dict[str, Any]:
    """Run the configured stages for one model; never raises for a model's own failure.

    direct: call the stage functions without Prefect task runs, for a model the planner found
    fully cached (every stage is an index lookup; no worker is needed).
    """
    logger = run_logger()
    plan = plan or plan_model(model, ctx)
    if direct:
        logger.info("%s: every stage cached", model.name)
    lease = None if direct or pool is None else Lease(pool)
    model_run = ModelRun(plan, lease, model.limits, time.monotonic())
    call: Callable[[str], Callable[..., Outcome]] = (lambda s: run_stage) if direct else (lambda s: STAGE_TASKS[s])
    result = empty_result(model.name)
    outcomes: dict[str, Outcome] = {}
    current = "source"
    _current.run = model_run
    try:
        outcomes["source"] = call("source")("source", model, ctx, {})
        result["source"] = outcomes["source"]["artifact"]
        for stage in ctx.stages:
            current = stage
            spec = STAGE_SPECS[stage]
            logger.info("%s: %s", model.name, stage)
            outcomes[stage] = call(stage)(stage, model, ctx, spec.gather(outcomes))
            result["stages"][stage] = _stage_view(outcomes[stage])
            if spec.slot:
                result["artifacts"][spec.slot] = outcomes[stage]["artifact"]
    except StageFailed as failure:
        outcome = failure.outcome
        if current != "source":
            result["stages"][current] = _stage_view(outcome)
        result.update(status="failed", failed_stage=current, error_class=outcome.get("error_class"), error=outcome.get("error"))
        tail = (outcome.get("details") or {}).get("stderr_tail")
        if tail:
            result["stderr_tail"] = tail
        logger.warning("%s failed at %s (%s): %s", model.name, current, outcome.get("error_class"), outcome.get("error"))
        outcomes[current] = outcome
    finally:
        _current.run = None
        if lease is not None:
            if lease.worker is not None:
                result["worker"] = f"{socket.gethostname()}:{lease.worker.pid}"
            lease.release()
    validation = (outcomes.get("validate") or {}).get("details", {}).get("validation")
    if validation:
        result["validation"] = {k: validation[k] for k in ("passed", "max_abs_err", "max_rel_err", "samples")}
    return result


def call_stage(stage: str, model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], pool: WorkerPool) -> Outcome:
    """One stage outside a model flow and outside Prefect (tools, tests): the bookkeeping here,
    the work on `pool`. A failure is recorded and returned as its outcome."""
    from flows.engine.planner import Plan

    lease = Lease(pool)
    _current.run = ModelRun(Plan(model), lease, model.limits, time.monotonic())
    try:
        return run_stage(stage, model, ctx, inputs)
    except StageFailed as failure:
        return failure.outcome
    finally:
        _current.run = None
        lease.release()


def run_logger() -> Any:
    """The Prefect run logger inside a flow or task run, else the plain `pt2flow` logger."""
    try:
        return get_run_logger()
    except Exception:
        import logging

        return logging.getLogger("pt2flow")


@flow(name="pt2flow-model", validate_parameters=False, persist_result=False)
def export_model_flow(model: ResolvedModel, ctx: RunContext, plan: Plan | None = None) -> Any:
    """One model through the configured stages on this process's worker pool; the flow run
    fails when the model does, naming the stage and the class."""
    from flows.engine.pool import shared_pool

    result = run_model(model, ctx, plan, shared_pool())
    if result["status"] != "ok":
        return Failed(message=f"{model.name}: {result['error_class']} at {result['failed_stage']}", data=result)
    return Completed(data=result)

