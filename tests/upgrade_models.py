"""Models built on the tinyops test distribution (tests/fixtures/tinyops-*): installed only in the
environments tests/integration/test_upgrade_check.py builds, never in the test runner's own."""

from __future__ import annotations

import tinyops
import torch
from torch import nn


class OnTinyops(nn.Module):
    """A linear layer, then one of tinyops' helpers (by name)."""

    def __init__(self, helper: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 4)
        self.helper = helper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(tinyops, self.helper)(self.linear(x))


def scaled() -> nn.Module:
    return OnTinyops("scale").eval()


def gated() -> nn.Module:
    return OnTinyops("gate").eval()
