"""decompose: the core ATen program (stages/decompose.py), ops named in `preserve` kept whole."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.options import DecomposeOptions

if TYPE_CHECKING:
    from pt2flow.flows.engine.stage_api import Produced, RebuildCall, ReproJob, StageCall

STAGE = Stage(
    "decompose",
    3,
    compute=f"{__name__}:compute",
    inputs=(Input("program", ("functionalize", "trace")),),
    options=DecomposeOptions,
    repro=f"{__name__}:repro",
    rebuild=f"{__name__}:rebuild",
    default=True,
    position=30,
    description="the core ATen program",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.decompose import decompose

    return call.publish_program(decompose(call.program(), call.options(DecomposeOptions)))


def rebuild(call: RebuildCall) -> str | None:
    from pt2flow.stages.decompose import decompose
    from pt2flow.stages.serialize import stored_program

    if call.parent is None:
        return None
    return stored_program(decompose(call.parent, DecomposeOptions(**call.options)).output).fingerprint


def repro(job: ReproJob) -> str:
    """run_decompositions(core ATen table minus `preserve`), then the check that no op outside
    core ATen is left."""
    from pt2flow.stages.program import ALWAYS_ALLOWED_PREFIXES as ALLOWED

    load = job.program()
    preserve = tuple(job.options.get("preserve") or ())
    return load + textwrap.dedent(f"""\
        preserve = {preserve!r}
        table = torch.export.default_decompositions()
        for name in preserve:
            namespace, op, overload = name.split(".")
            table.pop(getattr(getattr(getattr(torch.ops, namespace), op), overload), None)
        ep = ep.run_decompositions(table)
        def is_core(target):  # pt2flow's rule: structure (getitem, sym ops, control flow) and core ATen
            if not isinstance(target, torch._ops.OpOverload):
                name = getattr(target, "__name__", "")
                return isinstance(target, torch._ops.HigherOrderOperator) or getattr(target, "__module__", "") in ("_operator", "operator", "math") or name.startswith("sym_")
            return str(target).startswith({ALLOWED!r}) or torch.Tag.core in target.tags
        left = sorted({{str(n.target) for n in ep.graph.nodes
                       if n.op == "call_function" and str(n.target) not in preserve and not is_core(n.target)}})
        if left:
            raise RuntimeError("ops outside core ATen remain after decomposition: " + ", ".join(left))
        """)
