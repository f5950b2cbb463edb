"""Small model factories for configs/demo.yaml: each exercises a different part of the export stack."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Plain MLP with a dynamic batch."""

    def __init__(self, in_features: int = 16, hidden: int = 32, out_features: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(in_features: int = 16, hidden: int = 32, out_features: int = 4) -> nn.Module:
    return MLP(in_features, hidden, out_features)


class SmallCNN(nn.Module):
    """Conv + BatchNorm + pooling classifier (BatchNorm in eval mode uses its running stats)."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, channels * 2, 3, padding=1),
            nn.BatchNorm2d(channels * 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(channels * 2, classes)
        # non-trivial running statistics, so that eval-mode BatchNorm does real work
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.BatchNorm2d):
                    module.running_mean.uniform_(-0.5, 0.5)
                    module.running_var.uniform_(0.5, 1.5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(image).flatten(1))


def small_cnn(channels: int = 8, classes: int = 10) -> nn.Module:
    return SmallCNN(channels, classes)


class TinyEncoder(nn.Module):
    """Token embedding + sinusoidal positions + a 2-layer transformer encoder; dynamic batch and sequence."""

    def __init__(self, vocab: int = 100, d_model: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("positions", pe, persistent=False)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        hidden = self.embed(input_ids) + self.positions[:seq]
        return self.norm(self.encoder(hidden))


def tiny_encoder(vocab: int = 100, d_model: int = 32, heads: int = 4, layers: int = 2) -> nn.Module:
    return TinyEncoder(vocab, d_model, heads, layers)


class RunningNormalizer(nn.Module):
    """Mutates buffers in forward: counts calls and keeps an exponential moving average of its input.

    The output depends on the updated average, so every candidate must apply the same buffer
    updates, call after call, to match eager.
    """

    def __init__(self, features: int = 8, momentum: float = 0.1) -> None:
        super().__init__()
        self.momentum = momentum
        self.proj = nn.Linear(features, features)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("running_mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.running_mean.mul_(1 - self.momentum).add_(self.momentum * x.mean(0))
        return self.proj(x - self.running_mean)


def running_normalizer(features: int = 8) -> nn.Module:
    return RunningNormalizer(features)


class MultiHead(nn.Module):
    """Returns a dict of outputs (a pytree) with different shapes and dtypes."""

    def __init__(self, features: int = 12, classes: int = 5) -> None:
        super().__init__()
        self.trunk = nn.Linear(features, 16)
        self.cls = nn.Linear(16, classes)
        self.reg = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.trunk(x)) * mask.unsqueeze(-1)
        logits = self.cls(h)
        return {"logits": logits, "score": self.reg(h).squeeze(-1), "label": logits.argmax(-1)}


def multi_head(features: int = 12, classes: int = 5) -> nn.Module:
    return MultiHead(features, classes)


class ResidualRegressor(nn.Module):
    """Residual MLP with LayerNorm, exported in training mode (joint forward + backward)."""

    def __init__(self, features: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.block = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.SiLU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.block(h)
        prediction = self.out(h).squeeze(-1)
        return nn.functional.mse_loss(prediction, target)


def residual_regressor(features: int = 8, hidden: int = 16) -> nn.Module:
    return ResidualRegressor(features, hidden)
