"""aot_compile: the AOTInductor package (stages/aot_compile.py) of the newest program, native code
for the configured device."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING
from collections.abc import Mapping

from pt2flow.flows.builtin._programs import NEWEST_PROGRAM
from pt2flow.flows.pipeline.stage import Stage
from pt2flow.stages.options import AotCompileOptions

if TYPE_CHECKING:
    from pt2flow.flows.config.models import ResolvedModel
    from pt2flow.flows.engine.stage_api import Outcome, Produced, ReproJob, StageCall
    from pt2flow.stages.generation_steps import StepContext, StepFn

# 2: the program fingerprint covers every node's tensor metadata (stages/program.py)
STAGE = Stage(
    "aot_compile",
    2,
    compute=f"{__name__}:compute",
    inputs=(NEWEST_PROGRAM,),
    options=AotCompileOptions,
    publishes="package",
    artifact="compiled",
    suffix=".pt2",
    key=f"{__name__}:key",
    candidate="pt2flow.stages.aot_compile:load_runner",
    repro=f"{__name__}:repro",
    device=f"{__name__}:device",
    step=f"{__name__}:step",
    default=True,
    position=50,
    description="AOTInductor package",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.aot_compile import aot_compile

    return call.publish_result(aot_compile(call.program(), call.options(AotCompileOptions)))


def device(model: ResolvedModel) -> str:
    """The device the package is compiled for (its options' `device`)."""
    from pt2flow.flows.engine.stage_api import stage_options

    return stage_options(model, STAGE.name, AotCompileOptions).device


def key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """A package is native code: its key also covers what that code was built for and with
    (CPU vector ISA, C++ compiler and version; for CUDA the GPU architecture and CUDA version),
    so a store shared by different machines never hands one a package built for another."""
    from pt2flow.flows.engine.stage_api import (
        cache_dir,
        current_interpreter,
        derivation_key,
        environment_part,
        options_json,
        toolchain_identity,
    )

    target = device(model)
    options = options_json(model, stage.name)
    env = {
        **environment_part(target),
        "toolchain": toolchain_identity(target, cache_dir(), options.get("inductor_configs"), current_interpreter()),
    }
    return derivation_key(stage.name, [inputs["program"].fingerprint], options, env)


def repro(job: ReproJob) -> str:
    """torch._inductor.aoti_compile_and_package (after move_to_device_pass for a GPU target)."""
    load = job.program()
    configs = job.options.get("inductor_configs") or {}
    target = job.options.get("device") or "cpu"
    if target != "cpu":  # as the stage does: the program moved to the target device
        load += textwrap.dedent(f"""\
            from torch.export.passes import move_to_device_pass
            ep = move_to_device_pass(ep, {target!r})
            """)
    return load + textwrap.dedent(f"""\
        import tempfile
        from torch._inductor import aoti_compile_and_package
        with tempfile.TemporaryDirectory() as folder:
            aoti_compile_and_package(ep, package_path=os.path.join(folder, "model.pt2"), inductor_configs={configs!r})
        """)


def step(data: bytes, context: StepContext) -> StepFn:
    """A generative component's package as a step, unpacked into the context's folder (its own call spec flattens the kwargs)."""
    from pt2flow.stages.generation_steps import aoti_step

    return aoti_step(data, context.workdir)
