"""From a model's description to a live nn.Module: factory import, weights, the training wrapper,
and example inputs read from a file.

Everything here is torch and the Python import system; where the bytes of a checkpoint come
from is the caller's business (flows read them through the store). How example inputs are
described and made is in stages.example_inputs, how they are bound to forward() in
stages.binding.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import sys
from typing import Any
from collections.abc import Callable, Mapping

import torch
import torch.utils._pytree as pytree

from pt2flow.stages.classify import strip_ansi
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import check_inputs_call
from pt2flow.stages.importing import search_path_first
from pt2flow.stages.vocabulary import FACTORY_PATTERN
from pt2flow.stages.vocabulary import ErrorClass


IMPORT_SEED = 0  # torch's RNG seed when a factory's module is first imported (build_model's default too)


def import_factory(path: str, search_path: str | None = None) -> Callable[..., Any]:
    """Import `module:callable`, with `search_path` (the config's folder) first on sys.path."""
    if not isinstance(path, str) or not FACTORY_PATTERN.fullmatch(path):  # checked before anything is imported
        raise StageError(ErrorClass.CONFIG, f"factory {path!r} is not of the form 'module:callable'")
    module_name, _, attr = path.partition(":")
    if module_name not in sys.modules:
        # a module that builds its models when imported (torch's ExportDB examples do) draws on
        # torch's RNG then: seed it as build_model does, or the weights, and so every key and
        # artifact after them, would depend on what this process ran before
        torch.manual_seed(IMPORT_SEED)
    try:
        with search_path_first(search_path):
            module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError inside the module, a SyntaxError, anything it raises
        raise StageError(ErrorClass.IMPORT, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise StageError(ErrorClass.IMPORT, f"{module_name!r} has no attribute {attr!r}") from exc
    if not callable(target):
        raise StageError(ErrorClass.IMPORT, f"factory {path!r} is not callable")
    return target


def load_state_dict(data: bytes, filename: str) -> dict[str, torch.Tensor]:
    """Parse a checkpoint: safetensors, or a torch pickle loaded with weights_only=True.

    Arbitrary pickles can run code when loaded; weights_only refuses anything but tensors and
    plain containers, and the refusal is reported as a `weights` error.
    """
    lowered = filename.lower()
    if lowered.endswith(".safetensors"):
        return _read_safetensors(data, filename, ErrorClass.WEIGHTS)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StageError(
            ErrorClass.WEIGHTS,
            f"{filename}: refused to load (torch.load with weights_only=True): {_unpickling_reason(exc)}. "
            "Checkpoints must hold only tensors; save a state_dict or use .safetensors",
        ) from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise StageError(
            ErrorClass.WEIGHTS, f"{filename}: expected a state_dict of tensors, got {type(state).__name__}"
        )
    return state


def _read_safetensors(data: bytes, filename: str, error_class: ErrorClass) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file by name; StageError(error_class) when it is unreadable."""
    try:
        from safetensors.torch import load as load_safetensors

        return dict(load_safetensors(data))
    except Exception as exc:
        raise StageError(error_class, f"{filename}: not a readable safetensors file: {exc}") from exc


def _unpickling_reason(exc: Exception) -> str:
    """What a torch.load failure refused, without torch's boilerplate (which opens with advice to
    retry with weights_only=False: exactly what must not be done with an untrusted file)."""
    text = strip_ansi(str(exc))
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
    checkpoint: str | None = None,
) -> torch.nn.Module:
    """Call the factory (seeded, so random init is reproducible), load weights, set the mode.

    `checkpoint` (a folder): a class with `from_pretrained` (a transformers model class or
    AutoModel) is loaded with `Class.from_pretrained(folder, **kwargs)`; any other factory is
    called with the folder as its first argument."""
    torch.manual_seed(seed)
    try:
        if checkpoint is None:
            model = factory(**dict(kwargs))
        elif isinstance(factory, type) and callable(from_pretrained := getattr(factory, "from_pretrained", None)):
            model = from_pretrained(checkpoint, **dict(kwargs))
        else:
            model = factory(checkpoint, **dict(kwargs))
    except TypeError as exc:
        raise StageError(ErrorClass.CONFIG, f"factory call failed: {exc}") from exc
    except Exception as exc:
        raise StageError(ErrorClass.RUNTIME, f"factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise StageError(ErrorClass.CONFIG, f"factory returned {type(model).__name__}, expected a torch.nn.Module")
    if state_dict is not None:
        try:
            result = model.load_state_dict(dict(state_dict), strict=True)
        except RuntimeError as exc:
            raise StageError(ErrorClass.WEIGHTS, f"state_dict does not match the model: {str(exc)[:1000]}") from exc
        del result
    model.train(training)
    return model


def eager_digest(model: torch.nn.Module) -> str:
    """sha256 of a built eager model: its module tree (names, classes, training flags) and every
    parameter and buffer (name, dtype, shape, bytes). The backstop for what no file tracker sees
    (a factory reading an environment variable, a subprocess, the network): a rebuild that gives
    another digest is another model (docs/architecture.md §5)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        kind = type(module)
        digest.update(f"m {name} {kind.__module__}.{kind.__qualname__} {module.training}\n".encode())
    tensors = [("p", n, t) for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [("b", n, t) for n, t in model.named_buffers(remove_duplicate=False)]
    for kind_tag, name, tensor in tensors:
        digest.update(f"{kind_tag} {name} {tensor.dtype} {tuple(tensor.shape)} {tensor.requires_grad}\n".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    data = tensor.detach()
    if data.device.type == "meta":
        return b"meta"
    try:
        flat = data.cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    except (RuntimeError, TypeError):  # a quantized or sparse tensor: its values as text
        return repr(data.cpu().tolist()).encode()


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

    def forward(self: TrainingStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        return TrainingStep.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(type(model).forward)  # type: ignore[attr-defined]
    step_cls = type("TrainingStep", (TrainingStep,), {"forward": forward})
    step = step_cls(model, loss_output)
    step.train(model.training)
    return step


def load_example_inputs(data: bytes, filename: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs from a file: safetensors (tensors by forward() argument name), or a
    torch.save file read with torch.load(weights_only=True) holding (args, kwargs) or a dict of
    arguments by name (containers, scalars and strings allowed; never arbitrary objects)."""
    if filename.lower().endswith(".safetensors"):
        return (), _read_safetensors(data, filename, ErrorClass.CONFIG)
    return check_inputs_call(_load_plain(data, filename, "example inputs"), filename)


def _load_plain(data: bytes, filename: str, what: str) -> Any:
    """A torch.save file of tensors, containers, scalars and strings (torch.load with
    weights_only=True: never arbitrary objects); StageError (config) naming the file otherwise."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StageError(
            ErrorClass.CONFIG,
            f"{filename}: refused to load {what} (torch.load with weights_only=True): {_unpickling_reason(exc)}",
        ) from exc


def load_data_batches(data: bytes, filename: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """A model's data batches from a file (`data.file`), each as (args, kwargs) for forward():
    - `.npz` (numpy.savez, read without pickles) or `.safetensors`: arrays by forward() argument
      name, each with the batch index as its leading axis (batch i is {name: array[i]}), every
      array as many batches long;
    - `.pt`/`.pth` (torch.save, read with torch.load(weights_only=True)): a list of batches, each a
      dict of arguments by name or (args, kwargs), or a dict of stacked tensors as above.
    StageError (config) naming the file when it is unreadable or not batches."""
    lower = filename.lower()
    stacked: Any
    if lower.endswith(".npz"):
        import numpy

        try:
            with numpy.load(io.BytesIO(data), allow_pickle=False) as arrays:
                stacked = {name: torch.from_numpy(arrays[name].copy()) for name in arrays.files}
        except Exception as exc:
            raise StageError(ErrorClass.CONFIG, f"{filename}: not a readable .npz file: {exc}") from exc
    elif lower.endswith(".safetensors"):
        stacked = _read_safetensors(data, filename, ErrorClass.CONFIG)
    else:
        stacked = _load_plain(data, filename, "data batches")
        if isinstance(stacked, (list, tuple)):
            return [check_inputs_call(batch, f"{filename} batch {i}") for i, batch in enumerate(stacked)]
    if not isinstance(stacked, dict) or not stacked:
        raise StageError(
            ErrorClass.CONFIG,
            f"{filename} must hold a list of batches or arrays by forward() argument name (batch index first); "
            f"got {type(stacked).__name__ if stacked else 'nothing'}",
        )
    lengths = {}
    for name, value in stacked.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise StageError(
                ErrorClass.CONFIG, f"{filename}: {name!r} must be an array whose leading axis is the batch index"
            )
        lengths[name] = value.shape[0]
    if len(set(lengths.values())) != 1:
        raise StageError(
            ErrorClass.CONFIG,
            f"{filename}: every array must hold as many batches (its leading axis); got "
            + ", ".join(f"{name} {n}" for name, n in lengths.items()),
        )
    count = next(iter(lengths.values()))
    return [
        check_inputs_call({name: value[i].clone() for name, value in stacked.items()}, f"{filename} batch {i}")
        for i in range(count)
    ]
