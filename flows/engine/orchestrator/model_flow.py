"""The Prefect tasks of a model's stages: one per stage, named after it, so the UI shows which
stage of which model failed. The fleet flow's model task (flows/fleet.py) runs them; their bodies
are flows/engine/orchestrator/runner.py's, which run in this process and send the torch work to a supervised
worker process.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from pt2flow.flows import pipeline
from pt2flow.flows.engine.common.context import TransientStageError
from pt2flow.flows.engine.orchestrator.runner import run_stage

# A stage task is retried, by Prefect, only after a transient storage error (the store's own
# RetryPolicy gave up: an outage longer than its backoff). The retry looks the stage up in the
# index and the store again, so what the failed attempt already published is reused, not redone.
STAGE_RETRIES = 2
STAGE_RETRY_DELAY_SECONDS = 1.0


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    return isinstance(state.data, TransientStageError)


class StageTasks(dict):
    """One Prefect task per stage, named after it, made when a run first needs it (a stage
    registered after this module was imported gets one too), called with its arguments quoted
    (prefect.utilities.annotations.quote): Prefect hands them to the task as they are instead of
    walking into every object they hold looking for futures (a stage's model, run context and
    input outcomes: bench/profile_fleet.py measured the walk among the orchestrator's largest
    costs per stage). No stage argument is a future or a state, so no dependency between task
    runs goes unseen."""

    def __missing__(self, name: str) -> Any:
        pipeline.get(name)  # an unknown stage is a KeyError here, as before
        made = task(
            name=name,
            cache_policy=NO_CACHE,
            persist_result=False,
            retries=STAGE_RETRIES,
            retry_delay_seconds=STAGE_RETRY_DELAY_SECONDS,
            retry_condition_fn=_retry_transient,
        )(run_stage)

        def call(stage: str, model: Any, ctx: Any, inputs: Any) -> Any:
            return made(stage, quote(model), quote(ctx), quote(inputs))

        self[name] = call
        return call


STAGE_TASKS = StageTasks()
