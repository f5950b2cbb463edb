"""openvino: the functional program converted by OpenVINO's PyTorch frontend and saved as OpenVINO IR
(stages/openvino_target.py: convert_model with the program's input shapes, save_model, one zip of
model.xml and model.bin), run by OpenVINO's CPU plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.target_options import OpenvinoOptions

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, ReproJob, StageCall

# 2: a constant user input (a None) no longer shifts the input shapes (_drop_constant_inputs)
STAGE = Stage(
    "openvino",
    2,
    compute=f"{__name__}:compute",
    inputs=(Input("program", ("functionalize", "trace")),),
    options=OpenvinoOptions,
    publishes="openvino",
    artifact="openvino",
    suffix=".openvino.zip",
    candidate="pt2flow.stages.openvino_target:load_openvino",
    repro=f"{__name__}:repro",
    libraries=("openvino",),
    extra="openvino",
    accepts_training=False,
    position=80,
    description="OpenVINO IR (model.xml + model.bin, zipped), for OpenVINO's CPU runtime",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.openvino_target import convert

    return call.publish_result(convert(call.program(), call.options(OpenvinoOptions)))


def repro(job: ReproJob) -> str:
    """convert_model with the stage's input shapes, save_model, a compile for the CPU and one run."""
    from pt2flow.stages.openvino_target import openvino_repro_body

    return job.program() + "program = ep\n" + openvino_repro_body(OpenvinoOptions(**job.options))
