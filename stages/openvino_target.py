"""The openvino target: the program converted by OpenVINO's PyTorch frontend (`openvino.convert_model`), saved
as OpenVINO IR (`openvino.save_model`: model.xml + model.bin), run by OpenVINO's CPU plugin.

Takes the functional program, as the other targets do (docs/architecture.md §2): the frontend
translates ATen ops itself and keeps linear, layer_norm and attention whole. The program's user
inputs are given to convert_model with their shapes (`input=`): static dims stay static and a
dynamic dim keeps its range (`1..32`), where the frontend alone would leave every dim `?`.

Output: one blob, a zip of model.xml and model.bin (stored, fixed member times). The same program
gives the same bytes: convert_model names the nodes it makes from a process-wide counter
(`Constant_2432`, the network `Model3`), so those names are renumbered in graph order before
saving. The CPU plugin computes in bf16/f16 where the CPU has them unless told otherwise (1e-2
errors on a tiny Linear), so the artifact records the inference precision to compile with
(`inference_precision`, f32 by default) in the IR's rt_info, and load_openvino compiles with it.

Refused: a training program (`config`); a program that updates buffers (`lowering`: the IR has
no state, the frontend drops the updates); an op the frontend has no conversion for, or whose
conversion fails (`lowering`, naming it, from the frontend's report).

Its declaration is flows/builtin/openvino.py; its options stages/target_options.py OpenvinoOptions.
openvino is imported inside the functions, with its telemetry declined (import_openvino).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from pt2flow.stages.target_options import OpenvinoOptions

MODEL_FILE = "model.xml"
WEIGHTS_FILE = "model.bin"
FORMAT = "openvino-ir.zip"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member times: the same model gives the same bytes
_NETWORK_NAME = "model"
# where the artifact records the precision it is compiled with (the IR's rt_info)
PRECISION_KEY = ("pt2flow", "inference_precision")
EXTRA = "openvino"


# ---------------------------------------------------------------------------------------------
# conversion


def _require_openvino() -> None:
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.vocabulary import ErrorClass

    import importlib.util

    if importlib.util.find_spec("openvino") is None:
        raise StageError(ErrorClass.CONFIG, f"the openvino target needs openvino: pip install 'pt2flow[{EXTRA}]'")


def convert(program: Any, options: OpenvinoOptions) -> Any:
    """The program as OpenVINO IR: a StageResult whose output is the zip's bytes and whose metadata
    says what the model takes and returns (names, partial shapes, element types), its op counts
    by type and its sizes. StageError: `config` for a training program or no openvino,
    `lowering` naming the ops the frontend refuses, or for a program that updates buffers."""
    from pt2flow.stages.quiet import quiet_torch
    from pt2flow.stages.result import StageResult
    from pt2flow.stages.targets import refuse_training

    refuse_training(program, "openvino")
    _refuse_state(program)
    _require_openvino()
    openvino = import_openvino()
    with quiet_torch() as sink, _telemetry_declined():
        try:
            model = openvino.convert_model(program, input=input_shapes(program))
        except Exception as exc:
            raise conversion_error(exc) from exc
    _drop_constant_inputs(model, program)
    _name_deterministically(model)
    model.set_rt_info(options.inference_precision, list(PRECISION_KEY))
    xml, weights = _save(model, options.compress_to_fp16)
    data = _zip(xml, weights)
    ops = Counter(op.get_type_name() for op in model.get_ordered_ops())
    metadata = {
        "format": FORMAT,
        "size": len(data),
        "xml_bytes": len(xml),
        "weights_bytes": len(weights),
        "inputs": [_port(p) for p in model.inputs],
        "outputs": [_port(p) for p in model.outputs],
        "node_count": sum(ops.values()),
        "op_histogram": dict(sorted(ops.items())),
        "compress_to_fp16": options.compress_to_fp16,
        "inference_precision": options.inference_precision,
        "openvino_version": openvino.__version__,
    }
    return StageResult(output=data, metadata=metadata, warnings=sink.items)


def import_openvino() -> Any:
    """The openvino module, imported with its telemetry declined (importing it starts the
    converter's telemetry session)."""
    with _telemetry_declined():
        import openvino
    return openvino


@contextlib.contextmanager
def _telemetry_declined() -> Iterator[None]:
    """OpenVINO's converter sends usage telemetry unless the user's consent file declines it (a
    missing file counts as consent): `import openvino` and every convert_model call write a client
    id and usage counts under ~/intel, and each convert_model waits up to a second for the sender
    (0.5 s of the 0.6 s a tiny MLP takes, offline). Its consent check declines in CI (CI=true), which
    this sets for the call."""
    before = os.environ.get("CI")
    os.environ["CI"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CI", None)
        else:
            os.environ["CI"] = before


def input_shapes(program: Any) -> list[Any]:
    """openvino.PartialShape of each user input, in flattening order (the placeholders of
    `program.module()`, from which convert_model makes its Parameters): ints stay static, a dim
    that is a symbol of the program's range constraints keeps its range, any other is `?`; a
    constant input (a None the program was traced with, as a mask of Qwen2's prefill) is dynamic,
    and its Parameter is dropped after conversion (_drop_constant_inputs). Before, the constants
    were left out of the list and every later input was given the shape of the one after it."""
    import torch

    from pt2flow.stages.program import range_end

    openvino = import_openvino()
    ranges = {str(k): v for k, v in program.range_constraints.items()}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    shapes = []
    for spec in _user_inputs(program):
        if type(spec.arg).__name__ != "TensorArgument":
            shapes.append(openvino.PartialShape.dynamic())
            continue
        node = placeholders.get(spec.arg.name)
        value = node.meta.get("val") if node is not None else None
        dims = []
        for size in getattr(value, "shape", ()):
            if not isinstance(size, torch.SymInt):
                dims.append(openvino.Dimension(int(size)))
                continue
            bounds = ranges.get(str(size.node.expr))
            if bounds is None:
                dims.append(openvino.Dimension())
                continue
            low, high = range_end(bounds.lower), range_end(bounds.upper)
            dims.append(openvino.Dimension(low or 0, -1 if high is None else high))
        shapes.append(openvino.PartialShape(dims))
    return shapes


def _user_inputs(program: Any) -> list[Any]:
    return [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]


def _drop_constant_inputs(model: Any, program: Any) -> None:
    """The converted model takes the program's user tensor inputs alone, as every runner feeds
    them (stages/targets.FlatRunner): the Parameter of a constant input is removed, and one that
    the converted graph reads is refused (`lowering`)."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.vocabulary import ErrorClass

    parameters = list(model.get_parameters())
    specs = _user_inputs(program)
    if len(parameters) != len(specs):
        raise StageError(
            ErrorClass.LOWERING, f"OpenVINO made {len(parameters)} inputs of the program's {len(specs)} user inputs"
        )
    for parameter, spec in reversed(list(zip(parameters, specs))):
        if type(spec.arg).__name__ == "TensorArgument":
            continue
        if parameter.output(0).get_target_inputs():
            raise StageError(
                ErrorClass.LOWERING,
                f"the converted model reads the constant input {spec.arg.name} ({spec.arg.value!r}) as a tensor",
            )
        model.remove_parameter(parameter)


def _refuse_state(program: Any) -> None:
    from pt2flow.stages.targets import refuse_state

    refuse_state(
        program,
        "an OpenVINO model is stateless",
        "the converted model would drop the updates and start each call from their initial values",
    )


# the frontend's report of what it could not convert (src/frontends/common_translators/src/unconverted_ops_report.cpp)
_NO_RULE = re.compile(r"No conversion rule found for operations: (.+)")
_FAILED = re.compile(r"Conversion is failed for: (.+)")


def refused_ops(exc: BaseException) -> list[str]:
    """The ops the frontend's report names: those it has no rule for, then those whose rule failed."""
    from pt2flow.stages.targets import exception_chain

    found: list[str] = []
    for pattern in (_NO_RULE, _FAILED):
        for link in exception_chain(exc):
            for match in pattern.finditer(str(link)):
                for name in match.group(1).split(", "):
                    if name.strip() and name.strip() not in found:
                        found.append(name.strip())
    return found


def conversion_error(exc: BaseException) -> Any:
    """The StageError of a failed convert_model: `lowering` naming the ops the frontend refused, and
    the frontend's own reason for a failure it does not blame on an op."""
    from pt2flow.stages.classify import classify_target_error, short_message
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.targets import innermost_reason, ops_named_in

    ops = refused_ops(exc) or ops_named_in(exc)
    if ops:
        message = f"OpenVINO cannot convert {', '.join(ops)}: {_report_summary(exc)}"
    else:
        message = f"OpenVINO conversion failed: {innermost_reason(exc)} ({short_message(exc, 500)})"
    return StageError(classify_target_error(exc), message, details={"ops": ops})


def _report_summary(exc: BaseException) -> str:
    """The frontend's summary lines ("No conversion rule found for operations: ..."), one line."""
    lines = [line.strip().lstrip("- ").strip() for line in str(exc).splitlines()]
    summary = [line for line in lines if _NO_RULE.match(line) or _FAILED.match(line)]
    return "; ".join(summary) or (lines[0] if lines else type(exc).__name__)


# a name OpenVINO makes up, `<OpType>_<counter>` (the converted nodes' own names come from the
# program's, lower case: `linear_1`, `linear/aten.linear.default/Add`; the inputs keep theirs)
_AUTOMATIC_NAME = re.compile(r"[A-Z][A-Za-z0-9]*_\d+")


def _name_deterministically(model: Any) -> None:
    """Renumber the names convert_model takes from its process-wide counter (`Constant_2432`, and
    a fused node's inherited `Multiply_2857`) in graph order, per op type, and name the network:
    the names are written into model.xml, and would otherwise depend on what the process
    converted before."""
    model.set_friendly_name(_NETWORK_NAME)
    ops = model.get_ordered_ops()
    automatic = [
        op for op in ops if op.get_type_name() != "Parameter" and _AUTOMATIC_NAME.fullmatch(op.get_friendly_name())
    ]
    taken = {op.get_friendly_name() for op in ops} - {op.get_friendly_name() for op in automatic}
    counters: Counter[str] = Counter()
    for op in automatic:
        kind = op.get_type_name()
        while True:
            counters[kind] += 1
            fresh = f"{kind}_{counters[kind]}"
            if fresh not in taken:
                break
        taken.add(fresh)
        op.set_friendly_name(fresh)


def _save(model: Any, compress_to_fp16: bool) -> tuple[bytes, bytes]:
    openvino = import_openvino()

    with tempfile.TemporaryDirectory(prefix="pt2flow-openvino-") as tmp:
        path = Path(tmp) / MODEL_FILE
        openvino.save_model(model, str(path), compress_to_fp16=compress_to_fp16)
        return path.read_bytes(), (Path(tmp) / WEIGHTS_FILE).read_bytes()


def _zip(xml: bytes, weights: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(zipfile.ZipInfo(MODEL_FILE, _ZIP_TIME), xml)
        archive.writestr(zipfile.ZipInfo(WEIGHTS_FILE, _ZIP_TIME), weights)
    return buffer.getvalue()


def _unzip(data: bytes) -> tuple[bytes, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = sorted(archive.namelist())
        if names != sorted([MODEL_FILE, WEIGHTS_FILE]):
            raise ValueError(f"not a pt2flow OpenVINO zip (members {names}, expected {MODEL_FILE} and {WEIGHTS_FILE})")
        return archive.read(MODEL_FILE), archive.read(WEIGHTS_FILE)


def _dim(dimension: Any) -> int | str:
    if dimension.is_static:
        return int(dimension.get_length())
    return str(dimension)  # "?", "1..32", "2.."


def _port(port: Any) -> dict[str, Any]:
    shape = port.get_partial_shape()
    return {
        "name": port.get_any_name() if port.get_names() else "",
        "shape": [_dim(d) for d in shape] if shape.rank.is_static else "?",
        "dtype": port.get_element_type().get_type_name(),
    }


# ---------------------------------------------------------------------------------------------
# running it


class OpenvinoRunner:
    """The IR compiled for OpenVINO's CPU plugin, at the precision the artifact records: flat input
    tensors in, flat output tensors out (stages/targets.FlatRunner)."""

    def __init__(self, data: bytes, threads: int | None = None) -> None:
        import numpy

        openvino = import_openvino()
        xml, weights = _unzip(data)
        core = openvino.Core()
        model = core.read_model(model=xml, weights=openvino.Tensor(numpy.frombuffer(weights, dtype=numpy.uint8)))
        precision = (
            model.get_rt_info(list(PRECISION_KEY)).astype(str) if model.has_rt_info(list(PRECISION_KEY)) else "f32"
        )
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision}
        if threads is not None:  # else the plugin's own: every core
            config["INFERENCE_NUM_THREADS"] = threads
        self.compiled = core.compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.input_names = [p.get_any_name() if p.get_names() else str(i) for i, p in enumerate(self.compiled.inputs)]
        self.precision = precision

    def _feeds(self, inputs: Sequence[Any]) -> list[Any]:
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"the OpenVINO model takes {len(self.input_names)} tensors ({self.input_names}), got {len(inputs)}"
            )
        return [t.detach().cpu().contiguous().numpy() for t in inputs]

    def prepare(self, inputs: Sequence[Any]) -> Callable[[], Any]:
        """The infer request on these inputs, converted to numpy once (what the benchmark times)."""
        feeds = self._feeds(inputs)
        return lambda: self.request.infer(feeds)

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        import torch

        self.request.infer(self._feeds(inputs))
        # the request's output tensors are overwritten by its next call: copied out
        return [
            torch.from_numpy(self.request.get_output_tensor(i).data.copy()) for i in range(len(self.compiled.outputs))
        ]


def load_openvino(data: bytes, threads: int | None = None) -> Any:
    """A runner (stages/targets.FlatRunner) of convert's bytes on the CPU, on `threads` inference
    threads (None: the CPU plugin's default)."""
    _require_openvino()
    return OpenvinoRunner(data, threads)


# ---------------------------------------------------------------------------------------------
# repro


REPRO_BODY = """import openvino

# the user inputs' shapes, as the stage gives them: static dims, dynamic ones with their range
from torch.export.graph_signature import InputKind, TensorArgument
ranges = {{str(k): v for k, v in program.range_constraints.items()}}
placeholders = {{n.name: n for n in program.graph.nodes if n.op == "placeholder"}}


def dimension(size):
    if not isinstance(size, torch.SymInt):
        return openvino.Dimension(int(size))
    bounds = ranges.get(str(size.node.expr))
    if bounds is None:
        return openvino.Dimension()
    high = int(bounds.upper) if bounds.upper.is_finite and int(bounds.upper) < 2**62 else -1
    return openvino.Dimension(int(bounds.lower), high)


# every user input is a Parameter of the converted model; a constant one (a None) is left dynamic,
# then removed: the model takes the tensors alone
user = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
shapes = [openvino.PartialShape([dimension(d) for d in placeholders[s.arg.name].meta["val"].shape])
          if isinstance(s.arg, TensorArgument) else openvino.PartialShape.dynamic() for s in user]
model = openvino.convert_model(program, input=shapes)
for parameter, spec in reversed(list(zip(model.get_parameters(), user))):
    if not isinstance(spec.arg, TensorArgument):
        model.remove_parameter(parameter)
openvino.save_model(model, "model.xml", compress_to_fp16={compress_to_fp16!r})
compiled = openvino.Core().compile_model("model.xml", "CPU", {{"INFERENCE_PRECISION_HINT": {precision!r}}})
if program.example_inputs is not None:  # one run on the inputs the program was exported with
    args, kwargs = program.example_inputs
    flat = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outputs = compiled([t.numpy() for t in flat])
    print("ran it:", [tuple(o.shape) for o in outputs.values()])
print("converted model.xml: the failure did not reproduce with torch", torch.__version__, "and openvino", openvino.__version__)
"""


def openvino_repro_body(options: OpenvinoOptions) -> str:
    """The script's lines after `program` is loaded: convert_model with the same input shapes,
    save_model with the same compression, a compile for the CPU and one run."""
    return REPRO_BODY.format(compress_to_fp16=options.compress_to_fp16, precision=options.inference_precision)
