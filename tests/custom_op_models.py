"""A model calling a custom op registered with torch.library: torch.export keeps the op as it is,
and no deployment target has a translation for it (ONNX: no ONNX function). Importing this module
registers the op, as a model's own package would: a process loading the program imports it first."""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("pt2flow_test::wobble", mutates_args=())
def wobble(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


@wobble.register_fake
def _wobble_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Wobbly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return wobble(self.proj(x)) + 1


def wobbly() -> nn.Module:
    return Wobbly()
