"""The data of configs/quantized.yaml's models, as a user's data callable gives it (`data:`): an
endless, seeded stream of batches of forward()'s arguments, by name. The first
`data.calibration` calibrate the int8 stages; the `data.evaluation` after them, which nothing
calibrated on, are what each int8 artifact's accuracy is measured on.

Synthetic but shaped like real data, which validate's random samples are not: images with pixels
in [0, 1) (smooth gradients and blobs, as photos after ToTensor()), features with a few dominant
directions, and token ids with a Zipf-like frequency, padded sentences whose attention mask is 0
past their length."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def images(batch: int = 2, size: int = 16, seed: int = 0) -> Iterator[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    axis = torch.linspace(0, 1, size)
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    while True:
        centre = torch.rand(batch, 3, 2, generator=generator)
        width = 0.1 + 0.3 * torch.rand(batch, 3, 1, 1, generator=generator)
        blob = torch.exp(
            -((xx - centre[..., 0, None, None]) ** 2 + (yy - centre[..., 1, None, None]) ** 2) / width**2
        )
        slope = torch.rand(batch, 3, 1, 1, generator=generator)
        image = 0.5 * blob + 0.4 * slope * xx + 0.1 * torch.rand(batch, 3, size, size, generator=generator)
        yield {"image": image.clamp(0, 0.999)}


def features(batch: int = 64, width: int = 256, seed: int = 0) -> Iterator[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, width, generator=torch.Generator().manual_seed(1234))
    while True:
        weights = torch.randn(batch, 8, generator=generator) * torch.linspace(2.0, 0.2, 8)
        yield {"x": weights @ basis + 0.1 * torch.randn(batch, width, generator=generator)}


def sentences(batch: int = 4, length: int = 32, vocab: int = 512, seed: int = 0) -> Iterator[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    frequency = 1.0 / torch.arange(1, vocab - 1, dtype=torch.float64)  # ids 2.. by rank; 0 pads, 1 starts
    while True:
        ids = torch.multinomial(frequency, batch * length, replacement=True, generator=generator) + 2
        ids = ids.view(batch, length)
        ids[:, 0] = 1
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        yield {"input_ids": ids * mask, "attention_mask": mask}
