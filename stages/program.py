"""Facts about an ExportedProgram: op histogram, signature, ranges, invariants and fingerprint."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.export import ExportedProgram

# Ops that stay in a core-ATen program by design: symbolic-shape queries and runtime asserts.
ALWAYS_ALLOWED_PREFIXES = ("aten.sym_", "aten._assert", "aten.sym_constrain_range")


def op_name(target: Any) -> str:
    """A stable, readable name for a call_function target (`aten.linear.default`, `operator.getitem`)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    if module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{name}" if module else name


def call_nodes(ep: ExportedProgram) -> Iterable[torch.fx.Node]:
    return (n for n in ep.graph.nodes if n.op == "call_function")


def op_histogram(ep: ExportedProgram) -> dict[str, int]:
    counts = Counter(op_name(n.target) for n in call_nodes(ep))
    return dict(sorted(counts.items()))


def node_count(ep: ExportedProgram) -> int:
    return len(ep.graph.nodes)


def _shape_of(node: torch.fx.Node) -> tuple[list[str], str] | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [str(d) for d in val.shape], str(val.dtype).replace("torch.", "")
    return None


def signature_summary(ep: ExportedProgram) -> dict[str, Any]:
    """Inputs and outputs by kind, with user input/output shapes (symbolic sizes as strings)."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    output_values = {getattr(a, "name", None): a for a in output_node.args[0] if isinstance(a, torch.fx.Node)}
    inputs, outputs = [], []
    kinds: Counter[str] = Counter()
    for spec in ep.graph_signature.input_specs:
        kinds[f"in.{spec.kind.name}"] += 1
        if spec.kind.name == "USER_INPUT":
            entry: dict[str, Any] = {"name": spec.arg.name}
            node = placeholders.get(spec.arg.name)
            shaped = _shape_of(node) if node is not None else None
            if shaped:
                entry["shape"], entry["dtype"] = shaped
            inputs.append(entry)
    for spec in ep.graph_signature.output_specs:
        kinds[f"out.{spec.kind.name}"] += 1
        name = getattr(spec.arg, "name", None)
        entry = {"kind": spec.kind.name, "target": spec.target}
        node = output_values.get(name)
        shaped = _shape_of(node) if node is not None else None
        if shaped:
            entry["shape"], entry["dtype"] = shaped
        outputs.append(entry)
    return {"inputs": inputs, "outputs": outputs, "counts": dict(sorted(kinds.items()))}


def _bound(value: Any) -> int | None:
    """An int range end, or None for an open end: sympy's (int_)oo, or anything not an integer."""
    if getattr(value, "is_finite", True) is False:
        return None
    try:
        as_int = int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
    return as_int if abs(as_int) < 2**62 else None


def range_constraints(ep: ExportedProgram) -> dict[str, list[int | None]]:
    """Symbol -> [lower, upper]; None stands for an unbounded end."""
    out = {}
    for symbol, vr in ep.range_constraints.items():
        out[str(symbol)] = [_bound(vr.lower), _bound(vr.upper)]
    return dict(sorted(out.items()))


def effective_dims(
    ep: ExportedProgram,
    arg_names: Sequence[str],
    dynamic: dict[str, dict[int, str]],
) -> dict[str, dict[str, Any]]:
    """effective_dims_of_leaves for flat inputs: one tensor per argument, in `arg_names` order."""
    return effective_dims_of_leaves(ep, [dynamic.get(arg) for arg in arg_names])


