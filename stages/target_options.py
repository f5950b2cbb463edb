"""The deployment targets' options (stages/onnx_target.py, stages/executorch_target.py) and the
extras that install their libraries. Torch-free, like stages/options.py: a config naming a target
validates without torch, and says which extra to install when the library is missing."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _TargetOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OnnxOptions(_TargetOptions):
    """opset: the ONNX opset to convert to (unset: the exporter's own); optimize: run the
    exporter's graph optimizer (constant folding, dead code); external_data_threshold_mb: weights
    above this size leave the .onnx (protobuf caps one message at 2 GiB), and the artifact becomes a
    zip of model.onnx and model.onnx.data instead of the .onnx bytes alone."""

    opset: int | None = Field(default=None, ge=7)
    optimize: bool = True
    external_data_threshold_mb: float = Field(default=1536.0, ge=0)


# the partitioners pt2flow knows by name (stages/executorch_target.py builds them)
PartitionerName = Literal["xnnpack"]


class ExecutorchOptions(_TargetOptions):
    """partitioners: the backends that take the subgraphs they support, in order ([] lowers
    everything to ExecuTorch's portable kernels); portable_fallback: whether ops no partitioner
    takes may run on the portable kernels (false: such an op fails the stage with `lowering`)."""

    partitioners: tuple[PartitionerName, ...] = ("xnnpack",)
    portable_fallback: bool = True


# target -> (the pip extra, the import names that extra provides)
TARGET_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "onnx": ("onnx", ("onnx", "onnxscript", "onnxruntime")),
    "executorch": ("executorch", ("executorch",)),
}


def missing_extra(target: str) -> str | None:
    """None when `target`'s libraries import here, else what to tell the user (which extra to
    install). Looks the modules up without importing them."""
    extra, modules = TARGET_EXTRAS[target]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"the {target} target needs {', '.join(missing)}: pip install 'pt2flow[{extra}]'"
