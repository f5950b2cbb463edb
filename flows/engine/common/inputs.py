"""A model's example inputs, from its config to the stages: the input trees written in YAML,
an inputs factory (`module:callable` returning (args, kwargs)), or an inputs file; and what of
them the source key covers.
"""

from __future__ import annotations

import hashlib
import os
import importlib.util
from pathlib import Path
from typing import Any

from pt2flow.flows.engine.common import stores
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.config.inputs import DICT_KEY, TUPLE_KEY, InputConfig
from pt2flow.stages.vocabulary import ErrorClass


def to_stage_tree(tree: Any) -> Any:
    """A config input tree with InputConfig leaves as stages.example_inputs.InputSpec leaves."""
    from pt2flow.stages.example_inputs import InputSpec

    if isinstance(tree, InputConfig):
        return InputSpec(tuple(tree.shape), tree.dtype, tree.low, tree.high, tree.value)
    if isinstance(tree, tuple):
        return tuple(to_stage_tree(t) for t in tree)
    if isinstance(tree, list):
        return [to_stage_tree(t) for t in tree]
    if isinstance(tree, dict):
        return {k: to_stage_tree(v) for k, v in tree.items()}
    return tree


def model_inputs(model: ResolvedModel) -> Any:
    """stages.example_inputs.ModelInputs for `model`: from its YAML inputs, its inputs factory (imported
    and called here) or its inputs file (read here)."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.example_inputs import ModelInputs, check_inputs_call
    from pt2flow.stages.source import import_factory, load_example_inputs

    positional: tuple[Any, ...] = ()
    if model.inputs_factory:
        make = import_factory(model.inputs_factory, model.search_path)
        try:
            result = make()
        except Exception as exc:
            raise StageError(
                ErrorClass.RUNTIME, f"inputs_factory {model.inputs_factory} raised {type(exc).__name__}: {exc}"
            ) from exc
        positional, inputs = check_inputs_call(result, f"inputs_factory {model.inputs_factory}")
    elif model.inputs_file:
        data, url = read_inputs_file(model)
        positional, inputs = load_example_inputs(data, Path(url.split("?")[0]).name)
    else:
        inputs = {name: to_stage_tree(tree) for name, tree in model.inputs.items()}
    return ModelInputs(inputs=inputs, dynamic=dict(model.dynamic_shapes), dims=dict(model.dims), positional=positional)


def resolve_model_url(path: str, search_path: str) -> str:
    """A config's file reference (weights, inputs file): URLs and absolute paths as they are,
    relative paths from the config's folder."""
    url = str(path)
    if "://" in url or Path(url).is_absolute():
        return url
    return str(Path(search_path) / url)


def checkpoint_folder(model: ResolvedModel) -> str | None:
    """The model's checkpoint folder, resolved against its config's folder."""
    return os.path.abspath(resolve_model_url(model.checkpoint, model.search_path)) if model.checkpoint else None


def declared_paths(model: ResolvedModel) -> list[str]:
    """What the model declares it is made of beyond code and weights: its checkpoint folder and
    its `depends_on` files, folders and globs, resolved against its config's folder."""
    folder = checkpoint_folder(model)
    return ([folder] if folder else []) + [
        os.path.abspath(resolve_model_url(p, model.search_path)) for p in model.depends_on
    ]


def declared_problems(model: ResolvedModel) -> list[tuple[tuple[Any, ...], str]]:
    """A checkpoint that is not a folder, a depends_on entry that names no file."""
    from pt2flow.stages.datafiles import expand

    problems: list[tuple[tuple[Any, ...], str]] = []
    folder = checkpoint_folder(model)
    if folder is not None and not os.path.isdir(folder):
        problems.append((("checkpoint",), f"checkpoint folder not found: {folder}"))
    for j, pattern in enumerate(model.depends_on):
        if not expand(os.path.abspath(resolve_model_url(pattern, model.search_path))):
            problems.append((("depends_on", j), f"names no file: {pattern} (resolved against {model.search_path})"))
    return problems


def read_model_file(path: str, search_path: str, error_class: ErrorClass, what: str) -> tuple[bytes, str]:
    """(bytes, resolved URL) of a file a config names (weights, inputs file), with the store's
    storage options for a URL; a missing file is a StageError of `error_class`."""
    from pt2flow.stages.errors import StageError
    from pt2flow.storage.urls import read_url

    url = resolve_model_url(path, search_path)
    try:
        return read_url(url, stores.storage_options(url) if "://" in url else {}), url
    except FileNotFoundError as exc:
        raise StageError(error_class, f"{what} not found: {path}") from exc


def read_inputs_file(model: ResolvedModel) -> tuple[bytes, str]:
    return read_model_file(str(model.inputs_file), model.search_path, ErrorClass.CONFIG, "inputs_file")


def tree_json(tree: Any) -> Any:
    """An input tree as JSON for the source key: a tensor spec as before (schema v1 keys stay
    the same), a tuple as {tuple: [...]}, a dict as {dict: [[key, value], ...]} (keys keep
    their type), scalars, strings and null as they are."""
    if isinstance(tree, InputConfig):
        return tree.model_dump(mode="json")
    if isinstance(tree, tuple):
        return {TUPLE_KEY: [tree_json(t) for t in tree]}
    if isinstance(tree, list):
        return [tree_json(t) for t in tree]
    if isinstance(tree, dict):
        return {DICT_KEY: [[k, tree_json(v)] for k, v in tree.items()]}
    return tree


