"""The config's JSON Schema: the shipped configs reference the copy in docs/ and validate against
it, the copy is what the code generates, and it refuses what load_config refuses by shape."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from pt2flow.flows.config.jsonschema import SHIPPED_PATH, config_json_schema, config_json_schema_text
from tests.conftest import ROOT

SHIPPED_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _validator() -> jsonschema.Draft202012Validator:
    schema = config_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _readme_configs() -> list[dict]:
    """The whole configs (`version: 1`) shown in README.md and on the site's pages."""
    text = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))])
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    return [b for b in blocks if isinstance(b, dict) and b.get("version") == 1]


def test_the_shipped_copy_is_what_the_code_generates() -> None:
    assert (ROOT / SHIPPED_PATH).read_text() == config_json_schema_text()


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_references_the_schema_and_validates(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first == f"# yaml-language-server: $schema=../{SHIPPED_PATH}"
    assert (path.parent / first.split("=", 1)[1]).resolve() == (ROOT / SHIPPED_PATH).resolve()
    errors = [e.message for e in _validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


def test_the_readme_configs_validate() -> None:
    configs = _readme_configs()
    assert configs, "the README shows no version-1 config"
    for config in configs:
        assert [e.message for e in _validator().iter_errors(config)] == []


GOOD_MODEL = {"name": "m", "factory": "pkg.mod:make", "inputs": {"x": {"shape": [2, 3]}}}


@pytest.mark.parametrize(
    "change, where",
    [
        ({"version": 2}, "version"),
        ({"stages": ["trace", "compile"]}, "stages"),
        ({"defaults": {"trace": {"strict": "yes"}}}, "strict"),
        ({"defaults": {"validate": {"atol": -1}}}, "atol"),
        ({"defaults": {"decompose": {"tabel": "none"}}}, "tabel"),
        ({"defaults": {"limits": {"memory_gb": 0}}}, "memory_gb"),
        ({"models": []}, "models"),
        ({"models": [{**GOOD_MODEL, "factory": "no_colon"}]}, "factory"),
        ({"models": [{**GOOD_MODEL, "name": "a/b"}]}, "name"),
        ({"models": [{**GOOD_MODEL, "inputs": {"x": {"shape": [2], "dtype": "float99"}}}]}, "dtype"),
        ({"models": [{**GOOD_MODEL, "inputs": {"x": {"shape": "2x3"}}}]}, "shape"),
        ({"models": [{**GOOD_MODEL, "stages": {"validate": {"samples": 0}}}]}, "samples"),
        ({"models": [{**GOOD_MODEL, "weigths": "w.safetensors"}]}, "weigths"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_the_schema_refuses_bad_shapes(change: dict, where: str) -> None:
    config = {"version": 1, "models": [GOOD_MODEL], **change}
    errors = list(_validator().iter_errors(config))
    assert errors, f"the schema accepted {change}"
    # the error (or, under anyOf, one of the alternatives' errors) names what is wrong
    described = [f"{e.message} at {list(e.absolute_path)}" for error in errors for e in [error, *(error.context or [])]]
    assert any(where in text for text in described), described


def test_nested_inputs_and_dims_trees_validate() -> None:
    config = {
        "version": 1,
        "models": [
            {
                "name": "nested",
                "factory": "pkg.mod:make",
                "inputs": {
                    "batch": {
                        "ids": {"shape": [2, 5], "dtype": "int64", "low": 0, "high": 100},
                        "mask": [{"shape": [2]}, None, 3, True, "mean"],
                    },
                    "pair": {"tuple": [{"shape": [4]}, 1.5]},
                    "odd": {"dict": {"shape": {"shape": [1]}}},
                },
                "dynamic_shapes": {
                    "batch": {"ids": {0: "b"}, "mask": [{0: "b"}, None, None, None, None]},
                    "pair": None,
                },
                "dims": {"b": {"min": 1, "max": 64}},
                "stages": {"trace": {"fallback": {"static": False}}, "aot_compile": {"device": "cpu"}},
                "limits": {"timeout_s": 60, "stage_timeout_s": {"aot_compile": 30}},
            }
        ],
    }
    assert [e.message for e in _validator().iter_errors(config)] == []
