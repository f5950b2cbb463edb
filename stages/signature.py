"""Does an artifact take the inputs the model is configured with, and return what eager returns?

validate asks this before it compares any number (docs/architecture.md §6): a kernel that
happens to accept int32 ids where the program was exported for int64, or a program exported for
a batch of 2 served to a model configured for 3, must fail as a mismatch naming the input, never
pass on numbers that agree by accident.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from pt2flow.stages.example_inputs import BoundInputs
from pt2flow.stages.devices import OnDevice
from pt2flow.stages.program import range_end, user_outputs, user_tensor_inputs


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _range_of(ep: ExportedProgram, size: torch.SymInt) -> tuple[int | None, int | None] | None:
    vr = {str(k): v for k, v in ep.range_constraints.items()}.get(str(size.node.expr))
    return None if vr is None else (range_end(vr.lower), range_end(vr.upper))


def _dim_mismatch(
    ep: ExportedProgram,
    where: str,
    index: int,
    size: Any,
    configured: int,
    dim: str | None,
    dims: Mapping[str, Mapping[str, Any]],
) -> str | None:
    """One dim: dynamic where the config (as the trace settled it) has it dynamic, with the same
    range; static and of the configured size elsewhere."""
    effective = dims.get(dim, {}) if dim else {}
    dynamic_here = dim is not None and not effective.get("static", False)
    if not isinstance(size, torch.SymInt):
        if dynamic_here:
            return f"{where}: dim {index} ({dim}) is dynamic in the config but static ({int(size)}) in the artifact"
        if int(size) != configured:
            return f"{where}: dim {index} is {int(size)} in the artifact, {configured} in the config"
        return None
    if not dynamic_here:
        return f"{where}: dim {index} is dynamic ({size.node.expr}) in the artifact but static ({configured}) in the config"
    found = _range_of(ep, size)
    wanted = (effective.get("min"), effective.get("max"))
    if found is not None and wanted != (None, None) and "expr" not in effective and found != wanted:
        return f"{where}: dim {index} ({dim}) takes {list(found)} in the artifact, {list(wanted)} in the config"
    return None


def _named(path: str, bound: BoundInputs) -> str:
    """`args[0][1]` as the config names it (`x[1]`): positional arguments by their parameter name."""
    if path.startswith("args["):
        index, _, rest = path[len("args[") :].partition("]")
        if index.isdigit() and int(index) < len(bound.order):
            return bound.order[int(index)] + rest
    return path


def _leaf_mismatches(
    where: str, val: torch.Tensor, other: torch.Tensor, verb: str, theirs: str
) -> tuple[list[str], bool]:
    """dtype and rank of one artifact leaf against the configured or eager one: (problems,
    whether the ranks agree, so that the dims can be compared)."""
    problems = []
    if val.dtype != other.dtype:
        problems.append(f"{where}: the artifact {verb} {_dtype(val.dtype)}, {theirs} {_dtype(other.dtype)}")
    same_rank = val.dim() == other.dim()
    if not same_rank:
        problems.append(
            f"{where}: the artifact {verb} {val.dim()} dims {list(val.shape)}, {theirs} {list(other.shape)}"
        )
    return problems, same_rank


def input_mismatches(ep: ExportedProgram, bound: BoundInputs, dims: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The program's user tensor inputs against the configured example inputs (in torch's
    flattening order): count, dtype, rank, and each dim's dynamism, range or size."""
    takes = user_tensor_inputs(ep)
    leaves = bound.tensor_leaves()
    if len(takes) != len(leaves):
        return [f"the artifact takes {len(takes)} tensor inputs, the config gives {len(leaves)}"]
    problems: list[str] = []
    for node, (path, tensor, per_dim) in zip(takes, leaves):
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        where = f"input {_named(path, bound)}"
        found, same_rank = _leaf_mismatches(where, val, tensor, "takes", "the config gives")
        problems += found
        for index, size in enumerate(val.shape) if same_rank else ():
            problem = _dim_mismatch(ep, where, index, size, int(tensor.shape[index]), (per_dim or {}).get(index), dims)
            if problem:
                problems.append(problem)
    return problems


def output_mismatches(ep: ExportedProgram, eager_output: Any) -> list[str]:
    """The program's user outputs against eager's output leaves: count, dtype, rank, static sizes."""
    returns = user_outputs(ep)
    expected: Sequence[Any] = pytree.tree_leaves(eager_output)
    if len(returns) != len(expected):
        return [f"the artifact returns {len(returns)} outputs, eager returns {len(expected)}"]
    problems: list[str] = []
    for i, (node, leaf) in enumerate(zip(returns, expected)):
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor) or not isinstance(leaf, torch.Tensor):
            continue
        found, same_rank = _leaf_mismatches(f"output {i}", val, leaf, "returns", "eager returns")
        problems += found
        for index, size in enumerate(val.shape) if same_rank else ():
            if not isinstance(size, torch.SymInt) and int(size) != int(leaf.shape[index]):
                problems.append(
                    f"output {i}: dim {index} is {int(size)} in the artifact, {int(leaf.shape[index])} from eager"
                )
    return problems


def call_spec_mismatch(archived: ExportedProgram, package: Any) -> str | None:
    """The package's input and output pytree specs against the archive's (both come from the same
    decomposed program when the run built both)."""
    inner = package.fn if isinstance(package, OnDevice) else package  # a GPU package's wrapper
    loader = getattr(inner, "loader", None)
    if loader is None or not hasattr(loader, "get_call_spec"):
        return None
    in_spec, out_spec = loader.get_call_spec()
    ours = archived.call_spec
    if ours.in_spec is None or ours.out_spec is None:
        return None
    if (in_spec, out_spec) != (pytree.treespec_dumps(ours.in_spec), pytree.treespec_dumps(ours.out_spec)):
        return "the compiled package's input/output structure differs from the archive's"
    return None
