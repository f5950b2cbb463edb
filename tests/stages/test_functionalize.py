"""functionalize: functional ATen in inference mode; the joint forward+backward program in training mode."""

from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import OutputKind

from pt2flow.stages.errors import StageError
from pt2flow.stages.functionalize import functionalize
from pt2flow.stages.options import FunctionalizeOptions
from pt2flow.stages.source import build_model
from tests import models
from tests.stages.helpers import builder, mlp_inputs, op_overloads, regressor_inputs, static_inputs, traced


def _mutating(ep: torch.export.ExportedProgram) -> list[str]:
    return sorted({str(op) for op in op_overloads(ep) if op._schema.is_mutable})


# --- inference --------------------------------------------------------------------------------


def test_inference_mode_leaves_no_mutating_ops_and_lifts_buffer_mutations() -> None:
    traced_ep = traced(builder(models.buffer_counter), mlp_inputs()).output
    # training IR still holds the in-place updates of both buffers
    assert _mutating(traced_ep) == ["aten.add_.Tensor", "aten.mul_.Tensor"]

    result = functionalize(traced_ep, FunctionalizeOptions(mode="inference"))
    ep = result.output
    assert _mutating(ep) == []
    mutations = {s.target: s.kind for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    assert set(mutations) == {"calls", "ema"}
    assert ep.graph_signature.buffers_to_mutate == {
        s.arg.name: s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION
    }
    assert result.metadata["mutated_buffers"] == ["calls", "ema"]
    assert result.metadata["mode"] == "inference"
    assert result.metadata["signature"]["counts"]["out.BUFFER_MUTATION"] == 2
    assert result.metadata["signature"]["counts"]["out.USER_OUTPUT"] == 1
    # the functional ops replace the in-place ones one for one
    assert result.metadata["op_histogram"] == {
        "aten.add.Tensor": 3,
        "aten.linear.default": 1,
        "aten.mean.dim": 1,
        "aten.mul.Tensor": 2,
    }


def test_functional_program_updates_buffers_like_eager() -> None:
    build = builder(models.buffer_counter)
    ep = functionalize(traced(build, mlp_inputs()).output, FunctionalizeOptions()).output
    eager, exported = build(), ep.module()
    for batch in (4, 2, 9):  # the second and third outputs depend on the lifted buffer updates
        x = torch.randn(batch, 8)
        with torch.no_grad():
            torch.testing.assert_close(exported(x), eager(x))
    assert int(exported.calls) == int(eager.calls) == 3
    torch.testing.assert_close(exported.ema, eager.ema)


def test_model_without_state_has_no_buffer_mutation() -> None:
    result = functionalize(traced(builder(models.tiny_mlp), mlp_inputs()).output, FunctionalizeOptions())
    assert result.metadata["mutated_buffers"] == []
    assert "out.BUFFER_MUTATION" not in result.metadata["signature"]["counts"]
    assert result.metadata["op_histogram"] == {"aten.linear.default": 2, "aten.relu.default": 1}


# --- training: the joint program --------------------------------------------------------------


def test_training_mode_produces_a_loss_and_one_gradient_per_parameter() -> None:
    build = builder(models.regressor, training=True, loss_output=0)
    traced_ep = traced(build, regressor_inputs()).output
    result = functionalize(traced_ep, FunctionalizeOptions(mode="training", loss_output=0))
    ep = result.output
    specs = ep.graph_signature.output_specs
    kinds = [s.kind for s in specs]
    assert kinds.count(OutputKind.LOSS_OUTPUT) == 1
    assert kinds[0] == OutputKind.LOSS_OUTPUT
    grads = [s.target for s in specs if s.kind == OutputKind.GRADIENT_TO_PARAMETER]
    parameters = [name for name, _ in build().named_parameters()]
    assert len(parameters) == 6
    assert sorted(grads) == sorted(parameters)
    assert result.metadata["signature"]["counts"]["out.GRADIENT_TO_PARAMETER"] == 6
    assert result.metadata["signature"]["counts"]["out.LOSS_OUTPUT"] == 1
    assert result.metadata["mode"] == "training"
    assert _mutating(ep) == []


def test_joint_program_computes_eager_autograd_loss_and_gradients() -> None:
    build = builder(models.regressor, training=True, loss_output=0)
    ep = functionalize(traced(build, regressor_inputs()).output, FunctionalizeOptions(mode="training")).output
    x, y = torch.randn(5, 4), torch.randn(5)  # a batch other than the example's
    loss, grads = ep.module()(x, y)  # the out spec was rewritten to (loss, {param: grad})
    eager = build()
    expected = eager(x, y)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach())
    assert set(grads) == {n for n, _ in eager.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name].detach(), p.grad, msg=name)


def test_training_mode_default_loss_reduces_every_output() -> None:
    # tiny_mlp returns a [batch, 4] tensor: the TrainingStep's loss is mean(out**2)
    build = builder(models.tiny_mlp, training=True)
    result = functionalize(traced(build, mlp_inputs(2, 16)).output, FunctionalizeOptions(mode="training"))
    counts = result.metadata["signature"]["counts"]
    assert counts["out.LOSS_OUTPUT"] == 1 and counts["out.GRADIENT_TO_PARAMETER"] == 4
    x = torch.randn(3, 8)
    loss, _ = result.output.module()(x)
    with torch.no_grad():
        reference = build_model(models.tiny_mlp, {})(x).pow(2).mean()
    torch.testing.assert_close(loss.detach(), reference)


def test_training_mode_needs_a_scalar_loss() -> None:
    # exported without the TrainingStep wrapper, tiny_mlp's output is not a scalar loss
    traced_ep = traced(builder(models.tiny_mlp), static_inputs(4, 8)).output
    with pytest.raises(StageError) as info:
        functionalize(traced_ep, FunctionalizeOptions(mode="training"))
    assert info.value.error_class == "decomposition"
    assert "joint forward+backward export failed" in info.value.message
    assert "scalar" in info.value.message
