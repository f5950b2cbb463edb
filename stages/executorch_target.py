"""executorch: the program lowered for ExecuTorch (`to_edge_transform_and_lower` with the configured
partitioners, then `to_executorch`), as the bytes of a .pte; run by the ExecuTorch runtime's
Python bindings.

Takes the functional program before core-ATen decomposition: to_edge_transform_and_lower
decomposes with ExecuTorch's table and keeps the ops a partitioner asks for (XNNPACK takes
linear whole); a core-ATen program has lost them.

ExecuTorch plans memory ahead of time for the largest input, so every dynamic dim needs an upper
bound: a program with an unbounded dim fails with `dynamic_shape` before any lowering (unchecked,
the runtime refuses any input above the example's size). Ops no partitioner takes run on the
portable kernels; with portable_fallback false they fail the stage with `lowering`, named.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import torch
from torch.export import ExportedProgram

from pt2flow.stages import program
from pt2flow.stages.classify import classify_target_error, short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import ErrorClass
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.target_options import ExecutorchOptions
from pt2flow.stages.targets import (
    FlatRunner,
    innermost_reason,
    native_stderr,
    ops_named_in,
    refuse_training,
    with_runtime_log,
)


def _xnnpack() -> Any:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner()


# the partitioners ExecutorchOptions.partitioners names, built fresh for each lowering
PARTITIONERS: dict[str, Callable[[], Any]] = {"xnnpack": _xnnpack}
# the import line and constructor call of each, for the repro script
_PARTITIONER_SOURCE: dict[str, tuple[str, str]] = {
    "xnnpack": (
        "from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner",
        "XnnpackPartitioner()",
    ),
}


# what the record of a failure of that check says of it (`details.check`: pt2flow's, not the library's)
UNBOUNDED_DIMS_CHECK = {
    "by": "pt2flow",
    "library": "ExecuTorch",
    "checks": "that every dynamic dim of the program's inputs has a maximum (its range constraints), which "
    "ExecuTorch's memory planning needs",
}


def unbounded_dims(ep: ExportedProgram) -> list[str]:
    """`input 'name' dim d (symbol)` for every user input dim whose range has no upper bound."""
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    found = []
    for node in program.user_tensor_inputs(ep):
        val = node.meta.get("val") if node is not None else None
        if node is None or not isinstance(val, torch.Tensor):
            continue
        for index, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                continue
            for symbol in size.node.expr.free_symbols:
                vr = ranges.get(str(symbol))
                if vr is not None and program.range_end(vr.upper) is None:
                    found.append(f"input {node.name!r} dim {index} ({symbol})")
    return found


@dataclass(frozen=True)
class Delegation:
    """How a lowered program splits: nodes inside the backends' partitions, ops left outside."""

    backends: tuple[str, ...]
    partitions: int
    delegated_nodes: int
    delegated_ops: dict[str, int]
    portable_ops: dict[str, int]  # compute ops the portable kernels run

    @property
    def portable_nodes(self) -> int:
        return sum(self.portable_ops.values())


def _edge_op_name(target: Any) -> str:
    if type(target).__name__ == "EdgeOpOverload":  # wraps the ATen op (an OpOverload's own _op is its C++ function)
        target = target._op
    return program.op_name(target)


def _is_bookkeeping(name: str) -> bool:
    """Nodes that are not kernels: tuple indexing, the delegate call, symbolic-size arithmetic."""
    return name.startswith(
        ("operator.", "_operator.", "higher_order.executorch_call_delegate", *program.ALWAYS_ALLOWED_PREFIXES)
    )


