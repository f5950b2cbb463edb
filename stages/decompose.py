"""decompose: lower a functional program to core ATen (torch.export.default_decompositions)."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping


import torch
from torch.export import ExportedProgram

from pt2flow.stages import program
from pt2flow.stages.classify import short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import DecomposeOptions
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.vocabulary import ErrorClass


def resolve_op(name: str) -> torch._ops.OpOverload:
    """`aten.linear.default` -> torch.ops.aten.linear.default."""
    parts = name.split(".")
    if len(parts) != 3:
        raise StageError(ErrorClass.CONFIG, f"decompose.preserve: {name!r} is not of the form namespace.op.overload")
    namespace, op, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError) as exc:
        raise StageError(ErrorClass.CONFIG, f"decompose.preserve: no operator {name!r}") from exc


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):  # type: ignore[no-untyped-def]
    """aten.empty_permuted (left in backward graphs, not core ATen) as aten.empty + aten.permute."""
    physical = [size[i] for i in physical_layout]
    inverse = [list(physical_layout).index(i) for i in range(len(size))]
    return torch.empty(physical, dtype=dtype, layout=layout, device=device, pin_memory=bool(pin_memory)).permute(
        inverse
    )


def _like(factory):  # type: ignore[no-untyped-def]
    """aten.rand_like / randn_like (not core ATen) as aten.rand / randn (core) on the input's shape."""

    def decomposition(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):  # type: ignore[no-untyped-def]
        return factory(self.shape, dtype=dtype or self.dtype, device=device or self.device)

    return decomposition


# Non-core ops that torch's default table leaves in some programs, with core ATen equivalents.
SUPPLEMENT = {
    torch.ops.aten.empty_permuted.default: _empty_permuted,
    torch.ops.aten.rand_like.default: _like(torch.rand),
    torch.ops.aten.randn_like.default: _like(torch.randn),
}


def decomposition_table(preserve: tuple[str, ...]) -> tuple[Any, list[str]]:
    """torch.export.default_decompositions() plus SUPPLEMENT, minus `preserve`; and warnings."""
    warnings: list[str] = []
    table = torch.export.default_decompositions()
    for op, fn in SUPPLEMENT.items():
        table[op] = fn
    for name in preserve:
        op = resolve_op(name)
        if op in table:
            table.pop(op)
        else:
            warnings.append(f"preserve: {name} is not decomposed by the core_aten table anyway")
    return table, warnings


# Rounds of looking up leftover ops in torch's full registry: a decomposition can itself produce
# another non-core op, which the next round looks up.
MAX_REGISTRY_ROUNDS = 4


def registry_decompositions(ep: ExportedProgram, stray: list[str], table: Mapping[Any, Any]) -> dict[Any, Any]:
    """Decompositions from torch's full registry (torch._decomp) for the non-core ops the
    default table left in `ep`: those torch knows how to lower, not yet in `table`."""
    from torch._decomp import decomposition_table as registry

    wanted = set(stray)
    found: dict[Any, Any] = {}
    for node in program.call_nodes(ep):
        target = node.target
        if program.op_name(target) in wanted and target not in table and target in registry:
            found[target] = registry[target]
    return found


def decompose(ep: ExportedProgram, options: DecomposeOptions) -> StageResult:
    """Output: the program after decomposition. Invariant: only core ATen ops remain (but `preserve`)."""
    if options.table == "none":
        return StageResult(output=ep, metadata={**program.describe(ep), "table": "none", "preserved": []})
    table, warnings = decomposition_table(options.preserve)
    registry_used: list[str] = []
    with quiet_torch() as sink:
        for _round in range(MAX_REGISTRY_ROUNDS + 1):
            try:
                out = ep.run_decompositions(table)
            except Exception as exc:
                raise StageError(ErrorClass.DECOMPOSITION, f"run_decompositions failed: {short_message(exc)}") from exc
            stray = program.non_core_ops(out, options.preserve)
            found = registry_decompositions(out, stray, table)
            if not found or _round == MAX_REGISTRY_ROUNDS:
                break
            table.update(found)
            registry_used.extend(program.op_name(op) for op in found)
    if stray:
        missing = [name for name in stray if name not in registry_used]
        raise StageError(
            ErrorClass.DECOMPOSITION,
            f"ops outside core ATen remain after decomposition, and torch has no decomposition for them: {', '.join(stray)} "
            "(list them in decompose.preserve to keep them deliberately)"
            + ("" if missing == stray else f"; torch's registry was tried for {', '.join(registry_used)}"),
        )
    if registry_used:
        warnings.append(
            f"decomposed with torch's full registry (torch._decomp), beyond the default table: {', '.join(sorted(set(registry_used)))}"
        )
    metadata = {**program.describe(out), "table": options.table, "preserved": sorted(options.preserve)}
    return StageResult(output=out, metadata=metadata, warnings=tuple(warnings) + sink.items)
