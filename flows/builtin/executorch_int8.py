"""executorch_int8: the functional program quantized to int8 through PT2E with XNNPACK's quantizer,
calibrated on batches of the model's inputs, and lowered for ExecuTorch with the XNNPACK partitioner
(stages/quantize.py). Not meant to equal eager: validate judges it by the model's accuracy budgets
(`validate.accuracy`), not by allclose."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pt2flow.flows.builtin._programs import FUNCTIONAL_PROGRAM
from pt2flow.flows.pipeline.stage import Stage
from pt2flow.stages.target_options import Int8Options

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, StageCall

STAGE = Stage(
    "executorch_int8",
    1,
    compute=f"{__name__}:compute",
    inputs=(FUNCTIONAL_PROGRAM,),
    options=Int8Options,
    publishes="pte-int8",
    artifact="pte-int8",
    suffix=".int8.pte",
    candidate="pt2flow.stages.executorch_target:load_pte",
    libraries=("executorch", "torchao"),
    extra="executorch",
    accepts_training=False,
    exact=False,
    position=75,
    description="int8 .pte (PT2E, XNNPACK), for the ExecuTorch runtime; judged by accuracy budgets",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.quantize import quantize_for_executorch

    options = call.options(Int8Options)
    calibration, example = calibration_inputs(call, options, STAGE.name)
    return call.publish_result(quantize_for_executorch(call.program(), calibration, example, options))


def calibration_inputs(call: StageCall, options: Int8Options, stage: str) -> tuple[list[Any], Any]:
    """The calibration batches (drawn from the model's inputs spec at the example sizes, seeded
    by stages.quantize.calibration_seeds) and the example the quantized module is exported on."""
    from pt2flow.stages.binding import bind_inputs
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.quantize import calibration_seeds
    from pt2flow.stages.vocabulary import ErrorClass

    if call.model.component:
        raise StageError(ErrorClass.CONFIG, f"{stage} does not quantize a generative model's components yet")
    eager, inputs = call.eager_model(), call.example_inputs()
    calibration = [bind_inputs(eager, inputs, seed=seed) for seed in calibration_seeds(options)]
    return calibration, bind_inputs(eager, inputs, seed=0)
