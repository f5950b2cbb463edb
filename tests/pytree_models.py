"""A model whose output is a dataclass registered with torch.export.register_dataclass, whose
serialized type name follows the "module.Class" convention: its archive loads only in a process
that has imported this module. Kept apart so that a fresh process has not."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class Point:
    x: torch.Tensor
    y: torch.Tensor


torch.export.register_dataclass(Point, serialized_type_name=f"{__name__}.Point")  # the "module.Class" convention


class PointOutput(nn.Module):
    def forward(self, t: torch.Tensor) -> Point:
        return Point(t + 1, t * 2)


def point_output() -> nn.Module:
    return PointOutput()
