"""From a model's description to a live nn.Module and its inputs: factory import, weights, inputs.

Everything here is torch and the Python import system; where the bytes of a checkpoint come
from is the caller's business (flows read them through the store).
"""

from __future__ import annotations

import importlib
import inspect
import io
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from pt2flow.stages.errors import StageError
from pt2flow.stages.importing import search_path_first
from pt2flow.stages.vocabulary import FACTORY_PATTERN


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


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

    def clone(self) -> "BoundInputs":
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


def import_factory(path: str, search_path: str | None = None) -> Callable[..., Any]:
    """Import `module:callable`, with `search_path` (the config's folder) first on sys.path."""
    if not isinstance(path, str) or not FACTORY_PATTERN.fullmatch(path):  # checked before anything is imported
        raise StageError("config", f"factory {path!r} is not of the form 'module:callable'")
    module_name, _, attr = path.partition(":")
    try:
        with search_path_first(search_path):
            module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError inside the module, a SyntaxError, anything it raises
        raise StageError("import", f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise StageError("import", f"{module_name!r} has no attribute {attr!r}") from exc
    if not callable(target):
        raise StageError("import", f"factory {path!r} is not callable")
    return target


def load_state_dict(data: bytes, filename: str) -> dict[str, torch.Tensor]:
    """Parse a checkpoint: safetensors, or a torch pickle loaded with weights_only=True.

    Arbitrary pickles can run code when loaded; weights_only refuses anything but tensors and
    plain containers, and the refusal is reported as a `weights` error.
    """
    lowered = filename.lower()
    if lowered.endswith(".safetensors"):
        try:
            from safetensors.torch import load as load_safetensors

            return dict(load_safetensors(data))
        except Exception as exc:
            raise StageError("weights", f"{filename}: not a readable safetensors file: {exc}") from exc
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StageError(
            "weights",
            f"{filename}: refused to load (torch.load with weights_only=True): {_unpickling_reason(exc)}. "
            "Checkpoints must hold only tensors; save a state_dict or use .safetensors",
        ) from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise StageError("weights", f"{filename}: expected a state_dict of tensors, got {type(state).__name__}")
    return state


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _unpickling_reason(exc: Exception) -> str:
    """What a torch.load failure refused, without torch's boilerplate (which opens with advice to
    retry with weights_only=False: exactly what must not be done with an untrusted file)."""
    text = _ANSI.sub("", str(exc))
    text = text.split("WeightsUnpickler error:", 1)[-1]
    boilerplate = ("Weights only load failed", "(1)", "(2)", "Check the documentation", "Please file an issue")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(boilerplate):
            return f"{type(exc).__name__}: {line.split(' Please use ', 1)[0][:300].rstrip('. ')}"
    return type(exc).__name__


def build_model(
    factory: Callable[..., Any],
    kwargs: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor] | None = None,
    *,
    training: bool = False,
    seed: int = 0,
) -> torch.nn.Module:
    """Call the factory (seeded, so random init is reproducible), load weights, set the mode."""
    torch.manual_seed(seed)
    try:
        model = factory(**dict(kwargs))
    except TypeError as exc:
        raise StageError("config", f"factory call failed: {exc}") from exc
    except Exception as exc:
        raise StageError("runtime", f"factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise StageError("config", f"factory returned {type(model).__name__}, expected a torch.nn.Module")
    if state_dict is not None:
        try:
            result = model.load_state_dict(dict(state_dict), strict=True)
        except RuntimeError as exc:
            raise StageError("weights", f"state_dict does not match the model: {str(exc)[:1000]}") from exc
        del result
    model.train(training)
    return model


def sizes_for(model_inputs: ModelInputs, dim_sizes: Mapping[str, int] | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of the top-level tensor inputs with dynamic dims set to `dim_sizes` (example shape otherwise)."""
    shapes = {}
    for name, spec in model_inputs.inputs.items():
        if isinstance(spec, (InputSpec, torch.Tensor)):
            shapes[name] = _resized(tuple(spec.shape), model_inputs.dynamic.get(name), dim_sizes, name)
    return shapes


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


def _like(example: torch.Tensor, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
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
            raise StageError("config", f"dynamic_shapes.{path}: dim index {index!r} is out of range for a rank-{len(out)} input")
        if dim_sizes and dim in dim_sizes:
            out[index] = int(dim_sizes[dim])
    return tuple(out)


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
            raise StageError("config", f"dynamic_shapes.{path}: a tensor input takes {{dim index: dim name}}, got {dyn!r}")
        for index in dyn:
            if not 0 <= index < rank:
                raise StageError("config", f"dynamic_shapes.{path}: dim index {index} is out of range for a rank-{rank} input")
        return dict(dyn) or None
    if isinstance(value, (list, tuple)):
        if not isinstance(dyn, (list, tuple)) or len(dyn) != len(value):
            raise StageError("config", f"dynamic_shapes.{path}: a {type(value).__name__} of {len(value)} takes a list of {len(value)} dims trees (null where static), got {dyn!r}")
        return type(value)(_aligned_dynamic(v, d, f"{path}[{i}]") for i, (v, d) in enumerate(zip(value, dyn)))
    if isinstance(value, dict):
        if not isinstance(dyn, Mapping) or set(dyn) - set(value):
            raise StageError("config", f"dynamic_shapes.{path}: a dict input takes a mapping of its keys {sorted(map(str, value))} to dims trees, got {dyn!r}")
        return {k: _aligned_dynamic(v, dyn.get(k), f"{path}.{k}") for k, v in value.items()}
    raise StageError("config", f"dynamic_shapes.{path}: a {type(value).__name__} input has no dims to make dynamic")


def _materialize(tree: Any, dyn: Any, generator: torch.Generator, dim_sizes: Mapping[str, int] | None, path: str) -> Any:
    """Concrete values for an input tree: tensors made (InputSpec) or copied (given), dynamic
    dims at `dim_sizes`; scalars, strings and None as they are."""
    if isinstance(tree, InputSpec):
        return make_tensor(tree, _resized(tree.shape, dyn, dim_sizes, path), generator)
    if isinstance(tree, torch.Tensor):
        shape = _resized(tuple(tree.shape), dyn, dim_sizes, path)
        return tree.clone() if shape == tuple(tree.shape) else _like(tree, shape, generator)
    if isinstance(tree, (list, tuple)):
        subs = dyn if isinstance(dyn, (list, tuple)) else [None] * len(tree)
        return type(tree)(_materialize(v, d, generator, dim_sizes, f"{path}[{i}]") for i, (v, d) in enumerate(zip(tree, subs)))
    if isinstance(tree, dict):
        subs = dyn if isinstance(dyn, Mapping) else {}
        return {k: _materialize(v, subs.get(k), generator, dim_sizes, f"{path}.{k}") for k, v in tree.items()}
    return tree


def forward_signature(model: torch.nn.Module) -> inspect.Signature:
    return inspect.signature(model.forward)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _arrange(signature: inspect.Signature, positional: Sequence[Any], values: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
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
                    raise StageError("config", f"input {param.name!r} is forward()'s *{param.name}: give it a list of the extra positional arguments")
                if not open_:
                    raise StageError("config", f"*{param.name} needs every positional parameter before it to be given")
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
        raise StageError("config", f"dynamic_shapes names {unknown}, which are not inputs (inputs: {sorted(model_inputs.inputs)})")
    signature = forward_signature(model)
    try:
        positional = [_materialize(v, None, generator, None, f"args[{i}]") for i, v in enumerate(model_inputs.positional)]
        values = {name: _materialize(spec, dynamic.get(name), generator, dim_sizes, str(name)) for name, spec in model_inputs.inputs.items()}
        args, kwargs = _arrange(signature, positional, values)
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        params = list(signature.parameters)
        raise StageError(
            "config",
            f"inputs {sorted(map(str, model_inputs.inputs))} do not match forward{tuple(params)}: {exc}",
        ) from exc
    order, per_arg = [], []
    args_dynamic: list[Any] = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
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
        raise StageError("config", f"dims {missing} are used in dynamic_shapes but have no definition under dims")

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


class TrainingStep(torch.nn.Module):
    """Wraps a model so that forward() returns one scalar loss (what a joint export needs).

    loss_output: index of the output leaf that already is the loss; None means pt2flow's
    reduction, the sum over floating output leaves of mean(leaf**2).
    """

    def __init__(self, model: torch.nn.Module, loss_output: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_output = loss_output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model(*args, **kwargs)
        leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        if self.loss_output is not None:
            return leaves[self.loss_output]
        floats = [leaf for leaf in leaves if leaf.is_floating_point()]
        loss = floats[0].float().pow(2).mean()
        for leaf in floats[1:]:
            loss = loss + leaf.float().pow(2).mean()
        return loss


def training_step(model: torch.nn.Module, loss_output: int | None = None) -> TrainingStep:
    """A TrainingStep whose forward() carries the wrapped model's signature (for export's arg names)."""
    step_cls = type("TrainingStep", (TrainingStep,), {})

    def forward(self: TrainingStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        return TrainingStep.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(type(model).forward)  # type: ignore[attr-defined]
    step_cls.forward = forward  # type: ignore[method-assign]
    step = step_cls(model, loss_output)
    step.train(model.training)
    return step


def _check_input_leaves(tree: Any, path: str) -> None:
    if isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            _check_input_leaves(item, f"{path}[{i}]")
    elif isinstance(tree, dict):
        for key, item in tree.items():
            _check_input_leaves(item, f"{path}[{key!r}]")
    elif not (tree is None or isinstance(tree, (torch.Tensor, bool, int, float, str))):
        raise StageError("config", f"{path}: {type(tree).__name__} is not a forward() input pt2flow can pass (tensors, scalars, str, None, containers of these)")


def check_inputs_call(result: Any, what: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) from an inputs factory's return value or an inputs file, checked."""
    if isinstance(result, dict):
        args, kwargs = (), result
    elif isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], (tuple, list)) and isinstance(result[1], dict):
        args, kwargs = tuple(result[0]), result[1]
    else:
        raise StageError("config", f"{what} must give (args, kwargs) for forward(), or a dict of arguments by name; got {type(result).__name__}")
    if not all(isinstance(k, str) for k in kwargs):
        raise StageError("config", f"{what}: keyword argument names must be strings")
    _check_input_leaves((args, kwargs), what)
    return tuple(args), dict(kwargs)


def load_example_inputs(data: bytes, filename: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs from a file: safetensors (tensors by forward() argument name), or a
    torch.save file read with torch.load(weights_only=True) holding (args, kwargs) or a dict of
    arguments by name (containers, scalars and strings allowed; never arbitrary objects)."""
    if filename.lower().endswith(".safetensors"):
        try:
            from safetensors.torch import load as load_safetensors

            return (), dict(load_safetensors(data))
        except Exception as exc:
            raise StageError("config", f"{filename}: not a readable safetensors file: {exc}") from exc
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StageError("config", f"{filename}: refused to load example inputs (torch.load with weights_only=True): {_unpickling_reason(exc)}") from exc
    return check_inputs_call(loaded, filename)
