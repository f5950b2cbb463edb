"""aot_compile: an AOTInductor package (torch._inductor.aoti_compile_and_package)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config
from torch.export import ExportedProgram

from pt2flow.stages.classify import classify_compile_error, short_message
from pt2flow.stages.devices import device_index, on_device, require_device
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import AotCompileOptions
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.serialize import pytree_modules
from pt2flow.stages.vocabulary import ErrorClass


def aot_compile(ep: ExportedProgram, options: AotCompileOptions) -> StageResult:
    """Output: the package's bytes (a .pt2 zip holding the compiled shared library and weights)."""
    from torch._inductor import aoti_compile_and_package

    if require_device(options.device, ErrorClass.COMPILE).type != "cpu":
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, options.device)
    with tempfile.TemporaryDirectory(prefix="pt2flow-aoti-") as tmp, quiet_torch() as sink:
        target = Path(tmp) / "model.pt2"
        try:
            with torch.fx.experimental._config.patch(backed_size_oblivious=size_oblivious(ep)):
                path = aoti_compile_and_package(
                    ep, package_path=str(target), inductor_configs=dict(options.inductor_configs) or None
                )
        except Exception as exc:
            raise StageError(classify_compile_error(exc), f"AOTInductor compile failed: {short_message(exc)}") from exc
        data = Path(path).read_bytes()
    modules = pytree_modules(ep)  # what a serving process imports before this package loads (the package cannot say)
    metadata = {"size": len(data), "device": options.device, **({"pytree_modules": modules} if modules else {})}
    return StageResult(output=data, metadata=metadata, warnings=sink.items)


def size_oblivious(ep: ExportedProgram) -> bool:
    """Whether the program was exported with size-oblivious sizes: an input dim is symbolic though
    its example was 0 or 1 (torch.export specializes such a dim otherwise). An encoder-decoder's
    decode component is (docs/architecture.md, generative models: its self-attention cache was
    captured at length 1). Inductor must compile it the same way: with the example's 1 as a plain
    hint it generated code right only at length 1 (T5's decode package diverged from its second
    call on; compiled size-obliviously it generates eager's tokens)."""
    for node in ep.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and any(
            isinstance(size, torch.SymInt) and size.node.hint in (0, 1) for size in value.shape
        ):
            return True
    return False


def load_package(data: bytes, workdir: str, device: str = "cpu") -> Any:
    """Load a compiled package from bytes (written under `workdir`, which must outlive the runner).

    `device`: the one it was compiled for (its record's `device`); the runner takes and returns
    tensors there (stages/devices.py `on_device` makes it take CPU tensors)."""
    from torch._inductor import aoti_load_package

    path = Path(workdir) / "package.pt2"
    path.write_bytes(data)
    with quiet_torch():
        return aoti_load_package(str(path), device_index=device_index(device))


def load_runner(data: bytes, workdir: str, device: str = "cpu") -> Any:
    """The package loaded for `device`, called with CPU tensors like the eager model and returning
    CPU tensors (stages/devices.py). StageError(ErrorClass.RUNTIME) when `device` is not usable here."""
    require_device(device, ErrorClass.RUNTIME)
    return on_device(load_package(data, workdir, device), device)
