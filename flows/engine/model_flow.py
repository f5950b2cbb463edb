"""One model through the stages as a Prefect flow: one Prefect task per stage, named after it,
so the UI shows which stage of which model failed. The bodies are flows/engine/runner.py's; they
run in this process and send the torch work to a supervised worker process.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.context import RunContext, TransientStageError
from pt2flow.flows.engine.planner import Plan
from pt2flow.flows.engine.registry import STAGE_SPECS
from pt2flow.flows.engine.runner import run_model, run_stage

# A stage task is retried, by Prefect, only after a transient storage error (the store's own
# RetryPolicy gave up: an outage longer than its backoff). The retry looks the stage up in the
# index and the store again, so what the failed attempt already published is reused, not redone.
STAGE_RETRIES = 2
STAGE_RETRY_DELAY_SECONDS = 1.0


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    return isinstance(state.data, TransientStageError)


STAGE_TASKS = {
    name: task(
        name=name,
        cache_policy=NO_CACHE,
        persist_result=False,
        retries=STAGE_RETRIES,
        retry_delay_seconds=STAGE_RETRY_DELAY_SECONDS,
        retry_condition_fn=_retry_transient,
    )(run_stage)
    for name in ("source", *STAGE_SPECS)
}


@flow(name="pt2flow-model", validate_parameters=False, persist_result=False)
def export_model_flow(model: ResolvedModel, ctx: RunContext, plan: Plan | None = None) -> Any:
    """One model through the configured stages on this process's worker pool; returns its entry
    of the run document (a dict). The flow run fails when the model does, naming the stage and
    the class."""
    from pt2flow.flows.engine.pool import shared_pool

    result = run_model(model, ctx, plan, shared_pool(), tasks=STAGE_TASKS)
    data = result.model_dump(mode="json")  # the flow's result: the model's entry of the run document
    if result.status != "ok":
        return Failed(message=f"{model.name}: {result.error_class} at {result.failed_stage}", data=data)
    return Completed(data=data)
