"""Example inputs: how a model's are described and how concrete ones are made.

InputSpec describes a tensor pt2flow makes (shape, dtype, value range); ModelInputs holds a
model's input trees, which dims vary and their ranges; BoundInputs is the result of binding
them to forward() (stages.binding). `materialize` makes concrete values for a tree at given dim
sizes; `check_inputs_call` checks what an inputs factory or an inputs file gives. Torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import DTYPE_NAMES
from pt2flow.stages.vocabulary import ErrorClass

# the config's dtype names (stages.vocabulary), as torch dtypes
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class InputSpec:
    """How to make one forward() argument (docs/architecture.md §3, `inputs`)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    low: float | None = None
    high: float | None = None
    value: float | None = None


@dataclass(frozen=True)
class ModelInputs:
    """The example inputs of a model and how their dims may vary.

    inputs: forward() argument name -> input tree, in config order. A tree is an InputSpec (a
      tensor pt2flow makes), a torch.Tensor (given: read from a file or made by an inputs
      factory), a Python scalar (int, float, bool, str), None, or a list, tuple or dict of trees.
      The name of a `*args` parameter takes a list (the extra positional arguments); names that
      forward() does not declare go to its `**kwargs`.
    dynamic: argument -> dims tree mirroring its input: {dim index: dim name} at a tensor, a list
      (for a list or tuple) or a dict (for a dict) of dims trees at a container, None where static.
    dims: dim name -> (min, max).
    positional: leading positional arguments without names (an inputs factory's args), bound
      before `inputs`.
    """

    inputs: Mapping[str, Any]
    dynamic: Mapping[str, Any] = field(default_factory=dict)
    dims: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    positional: tuple[Any, ...] = ()


@dataclass(frozen=True)
class BoundInputs:
    """Concrete inputs bound to forward()'s signature, ready for export or a call.

    order: the bound argument names in signature order (what torch.export's dynamic_shapes
    tuple aligns with); dynamic: the dims tree of each, in that order (a *args parameter's is a
    tuple, a **kwargs parameter's a dict). args_dynamic / kwargs_dynamic: the same dims trees
    aligned with `args` and `kwargs`.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    order: tuple[str, ...]
    dynamic: tuple[Any, ...] = ()
    args_dynamic: tuple[Any, ...] = ()
    kwargs_dynamic: Mapping[str, Any] = field(default_factory=dict)

    def call(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)

    def clone(self) -> BoundInputs:
        """The same inputs with every tensor copied: a call that mutates its inputs leaves these intact."""
        return replace(self, args=clone_tree(self.args), kwargs=clone_tree(self.kwargs))

    def tensor_leaves(self) -> list[tuple[str, torch.Tensor, Mapping[int, str] | None]]:
        """(path, tensor, {dim index: dim name} or None) for every tensor, in torch's flattening order."""
        leaves: list[tuple[str, torch.Tensor, Mapping[int, str] | None]] = []
        for i, value in enumerate(self.args):
            dyn = self.args_dynamic[i] if i < len(self.args_dynamic) else None
            _walk_tensors(value, dyn, f"args[{i}]", leaves)
        for key, value in self.kwargs.items():
            _walk_tensors(value, self.kwargs_dynamic.get(key), key, leaves)
        return leaves


