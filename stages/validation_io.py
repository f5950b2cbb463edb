"""The inputs validate used and the eager outputs it compared against, as one safetensors file,
so that a later check (`pt2flow check-compat`, after a torch upgrade) can run the stored
artifacts again and compare without the model's code or weights (docs/architecture.md §6).

Layout: tensors named `<sample>/in/<leaf>` and `<sample>/out/<leaf>` (pytree leaf order); the
safetensors metadata entry `pt2flow` holds JSON: per sample its label, the inputs' treespec
(torch.utils._pytree.treespec_dumps of `(args, kwargs)`), and for every leaf either the tensor's
name or its plain value (ints, floats, bools, strings, None). Outputs are kept as leaves only:
they are compared leaf by leaf, so their containers (a transformers ModelOutput) need no
registration where the check runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree

FORMAT = "pt2flow-validation-io/1"
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class IOSample:
    """One validation sample: its label, the call's (args, kwargs), the eager output's leaves."""

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[Any]


class NotStorable(ValueError):
    """Inputs that this format cannot hold (a leaf that is neither a tensor nor a plain value, or
    a container pytree cannot describe without the model's code)."""


def _leaves(values: Sequence[Any], prefix: str, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, leaf in enumerate(values):
        if isinstance(leaf, torch.Tensor):
            name = f"{prefix}/{j}"
            tensors[name] = leaf.detach().cpu().clone(memory_format=torch.contiguous_format)  # no shared storage
            out.append({"tensor": name})
        elif isinstance(leaf, _PLAIN):
            out.append({"value": leaf})
        else:
            raise NotStorable(f"{prefix}: a {type(leaf).__name__} leaf is neither a tensor nor a plain value")
    return out


def pack(samples: Sequence[IOSample]) -> bytes:
    """The samples as safetensors bytes (NotStorable if they cannot be)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    described = []
    for i, sample in enumerate(samples):
        leaves, spec = pytree.tree_flatten((tuple(sample.args), dict(sample.kwargs)))
        try:
            spec_text = pytree.treespec_dumps(spec)
        except Exception as exc:  # noqa: BLE001 - a container only the model's code knows
            raise NotStorable(f"sample {sample.label}: the inputs' structure cannot be stored: {exc}") from exc
        described.append(
            {
                "label": sample.label,
                "spec": spec_text,
                "inputs": _leaves(leaves, f"{i}/in", tensors),
                "outputs": _leaves(list(sample.outputs), f"{i}/out", tensors),
            }
        )
    return save(tensors, metadata={"pt2flow": json.dumps({"format": FORMAT, "samples": described})})


def unpack(data: bytes) -> list[IOSample]:
    """The samples of pack()'s bytes (ValueError for anything else)."""
    from safetensors.torch import load

    try:
        tensors = load(data)
        header = json.loads(_metadata(data)["pt2flow"])
    except Exception as exc:
        raise ValueError(f"not a pt2flow validation-io file: {exc}") from exc
    if header.get("format") != FORMAT:
        raise ValueError(f"unknown validation-io format {header.get('format')!r} (this pt2flow reads {FORMAT})")

    def value(entry: dict[str, Any]) -> Any:
        return tensors[entry["tensor"]] if "tensor" in entry else entry["value"]

    samples = []
    for sample in header["samples"]:
        args, kwargs = pytree.tree_unflatten(
            [value(e) for e in sample["inputs"]], pytree.treespec_loads(sample["spec"])
        )
        samples.append(IOSample(sample["label"], tuple(args), dict(kwargs), [value(e) for e in sample["outputs"]]))
    return samples


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (safetensors.torch.load drops it)."""
    size = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + size]).get("__metadata__") or {})
