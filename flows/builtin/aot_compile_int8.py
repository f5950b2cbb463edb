"""aot_compile_int8: the functional program quantized to int8 through PT2E with torchao's
X86InductorQuantizer, calibrated on batches of the model's inputs, and compiled by AOTInductor for
the CPU (stages/quantize.py). Not meant to equal eager: validate judges it by the model's accuracy
budgets (`validate.accuracy`), not by allclose."""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Mapping

from pt2flow.flows.builtin._programs import FUNCTIONAL_PROGRAM
from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.target_options import Int8Options

if TYPE_CHECKING:
    from pt2flow.flows.config.models import ResolvedModel
    from pt2flow.flows.engine.stage_api import Outcome, Produced, ReproJob, StageCall

STAGE = Stage(
    "aot_compile_int8",
    1,
    compute=f"{__name__}:compute",
    inputs=(FUNCTIONAL_PROGRAM, Input.of("source")),  # the calibration's source: flows/builtin/executorch_int8.py key
    options=Int8Options,
    publishes="package-int8",
    artifact="compiled-int8",
    suffix=".int8.pt2",
    key=f"{__name__}:key",
    candidate="pt2flow.stages.quantize:load_int8_package",
    libraries=("torchao",),
    extra="executorch",
    accepts_training=False,
    exact=False,
    repro=f"{__name__}:repro",
    position=55,
    description="int8 AOTInductor package (PT2E, X86InductorQuantizer), for the CPU; judged by accuracy budgets",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.flows.builtin.executorch_int8 import calibration_inputs, described
    from pt2flow.stages.quantize import quantize_for_inductor

    options = call.options(Int8Options)
    calibration, example = calibration_inputs(
        call.model, call.eager_model(), call.example_inputs(), options, STAGE.name
    )
    result = quantize_for_inductor(call.program(), calibration, example, options)
    return call.publish_result(described(result, call.model, options))


def repro(job: ReproJob) -> str:
    """The failed quantization and compile again with torch and torchao alone
    (flows/builtin/executorch_int8.py int8_repro, X86InductorQuantizer and aoti_compile_and_package)."""
    from pt2flow.flows.builtin.executorch_int8 import int8_repro

    return int8_repro(job, "inductor")


def key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """executorch_int8's (flows/builtin/executorch_int8.py int8_key: the program's fingerprint,
    the source's key, the options, torchao's version), and, native code as aot_compile's package
    is, the CPU's vector ISA and the C++ compiler it was built with (flows/builtin/aot_compile.py key)."""
    from pt2flow.flows.builtin.executorch_int8 import int8_key
    from pt2flow.flows.engine.stage_api import cache_dir, current_interpreter, toolchain_identity
    from pt2flow.stages.target_options import INT8_INDUCTOR_CONFIGS

    toolchain = toolchain_identity("cpu", cache_dir(), INT8_INDUCTOR_CONFIGS, current_interpreter())
    return int8_key(stage, model, inputs, {"toolchain": toolchain})
