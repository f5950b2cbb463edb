"""From a model's description to a live nn.Module and its inputs: factory import, weights, inputs.

Everything here is torch and the Python import system; where the bytes of a checkpoint come
from is the caller's business (flows read them through the store).
"""

from __future__ import annotations

import importlib
import inspect
import io
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from stages.errors import StageError
from stages.importing import search_path_first

# dotted module path, a colon, dotted attribute path: nothing else (no calls, no '..', no slashes)
_FACTORY_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

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

    inputs: forward() argument name -> spec, in config order.
    dynamic: argument -> {dim index: dim name}.
    dims: dim name -> (min, max).
    """

    inputs: Mapping[str, InputSpec]
    dynamic: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    dims: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class BoundInputs:
    """Concrete tensors bound to forward()'s signature, ready for export or a call."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    order: tuple[str, ...]  # argument names in the order torch sees them (args, then kwargs)

    def call(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)


def import_factory(path: str, search_path: str | None = None) -> Callable[..., Any]:
    """Import `module:callable`, with `search_path` (the config's folder) first on sys.path."""
    if not isinstance(path, str) or not _FACTORY_PATH.fullmatch(path):  # checked before anything is imported
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
    """Input shapes with dynamic dims set to `dim_sizes` (example shape otherwise)."""
    shapes = {}
    for name, spec in model_inputs.inputs.items():
        shape = list(spec.shape)
        for index, dim in model_inputs.dynamic.get(name, {}).items():
            if dim_sizes and dim in dim_sizes:
                shape[int(index)] = int(dim_sizes[dim])
        shapes[name] = tuple(shape)
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


def forward_signature(model: torch.nn.Module) -> inspect.Signature:
    return inspect.signature(model.forward)


def bind_inputs(
    model: torch.nn.Module,
    model_inputs: ModelInputs,
    *,
    seed: int = 0,
    dim_sizes: Mapping[str, int] | None = None,
) -> BoundInputs:
    """Make the tensors and bind them to forward()'s parameters by name."""
    generator = torch.Generator().manual_seed(seed)
    shapes = sizes_for(model_inputs, dim_sizes)
    values = {name: make_tensor(spec, shapes[name], generator) for name, spec in model_inputs.inputs.items()}
    try:
        bound = forward_signature(model).bind(**values)
    except TypeError as exc:
        params = list(forward_signature(model).parameters)
        raise StageError(
            "config",
            f"inputs {sorted(values)} do not match forward{tuple(params)}: {exc}",
        ) from exc
    args = tuple(bound.args)
    kwargs = dict(bound.kwargs)
    positional = [name for name in forward_signature(model).parameters if name in values][: len(args)]
    return BoundInputs(args=args, kwargs=kwargs, order=tuple(positional) + tuple(kwargs))


def export_dynamic_shapes(model_inputs: ModelInputs, bound: BoundInputs) -> tuple[Any, ...] | None:
    """dynamic_shapes for torch.export, as a tuple aligned with (args..., kwargs...).

    One torch.export.Dim per dim name, shared by every input that names it.
    """
    if not model_inputs.dynamic:
        return None
    dims = {
        name: torch.export.Dim(_dim_identifier(name), min=lo, max=hi) for name, (lo, hi) in model_inputs.dims.items()
    }
    specs = []
    for arg in bound.order:
        per_arg = model_inputs.dynamic.get(arg)
        specs.append({int(i): dims[d] for i, d in per_arg.items()} if per_arg else None)
    return tuple(specs)


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