def dynamic_json(dyn: Any) -> Any:
    """A dims tree as JSON: {"0": name} at a tensor (as schema v1), lists and mappings around it."""
    if isinstance(dyn, (list, tuple)):
        return [dynamic_json(d) for d in dyn]
    if isinstance(dyn, dict):
        return {str(k): dynamic_json(v) for k, v in dyn.items()}
    return dyn


def module_source_hash(factory: str, search_path: str) -> tuple[str, str | None]:
    """(sha256 of the source of `module:callable`'s module, its file), found with the config's
    folder first on sys.path; the module name's hash for a module without a source file."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.importing import search_path_first

    module_name = factory.split(":", 1)[0]
    try:
        with search_path_first(search_path):
            spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise StageError(ErrorClass.IMPORT, f"module {module_name!r} cannot be found: {exc}") from exc
    if spec is None:
        raise StageError(ErrorClass.IMPORT, f"module {module_name!r} not found")
    origin = spec.origin if spec.origin and Path(spec.origin).is_file() else None
    return hashlib.sha256(Path(origin).read_bytes() if origin else module_name.encode()).hexdigest(), origin


def inputs_manifest(model: ResolvedModel) -> dict[str, Any]:
    """What the source key covers of a model's inputs: the input trees and dims trees (the same
    JSON as schema v1 for tensor-only inputs), and where set the inputs factory with its
    module's source hash, or the inputs file's sha256."""
    manifest: dict[str, Any] = {
        "inputs": {k: tree_json(v) for k, v in model.inputs.items()},
        "dynamic_shapes": {k: dynamic_json(v) for k, v in model.dynamic_shapes.items()},
    }
    if model.inputs_factory:
        manifest["inputs_factory"] = {
            "factory": model.inputs_factory,
            "code_hash": module_source_hash(model.inputs_factory, model.search_path)[0],
        }
    if model.inputs_file:
        data, _ = read_inputs_file(model)
        manifest["inputs_file"] = {"path": model.inputs_file, "sha256": hashlib.sha256(data).hexdigest()}
    if model.data is not None and model.data.factory is not None:  # the factory's code (the files it reads: the deps)
        manifest["data"] = {
            **model.data.model_dump(mode="json", exclude_none=True),
            "code_hash": module_source_hash(model.data.factory, model.search_path)[0],
        }
    elif model.data is not None:  # a file of batches: its bytes
        data, _ = read_data_file(model)
        manifest["data"] = {
            **model.data.model_dump(mode="json", exclude_none=True),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return manifest


def read_data_file(model: ResolvedModel) -> tuple[bytes, str]:
    assert model.data is not None and model.data.file is not None
    return read_model_file(model.data.file, model.search_path, ErrorClass.CONFIG, "data.file")


def data_source(model: ResolvedModel) -> str:
    """Where the model's data batches come from, as its messages name it."""
    assert model.data is not None
    return f"data.factory {model.data.factory}" if model.data.factory is not None else f"data.file {model.data.file}"


def data_batches(model: ResolvedModel, part: str = "calibration") -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The batches of the model's data (`data.factory` gives them, or `data.file` holds them) for
    `part`: the first `data.calibration` ("calibration"), or the `data.evaluation` after them
    ("evaluation"), each as (args, kwargs), checked as an inputs factory's result is. A factory is
    read as far as both parts go, whichever is asked for (so the files it reads for either are
    read, and recorded, the same way). StageError (runtime) when the factory raises, (config)
    when a batch is not forward()'s arguments, the file is unreadable, or there are fewer batches
    than both parts ask for."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.example_inputs import check_inputs_call
    from pt2flow.stages.source import import_factory, load_data_batches

    assert model.data is not None and part in ("calibration", "evaluation")
    calibration, evaluation = model.data.calibration, model.data.evaluation
    wanted = calibration + evaluation
    source = data_source(model)
    batches = []
    if model.data.file is not None:
        data, url = read_data_file(model)
        batches = load_data_batches(data, Path(url.split("?")[0]).name)[:wanted]
    else:
        make = import_factory(str(model.data.factory), model.search_path)
        try:
            for index, batch in enumerate(make()):
                if index == wanted:
                    break
                batches.append(check_inputs_call(batch, f"{source} batch {index}"))
        except StageError:
            raise
        except Exception as exc:
            raise StageError(ErrorClass.RUNTIME, f"{source} raised {type(exc).__name__}: {exc}") from exc
    if len(batches) < wanted:
        asked = f"data.calibration asks for {calibration}" + (
            f" and data.evaluation for {evaluation} more" if evaluation else ""
        )
        verb = "gave" if model.data.file is None else "holds"
        raise StageError(ErrorClass.CONFIG, f"{source} {verb} {len(batches)} batches and {asked}")
    return batches[:calibration] if part == "calibration" else batches[calibration:]
