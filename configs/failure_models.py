"""Models that cannot be exported or verified, each for a different reason (see configs/failures.yaml).

pt2flow must classify each failure (docs/architecture.md §7) and still finish the rest of the fleet.
"""

from __future__ import annotations

import torch
from torch import nn


class DataDependentBranch(nn.Module):
    """Python control flow on a tensor's value: no static graph can represent it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.sum() > 0:
            return h * 2
        return h - 1


def data_dependent_branch() -> nn.Module:
    return DataDependentBranch()


class Detection:
    """A plain Python class holding tensors, not registered as a pytree node."""

    def __init__(self, boxes: torch.Tensor, scores: torch.Tensor) -> None:
        self.boxes = boxes
        self.scores = scores


class UnregisteredOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> Detection:
        out = self.head(x)
        return Detection(out[:, :4], out[:, 4])


def unregistered_output() -> nn.Module:
    return UnregisteredOutput()


class NoisyModel(nn.Module):
    """Adds fresh noise on every call: eager disagrees with itself, so no export can be judged."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y + 0.05 * torch.rand_like(y)


def noisy_model() -> nn.Module:
    return NoisyModel()


class Bfloat16Stack(nn.Module):
    """bfloat16 arithmetic: eager rounds after every op, AOTInductor's fused kernels keep float32
    intermediates, so the compiled package really exceeds a float32 tolerance."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.bfloat16)
        for _ in range(4):
            h = nn.functional.gelu(self.layer(h)) * 1.37 + h.exp().log1p()
        return h.float().softmax(-1) * 100


def bfloat16_stack() -> nn.Module:
    return Bfloat16Stack()


class FixedBatch(nn.Module):
    """Works only for a batch of exactly 4, though the config marks the batch dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).reshape(4, 2, 4).sum(1)


def fixed_batch() -> nn.Module:
    return FixedBatch()


def healthy_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
