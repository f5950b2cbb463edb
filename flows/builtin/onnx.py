"""onnx: the functional program as an ONNX model (stages/onnx_target.py: torch.onnx.export with
dynamo), run by ONNX Runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pt2flow.flows.builtin._programs import FUNCTIONAL_PROGRAM
from pt2flow.flows.pipeline.stage import Stage
from pt2flow.stages.target_options import OnnxOptions

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, ReproJob, StageCall

STAGE = Stage(
    "onnx",
    1,
    compute=f"{__name__}:compute",
    inputs=(FUNCTIONAL_PROGRAM,),
    options=OnnxOptions,
    publishes="onnx",
    artifact="onnx",
    suffix=".onnx",
    candidate="pt2flow.stages.onnx_target:load_onnx",
    repro=f"{__name__}:repro",
    libraries=("onnx", "onnxscript", "onnxruntime"),
    extra="onnx",
    accepts_training=False,
    position=60,
    description=".onnx model, for ONNX Runtime",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.onnx_target import export_onnx

    return call.publish_result(export_onnx(call.program(), call.options(OnnxOptions)))


def repro(job: ReproJob) -> str:
    """torch.onnx.export(program, dynamo=True) as the stage calls it."""
    from pt2flow.stages.onnx_target import onnx_repro_body

    return job.program() + "program = ep\n" + onnx_repro_body(OnnxOptions(**job.options))