def effective_dims_of_leaves(ep: ExportedProgram, leaf_dims: Sequence[Mapping[int, str] | None]) -> dict[str, dict[str, Any]]:
    """For each configured dim name, what the exported program really accepts.

    leaf_dims: for each tensor input in torch's flattening order (nested containers included),
    its {dim index: dim name}, or None. Returns {dim: {"min": int|None, "max": int|None,
    "static": bool, "value": int|None}}; None is an open end. A dim the exporter specialized
    (static fallback, a suggested fix) is reported static with its value.
    """
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    tensor_inputs = [
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind.name == "USER_INPUT" and type(s.arg).__name__ == "TensorArgument"
    ]
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    result: dict[str, dict[str, Any]] = {}
    for position, per_dim in enumerate(leaf_dims):
        if not per_dim or position >= len(tensor_inputs):
            continue
        node = by_name.get(tensor_inputs[position])
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        for index, dim_name in per_dim.items():
            size = val.shape[int(index)]
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                vr = ranges.get(str(expr))
                if vr is not None:
                    entry = {"min": _bound(vr.lower), "max": _bound(vr.upper), "static": False, "value": None}
                else:  # a derived expression such as 2*s0: its range is implied by its root
                    entry = {"min": None, "max": None, "static": False, "value": None, "expr": str(expr)}
            else:
                entry = {"min": int(size), "max": int(size), "static": True, "value": int(size)}
            result.setdefault(dim_name, entry)
    return result


def mutating_ops(ep: ExportedProgram) -> list[str]:
    """Names of in-place / out= ops left in the graph (none may remain after functionalization)."""
    found = []
    for node in call_nodes(ep):
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            found.append(op_name(target))
    return sorted(set(found))


def mutated_inputs(ep: ExportedProgram) -> set[str]:
    """Placeholders written by an in-place op (training IR still has them as ops)."""
    written = set()
    for node in call_nodes(ep):
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        for arg_schema, arg in zip(target._schema.arguments, node.args):
            if arg_schema.alias_info is not None and arg_schema.alias_info.is_write:
                if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
                    written.add(arg.name)
    return written


def buffer_targets_of(ep: ExportedProgram, placeholder_names: set[str]) -> set[str]:
    return {
        s.target
        for s in ep.graph_signature.input_specs
        if s.arg.name in placeholder_names and s.kind.name == "BUFFER" and s.target
    }


def mutated_buffers_in_signature(ep: ExportedProgram) -> set[str]:
    return {s.target for s in ep.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION" and s.target}


def is_core_aten(name: str, target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        # getitem, symbolic-size arithmetic (operator.mul on SymInts, torch.sym_max...) and
        # higher-order control flow are structure, not tensor ops to decompose
        return (
            isinstance(target, torch._ops.HigherOrderOperator)
            or name.startswith(("operator.", "math.", "torch.sym_"))
            or getattr(target, "__name__", "").startswith("sym_")
        )
    if name.startswith(ALWAYS_ALLOWED_PREFIXES):
        return True
    return torch.Tag.core in target.tags


def non_core_ops(ep: ExportedProgram, preserve: Iterable[str] = ()) -> list[str]:
    keep = set(preserve)
    bad = set()
    for node in call_nodes(ep):
        name = op_name(node.target)
        if name in keep:
            continue
        if not is_core_aten(name, node.target):
            bad.add(name)
    return sorted(bad)


def _hash_tensor(h: "hashlib._Hash", name: str, value: Any) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            t = t.contiguous().cpu()
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())


def fingerprint(ep: ExportedProgram) -> str:
    """sha256 of the program's graph code, signature, ranges, call specs and weights.

    Identical when the same model is exported twice, unlike the bytes of torch.export.save.
    """
    h = hashlib.sha256()
    h.update(ep.graph_module.code.encode())
    h.update(str(ep.graph_signature).encode())
    h.update(repr(range_constraints(ep)).encode())
    for entry in ep.module_call_graph:
        sig = entry.signature
        h.update(entry.fqn.encode())
        if sig is not None:
            h.update(str(sig.in_spec).encode())
            h.update(str(sig.out_spec).encode())
    for name in sorted(ep.state_dict):
        _hash_tensor(h, name, ep.state_dict[name])
    for name in sorted(ep.constants):
        _hash_tensor(h, name, ep.constants[name])
    return h.hexdigest()


def describe(ep: ExportedProgram) -> dict[str, Any]:
    """The metadata every program-producing stage reports."""
    return {
        "op_histogram": op_histogram(ep),
        "node_count": node_count(ep),
        "signature": signature_summary(ep),
        "range_constraints": range_constraints(ep),
        "fingerprint": fingerprint(ep),
    }
