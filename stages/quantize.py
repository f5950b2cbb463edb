"""Post-training int8 through PT2E (torchao.quantization.pt2e): the functional program's module
annotated by a target's quantizer (`prepare_pt2e`), its observers calibrated on batches of the
model's inputs, the observed module converted (`convert_pt2e`: quantize/dequantize pairs around
int8 weights) and exported again with the program's own dynamic dims, then lowered by the target
(ExecuTorch with XNNPACK, which fuses the pairs into int8 kernels).

The result is not meant to equal eager: validate judges it by the model's accuracy budgets
(stages/accuracy.py), on its own samples, none of which calibrated it.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Sequence

import torch
from torch.export import ExportedProgram

from pt2flow.stages import program
from pt2flow.stages.classify import short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import BoundInputs
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.options import AotCompileOptions
from pt2flow.stages.result import StageResult
from pt2flow.stages.target_options import INT8_INDUCTOR_CONFIGS, ExecutorchOptions, Int8Options
from pt2flow.stages.targets import refuse_training
from pt2flow.stages.vocabulary import ErrorClass

CALIBRATION_SEED_BASE = 1_000_000  # far from validate's seeds (options.seed + sample index)


def calibration_seeds(options: Int8Options) -> list[int]:
    """The seeds of the calibration batches (stages.binding.bind_inputs draws each batch)."""
    base = CALIBRATION_SEED_BASE + 1000 * options.calibration_seed
    return [base + i for i in range(options.calibration_batches)]


def xnnpack_quantizer(options: Int8Options) -> Any:
    """ExecuTorch's XNNPACKQuantizer, symmetric, set as the options say (the modules under
    float_modules get no annotation: they stay float and run on XNNPACK's float kernels)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    class Quantizer(XNNPACKQuantizer):
        def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return float_scalars_to_attrs(model)

    config = get_symmetric_quantization_config(
        is_per_channel=options.per_channel, is_dynamic=options.activations == "dynamic"
    )
    quantizer = Quantizer().set_global(config)
    if options.float_modules:  # (its set_module_name(name, None) is "not supported yet")
        from torchao.quantization.pt2e.quantizer.utils import get_module_name_filter

        kept = [get_module_name_filter(name) for name in options.float_modules]
        quantizer.set_filter_function(lambda node: not any(inside(node) for inside in kept))
    return quantizer


SCALAR_OPERAND_OPS = ("aten.add.Tensor", "aten.mul.Tensor")


