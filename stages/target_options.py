"""The deployment targets' options (stages/onnx_target.py, stages/executorch_target.py,
stages/openvino_target.py). Torch-free,
like stages/options.py: a config naming a target validates without torch. The libraries a target
needs and the extra installing them are in its declaration (flows/builtin/)."""

from __future__ import annotations

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


class OpenvinoOptions(_TargetOptions):
    """compress_to_fp16: store the weights as f16 (openvino.save_model's compress_to_fp16: half the
    size, the weights rounded); inference_precision: the CPU plugin's INFERENCE_PRECISION_HINT when
    the model is run (validate, check-compat): f32 computes as eager does, bf16/f16 lets a CPU that
    has them trade accuracy for speed. Recorded in the artifact: a model is run as it was made."""

    compress_to_fp16: bool = False
    inference_precision: Literal["f32", "bf16", "f16"] = "f32"


class Int8Options(_TargetOptions):
    """Post-training static int8 through PT2E (stages/quantize.py): prepare_pt2e with the target's
    quantizer, calibration, convert_pt2e, then the target's own lowering.

    per_channel: weights quantized per output channel (else one scale per tensor); activations:
    static (scales fixed by calibration) or dynamic (computed per call from the activation);
    float_modules: modules left in float, by their name in the model (`conv1`, `encoder.layer.0`;
    every module under a name stays float); calibration_batches: how many batches of the model's
    inputs calibrate the observers, drawn from its inputs spec at the example sizes with seeds
    calibration_seed*1000 + 1_000_000 + i, none of which validate's samples use."""

    per_channel: bool = True
    activations: Literal["static", "dynamic"] = "static"
    float_modules: tuple[str, ...] = ()
    calibration_batches: int = Field(default=8, ge=1, le=1024)
    calibration_seed: int = Field(default=0, ge=0)


# the Inductor configs of an int8 AOTInductor package (stages/quantize.py): freezing folds the int8
# weights' dequantization into constants, so Inductor's int8 patterns (oneDNN qconv/qlinear) apply
INT8_INDUCTOR_CONFIGS = {"freezing": True}
