"""Where a compiled package runs (docs/architecture.md §6, "Devices").

The reference model, the example inputs and the serialized archive live on the CPU. An
AOTInductor package compiled for `aot_compile.device: cuda` runs only on that device: its inputs
must be there and its outputs come back there. `on_device` wraps such a package so that it is
called exactly like the CPU model: tensors go to the device, outputs come back to the CPU, and
an input the package changed in place is copied back into the caller's tensor.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import ErrorClass


# how a device this machine lacks is reported (require_device); `repro` recognises it by this
MISSING_DEVICE_PREFIX = "aot_compile.device is "


def parse_device(device: str, setting: str = "aot_compile.device") -> torch.device:
    """torch.device(device), or StageError(ErrorClass.CONFIG) naming the setting."""
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise StageError(ErrorClass.CONFIG, f"{setting}: {device!r} is not a torch device") from exc


def missing_device(device: str) -> str | None:
    """Why `device` cannot be used in this process, or None when it can."""
    parsed = parse_device(device)
    if parsed.type == "cpu":
        return None
    backend = getattr(torch, parsed.type, None)  # torch.cuda, torch.xpu, torch.mps
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        return f"no {parsed.type.upper()} device is available here"
    count = getattr(backend, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        return f"{parsed.type} has {count()} device(s) here, so index {parsed.index} does not exist"
    return None


def require_device(device: str, error_class: ErrorClass) -> torch.device:
    """The parsed device, or StageError(error_class) saying why it cannot be used here."""
    why = missing_device(device)
    if why is not None:
        raise StageError(error_class, f"{MISSING_DEVICE_PREFIX}{device!r} but {why}")
    return parse_device(device)


class OnDevice:
    """`fn` (a package loaded for `device`), called with CPU tensors like the eager model."""

    def __init__(self, fn: Callable[..., Any], device: str | torch.device) -> None:
        self.fn = fn
        self.device = torch.device(device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def there(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            copy = value.to(self.device, copy=True)
            moved.append((value, copy))
            return copy

        out = self.fn(*pytree.tree_map(there, args), **pytree.tree_map(there, kwargs))
        for original, copy in moved:  # a package that mutates an input mutates the device copy
            back = copy.to(original.device)
            if not _same(back, original):
                original.copy_(back)
        return pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, out)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (an input holding NaN is not taken for a mutated one)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()) or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def on_device(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """`fn` itself on the CPU; elsewhere an OnDevice wrapper."""
    return fn if parse_device(device).type == "cpu" else OnDevice(fn, device)


def device_index(device: str) -> int:
    """What aoti_load_package's device_index expects: the device's index, -1 for the default."""
    index = parse_device(device).index
    return -1 if index is None else index
