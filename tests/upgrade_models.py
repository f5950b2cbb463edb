"""Models built on the tinyops test distribution (tests/fixtures/tinyops-*): installed only in the
environments tests/integration/test_upgrade_check.py builds, never in the test runner's own."""

from __future__ import annotations

import tinyops
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tinyops.scale(self.linear(x))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tinyops.gate(self.linear(x))


def scaled() -> nn.Module:
    return Scaled().eval()


def gated() -> nn.Module:
    return Gated().eval()
