"""functionalize: functional ATen (inference) or the joint forward+backward program (training)."""

from __future__ import annotations


import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from pt2flow.stages import program
from pt2flow.stages.classify import short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import FunctionalizeOptions
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.vocabulary import ErrorClass


def _joint(ep: ExportedProgram) -> ExportedProgram:
    from torch.export.experimental import _export_forward_backward

    joint = _export_forward_backward(ep, joint_loss_index=0)
    # The joint program's graph returns the loss and one gradient per parameter, but it keeps the
    # forward's output spec (one leaf). Give it the spec of what it returns, (loss, {param: grad}),
    # so that torch.export.load(...).module() and AOTInductor packages of it can be called.
    grads = [s.target for s in joint.graph_signature.output_specs if s.kind == OutputKind.GRADIENT_TO_PARAMETER]
    spec = pytree.tree_structure((0, {g: 0 for g in grads}))
    entry = joint.module_call_graph[0]
    if entry.signature is None:
        raise StageError(
            ErrorClass.DECOMPOSITION, "joint program has no call signature to attach the gradient outputs to"
        )
    entry.signature.out_spec = spec
    return joint


def functionalize(ep: ExportedProgram, options: FunctionalizeOptions) -> StageResult:
    """Output: an ExportedProgram with no mutating ops; buffer mutations lifted into the signature."""
    training = options.mode == "training"
    with quiet_torch() as sink:
        try:
            out = _joint(ep) if training else ep.run_decompositions({})
        except StageError:
            raise
        except Exception as exc:
            what = "joint forward+backward export" if training else "functionalization"
            raise StageError(ErrorClass.DECOMPOSITION, f"{what} failed: {short_message(exc)}") from exc
    left = program.mutating_ops(out)
    if left:
        raise StageError(ErrorClass.DECOMPOSITION, f"mutating ops remain after functionalization: {', '.join(left)}")
    expected = program.buffer_targets_of(ep, program.mutated_inputs(ep))
    lifted = program.mutated_buffers_in_signature(out)
    missing = sorted(expected - lifted)
    if missing:
        raise StageError(
            ErrorClass.DECOMPOSITION,
            f"buffers mutated by the model are missing from the graph signature: {', '.join(missing)}",
        )
    kinds = [s.kind.name for s in out.graph_signature.output_specs]
    if training and ("LOSS_OUTPUT" not in kinds or "GRADIENT_TO_PARAMETER" not in kinds):
        raise StageError(
            ErrorClass.DECOMPOSITION, f"joint program lacks LOSS_OUTPUT/GRADIENT_TO_PARAMETER outputs: {kinds}"
        )
    metadata = {**program.describe(out), "mode": options.mode, "mutated_buffers": sorted(lifted)}
    return StageResult(output=out, metadata=metadata, warnings=sink.items)