def delegation(edge_program: ExportedProgram) -> Delegation:
    """The split of a lowered edge program (to_edge_transform_and_lower's exported_program())."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    backends: set[str] = set()
    delegated: Counter[str] = Counter()
    partitions = 0
    for _, child in edge_program.graph_module.named_children():
        if isinstance(child, LoweredBackendModule):
            partitions += 1
            backends.add(child.backend_id)
            for node in child.original_module.graph.nodes:
                if node.op == "call_function" and not _is_bookkeeping(name := _edge_op_name(node.target)):
                    delegated[name] += 1
    portable = Counter(
        name
        for node in edge_program.graph.nodes
        if node.op == "call_function" and not _is_bookkeeping(name := _edge_op_name(node.target))
    )
    return Delegation(
        tuple(sorted(backends)),
        partitions,
        sum(delegated.values()),
        dict(sorted(delegated.items())),
        dict(sorted(portable.items())),
    )


def lower_executorch(ep: ExportedProgram, options: ExecutorchOptions) -> StageResult:
    """Output: the .pte bytes. StageError(lowering) when ExecuTorch refuses the program (or an op
    stays outside every partition with portable_fallback false), dynamic_shape for an unbounded
    dim, config for a training program, no partitioner without portable fallback, or no extra."""
    refuse_training(ep, "executorch")
    if not options.partitioners and not options.portable_fallback:
        raise StageError(
            ErrorClass.CONFIG,
            "executorch: portable_fallback false needs at least one partitioner (partitioners: [xnnpack])",
        )
    open_dims = unbounded_dims(ep)
    if open_dims:  # pt2flow's own check: ExecuTorch is not called (the record's details say so, for repro)
        raise StageError(
            ErrorClass.DYNAMIC_SHAPE,
            "refused by pt2flow's own check before ExecuTorch was called (ExecuTorch plans memory for the largest "
            "input, so pt2flow asks for a maximum on every dynamic dim); unbounded: "
            + ", ".join(open_dims)
            + ". Set the dim's max in the config (dims: {NAME: {min: 1, max: 64}})",
            details={"check": UNBOUNDED_DIMS_CHECK},
        )
    from executorch.exir import to_edge_transform_and_lower

    with quiet_torch() as sink:
        try:
            edge = to_edge_transform_and_lower(ep, partitioner=[PARTITIONERS[name]() for name in options.partitioners])
        except Exception as exc:
            raise lowering_error(exc, "ExecuTorch lowering") from exc
        split = delegation(edge.exported_program())
        if not options.portable_fallback and split.portable_ops:
            raise StageError(
                ErrorClass.LOWERING,
                not_delegated_message(split.portable_ops, options.partitioners),
                details={"ops": sorted(split.portable_ops), "portable_ops": split.portable_ops},
            )
        try:
            data = bytes(edge.to_executorch().buffer)
        except Exception as exc:
            raise lowering_error(exc, "ExecuTorch to_executorch") from exc
    metadata = {
        "size": len(data),
        "partitioners": list(options.partitioners),
        "backends": list(split.backends),
        "partitions": split.partitions,
        "delegated_nodes": split.delegated_nodes,
        "portable_nodes": split.portable_nodes,
        "delegated_ops": split.delegated_ops,
        "portable_ops": split.portable_ops,
    }
    return StageResult(output=data, metadata=metadata, warnings=sink.items)


def not_delegated_message(portable_ops: dict[str, int], partitioners: Sequence[str]) -> str:
    shown = ", ".join(f"{name} (x{count})" for name, count in sorted(portable_ops.items()))
    return f"ops no partitioner ({', '.join(partitioners)}) takes, and portable_fallback is false: {shown}"


def lowering_error(exc: BaseException, what: str) -> StageError:
    ops = ops_named_in(exc)
    named = f" at {', '.join(ops)}" if ops else ""
    reason, outer = innermost_reason(exc), short_message(exc, 500)
    said = (
        reason if reason.split(":", 1)[-1].strip() in outer else f"{reason} ({outer})"
    )  # the outer message only when it says more
    return StageError(classify_target_error(exc), f"{what} failed{named}: {said}", details={"ops": ops})


class PteRunner:
    """A .pte loaded by the ExecuTorch runtime's Python bindings (portable kernels and XNNPACK)."""

    def __init__(self, data: bytes, threads: int | None = None) -> None:
        from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

        self._data = data  # kept for as long as the module: the bindings may read the program from it
        self.module = _load_for_executorch_from_buffer(data)
        self._pool_before = _set_thread_pool(threads) if threads is not None else None

    def close(self) -> None:
        """The process's thread pool back to its size before this runner set it."""
        if self._pool_before is not None:
            _set_thread_pool(self._pool_before)
            self._pool_before = None

    @staticmethod
    def _flat(inputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        return tuple(t.detach().cpu().contiguous() if isinstance(t, torch.Tensor) else t for t in inputs)  # None stays

    def prepare(self, inputs: Sequence[torch.Tensor]) -> Callable[[], Any]:
        """The program's forward on these inputs, made contiguous once (what the benchmark times)."""
        flat = self._flat(inputs)
        return lambda: self.module.forward(flat)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = self._flat(inputs)
        try:
            outputs = self.module.forward(flat)
        except RuntimeError as exc:  # "error: 0x10": the reason is in the runtime's log, so call again to hear it
            with native_stderr() as lines:
                with contextlib.suppress(RuntimeError):
                    self.module.forward(flat)
            raise with_runtime_log(exc, lines, _runtime_says) from exc
        # the runtime's output tensors live in its planned memory, which the next call overwrites
        return [out.clone() if isinstance(out, torch.Tensor) else torch.tensor(out) for out in outputs]


def _runtime_says(line: str) -> bool:
    """A line of the runtime's log about the failed call, not its start-up chatter (cpuinfo)."""
    return not line.lstrip().startswith("[cpuinfo")


def _set_thread_pool(threads: int) -> int:
    """Size the ExecuTorch runtime's thread pool (XNNPACK's kernels run on it; one per process,
    sized to the cores at start): its size before. The bindings call this API experimental and
    unsafe while a method runs on another thread; pt2flow runs one method at a time per process."""
    from executorch.extension.pybindings import portable_lib

    before = int(portable_lib._threadpool_get_thread_count())
    if before != threads:
        portable_lib._unsafe_reset_threadpool(threads)
    return before


def load_pte(data: bytes, threads: int | None = None) -> FlatRunner:
    """A runner of lower_executorch's bytes; threads: the runtime's thread pool while it is
    loaded (until its `close`; None: the pool as it is)."""
    return PteRunner(data, threads)


REPRO_BODY = """{partitioner_imports}from executorch.exir import to_edge_transform_and_lower

edge = to_edge_transform_and_lower(program, partitioner=[{partitioners}])
{fallback_check}executorch_program = edge.to_executorch()
with open("model.pte", "wb") as f:
    f.write(executorch_program.buffer)
print("lowered model.pte: the failure did not reproduce with torch", torch.__version__)
"""

FALLBACK_CHECK = """# pt2flow's portable_fallback: false: every compute op must sit inside a delegated partition
def op_name(target):
    return str(target._op if type(target).__name__ == "EdgeOpOverload" else target)


left = sorted({{
    op_name(node.target)
    for node in edge.exported_program().graph.nodes
    if node.op == "call_function" and "executorch_call_delegate" not in str(node.target)
    and getattr(node.target, "__module__", "") not in ("_operator", "operator")
    and not op_name(node.target).startswith({bookkeeping!r})
}})
if left:
    raise RuntimeError("ops no partitioner ({names}) takes, and portable_fallback is false: " + ", ".join(left))
"""


def executorch_repro_body(options: ExecutorchOptions) -> str:
    """The script's lines after `program` is loaded: the lowering (and the fallback check) written out."""
    sources = [_PARTITIONER_SOURCE[name] for name in options.partitioners]
    fallback = (
        ""
        if options.portable_fallback
        else FALLBACK_CHECK.format(bookkeeping=program.ALWAYS_ALLOWED_PREFIXES, names=", ".join(options.partitioners))
    )
    return REPRO_BODY.format(
        partitioner_imports="".join(f"{imp}\n" for imp, _ in dict.fromkeys(sources)),
        partitioners=", ".join(call for _, call in sources),
        fallback_check=fallback,
    )
