"""decompose: core ATen via torch.export.default_decompositions(), `preserve`, and the `none` table."""

from __future__ import annotations

import pytest
import torch

from pt2flow.stages import decompose as decompose_module
from pt2flow.stages.decompose import decompose, decomposition_table, resolve_op
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import DecomposeOptions
from tests import models
from tests.stages.helpers import (
    builder,
    call_targets,
    functional,
    mlp_inputs,
    op_overloads,
    regressor_inputs,
    static_inputs,
)

# symbolic-size queries and runtime asserts are allowed in a core-ATen program
_ALLOWED_NON_CORE = ("aten.sym_", "aten._assert")


def _not_core(ep: torch.export.ExportedProgram) -> list[str]:
    """Ops without torch's `core` tag (checked here independently of stages.program)."""
    return sorted(
        {
            str(op)
            for op in op_overloads(ep)
            if torch.Tag.core not in op.tags and not str(op).startswith(_ALLOWED_NON_CORE)
        }
    )


def _histogram(ep: torch.export.ExportedProgram) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in op_overloads(ep):
        out[str(op)] = out.get(str(op), 0) + 1
    return out


@pytest.fixture(scope="module")
def mlp_functional() -> torch.export.ExportedProgram:
    return functional(builder(models.tiny_mlp), mlp_inputs()).output


def test_core_aten_leaves_only_core_ops(mlp_functional: torch.export.ExportedProgram) -> None:
    assert _not_core(mlp_functional) == ["aten.linear.default"]  # the input does have a non-core op
    result = decompose(mlp_functional, DecomposeOptions(table="core_aten"))
    assert _not_core(result.output) == []
    assert _histogram(result.output) == {"aten.addmm.default": 2, "aten.permute.default": 2, "aten.relu.default": 1}
    assert result.metadata["op_histogram"] == _histogram(result.output)
    assert result.metadata["table"] == "core_aten"
    assert result.metadata["preserved"] == []
    assert result.warnings == ()
    # same function: the decomposed program matches eager at another batch size
    x = torch.randn(6, 8)
    torch.testing.assert_close(result.output.module()(x), builder(models.tiny_mlp)()(x))


def test_core_aten_keeps_a_joint_training_program_intact() -> None:
    build = builder(models.regressor, training=True, loss_output=0)
    joint = functional(build, regressor_inputs(), mode="training").output
    result = decompose(joint, DecomposeOptions())
    assert _not_core(result.output) == []
    counts = result.metadata["signature"]["counts"]
    assert counts["out.LOSS_OUTPUT"] == 1 and counts["out.GRADIENT_TO_PARAMETER"] == 6
    x, y = torch.randn(3, 4), torch.randn(3)
    loss, grads = result.output.module()(x, y)
    eager = build()
    expected = eager(x, y)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach())
    torch.testing.assert_close(grads["model.norm.weight"].detach(), eager.model.norm.weight.grad)


def test_random_like_ops_become_core_random_ops() -> None:
    ep = functional(builder(models.noisy), static_inputs(4, 8)).output
    assert "aten.rand_like.default" in _histogram(ep)
    out = decompose(ep, DecomposeOptions()).output
    hist = _histogram(out)
    assert "aten.rand_like.default" not in hist
    assert hist.get("aten.rand.default") == 1
    assert _not_core(out) == []
    y = out.module()(torch.randn(4, 8))
    assert y.shape == (4, 4)


def test_preserve_keeps_the_named_op(mlp_functional: torch.export.ExportedProgram) -> None:
    result = decompose(mlp_functional, DecomposeOptions(preserve=("aten.linear.default",)))
    hist = _histogram(result.output)
    assert hist == {"aten.linear.default": 2, "aten.relu.default": 1}
    assert "aten.addmm.default" not in hist
    assert result.metadata["preserved"] == ["aten.linear.default"]
    table, warnings = decomposition_table(("aten.linear.default",))
    assert torch.ops.aten.linear.default not in table and warnings == []
    assert torch.ops.aten.linear.default in decomposition_table(())[0]


def test_preserving_an_op_the_table_keeps_anyway_warns(mlp_functional: torch.export.ExportedProgram) -> None:
    result = decompose(mlp_functional, DecomposeOptions(preserve=("aten.relu.default",)))
    assert result.warnings == ("preserve: aten.relu.default is not decomposed by the core_aten table anyway",)
    assert _histogram(result.output)["aten.relu.default"] == 1


@pytest.mark.parametrize("name", ["linear", "aten.linear", "aten.no_such_op.default"])
def test_preserve_names_must_resolve_to_an_operator(name: str, mlp_functional: torch.export.ExportedProgram) -> None:
    with pytest.raises(StageError) as info:
        decompose(mlp_functional, DecomposeOptions(preserve=(name,)))
    assert info.value.error_class == "config"
    assert name in info.value.message


def test_resolve_op() -> None:
    assert resolve_op("aten.linear.default") is torch.ops.aten.linear.default
    assert resolve_op("aten.add.Tensor") is torch.ops.aten.add.Tensor


def test_table_none_is_the_identity(mlp_functional: torch.export.ExportedProgram) -> None:
    before = list(call_targets(mlp_functional))
    result = decompose(mlp_functional, DecomposeOptions(table="none", preserve=("aten.linear.default",)))
    assert result.output is mlp_functional
    assert list(call_targets(result.output)) == before
    assert result.metadata["table"] == "none"
    assert result.metadata["preserved"] == []
    assert result.metadata["op_histogram"] == {"aten.linear.default": 2, "aten.relu.default": 1}


def test_non_core_ops_left_by_the_table_are_an_error(
    monkeypatch: pytest.MonkeyPatch, mlp_functional: torch.export.ExportedProgram
) -> None:
    # a table that decomposes nothing leaves aten.linear in the program: the invariant check catches it
    monkeypatch.setattr(decompose_module, "decomposition_table", lambda preserve: ({}, []))
    with pytest.raises(StageError) as info:
        decompose(mlp_functional, DecomposeOptions())
    assert info.value.error_class == "decomposition"
    assert "aten.linear.default" in info.value.message
    assert "decompose.preserve" in info.value.message
