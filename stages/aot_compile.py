"""aot_compile: an AOTInductor package (torch._inductor.aoti_compile_and_package)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from pt2flow.stages.classify import classify_compile_error, short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import AotCompileOptions
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult




def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise StageError("config", f"aot_compile.device: {device!r} is not a torch device") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise StageError("compile", f"aot_compile.device is {device!r} but no CUDA device is available here")


def aot_compile(ep: ExportedProgram, options: AotCompileOptions) -> StageResult:
    """Output: the package's bytes (a .pt2 zip holding the compiled shared library and weights)."""
    from torch._inductor import aoti_compile_and_package

    _check_device(options.device)
    if torch.device(options.device).type != "cpu":
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, options.device)
    with tempfile.TemporaryDirectory(prefix="pt2flow-aoti-") as tmp, quiet_torch() as sink:
        target = Path(tmp) / "model.pt2"
        try:
            path = aoti_compile_and_package(
                ep, package_path=str(target), inductor_configs=dict(options.inductor_configs) or None
            )
        except Exception as exc:
            raise StageError(classify_compile_error(exc), f"AOTInductor compile failed: {short_message(exc)}") from exc
        data = Path(path).read_bytes()
    return StageResult(output=data, metadata={"size": len(data), "device": options.device}, warnings=sink.items)


def load_package(data: bytes, workdir: str) -> Any:
    """Load a compiled package from bytes (written under `workdir`, which must outlive the runner)."""
    from torch._inductor import aoti_load_package

    path = Path(workdir) / "package.pt2"
    path.write_bytes(data)
    with quiet_torch():
        return aoti_load_package(str(path))
