"""Binding example inputs to forward() (docs/architecture.md §3, `inputs`, `dynamic_shapes`).

Inputs are bound by name: named inputs go positionally while they can, a `*args` parameter's
list is spliced in, keyword-only and unknown names (for `**kwargs`) go by keyword. Each bound
argument gets a dims tree mirroring its structure, which `export_dynamic_shapes` turns into
torch.export's dynamic_shapes (one torch.export.Dim per dim name).
"""

from __future__ import annotations

import inspect
from typing import Any
from collections.abc import Mapping, Sequence

import torch

from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import BoundInputs, InputSpec, ModelInputs, materialize
from pt2flow.stages.vocabulary import ErrorClass


def forward_signature(model: torch.nn.Module) -> inspect.Signature:
    return inspect.signature(model.forward)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _arrange(
    signature: inspect.Signature, positional: Sequence[Any], values: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """(args, kwargs) for forward(): named inputs go positionally while they can, the *args
    parameter's list is spliced in, keyword-only and unknown names (for **kwargs) by keyword."""
    args, kwargs = list(positional), {}
    remaining = dict(values)
    skip = len(positional)  # parameters already filled by the unnamed positional arguments
    open_ = True  # no positional parameter skipped yet
    varkw = None
    for param in signature.parameters.values():
        if param.kind in _POSITIONAL:
            if skip:
                skip -= 1
            elif param.name in remaining:
                if open_:
                    args.append(remaining.pop(param.name))
                else:
                    kwargs[param.name] = remaining.pop(param.name)
            else:
                open_ = False
        elif param.kind == inspect.Parameter.VAR_POSITIONAL:
            skip = 0
            if param.name in remaining:
                extra = remaining.pop(param.name)
                if not isinstance(extra, (list, tuple)):
                    raise StageError(
                        ErrorClass.CONFIG,
                        f"input {param.name!r} is forward()'s *{param.name}: give it a list of the extra positional arguments",
                    )
                if not open_:
                    raise StageError(
                        ErrorClass.CONFIG, f"*{param.name} needs every positional parameter before it to be given"
                    )
                args.extend(extra)
        elif param.kind == inspect.Parameter.KEYWORD_ONLY:
            if param.name in remaining:
                kwargs[param.name] = remaining.pop(param.name)
        else:
            varkw = param.name
    if remaining and varkw is None:
        raise TypeError(f"forward() has no parameter named {', '.join(map(repr, remaining))}")
    kwargs.update(remaining)
    return args, kwargs


def bind_inputs(
    model: torch.nn.Module,
    model_inputs: ModelInputs,
    *,
    seed: int = 0,
    dim_sizes: Mapping[str, int] | None = None,
) -> BoundInputs:
    """Make the inputs and bind them to forward()'s parameters by name."""
    generator = torch.Generator().manual_seed(seed)
    dynamic = model_inputs.dynamic
    unknown = sorted(set(dynamic) - set(model_inputs.inputs))
    if unknown and not model_inputs.positional:
        raise StageError(
            ErrorClass.CONFIG,
            f"dynamic_shapes names {unknown}, which are not inputs (inputs: {sorted(model_inputs.inputs)})",
        )
    signature = forward_signature(model)
    try:
        positional = [
            materialize(v, None, generator, None, f"args[{i}]") for i, v in enumerate(model_inputs.positional)
        ]
        values = {
            name: materialize(spec, dynamic.get(name), generator, dim_sizes, str(name))
            for name, spec in model_inputs.inputs.items()
        }
        args, kwargs = _arrange(signature, positional, values)
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        params = list(signature.parameters)
        raise StageError(
            ErrorClass.CONFIG,
            f"inputs {sorted(map(str, model_inputs.inputs))} do not match forward{tuple(params)}: {exc}",
        ) from exc
    order, per_arg = [], []
    args_dynamic: list[Any] = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        dyn: Any
        if kind == inspect.Parameter.VAR_KEYWORD:
            dyn = {k: _aligned_dynamic(v, dynamic.get(k), str(k)) for k, v in value.items()}
        else:
            dyn = _aligned_dynamic(value, dynamic.get(name), name)
        if kind == inspect.Parameter.VAR_POSITIONAL:
            dyn = tuple(dyn) if dyn is not None else (None,) * len(value)
            args_dynamic.extend(dyn)
        elif name not in kwargs and kind != inspect.Parameter.VAR_KEYWORD:
            args_dynamic.append(dyn)
        order.append(name)
        per_arg.append(dyn)
    kwargs_dynamic = {k: _aligned_dynamic(v, dynamic.get(k), str(k)) for k, v in kwargs.items()}
    return BoundInputs(
        args=tuple(args),
        kwargs=dict(kwargs),
        order=tuple(order),
        dynamic=tuple(per_arg),
        args_dynamic=tuple(args_dynamic),
        kwargs_dynamic=kwargs_dynamic,
    )


def export_dynamic_shapes(model_inputs: ModelInputs, bound: BoundInputs) -> tuple[Any, ...] | None:
    """dynamic_shapes for torch.export: a tuple aligned with the bound arguments (signature
    order), each mirroring its argument's structure. One torch.export.Dim per dim name, shared
    by every tensor that names it."""
    if not any(per for _, _, per in bound.tensor_leaves()):
        return None
    dims = {
        name: torch.export.Dim(_dim_identifier(name), min=lo, max=hi) for name, (lo, hi) in model_inputs.dims.items()
    }
    missing = sorted({d for _, _, per in bound.tensor_leaves() for d in (per or {}).values()} - set(dims))
    if missing:
        raise StageError(
            ErrorClass.CONFIG, f"dims {missing} are used in dynamic_shapes but have no definition under dims"
        )

    def convert(dyn: Any) -> Any:
        if dyn is None:
            return None
        if isinstance(dyn, tuple):
            return tuple(convert(d) for d in dyn)
        if isinstance(dyn, list):
            return [convert(d) for d in dyn]
        if isinstance(dyn, Mapping) and all(isinstance(v, str) for v in dyn.values()):
            return {int(i): dims[d] for i, d in dyn.items()}
        return {k: convert(v) for k, v in dyn.items()}

    return tuple(convert(d) for d in bound.dynamic)


def _dim_identifier(name: str) -> str:
    """Dim names must be Python identifiers; config names may hold '-' or '.'."""
    ident = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return ident if ident and not ident[0].isdigit() else f"d_{ident}"


def _aligned_dynamic(value: Any, dyn: Any, path: str) -> Any:
    """The dims tree `dyn` checked against the input `value` and shaped like it (tuple for a
    tuple, list for a list, dict for a dict, {index: name} for a tensor, None elsewhere).
    torch.export wants a container's spec to mirror it even where nothing in it is dynamic."""
    if dyn is None:
        if isinstance(value, (list, tuple)):
            return type(value)(_aligned_dynamic(v, None, path) for v in value)
        if isinstance(value, dict):
            return {k: _aligned_dynamic(v, None, path) for k, v in value.items()}
        return None
    if isinstance(value, (InputSpec, torch.Tensor)):
        rank = len(value.shape)
        if not isinstance(dyn, Mapping) or not all(isinstance(k, int) and isinstance(v, str) for k, v in dyn.items()):
            raise StageError(
                ErrorClass.CONFIG, f"dynamic_shapes.{path}: a tensor input takes {{dim index: dim name}}, got {dyn!r}"
            )
        for index in dyn:
            if not 0 <= index < rank:
                raise StageError(
                    ErrorClass.CONFIG,
                    f"dynamic_shapes.{path}: dim index {index} is out of range for a rank-{rank} input",
                )
        return dict(dyn) or None
    if isinstance(value, (list, tuple)):
        if not isinstance(dyn, (list, tuple)) or len(dyn) != len(value):
            raise StageError(
                ErrorClass.CONFIG,
                f"dynamic_shapes.{path}: a {type(value).__name__} of {len(value)} takes a list of {len(value)} dims trees (null where static), got {dyn!r}",
            )
        return type(value)(_aligned_dynamic(v, d, f"{path}[{i}]") for i, (v, d) in enumerate(zip(value, dyn)))
    if isinstance(value, dict):
        if not isinstance(dyn, Mapping) or set(dyn) - set(value):
            raise StageError(
                ErrorClass.CONFIG,
                f"dynamic_shapes.{path}: a dict input takes a mapping of its keys {sorted(map(str, value))} to dims trees, got {dyn!r}",
            )
        return {k: _aligned_dynamic(v, dyn.get(k), f"{path}.{k}") for k, v in value.items()}
    raise StageError(
        ErrorClass.CONFIG, f"dynamic_shapes.{path}: a {type(value).__name__} input has no dims to make dynamic"
    )