def clone_tree(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _walk_tensors(value: Any, dyn: Any, path: str, out: list[Any]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((path, value, dict(dyn) if isinstance(dyn, Mapping) and dyn else None))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            sub = dyn[i] if isinstance(dyn, (list, tuple)) and i < len(dyn) else None
            _walk_tensors(item, sub, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for key, item in value.items():
            sub = dyn.get(key) if isinstance(dyn, Mapping) else None
            _walk_tensors(item, sub, f"{path}[{key!r}]", out)


def make_tensor(spec: InputSpec, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    if spec.value is not None:
        return torch.full(tuple(shape), spec.value, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    if dtype.is_floating_point:
        t = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
        if spec.low is not None or spec.high is not None:
            low = 0.0 if spec.low is None else float(spec.low)
            high = 1.0 if spec.high is None else float(spec.high)
            t = torch.rand(tuple(shape), generator=generator) * (high - low) + low
        return t.to(dtype)
    low = 0 if spec.low is None else int(spec.low)
    high = 10 if spec.high is None else int(spec.high)
    return torch.randint(low, high, tuple(shape), generator=generator, dtype=dtype)


def _random_like(example: torch.Tensor, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """A random tensor of `shape` resembling a given one (dtype, value range): a given input at
    another size, for the validation samples at each dynamic dim's min, max and random sizes."""
    if example.dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    if example.is_floating_point() or example.is_complex():
        return torch.randn(tuple(shape), generator=generator).to(example.dtype)
    low = int(example.min()) if example.numel() else 0
    high = int(example.max()) + 1 if example.numel() else 10
    return torch.randint(low, max(high, low + 1), tuple(shape), generator=generator, dtype=example.dtype)


def _resized(shape: tuple[int, ...], dyn: Any, dim_sizes: Mapping[str, int] | None, path: str) -> tuple[int, ...]:
    out = list(shape)
    for index, dim in (dyn or {}).items():
        if not isinstance(index, int) or not 0 <= index < len(out):
            raise StageError(
                ErrorClass.CONFIG,
                f"dynamic_shapes.{path}: dim index {index!r} is out of range for a rank-{len(out)} input",
            )
        if dim_sizes and dim in dim_sizes:
            out[index] = int(dim_sizes[dim])
    return tuple(out)


def materialize(tree: Any, dyn: Any, generator: torch.Generator, dim_sizes: Mapping[str, int] | None, path: str) -> Any:
    """Concrete values for an input tree: tensors made (InputSpec) or copied (given), dynamic
    dims at `dim_sizes`; scalars, strings and None as they are."""
    if isinstance(tree, InputSpec):
        return make_tensor(tree, _resized(tree.shape, dyn, dim_sizes, path), generator)
    if isinstance(tree, torch.Tensor):
        shape = _resized(tuple(tree.shape), dyn, dim_sizes, path)
        return tree.clone() if shape == tuple(tree.shape) else _random_like(tree, shape, generator)
    if isinstance(tree, (list, tuple)):
        subs: Sequence[Any] = dyn if isinstance(dyn, (list, tuple)) else [None] * len(tree)
        return type(tree)(
            materialize(v, d, generator, dim_sizes, f"{path}[{i}]") for i, (v, d) in enumerate(zip(tree, subs))
        )
    if isinstance(tree, dict):
        named: Mapping[Any, Any] = dyn if isinstance(dyn, Mapping) else {}
        return {k: materialize(v, named.get(k), generator, dim_sizes, f"{path}.{k}") for k, v in tree.items()}
    return tree


def _check_input_leaves(tree: Any, path: str) -> None:
    if isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            _check_input_leaves(item, f"{path}[{i}]")
    elif isinstance(tree, dict):
        for key, item in tree.items():
            _check_input_leaves(item, f"{path}[{key!r}]")
    elif not (tree is None or isinstance(tree, (torch.Tensor, bool, int, float, str))):
        raise StageError(
            ErrorClass.CONFIG,
            f"{path}: {type(tree).__name__} is not a forward() input pt2flow can pass (tensors, scalars, str, None, containers of these)",
        )


def check_inputs_call(result: Any, what: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) from an inputs factory's return value or an inputs file, checked."""
    if isinstance(result, dict):
        args, kwargs = (), result
    elif (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], (tuple, list))
        and isinstance(result[1], dict)
    ):
        args, kwargs = tuple(result[0]), result[1]
    else:
        raise StageError(
            ErrorClass.CONFIG,
            f"{what} must give (args, kwargs) for forward(), or a dict of arguments by name; got {type(result).__name__}",
        )
    if not all(isinstance(k, str) for k in kwargs):
        raise StageError(ErrorClass.CONFIG, f"{what}: keyword argument names must be strings")
    _check_input_leaves((args, kwargs), what)
    return tuple(args), dict(kwargs)
