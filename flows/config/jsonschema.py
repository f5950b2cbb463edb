"""The config's JSON Schema (schema version 1), for editors: `pt2flow schema` prints it and the
shipped configs point at the copy in docs/config.schema.json, so that a YAML editor validates and
completes them (docs/architecture.md §3).

It is composed from the same pydantic models that load_config validates with (each stage's
options, limits, dims, a tensor input), plus the shapes load_config checks by hand: input trees,
dims trees and the name and `module:callable` patterns. load_config stays the authority: it also
checks what no schema can (a factory that imports, a dim that is defined, names that are unique),
and reports every problem with its file and line.
"""

from __future__ import annotations

import functools
import json
from typing import Any
from collections.abc import Callable, Iterable, Sequence

from pydantic import BaseModel, TypeAdapter

from pt2flow.flows.config.inputs import DICT_KEY, TUPLE_KEY, InputConfig
from pt2flow.flows.config.limits import DaskConfig, LimitsConfig
from pt2flow.flows.config.models import NAME_PATTERN
from pt2flow.flows.config.models import DataConfig, DimConfig, GenerateConfig
from pt2flow.flows import pipeline
from pt2flow.stages.vocabulary import FACTORY_PATTERN
from pt2flow.flows.config.retention import RetentionConfig
from pt2flow.stages.options import AccuracyMetric, Bound

SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"
SHIPPED_PATH = "docs/config.schema.json"  # the copy the shipped configs reference


def _definition(model: type[BaseModel], defs: dict[str, Any], title: str) -> dict[str, Any]:
    """`model`'s schema registered under `title` in `defs` (its own $defs merged in); a $ref to it."""
    schema = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    defs.update(schema.pop("$defs", {}))
    schema["title"] = title
    defs[title] = schema
    return {"$ref": f"#/$defs/{title}"}


def _stage_options(defs: dict[str, Any]) -> dict[str, Any]:
    """A mapping from stage name to that stage's options."""
    properties = {stage.name: _definition(stage.options, defs, f"{stage.name}_options") for stage in pipeline.stages()}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _recursive(
    defs: dict[str, Any], name: str, description: str, alternatives: Callable[[dict[str, Any]], list[Any]]
) -> dict[str, Any]:
    """A self-referencing definition `name` (its alternatives get the $ref to it); the $ref."""
    ref = {"$ref": f"#/$defs/{name}"}
    defs[name] = {"title": name, "description": description, "anyOf": alternatives(ref)}
    return ref


def _input_tree(defs: dict[str, Any]) -> dict[str, Any]:
    """One forward() argument: a tensor spec, a container of input trees, or a plain value."""
    tensor = _definition(InputConfig, defs, "tensor_input")
    special = [{"required": ["shape"]}, {"required": [TUPLE_KEY]}, {"required": [DICT_KEY]}]
    return _recursive(
        defs,
        "input_tree",
        "a tensor ({shape: [...], dtype, low, high, value}), {tuple: [...]}, {dict: {...}}, a mapping or list of input trees, "
        "a number, a bool, a string or null",
        lambda tree: [
            tensor,
            {
                "type": "object",
                "properties": {TUPLE_KEY: {"type": "array", "items": tree}},
                "required": [TUPLE_KEY],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {DICT_KEY: {"type": "object", "additionalProperties": tree}},
                "required": [DICT_KEY],
                "additionalProperties": False,
            },
            {"type": "object", "not": {"anyOf": special}, "additionalProperties": tree},
            {"type": "array", "items": tree},
            {"type": ["number", "boolean", "string", "null"]},
        ],
    )


def _dims_tree(defs: dict[str, Any]) -> dict[str, Any]:
    """The dynamic_shapes of one argument: it mirrors the input tree; a tensor's is {axis: dim name}."""
    return _recursive(
        defs,
        "dims_tree",
        "for a tensor, {axis: dim name} (axes as integers; negative counts from the end); for a container, the same container "
        "of dims trees; null: static",
        lambda tree: [
            {"type": "object", "additionalProperties": {"anyOf": [tree, {"type": "string"}]}},
            {"type": "array", "items": tree},
            {"type": "null"},
        ],
    )


def _model(defs: dict[str, Any], stage_options: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    callable_ref = {"type": "string", "pattern": f"^{FACTORY_PATTERN.pattern}$", "description": "module:callable"}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "factory"],
        "properties": {
            "name": {"type": "string", "pattern": NAME_PATTERN.pattern, "description": "unique in the config"},
            "factory": {**callable_ref, "description": "module:callable that returns the torch.nn.Module"},
            "kwargs": {"type": "object", "description": "keyword arguments of the factory"},
            "weights": {"type": ["string", "null"], "description": "a .safetensors file (relative to the config)"},
            "checkpoint": {
                "type": ["string", "null"],
                "description": "a checkpoint folder (save_pretrained's), relative to the config: "
                "hashed as a tree into the key; the factory gets it (a class with from_pretrained: Class.from_pretrained(folder))",
            },
            "depends_on": {
                "type": "array",
                "items": {"type": "string"},
                "description": "files, folders or globs (relative to the config) the model's construction reads: part of the key",
            },
            "inputs": {
                "type": "object",
                "additionalProperties": _input_tree(defs),
                "description": "forward() argument -> example input",
            },
            "inputs_factory": {**callable_ref, "description": "module:callable returning (args, kwargs)"},
            "inputs_file": {"type": "string", "description": "a .safetensors, .pt or .pth file of example inputs"},
            "dynamic_shapes": {
                "type": "object",
                "additionalProperties": _dims_tree(defs),
                "description": "forward() argument -> dims tree",
            },
            "dims": {
                "type": "object",
                "additionalProperties": _definition(DimConfig, defs, "dim"),
                "description": "dim name -> {min, max}",
            },
            "stages": stage_options,
            "limits": limits,
            "require": _require(),
            "data": {
                "anyOf": [_definition(DataConfig, defs, "data"), {"type": "null"}],
                "description": "the model's own calibration data: a module:callable giving batches of forward() arguments",
            },
            "generate": {
                "anyOf": [_definition(GenerateConfig, defs, "generate"), {"type": "null"}],
                "description": "a generative model: exported as components (prefill, decode), validated by greedy generation",
            },
            "accuracy": _accuracy(defs),
        },
    }


