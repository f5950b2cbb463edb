"""Facts about an ExportedProgram: op histogram, signature, ranges, invariants and fingerprint."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from typing import Any
from collections.abc import Iterable, Iterator, Mapping, Sequence

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


def range_end(value: Any) -> int | None:
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
        out[str(symbol)] = [range_end(vr.lower), range_end(vr.upper)]
    return dict(sorted(out.items()))


def user_tensor_inputs(ep: ExportedProgram) -> list[torch.fx.Node | None]:
    """The placeholders of the program's user tensor inputs, in torch's flattening order (the
    order of BoundInputs.tensor_leaves)."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [
        placeholders.get(s.arg.name)
        for s in ep.graph_signature.input_specs
        if s.kind.name == "USER_INPUT" and type(s.arg).__name__ == "TensorArgument"
    ]


def user_outputs(ep: ExportedProgram) -> list[torch.fx.Node | None]:
    """The nodes of the program's user outputs, in order (None for a constant output)."""
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    values = {a.name: a for a in output_node.args[0] if isinstance(a, torch.fx.Node)}
    return [
        values.get(getattr(s.arg, "name", None))
        for s in ep.graph_signature.output_specs
        if s.kind.name == "USER_OUTPUT"
    ]


def effective_dims_of_leaves(
    ep: ExportedProgram, leaf_dims: Sequence[Mapping[int, str] | None]
) -> dict[str, dict[str, Any]]:
    """For each configured dim name, what the exported program really accepts.

    leaf_dims: for each tensor input in torch's flattening order (nested containers included),
    its {dim index: dim name}, or None. Returns {dim: {"min": int|None, "max": int|None,
    "static": bool, "value": int|None}}; None is an open end. A dim the exporter specialized
    (static fallback, a suggested fix) is reported static with its value.
    """
    tensor_inputs = user_tensor_inputs(ep)
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    result: dict[str, dict[str, Any]] = {}
    for position, per_dim in enumerate(leaf_dims):
        if not per_dim or position >= len(tensor_inputs):
            continue
        node = tensor_inputs[position]
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        for index, dim_name in per_dim.items():
            size = val.shape[int(index)]
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                vr = ranges.get(str(expr))
                if vr is not None:
                    entry: dict[str, Any] = {
                        "min": range_end(vr.lower),
                        "max": range_end(vr.upper),
                        "static": False,
                        "value": None,
                    }
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


# Node metadata that says where a node was written or which passes made it, not what it
# computes: left out of the fingerprint, so that the same model exported twice (another
# process, another checkout path, a parent program loaded from the store instead of kept in
# memory) has the same identity (docs/architecture.md §5, "Program fingerprint").
# stack_trace: file names and line numbers; from_node: pass provenance with graph ids (addresses).
VOLATILE_NODE_METADATA = frozenset({"stack_trace", "from_node"})
# What torch.export's serializer writes that is not the program: the torch build that wrote it
# (every derivation key covers the torch version already).
VOLATILE_PROGRAM_FIELDS = frozenset({"torch_version"})


def _hash_tensor(h: hashlib._Hash, name: str, value: Any) -> None:
    """A state-dict entry or constant: its name, its tensor metadata and its bytes."""
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach()
        meta = (
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            t.layout,
            t.device.type,
            value.requires_grad,
            type(value).__name__,
        )
        h.update(repr(meta).encode())
        if t.numel():
            t = t.contiguous().cpu()
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, torch.ScriptObject):  # a torchbind object: its state, not its address
        state = value.__getstate__() if hasattr(value, "__getstate__") else None
        h.update(f"{value._type().qualified_name()}:{state!r}".encode())
    else:
        h.update(f"{type(value).__module__}.{type(value).__qualname__}:{value!r}".encode())


