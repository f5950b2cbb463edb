"""onnx: the program as an ONNX model (torch.onnx.export(program, dynamo=True)), run by ONNX Runtime.

Takes the functional program before core-ATen decomposition: the exporter runs its own
decomposition table, which keeps the ops ONNX has functions for (linear, layer_norm, attention).
The program's dynamic dims stay symbolic ONNX dims (renamed to the config's names when given).

Output: the .onnx bytes, self-contained; when the weights pass `external_data_threshold_mb`
(protobuf caps one message at 2 GiB, and past that the exporter moves them out anyway), a zip
of `model.onnx` and its external data `model.onnx.data` (the store keeps one blob per
artifact); load_onnx reads either. Tensors under 1 KiB stay inline either way.
"""

from __future__ import annotations

import io
import tempfile
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.export import ExportedProgram

from pt2flow.stages.classify import classify_target_error, short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.target_options import OnnxOptions
from pt2flow.stages.targets import FlatRunner, innermost_reason, ops_named_in, refuse_training
from pt2flow.stages.targets import refuse_state as refuse_stateful
from pt2flow.stages.vocabulary import ErrorClass

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
FORMAT_SINGLE = "onnx"
FORMAT_ZIP = "onnx+external-data.zip"
_ZIP_MAGIC = b"PK\x03\x04"  # a serialized ModelProto starts with its ir_version tag, 0x08
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member times: the same model gives the same bytes


def export_onnx(
    ep: ExportedProgram,
    options: OnnxOptions,
    *,
    dim_names: Sequence[Mapping[int, str] | None] | None = None,
) -> StageResult:
    """Output: the model's bytes (see the module docstring for the two layouts).

    dim_names: for each user tensor input in flattening order, {dim index: the config's dim
    name}, to name the ONNX model's symbolic dims (BoundInputs.tensor_leaves gives them).
    StageError(lowering) naming the op the exporter cannot translate; StageError(config) for a
    training program or a missing extra."""
    refuse_training(ep, "onnx")
    refuse_state(ep)
    kwargs: dict[str, Any] = {"dynamo": True, "optimize": options.optimize, "verbose": False}
    if options.opset is not None:
        kwargs["opset_version"] = options.opset
    if dim_names:
        kwargs["dynamic_shapes"] = [dict(d) if d else None for d in dim_names]
    with quiet_torch() as sink:
        try:
            onnx_program = torch.onnx.export(ep, **kwargs)
        except Exception as exc:
            raise lowering_error(exc) from exc
        weights = _initializer_bytes(onnx_program)
        data, proto = _save(onnx_program, weights > options.external_data_threshold_mb * 1024 * 1024)
    metadata = {
        **describe_onnx(proto),
        "format": FORMAT_ZIP if data[:4] == _ZIP_MAGIC else FORMAT_SINGLE,
        "size": len(data),
        "weights_bytes": weights,
    }
    return StageResult(output=data, metadata=metadata, warnings=sink.items)


def refuse_state(ep: ExportedProgram) -> None:
    """StageError(lowering) for a program that updates buffers: an ONNX model has no state."""
    refuse_stateful(
        ep,
        "ONNX models are stateless",
        "ONNX Runtime would start each call from their initial values (executorch and aot_compile keep state)",
    )


def lowering_error(exc: BaseException) -> StageError:
    """The StageError for a failed torch.onnx.export: `lowering` naming the op it could not
    translate and the exporter's innermost reason."""
    error_class = classify_target_error(exc)
    ops = ops_named_in(exc)
    reason = innermost_reason(exc)
    if ops:
        message = f"ONNX export cannot translate {', '.join(ops)}: {reason}"
    else:
        message = f"ONNX export failed: {reason} ({short_message(exc, 500)})"
    return StageError(error_class, message, details={"ops": ops})


def _initializer_bytes(onnx_program: Any) -> int:
    total = 0
    for value in onnx_program.model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += int(tensor.nbytes)
    return total


