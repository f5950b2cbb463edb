"""Models that fail for a few shared root causes, the way a fleet does after a library upgrade:
different models (names, widths, batch sizes) reaching the same broken block or op.

    SharedGate    a block whose forward branches on a tensor's value (data-dependent guard);
                  gated_small and gated_wide use it with different widths. `safe=True` is the fix
                  (torch.where instead of a Python branch)
    mystery op    a custom op registered without a fake (meta) implementation: export cannot
                  trace through it (unsupported_op); opaque_small and opaque_wide call it
    Router        a block that picks an expert by a tensor's value (a data-dependent index, the
                  same class as SharedGate's but another cause); routed_a and routed_b
"""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("pt2flow_failing::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) + 1


class SharedGate(nn.Module):
    def __init__(self, width: int, safe: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.safe:
            return torch.where(h.sum() > 0, h, -h)
        if h.sum() > 0:
            return h
        return -h


class Gated(nn.Module):
    def __init__(self, features: int, width: int, safe: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.gate = SharedGate(width, safe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.relu(self.inp(x)))


def gated_small(safe: bool = False) -> nn.Module:
    return Gated(4, 8, safe)


def gated_wide(safe: bool = False) -> nn.Module:
    return Gated(6, 32, safe)


class Opaque(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(self.proj(x)) * 2


def opaque_small() -> nn.Module:
    return Opaque(4)


def opaque_wide() -> nn.Module:
    return Opaque(24)


class Router(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = int(x.mean(dim=-1).argmax())
        return self.experts[choice](x)


def routed_a() -> nn.Module:
    return Router(4, 3)


def routed_b() -> nn.Module:
    return Router(10, 5)