def _strip_volatile(value: Any) -> Any:
    """The serialized program with VOLATILE_NODE_METADATA removed from every node's metadata,
    nested graphs (control flow, HOP subgraphs) included, and the stride of every size-1 dim of
    a tensor's metadata made 0."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "metadata" and isinstance(item, dict):
                item = {k: v for k, v in item.items() if k not in VOLATILE_NODE_METADATA}
            out[key] = _strip_volatile(item)
        sizes, strides = out.get("sizes"), out.get("strides")
        if isinstance(sizes, list) and isinstance(strides, list) and len(sizes) == len(strides):
            # a dim of size 1 is never stepped along: its stride says nothing, and fake tensors
            # give it whatever the process computed before (tiny T5's decode program differed
            # by one [1, 1, 32] stride, [32, 32, 1] or [32, 8, 1], with the export before it)
            out["strides"] = [
                {"as_int": 0} if size == {"as_int": 1} else stride for size, stride in zip(sizes, strides)
            ]
        return out
    if isinstance(value, list):
        return [_strip_volatile(item) for item in value]
    return value


@contextlib.contextmanager
def _without_canonical_form_check() -> Iterator[None]:
    """Within the block, torch's program serializer skips its self-check that the program's
    canonical form is well defined (`canonicalize` on a deep copy of what it serialized, the
    result thrown away): 3.2 of a tiny MLP's 5.9 ms fingerprint. The serialized form is the same
    with or without it, and every program fingerprinted here was saved by torch.export.save, which
    ran that check. Where this torch's serializer does not call it by that module-level name, the
    block changes nothing."""
    from torch._export.serde import serialize as serde

    real = getattr(serde, "canonicalize", None)
    if real is None or "canonicalize" not in serde.ExportedProgramSerializer.serialize.__code__.co_names:
        yield
        return
    serde.canonicalize = lambda ep, constants=None: ep
    try:
        yield
    finally:
        serde.canonicalize = real


def canonical_program(ep: ExportedProgram) -> bytes:
    """torch's own serialized form of the program (torch.export's JSON schema: graph, every
    node's tensor metadata with symbolic sizes, strides, dtype, device, layout and
    requires_grad, range constraints, graph signature with input/output kinds and targets,
    module call graph with pytree specs, opset and schema versions, verifiers), with node
    source locations removed, as canonical JSON. The weights and constants are not in it
    (fingerprint hashes them separately, without pickling)."""
    from torch._export.serde.serialize import serialize

    with _without_canonical_form_check():
        artifact = serialize(ep, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False)
    document = json.loads(artifact.exported_program)
    for name in VOLATILE_PROGRAM_FIELDS:
        document.pop(name, None)
    return json.dumps(_strip_volatile(document), sort_keys=True, separators=(",", ":")).encode()


def _fallback_form(ep: ExportedProgram) -> bytes:
    """For a program torch cannot serialize (it fails its stage with `serialization` and is never
    stored or used as a parent): the graph code and every node's tensor metadata."""
    parts = [ep.graph_module.code, str(ep.graph_signature), repr(range_constraints(ep)), str(ep.call_spec)]
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            parts.append(
                f"{node.name}:{val.dtype}:{tuple(val.shape)}:{val.stride()}:{val.device}:{val.requires_grad}:{val.layout}"
            )
        else:
            parts.append(f"{node.name}:{val!r}")
    return "\n".join(parts).encode()


def fingerprint(ep: ExportedProgram) -> str:
    """The program's identity: sha256 of its canonical serialized form (canonical_program),
    its state dict and its constants (name, tensor metadata, bytes).

    Everything that can change what the program computes or accepts is in it (an input's
    shape, dtype or dynamic range, a weight, a buffer, an op); what only says where the code
    was written is not, so the same model exported twice, in any process, gets the same one.
    """
    h = hashlib.sha256(b"pt2flow-program-fingerprint-v3\n")
    try:
        h.update(canonical_program(ep))
    except Exception:  # noqa: BLE001 - unserializable: the stage fails at its round trip anyway
        h.update(b"unserializable\n" + _fallback_form(ep))
    for name in sorted(ep.state_dict):
        _hash_tensor(h, f"state:{name}", ep.state_dict[name])
    for name in sorted(ep.constants):
        _hash_tensor(h, f"constant:{name}", ep.constants[name])
    return h.hexdigest()


def describe(ep: ExportedProgram, *, identity_of: ExportedProgram | None = None) -> dict[str, Any]:
    """The metadata every program-producing stage reports. A program's identity is the
    fingerprint of the program as it loads back from its bytes (stages.serialize.stored_program),
    which may differ from the in-memory one's: with `identity_of` (that loaded program) it is
    included here; without it, it is left to whoever stores the program (a program stage's
    record gets it when published), so that no stage fingerprints a program twice."""
    described = {
        "op_histogram": op_histogram(ep),
        "node_count": node_count(ep),
        "signature": signature_summary(ep),
        "range_constraints": range_constraints(ep),
    }
    if identity_of is not None:
        described["fingerprint"] = fingerprint(identity_of)
    return described
