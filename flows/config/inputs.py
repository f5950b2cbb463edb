"""The `inputs` and `dynamic_shapes` of a model config (schema v1, extended compatibly): one input
tree per forward() argument, one dims tree mirroring it. Torch-free, like the rest of the config.

Problems are handed to `add(path, message)` (and pydantic's to `add_schema(exc, path)`) so that
the config loader reports them with its file, YAML line and key path, all in one pass.
"""

from __future__ import annotations

import re
from typing import Any
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pt2flow.flows.config.hints import DICT_INPUT, DIMS, TENSOR_DIMS, flow_yaml
from pt2flow.stages.vocabulary import INTEGER_RANGES, DType

# YAML spellings of the containers that a plain mapping or list cannot express
TUPLE_KEY = "tuple"  # {tuple: [a, b]} is the tuple (a, b)
DICT_KEY = "dict"  # {dict: {...}} is a dict, whatever its keys (shape, tuple, dict included)
INPUT_FILE_SUFFIXES = (".safetensors", ".pt", ".pth")
# what `data.file` may be (stages.source.load_data_batches reads each by its suffix)
DATA_FILE_SUFFIXES = (".npz", ".safetensors", ".pt", ".pth")

Path = tuple[Any, ...]
Add = Callable[[Path, str], None]
AddSchema = Callable[[ValidationError, Path], None]


class InputConfig(BaseModel):
    """A tensor input: a mapping with `shape`."""

    model_config = ConfigDict(extra="forbid")

    shape: list[int] = Field(description="example shape; [] is a 0-d tensor")
    dtype: DType = "float32"
    low: float | None = None
    high: float | None = None
    value: float | None = None

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape):
            raise ValueError("sizes must be >= 0")
        return shape

    @model_validator(mode="after")
    def _fits_the_dtype(self) -> InputConfig:
        """A narrow integer dtype (uint8, int8, int16) holds value, low and high (exclusive)."""
        if self.dtype not in INTEGER_RANGES:
            return self
        smallest, largest = INTEGER_RANGES[self.dtype]
        for name, bound in (("value", largest), ("low", largest), ("high", largest + 1)):
            given = getattr(self, name)
            if given is not None and not smallest <= given <= bound:
                raise ValueError(f"{name} {given:g} is outside what {self.dtype} holds ({smallest} to {largest})")
        return self