def float_scalars_to_attrs(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The number operands of the floating adds and muls of `model` made tensor constants, so that
    the quantizer can give them a scale as it does to a tensor operand. XNNPACKQuantizer's own pass
    does this to every add and mul, integer ones included: transformers' attention masks index
    with `arange(n) + k`, which then became a float tensor and failed as an index during
    calibration (tiny BERT: "tensors used as indices must be long")."""
    changed = False
    for node in list(model.graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or str(node.target) not in SCALAR_OPERAND_OPS:
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        args = list(node.args)
        for index, arg in enumerate(args):
            if isinstance(arg, torch.fx.Node) or not isinstance(arg, int | float) or isinstance(arg, bool):
                continue
            name = f"_pt2flow_scalar_{len(list(model.buffers()))}"
            constant = torch.tensor(float(arg))
            model.register_buffer(name, constant)
            with model.graph.inserting_before(node):
                attr = model.graph.get_attr(name)
            attr.meta["val"] = value.fake_mode.from_tensor(constant, static_shapes=True)
            args[index] = attr
            changed = True
        node.args = tuple(args)
    if changed:
        model.recompile()
    return model


def module_names(ep: ExportedProgram) -> set[str]:
    """The names of the model's modules that own a node of the program (its nn_module_stack),
    every prefix included (`encoder`, `encoder.layer`, `encoder.layer.0`)."""
    names: set[str] = set()
    for node in ep.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            path = path[len("L['self'].") :] if path.startswith("L['self'].") else path
            parts = path.split(".")
            names.update(".".join(parts[: i + 1]) for i in range(len(parts)) if path)
    return names


def program_dynamic_shapes(ep: ExportedProgram, example: BoundInputs) -> Any:
    """The dynamic dims `ep` has, for exporting its module again on `example` (the same pytree
    as the program's inputs): one torch.export.Dim per symbol, with the program's range for it.
    A dim the program computes from others (2*s0) is refused: the converted module would need
    the derivation spelled out again."""
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    dims: dict[str, Any] = {}
    shapes = torch.export.ShapesCollection()
    leaves = [tensor for _, tensor, _ in example.tensor_leaves()]
    nodes = program.user_tensor_inputs(ep)
    if len(leaves) != len(nodes):
        raise StageError(
            ErrorClass.CONFIG,
            f"the model's inputs have {len(leaves)} tensors and its program {len(nodes)}: they do not match",
        )
    dynamic = False
    for tensor, node in zip(leaves, nodes):
        val = node.meta.get("val") if node is not None else None
        if node is None or not isinstance(val, torch.Tensor):
            continue
        spec = {}
        for index, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            name = str(expr)
            if not expr.is_Symbol:
                raise StageError(
                    ErrorClass.DYNAMIC_SHAPE,
                    f"int8: input {node.name!r} dim {index} is {name}, a dim derived from others; "
                    "only plain dynamic dims can be exported again after quantization",
                )
            if name not in dims:
                vr = ranges.get(name)
                low = program.range_end(vr.lower) if vr is not None else None
                high = program.range_end(vr.upper) if vr is not None else None
                dims[name] = torch.export.Dim(f"d_{name}", min=max(low or 0, 0), max=high or torch.export.Dim.AUTO)
            spec[index] = dims[name]
        if spec:
            shapes[tensor] = spec
            dynamic = True
    return shapes if dynamic else None


def quantize(
    ep: ExportedProgram,
    calibration: Sequence[BoundInputs],
    example: BoundInputs,
    options: Int8Options,
    quantizer: Any,
) -> tuple[ExportedProgram, dict[str, Any]]:
    """`ep` quantized: prepare_pt2e(ep.module(), quantizer), every calibration batch run through
    it, convert_pt2e, and torch.export.export again on `example` with the program's dims. Errors:
    StageError(quantization) naming what PT2E refused."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    refuse_training(ep, "int8")
    unknown = [name for name in options.float_modules if name not in (known := module_names(ep))]
    if unknown:
        raise StageError(
            ErrorClass.CONFIG,
            f"executorch_int8.float_modules names {unknown}, which the program has no node of "
            f"(its modules: {', '.join(sorted(known)[:20]) or 'none'})",
        )
    start = time.perf_counter()
    try:
        prepared = prepare_pt2e(ep.module(), quantizer)
    except Exception as exc:
        raise StageError(
            ErrorClass.QUANTIZATION, f"prepare_pt2e refused the program: {short_message(exc, 800)}"
        ) from exc
    try:
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch.args, **batch.kwargs)
    except Exception as exc:
        raise StageError(
            ErrorClass.QUANTIZATION, f"calibration failed on the observed program: {short_message(exc, 800)}"
        ) from exc
    try:
        converted = convert_pt2e(prepared)
    except Exception as exc:
        raise StageError(ErrorClass.QUANTIZATION, f"convert_pt2e failed: {short_message(exc, 800)}") from exc
    args, kwargs = tuple(example.args), dict(example.kwargs)
    collected = program_dynamic_shapes(ep, example)
    try:
        shaped = collected.dynamic_shapes(converted, args, kwargs) if collected is not None else None
        quantized = torch.export.export(converted, args, kwargs, dynamic_shapes=shaped)
    except Exception as exc:
        raise StageError(
            ErrorClass.QUANTIZATION, f"the quantized program does not export again: {short_message(exc, 800)}"
        ) from exc
    quantized_ops = {k: v for k, v in program.op_histogram(quantized).items() if "quantize" in k}
    metadata = {
        "scheme": "pt2e-int8",
        "per_channel": options.per_channel,
        "activations": options.activations,
        "float_modules": list(options.float_modules),
        "calibration_batches": len(calibration),  # what they were: the caller's to say (`calibration`)
        "quantize_ops": quantized_ops,
        "quantize_seconds": round(time.perf_counter() - start, 3),
    }
    return quantized, metadata


def quantize_for_executorch(
    ep: ExportedProgram, calibration: Sequence[BoundInputs], example: BoundInputs, options: Int8Options
) -> StageResult:
    """Output: the .pte bytes of `ep` quantized with XNNPACKQuantizer and lowered with the XNNPACK
    partitioner (stages.executorch_target.lower_executorch). StageError(quantization) for what
    PT2E refuses; lowering and dynamic_shape as the executorch stage has them."""
    from pt2flow.stages.executorch_target import lower_executorch

    with quiet_torch() as sink:
        quantized, described = quantize(ep, calibration, example, options, xnnpack_quantizer(options))
    lowered = lower_executorch(quantized, ExecutorchOptions(partitioners=("xnnpack",), portable_fallback=True))
    metadata = {**lowered.metadata, **described}
    return StageResult(output=lowered.output, metadata=metadata, warnings=(*sink.items, *lowered.warnings))


def int8_repro_body(options: Int8Options, target: str) -> str:
    """The lines of a torch + torchao (+ ExecuTorch) script, after `ep` is loaded and
    `calibration.pt` written beside it (its `calibration` batches and its `example`, each (args,
    kwargs)), that quantize as quantize() does, with `target`'s quantizer ("executorch":
    XNNPACKQuantizer with pt2flow's float_scalars_to_attrs, written out; "inductor":
    X86InductorQuantizer), then lower (the .pte) or compile (the package) as the stage does. The
    export again is static: a failure only the program's dynamic dims cause is not reproduced."""
    import inspect

    per_channel, dynamic = options.per_channel, options.activations == "dynamic"
    lines = ["from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e", ""]
    if target == "executorch":
        lines += [
            "from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (",
            "    XNNPACKQuantizer,",
            "    get_symmetric_quantization_config,",
            ")",
            "",
            f"SCALAR_OPERAND_OPS = {SCALAR_OPERAND_OPS!r}",
            "",
            "",
            inspect.getsource(float_scalars_to_attrs),
            "",
            "class Quantizer(XNNPACKQuantizer):  # as the stage's: only floating adds and muls get tensor operands",
            "    def transform_for_annotation(self, model):",
            "        return float_scalars_to_attrs(model)",
            "",
            "",
            f"config = get_symmetric_quantization_config(is_per_channel={per_channel}, is_dynamic={dynamic})",
            "quantizer = Quantizer().set_global(config)",
        ]
        if options.float_modules:
            lines += [
                "from torchao.quantization.pt2e.quantizer.utils import get_module_name_filter",
                f"kept = [get_module_name_filter(name) for name in {list(options.float_modules)!r}]",
                "quantizer.set_filter_function(lambda node: not any(inside(node) for inside in kept))",
            ]
    else:
        lines += [
            "import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86",
            "",
            f"config = x86.get_default_x86_inductor_quantization_config(is_dynamic={dynamic})",
            "quantizer = x86.X86InductorQuantizer().set_global(config)",
            *(f"quantizer.set_module_name_qconfig({name!r}, None)" for name in options.float_modules),
        ]
    lines += [
        "data = torch.load(os.path.join(HERE, 'calibration.pt'), weights_only=True)",
        "prepared = prepare_pt2e(ep.module(), quantizer)",
        "with torch.no_grad():",
        "    for args, kwargs in data['calibration']:",
        "        prepared(*args, **kwargs)",
        "converted = convert_pt2e(prepared)",
        "args, kwargs = data['example']",
        "program = torch.export.export(converted, tuple(args), dict(kwargs))",
    ]
    if target == "executorch":
        lines += [
            "from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner",
            "from executorch.exir import to_edge_transform_and_lower",
            "",
            "to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()",
        ]
    else:
        lines += [
            "import torch._inductor",
            "",
            f"torch._inductor.aoti_compile_and_package(program, inductor_configs={dict(INT8_INDUCTOR_CONFIGS)!r})",
        ]
    return "\n".join(lines) + "\n"


def x86_inductor_quantizer(options: Int8Options) -> Any:
    """torchao's X86InductorQuantizer (weights per channel, activations per tensor, static or
    dynamic), the modules under float_modules given no config: they stay float."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86

    if not options.per_channel:
        raise StageError(
            ErrorClass.CONFIG,
            "aot_compile_int8 quantizes weights per channel (X86InductorQuantizer has no per-tensor "
            "weights): leave per_channel at true for this stage",
        )
    config = x86.get_default_x86_inductor_quantization_config(is_dynamic=options.activations == "dynamic")
    quantizer = x86.X86InductorQuantizer().set_global(config)
    for name in options.float_modules:
        quantizer.set_module_name_qconfig(name, None)
    return quantizer


def quantize_for_inductor(
    ep: ExportedProgram, calibration: Sequence[BoundInputs], example: BoundInputs, options: Int8Options
) -> StageResult:
    """Output: the bytes of an AOTInductor package (a .pt2 zip) of `ep` quantized with
    X86InductorQuantizer and compiled for the CPU by the aot_compile stage's own function with
    INT8_INDUCTOR_CONFIGS. StageError(quantization) for what PT2E refuses, a compile failure
    classified as aot_compile's."""
    from pt2flow.stages.aot_compile import aot_compile

    with quiet_torch() as sink:
        quantized, described = quantize(ep, calibration, example, options, x86_inductor_quantizer(options))
    compiled = aot_compile(quantized, AotCompileOptions(device="cpu", inductor_configs=dict(INT8_INDUCTOR_CONFIGS)))
    metadata = {**compiled.metadata, "inductor_configs": INT8_INDUCTOR_CONFIGS, **described}
    return StageResult(output=compiled.output, metadata=metadata, warnings=(*sink.items, *compiled.warnings))


class PackageRunner:
    """An AOTInductor package run on flat tensor inputs (its loader's own flat call: the user's
    tensor inputs in, in torch's flattening order, the output leaves out)."""

    def __init__(self, data: bytes) -> None:
        import tempfile

        from pt2flow.stages.aot_compile import load_package

        self._folder = tempfile.TemporaryDirectory(prefix="pt2flow-int8-package-")  # kept while loaded
        self.compiled = load_package(data, self._folder.name)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = [t.detach().contiguous() for t in inputs if isinstance(t, torch.Tensor)]
        return list(self.compiled.loader.run(flat))


def load_int8_package(data: bytes, threads: int | None = None) -> PackageRunner:
    """A runner of quantize_for_inductor's bytes (validate's, check-compat's and benchmark's
    loader). threads: an AOTInductor package runs on torch's intra-op threads, which the caller
    sets (the benchmark: torch.set_num_threads); taken so that the benchmark counts it among the
    artifacts timed on its thread count."""
    del threads
    return PackageRunner(data)
