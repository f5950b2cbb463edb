"""Models that fail at a later stage, for `pt2flow repro`: one whose program keeps an op that has
no core ATen decomposition (a custom operator), so decompose fails with `decomposition`."""

from __future__ import annotations

import torch
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