def parse_input(value: Any, path: Path, add: Add, add_schema: AddSchema) -> Any:
    """One input tree from YAML: a mapping with `shape` is a tensor spec (InputConfig);
    {tuple: [...]} a tuple; {dict: {...}} or any other mapping a dict; a list a list; int, float,
    bool, str and null are passed as they are. None where broken (the problem is reported)."""
    if isinstance(value, dict):
        if "shape" in value:
            try:
                return InputConfig.model_validate(value)
            except ValidationError as exc:
                add_schema(exc, path)
                return None
        special = [k for k in (TUPLE_KEY, DICT_KEY) if k in value]
        if special and len(value) > 1:
            add(
                path,
                f"a mapping with key {special[0]!r} spells a {special[0]} and takes no other keys; for a dict with these keys "
                f"write {DICT_INPUT.text(mapping=flow_yaml(value))}",
            )
            return None
        if TUPLE_KEY in value:
            items = value[TUPLE_KEY]
            if not isinstance(items, list):
                add(
                    path + (TUPLE_KEY,), f"{{tuple: ...}} takes a list of the tuple's items, got {type(items).__name__}"
                )
                return None
            return tuple(parse_input(v, path + (TUPLE_KEY, i), add, add_schema) for i, v in enumerate(items))
        if DICT_KEY in value:
            if not isinstance(value[DICT_KEY], dict):
                add(path + (DICT_KEY,), f"{{dict: ...}} takes a mapping, got {type(value[DICT_KEY]).__name__}")
                return None
            return _parse_dict(value[DICT_KEY], path + (DICT_KEY,), add, add_schema)
        return _parse_dict(value, path, add, add_schema)
    if isinstance(value, list):
        return [parse_input(v, path + (i,), add, add_schema) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    add(
        path,
        f"an input is a tensor spec (a mapping with shape), a number, a bool, a string, null, or a list, {{tuple: [...]}} or dict of these; got {type(value).__name__}",
    )
    return None


def _parse_dict(value: dict[Any, Any], path: Path, add: Add, add_schema: AddSchema) -> dict[Any, Any]:
    out = {}
    for key, item in value.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            add(path + (key,), f"dict keys must be strings or integers, got {type(key).__name__}")
            continue
        out[key] = parse_input(item, path + (key,), add, add_schema)
    return out


def parse_inputs(value: Any, path: Path, add: Add, add_schema: AddSchema) -> dict[str, Any] | None:
    """A model's `inputs`: forward() argument name -> input tree."""
    if value is None:
        return None
    if not isinstance(value, dict):
        add(path, f"expected a mapping of forward() argument names to inputs, got {type(value).__name__}")
        return None
    out = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            add(path + (name,), f"{name!r} is not a forward() argument name (a Python identifier)")
            continue
        out[name] = parse_input(item, path + (name,), add, add_schema)
    return out


def _dim_index(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key.strip()):
        return int(key)
    return None


def check_dynamic(tree: Any, dyn: Any, path: Path, input_path: Path, dims: Mapping[str, Any], add: Add) -> Any:
    """The dims tree `dyn` for input `tree`, normalized ({int: name} at tensors, lists at
    sequences), every problem reported at its path. None where static or broken. `dims`: dim
    name -> its definition (with .min and .max)."""
    if dyn is None:
        return None
    if isinstance(tree, InputConfig):
        if not isinstance(dyn, dict):
            example = TENSOR_DIMS.text(index=0, dim=flow_yaml(next(iter(dims), "batch")))
            add(path, f"a tensor input takes {{dim index: dim name}} (e.g. {example}), got {type(dyn).__name__}")
            return None
        out = {}
        rank = len(tree.shape)
        for key, dim_name in dyn.items():
            index = _dim_index(key)
            if index is None:
                add(path + (key,), f"dim index {key!r} is not an integer")
            elif not isinstance(dim_name, str):
                add(path + (index,), f"expected a dim name, got {dim_name!r}")
            elif not 0 <= index < rank:
                add(path + (index,), f"dim index {index} is out of range for a rank-{rank} input")
            elif dim_name not in dims:
                add(path + (index,), _undefined_dim(dim_name, max(64, tree.shape[index])))
            elif not dims[dim_name].min <= tree.shape[index] <= dims[dim_name].max:
                spec, size = dims[dim_name], tree.shape[index]
                wider = DIMS.text(dim=flow_yaml(dim_name), min=min(spec.min, size), max=max(spec.max, size))
                add(
                    input_path + ("shape",),
                    f"example size {size} of dim {dim_name!r} is outside its range [{spec.min}, {spec.max}]"
                    + (f"; to take it: {wider}" if size >= 1 else ""),  # a dim's min is at least 1
                )
            else:
                out[index] = dim_name
        return out or None
    if isinstance(tree, (list, tuple)):
        if not isinstance(dyn, list) or len(dyn) != len(tree):
            add(
                path,
                f"a {type(tree).__name__} of {len(tree)} takes a list of {len(tree)} dims entries (null where static), got {dyn!r}",
            )
            return None
        inner = (TUPLE_KEY,) if isinstance(tree, tuple) else ()
        items = [
            check_dynamic(t, d, path + (i,), input_path + inner + (i,), dims, add)
            for i, (t, d) in enumerate(zip(tree, dyn))
        ]
        return items if any(i is not None for i in items) else None
    if isinstance(tree, dict):
        if not isinstance(dyn, dict):
            add(path, f"a dict input takes a mapping of its keys to dims entries, got {type(dyn).__name__}")
            return None
        out = {}
        for key, d in dyn.items():
            if key not in tree:
                add(path + (key,), f"the dict input has no key {key!r} (keys: {sorted(map(str, tree))})")
                continue
            checked = check_dynamic(tree[key], d, path + (key,), input_path + (key,), dims, add)
            if checked is not None:
                out[key] = checked
        return out or None
    add(path, f"a {type(tree).__name__} input has no dims to make dynamic")
    return None


def check_dims_named(dyn: Any, path: Path, dims: Mapping[str, Any], add: Add) -> Any:
    """For inputs not written in the config (inputs_factory, inputs_file): the dims tree's dim
    names must be defined; its structure is checked against the real inputs at trace time."""
    if isinstance(dyn, list):
        return [check_dims_named(d, path + (i,), dims, add) for i, d in enumerate(dyn)]
    if isinstance(dyn, dict):
        if dyn and all(isinstance(v, str) for v in dyn.values()):
            out = {}
            for key, name in dyn.items():
                index = _dim_index(key)
                if index is None or index < 0:
                    add(path + (key,), f"dim index {key!r} is not a non-negative integer")
                elif name not in dims:
                    add(path + (index,), _undefined_dim(name, 64))
                else:
                    out[index] = name
            return out
        return {k: check_dims_named(v, path + (k,), dims, add) for k, v in dyn.items()}
    if dyn is not None:
        add(path, f"expected {{dim index: dim name}}, a list or a mapping of these, or null; got {dyn!r}")
    return None


def _undefined_dim(name: str, largest: int) -> str:
    """A dynamic_shapes entry names a dim that `dims` does not define: the definition to add."""
    return f"dim {name!r} has no definition under dims; define it: {DIMS.text(dim=flow_yaml(name), min=1, max=largest)}"
