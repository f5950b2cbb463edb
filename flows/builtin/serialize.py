"""serialize: the .pt2 archive (torch.export.save) of the newest program, with pt2flow's metadata."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from pt2flow.flows.builtin._programs import NEWEST_PROGRAM
from pt2flow.flows.pipeline.stage import Stage
from pt2flow.stages.options import SerializeOptions

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, RebuildCall, ReproJob, StageCall
    from pt2flow.stages.generation_steps import StepContext, StepFn

# 2: the archive names the modules its pytree types need; 3: the new fingerprint; 4: the same
# program saves to the same bytes (graph ids of the pass provenance numbered, not addresses);
# 5: an archive's node provenance names no function address
STAGE = Stage(
    "serialize",
    5,
    compute=f"{__name__}:compute",
    inputs=(NEWEST_PROGRAM,),
    options=SerializeOptions,
    publishes="archive",
    artifact="serialized",
    suffix=".pt2",
    candidate="pt2flow.stages.serialize:load_archive",
    repro=f"{__name__}:repro",
    rebuild=f"{__name__}:rebuild",
    step=f"{__name__}:step",
    default=True,
    position=40,
    description=".pt2 archive (torch.export.save)",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.flows.engine.stage_api import current_environment
    from pt2flow.stages.serialize import serialize

    env = current_environment()
    parent = call.inputs["program"]
    metadata = {
        "pt2flow_version": env.pt2flow_version,
        "torch_version": env.torch_version,
        "program_fingerprint": parent.fingerprint,
        "derivation_key": call.key,
        "parent_key": parent.key,
    }
    result = serialize(call.program(), metadata, identity=parent.fingerprint)
    return call.publish_result(result, fingerprint=result.metadata["fingerprint"])


def rebuild(call: RebuildCall) -> str | None:
    """The archive stores its parent program as it is: the parent's fingerprint (taken when the
    worker loaded the parent's blob)."""
    return call.parent_fingerprint


def repro(job: ReproJob) -> str:
    """torch.export.save, then torch.export.load of the bytes."""
    return job.program() + textwrap.dedent("""\
        import io
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        buffer.seek(0)
        torch.export.load(buffer)
        """)


def step(data: bytes, context: StepContext) -> StepFn:
    """A generative component's archive as a step: torch.export.load's module, called with the kwargs it was traced with."""
    from pt2flow.stages.generation_steps import archive_step

    return archive_step(data)
