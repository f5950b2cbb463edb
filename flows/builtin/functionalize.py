"""functionalize: the functional ATen program (stages/functionalize.py); in training mode the
joint forward+backward program."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.options import FunctionalizeOptions

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, RebuildCall, ReproJob, StageCall

STAGE = Stage(
    "functionalize",
    3,
    compute=f"{__name__}:compute",
    inputs=(Input("program", ("trace",)),),
    options=FunctionalizeOptions,
    repro=f"{__name__}:repro",
    rebuild=f"{__name__}:rebuild",
    default=True,
    position=20,
    description="the functional ATen program (training: the joint forward+backward program)",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.functionalize import functionalize

    return call.publish_program(functionalize(call.program(), call.options(FunctionalizeOptions)))


def rebuild(call: RebuildCall) -> str | None:
    from pt2flow.stages.functionalize import functionalize
    from pt2flow.stages.serialize import stored_program

    if call.parent is None:
        return None
    return stored_program(functionalize(call.parent, FunctionalizeOptions(**call.options)).output).fingerprint


def repro(job: ReproJob) -> str:
    """run_decompositions({}) on the traced program (training: the joint program)."""
    load = job.program()
    if job.options.get("mode") == "training":
        return load + textwrap.dedent("""\
            from torch.export.experimental import _export_forward_backward
            ep = _export_forward_backward(ep, joint_loss_index=0)
            """)
    return load + "ep = ep.run_decompositions({})\n"
