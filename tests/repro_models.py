"""Models that fail at a later stage, for `pt2flow repro`: one whose program keeps an op that has
no core ATen decomposition (a custom operator), so decompose fails with `decomposition`; a
training step through that op, so functionalize fails; one whose output type torch cannot
serialize, so the traced program fails the store's round trip (`serialization`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree
from torch import nn


@torch.library.custom_op("pt2flow_repro::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@scale.register_fake
def _scale_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(self.linear(x))


def custom_op_model() -> nn.Module:
    return UsesCustomOp()


class LossThroughCustomOp(nn.Module):
    """A training step whose loss goes through `scale`, which has no autograd formula: the joint
    forward+backward program cannot be built, so functionalize (training mode) fails."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (scale(self.linear(x)).sum(),)


def loss_through_custom_op() -> nn.Module:
    return LossThroughCustomOp()


@dataclasses.dataclass
class Pair:
    """An output type registered with torch's pytree but without a serialized_type_name: export
    works, torch.export.save does not, so the traced program fails the store's round trip."""

    first: torch.Tensor
    second: torch.Tensor


pytree.register_pytree_node(Pair, lambda p: ([p.first, p.second], None), lambda leaves, _: Pair(*leaves))


class PairOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(x + 1, x * 2)


def pair_output() -> nn.Module:
    return PairOutput()
