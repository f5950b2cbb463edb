"""The config forms that messages tell a user to write, in one table (HINTS).

A hint is only worth giving if writing it works: each Hint is the YAML a message shows (with the
user's own names and numbers put in), where in a config it goes, and an example of it, so that
tests/flows/test_first_hour_config.py can put every example into a one-model config and check
that `pt2flow validate` and the JSON Schema (flows/config/jsonschema.py) both accept it.
Torch-free and import-light: flows/config/inputs.py uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from string import Template
from typing import Any
from collections.abc import Mapping

import yaml


@dataclass(frozen=True)
class Hint:
    """`key: value` (or the value alone where `key` is None) as a message shows it. `value` is
    YAML in flow style with `$placeholders` (string.Template). `at`: the mapping the form goes in
    (for `key: value`) or the place the value takes, as a path in a config whose one model is
    models[0]; `example`: placeholder values for an instance of the form; `context`: YAML the
    model needs besides the form for that instance to be a valid config (a dim it names)."""

    key: str | None
    value: str
    at: tuple[str | int, ...]
    example: Mapping[str, str] = field(default_factory=dict)
    context: str = ""

    def text(self, **values: Any) -> str:
        """The form with `values` put in, as a message shows it."""
        value = Template(self.value).substitute({name: str(v) for name, v in values.items()})
        return f"{self.key}: {value}" if self.key else value


# a dim's range: where a dynamic_shapes entry names a dim that dims does not define, or the example's
# size is outside the range it has (flows/config/inputs.py); also the form for a dim that needs a max
DIMS = Hint("dims", "{$dim: {min: $min, max: $max}}", ("models", 0), {"dim": "batch", "min": "1", "max": "64"})
# a dict input whose keys would spell a tensor, a tuple or a dict (flows/config/inputs.py)
DICT_INPUT = Hint(None, "{dict: $mapping}", ("models", 0, "inputs", "x"), {"mapping": "{tuple: [1, 2], scale: 0.5}"})
# the dims of one tensor input (flows/config/inputs.py)
TENSOR_DIMS = Hint(
    None,
    "{$index: $dim}",
    ("models", 0, "dynamic_shapes", "x"),
    {"index": "0", "dim": "batch"},
    context="dims: {batch: {min: 1, max: 64}}",
)
# a model that must fail rather than export with static shapes (run summary's static-fallback note)
STATIC_FALLBACK_OFF = Hint("stages", "{trace: {fallback: {static: false}}}", ("models", 0))

HINTS: dict[str, Hint] = {
    "dims": DIMS,
    "dict_input": DICT_INPUT,
    "tensor_dims": TENSOR_DIMS,
    "static_fallback_off": STATIC_FALLBACK_OFF,
}


def flow_yaml(value: Any) -> str:
    """`value` (a user's own mapping, name or number) as one line of flow-style YAML, quoted where
    YAML needs it, to put into a hint."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**6, sort_keys=False).strip()[1:-1]
