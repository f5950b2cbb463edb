"""executorch: the functional program lowered for ExecuTorch (stages/executorch_target.py:
to_edge_transform_and_lower with the configured partitioners, then to_executorch), run by the
ExecuTorch runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pt2flow.flows.builtin._programs import FUNCTIONAL_PROGRAM
from pt2flow.flows.pipeline.stage import Stage
from pt2flow.stages.target_options import ExecutorchOptions

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, ReproJob, StageCall
    from pt2flow.stages.generation_steps import StepContext, StepFn

STAGE = Stage(
    "executorch",
    1,
    compute=f"{__name__}:compute",
    inputs=(FUNCTIONAL_PROGRAM,),
    options=ExecutorchOptions,
    publishes="pte",
    artifact="pte",
    suffix=".pte",
    candidate="pt2flow.stages.executorch_target:load_pte",
    repro=f"{__name__}:repro",
    step=f"{__name__}:step",
    libraries=("executorch",),
    extra="executorch",
    accepts_training=False,
    position=70,
    description=".pte program, for the ExecuTorch runtime (XNNPACK)",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.executorch_target import lower_executorch

    return call.publish_result(lower_executorch(call.program(), call.options(ExecutorchOptions)))


def repro(job: ReproJob) -> str:
    """to_edge_transform_and_lower with the configured partitioners, then to_executorch, and the
    portable_fallback check written out."""
    from pt2flow.stages.executorch_target import executorch_repro_body

    return job.program() + "program = ep\n" + executorch_repro_body(ExecutorchOptions(**job.options))


def step(data: bytes, context: StepContext) -> StepFn:
    """A generative component's .pte as a step: unlike other flat runners, the method keeps a None
    input in its place (stages.generation.pte_step)."""
    from pt2flow.stages.generation_steps import pte_step

    return pte_step(data, context.specs())