def _save(onnx_program: Any, external: bool) -> tuple[bytes, Any]:
    """(artifact bytes, the ModelProto without its external data)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="pt2flow-onnx-") as tmp:
        path = Path(tmp) / MODEL_FILE
        onnx_program.save(str(path), external_data=external)
        proto = onnx.load(str(path), load_external_data=False)
        # the saver keeps small tensors inline, and moves weights out past 2 GiB whatever it is told
        beside = sorted(p.name for p in Path(tmp).iterdir() if p.name != MODEL_FILE and p.stat().st_size > 0)
        if not beside:
            return path.read_bytes(), proto
        if beside != [DATA_FILE]:
            raise StageError(ErrorClass.INTERNAL, f"the ONNX saver wrote unexpected files: {beside}")
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            for member in (MODEL_FILE, DATA_FILE):
                archive.writestr(zipfile.ZipInfo(member, _ZIP_TIME), (Path(tmp) / member).read_bytes())
        return buffer.getvalue(), proto


def _dims(value_info: Any) -> list[int | str]:
    shape = value_info.type.tensor_type.shape
    return [d.dim_param if d.HasField("dim_param") else int(d.dim_value) for d in shape.dim]


def _dtype(value_info: Any) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(value_info.type.tensor_type.elem_type).lower()


def describe_onnx(proto: Any) -> dict[str, Any]:
    """opset, node count, op histogram (ops of a custom domain as `domain::Op`), inputs and outputs."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    counts = Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in proto.graph.node)
    return {
        "opset": opset,
        "ir_version": int(proto.ir_version),
        "node_count": len(proto.graph.node),
        "op_histogram": dict(sorted(counts.items())),
        "inputs": [{"name": v.name, "shape": _dims(v), "dtype": _dtype(v)} for v in proto.graph.input],
        "outputs": [{"name": v.name, "shape": _dims(v), "dtype": _dtype(v)} for v in proto.graph.output],
    }


class OnnxRunner:
    """An ONNX Runtime session on the CPU: flat input tensors in, flat output tensors out."""

    def __init__(self, data: bytes, threads: int | None = None) -> None:
        import onnxruntime

        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        source: str | bytes = data
        if data[:4] == _ZIP_MAGIC:  # model and external data (FORMAT_ZIP)
            self._tmp = tempfile.TemporaryDirectory(prefix="pt2flow-onnx-run-")
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                if sorted(archive.namelist()) != sorted([MODEL_FILE, DATA_FILE]):
                    raise ValueError(f"not a pt2flow ONNX zip: {archive.namelist()}")
                archive.extractall(self._tmp.name)
            source = str(Path(self._tmp.name) / MODEL_FILE)
        session_options = onnxruntime.SessionOptions()
        session_options.log_severity_level = 3  # errors only: its warnings reach the caller as exceptions or not at all
        if threads is not None:  # else ONNX Runtime's own: one per physical core
            session_options.intra_op_num_threads = threads
        self.session = onnxruntime.InferenceSession(source, session_options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [
            torch.from_numpy(out.copy()) if hasattr(out, "copy") else torch.tensor(out)
            for out in self.session.run(None, self._feeds(inputs))
        ]

    def _feeds(self, inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"the ONNX model takes {len(self.input_names)} tensors ({self.input_names}), got {len(inputs)}"
            )
        return {name: t.detach().cpu().contiguous().numpy() for name, t in zip(self.input_names, inputs)}

    def prepare(self, inputs: Sequence[torch.Tensor]) -> Callable[[], Any]:
        """InferenceSession.run on these inputs, converted to numpy once (what the benchmark times)."""
        feeds = self._feeds(inputs)
        return lambda: self.session.run(None, feeds)


def load_onnx(data: bytes, threads: int | None = None) -> FlatRunner:
    """A runner of export_onnx's bytes (either layout) in ONNX Runtime's CPU provider, on
    `threads` intra-op threads (None: ONNX Runtime's default)."""
    return OnnxRunner(data, threads)


REPRO_BODY = """onnx_program = torch.onnx.export(program, dynamo=True, optimize={optimize!r}, verbose=False{opset})
onnx_program.save("model.onnx", external_data=True)
print("exported model.onnx: the failure did not reproduce with torch", torch.__version__)
"""


def onnx_repro_body(options: OnnxOptions) -> str:
    """The script's lines after `program` is loaded: the export_onnx call written out."""
    opset = f", opset_version={options.opset!r}" if options.opset is not None else ""
    return REPRO_BODY.format(optimize=options.optimize, opset=opset)
