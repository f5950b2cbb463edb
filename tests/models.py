"""Tiny models for the tests: each small enough to export in a second."""

from __future__ import annotations

import time

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16, out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def tiny_mlp(features: int = 8, hidden: int = 16, out: int = 4) -> nn.Module:
    return TinyMLP(features, hidden, out)


class BufferCounter(nn.Module):
    """Mutates two buffers per call; the output depends on the updated one."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return self.proj(x) + self.ema


def slow_build(seconds: float = 3.0, hidden: int = 16) -> nn.Module:
    """tiny_mlp, built in `seconds` (a factory that loads or downloads for a while: the source
    stage's work)."""
    time.sleep(seconds)
    return tiny_mlp(hidden=hidden)


def buffer_counter() -> nn.Module:
    return BufferCounter()


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.proj(x) * scale
        return {"hidden": h, "pooled": h.mean(1), "argmax": h.argmax(-1)}


def dict_out() -> nn.Module:
    return DictOut()


class Regressor(nn.Module):
    """Returns a scalar loss: for training-mode export."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = self.fc2(torch.tanh(self.norm(self.fc1(x)))).squeeze(-1)
        return ((pred - y) ** 2).mean()


def regressor() -> nn.Module:
    return Regressor()


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


def data_dependent() -> nn.Module:
    return DataDependent()


class Holder:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class PythonObjectOut(nn.Module):
    def forward(self, x: torch.Tensor) -> Holder:
        return Holder(x + 1)


def python_object_out() -> nn.Module:
    return PythonObjectOut()


class BatchOfFour(nn.Module):
    """Specializes its batch to 4 (a reshape that bakes the size in)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).reshape(4, 2, 4).sum(1)


def batch_of_four() -> nn.Module:
    return BatchOfFour()


class NumpyRoundTrip(nn.Module):
    """Calls .numpy() in forward: non-strict export fails, strict (TorchDynamo) handles it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 2) + x


def numpy_round_trip() -> nn.Module:
    return NumpyRoundTrip()


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y + 0.01 * torch.rand_like(y)


def noisy() -> nn.Module:
    return Noisy()


class GraphBreak(nn.Module):
    """Calls torch._dynamo.graph_break(): strict export (TorchDynamo) fails, non-strict traces it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2


def graph_break() -> nn.Module:
    return GraphBreak()


class BranchOnBatch(nn.Module):
    """Branches on its batch size: a dynamic batch must be capped at 4 (torch suggests the cap)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return x * 2
        return x + 1


def branch_on_batch() -> nn.Module:
    return BranchOnBatch()


class NestedInputs(nn.Module):
    """forward() takes a list of tensors, a dict, a tuple, a float and a str (a detection-style
    signature); the list's tensors share a dynamic batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, images: list, meta: dict, pair: tuple, scale: float, mode: str) -> dict:
        joined = self.proj(images[0] + images[1]) * scale + meta["bias"]
        if mode == "with-pair":
            joined = joined + pair[0] * pair[1]
        return {"joined": joined, "count": images[0].new_full((1,), float(len(images)))}


def nested_inputs() -> nn.Module:
    return NestedInputs()


def plain() -> nn.Module:
    """One nn.Linear(8, 4): the same code and weights whatever inputs a config gives it."""
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def embedding() -> nn.Module:
    """An nn.Embedding: its kernel takes int64 and int32 ids alike."""
    torch.manual_seed(0)
    return nn.Embedding(16, 4)


class ByteImage(nn.Module):
    """Takes a uint8 image, an int8 offset map and int16 ids, as camera and quantized pipelines do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.embed = nn.Embedding(300, 4)

    def forward(self, image: torch.Tensor, offset: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pixels = image.float() / 255.0 + offset.float() / 128.0
        return self.proj(pixels) + self.embed(ids.long()).sum(1, keepdim=True)


def byte_image() -> nn.Module:
    return ByteImage()


class SeqEncoder(nn.Module):
    """x [batch, seq, 8] -> per-token features and a pooled vector: a dynamic batch and sequence
    (layer norm, linear, softmax over the sequence, as an encoder's pooling does)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.score = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.proj(self.norm(x)))
        weights = torch.softmax(self.score(h), dim=1)
        return h, (weights * h).sum(1)


def seq_encoder() -> nn.Module:
    return SeqEncoder()


class Spectrum(nn.Module):
    """The magnitude spectrum of a projected signal: torch.fft.rfft, which OpenVINO's PyTorch
    frontend has no conversion rule for (aten._fft_r2c)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.proj(x)).abs()


def spectrum() -> nn.Module:
    return Spectrum()


class SmallConvNet(nn.Module):
    """A conv, a ReLU, a global mean and a classifier: what PT2E int8 is made for."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def small_convnet() -> nn.Module:
    return SmallConvNet()


class OutlierMLP(nn.Module):
    """Three linears; `wide`'s first output channel is 1000x the others, and `head` reads it 1000x
    weaker: in float it is one feature among eight, but one int8 scale per tensor for `wide`'s
    output (sized for the outlier) rounds the seven others away. Keeping `wide` and `head` float
    keeps that tensor float; `stem` stays int8."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.wide = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.wide.weight[0] *= 1000.0
            self.wide.bias[0] *= 1000.0
            self.head.weight[:, 0] /= 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.wide(torch.relu(self.stem(x)))))


def outlier_mlp() -> nn.Module:
    return OutlierMLP()