def _accuracy(defs: dict[str, Any]) -> dict[str, Any]:
    """`accuracy:` (a model's, or every model's in defaults): the budgets of validate.accuracy."""
    schema = TypeAdapter(dict[AccuracyMetric, Bound] | None).json_schema(by_alias=True, ref_template="#/$defs/{model}")
    defs.update(schema.pop("$defs", {}))
    schema["description"] = (
        "accuracy budgets of the artifacts not meant to be exact (int8), per metric {min, max}: "
        "the same as stages.validate.accuracy, which it fills"
    )
    return schema


def _require() -> dict[str, Any]:
    kinds = list(pipeline.document_slots())
    return {
        "type": ["array", "null"],
        "items": {"enum": kinds},
        "uniqueItems": True,
        "description": "the artifacts that must validate for the model to be ok (default: every one built); "
        "another that fails makes the model `partial`",
    }


def _retention(defs: dict[str, Any]) -> dict[str, Any]:
    """The retention block; at least one of keep_runs and keep_days (RetentionConfig's validator)."""
    ref = _definition(RetentionConfig, defs, "retention")
    defs["retention"]["anyOf"] = [{"required": ["keep_runs"]}, {"required": ["keep_days"]}]
    return ref


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a version-1 config."""
    defs: dict[str, Any] = {}
    stage_options = _stage_options(defs)
    limits = _definition(LimitsConfig, defs, "limits")
    defaults = {
        "type": "object",
        "properties": {
            **stage_options["properties"],
            "limits": limits,
            "require": _require(),
            "data": {
                "anyOf": [_definition(DataConfig, defs, "data"), {"type": "null"}],
                "description": "every model's calibration data where it names none of its own",
            },
            "accuracy": _accuracy(defs),
        },
        "additionalProperties": False,
        "description": "options of every model, per stage; a model's `stages` overrides them",
    }
    return {
        "$schema": SCHEMA_URI,
        "title": "pt2flow config, schema version 1",
        "type": "object",
        "additionalProperties": False,
        "required": ["version", "models"],
        "properties": {
            "version": {"const": 1},
            "store": {
                "type": "string",
                "description": "store URL: a local path, file://, memory:// or s3://bucket/prefix",
            },
            "storage_options": {
                "type": "object",
                "description": "fsspec storage options (credentials belong in the environment)",
            },
            "stages": {
                "type": "array",
                "items": {"enum": list(pipeline.names())},
                "uniqueItems": True,
                "description": "the stages to run, in pipeline order",
            },
            "defaults": defaults,
            "models": {"type": "array", "minItems": 1, "items": _model(defs, stage_options, limits)},
            "retention": _retention(defs),
            "dask": _definition(DaskConfig, defs, "dask"),
            "python": {
                "type": ["string", "null"],
                "description": "the Python executable (or virtualenv folder) the workers run in, relative to the config's folder; `run --python` overrides it",
            },
        },
        "$defs": dict(sorted(defs.items())),
    }


def config_json_schema_text() -> str:
    """The schema as `pt2flow schema` prints it and docs/config.schema.json holds it."""
    return json.dumps(config_json_schema(), indent=2, sort_keys=False) + "\n"


def keys_at(path: Sequence[str | int]) -> tuple[str, ...]:
    """The keys the schema names for the mapping at `path` of a config (`("models", 0)`: a
    model's keys; `("models", 0, "stages", "trace")`: the trace options), sorted; () where the
    schema names none (a free mapping, or no such place). What an unknown key is compared with
    for a "did you mean" (flows/config/issues.py)."""
    schema = _schema_of(pipeline.names())
    defs = schema["$defs"]
    nodes = list(_alternatives([schema], defs))
    for part in path:
        found: list[dict[str, Any]] = []
        for node in nodes:
            if isinstance(part, int):
                items = node.get("items")
                found.extend([items] if isinstance(items, dict) else [])
            elif str(part) in node.get("properties", {}):
                found.append(node["properties"][str(part)])
            elif isinstance(node.get("additionalProperties"), dict):
                found.append(node["additionalProperties"])
        nodes = list(_alternatives(found, defs))
    return tuple(sorted({key for node in nodes for key in node.get("properties", {})}))


@functools.lru_cache(maxsize=4)
def _schema_of(stages: tuple[str, ...]) -> dict[str, Any]:
    """config_json_schema() for this set of registered stages, made once (read, never changed)."""
    return config_json_schema()


def _alternatives(nodes: Iterable[dict[str, Any]], defs: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """`nodes` with every $ref resolved and every anyOf/oneOf/allOf opened into its members."""
    pending, seen = list(nodes), set()
    while pending:
        node = pending.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if "$ref" in node:
            pending.append(defs[node["$ref"].rsplit("/", 1)[-1]])
        for combinator in ("anyOf", "oneOf", "allOf"):
            pending.extend(member for member in node.get(combinator, ()) if isinstance(member, dict))
        yield node
