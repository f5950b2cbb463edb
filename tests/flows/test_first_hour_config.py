"""A newcomer's config mistakes (issue 44): an unknown key names the key valid at that place it
most likely meant, and every hint a message gives is a form `pt2flow validate` and the JSON
Schema accept: each example of the hints table (flows/config/hints.py), and each hint as the
messages print it, put back into the config that drew it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pt2flow.flows.config.hints import HINTS, Hint
from pt2flow.flows.config.jsonschema import config_json_schema
from tests.conftest import run_cli

MODELS = "from torch import nn\n\n\ndef mlp():\n    return nn.Linear(8, 4)\n"


def _base() -> dict[str, Any]:
    return {
        "version": 1,
        "stages": ["trace", "serialize"],
        "models": [{"name": "m", "factory": "hint_models:mlp", "inputs": {"x": {"shape": [2, 8]}}}],
    }


def _validate(folder: Path, config: dict[str, Any] | str) -> tuple[int, str]:
    """`pt2flow validate --no-import` (the config's own checks and its files) on `config`
    written into `folder`: the exit code and stderr."""
    (folder / "hint_models.py").write_text(MODELS)
    path = folder / "c.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    proc = run_cli(["validate", str(path), "--no-import"])
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr


def _schema_errors(config: dict[str, Any]) -> list[str]:
    return [e.message for e in jsonschema.Draft202012Validator(config_json_schema()).iter_errors(config)]


def _parent(config: dict[str, Any], at: tuple[Any, ...]) -> Any:
    """The container that holds the place `at` of `config` (mappings made on the way)."""
    parent: Any = config
    for part in at[:-1]:
        parent = parent.setdefault(part, {}) if isinstance(part, str) else parent[part]
    return parent


def _set(config: dict[str, Any], at: tuple[Any, ...], value: Any) -> None:
    _parent(config, at)[at[-1]] = value


def _merge(config: dict[str, Any], at: tuple[Any, ...], mapping: dict[str, Any]) -> None:
    """`mapping`'s keys added to the mapping at `at` of `config`."""
    _parent(config, at)[at[-1]].update(mapping)


def _with_hint(hint: Hint, text: str) -> dict[str, Any]:
    """The base config with `text` (a hint as a message shows it) written where the hint goes."""
    config = _base()
    if hint.context:
        _merge(config, ("models", 0), yaml.safe_load(hint.context))
    form = yaml.safe_load(text)
    if hint.key is None:  # the value the place takes
        _set(config, hint.at, form)
    else:  # `key: value` in the mapping at hint.at
        _merge(config, hint.at, form)
    return config


def test_the_base_config_is_valid(tmp_path: Path) -> None:
    assert _validate(tmp_path, _base()) == (0, "")
    assert _schema_errors(_base()) == []


@pytest.mark.parametrize("name", sorted(HINTS))
def test_every_hint_is_a_form_validate_and_the_schema_accept(name: str, tmp_path: Path) -> None:
    hint = HINTS[name]
    text = hint.text(**hint.example)
    if hint.key is not None:
        assert text.startswith(f"{hint.key}: ")
    config = _with_hint(hint, text)
    assert config != _base()  # the form did change the config
    code, stderr = _validate(tmp_path, config)
    assert code == 0, stderr
    assert _schema_errors(config) == []


def test_the_old_dims_hint_is_refused(tmp_path: Path) -> None:
    """What messages used to tell users to write (`dims: NAME: [min, max]`) is refused: the
    check above is one that can fail."""
    config = _base()
    config["models"][0]["dims"] = {"batch": [1, 64]}
    code, stderr = _validate(tmp_path, config)
    assert code == 2 and "models[0].dims.batch" in stderr
    assert _schema_errors(config)


# (the model's mistake, the hint it draws, the hint as the message must print it)
MISTAKES = {
    "undefined-dim": ({"dynamic_shapes": {"x": {0: "batch"}}}, "dims", "dims: {batch: {min: 1, max: 64}}"),
    "size-outside-range": (
        {
            "inputs": {"x": {"shape": [100, 8]}},
            "dynamic_shapes": {"x": {0: "batch"}},
            "dims": {"batch": {"min": 2, "max": 64}},
        },
        "dims",
        "dims: {batch: {min: 2, max: 100}}",
    ),
    "dict-with-special-key": (
        {"inputs": {"x": {"tuple": [1, 2], "scale": 0.5}}},
        "dict_input",
        "{dict: {tuple: [1, 2], scale: 0.5}}",
    ),
    "dims-of-a-tensor": (
        {"dynamic_shapes": {"x": ["n"]}, "dims": {"n": {"min": 1, "max": 64}}},
        "tensor_dims",
        "{0: n}",
    ),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_the_hint_a_message_prints_fixes_the_config(case: str, tmp_path: Path) -> None:
    """The hint as `validate` prints it (the user's names and sizes in it), written where it
    says, makes the config valid."""
    mistake, name, printed = MISTAKES[case]
    config = _base()
    config["models"][0].update(copy.deepcopy(mistake))
    code, stderr = _validate(tmp_path, config)
    assert code == 2, stderr
    problems = [line for line in stderr.splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and printed in problems[0], stderr
    hint = HINTS[name]
    form = yaml.safe_load(printed)
    if hint.key is not None:  # the form replaces what the model had under that key
        config["models"][0][hint.key] = form[hint.key]
    else:
        _set(config, hint.at, form)
    assert _validate(tmp_path, config) == (0, ""), printed
    assert _schema_errors(config) == []


# ---------------------------------------------------------------------------------------------
# unknown keys: did you mean


TYPOS = [
    # (where in the config, the typo, its value, the key meant)
    (("models", 0), "dynamic_shape", {"x": {0: "batch"}}, "dynamic_shapes"),
    ((), "model", None, "models"),
    (("models", 0), "Dims", {"batch": {"min": 1, "max": 8}}, "dims"),
    (("models", 0, "stages", "trace"), "stirct", True, "strict"),
    (("models", 0, "stages", "trace", "fallback"), "statik", False, "static"),
    (("models", 0, "inputs", "x"), "dtyp", "float32", "dtype"),
    (("defaults",), "limts", {"timeout_s": 60}, "limits"),
    (("defaults", "limits"), "timeout", 60, "timeout_s"),
]


def _config_with(at: tuple[Any, ...], key: str, value: Any) -> dict[str, Any]:
    """A valid config (a dynamic dim, trace options) with `key: value` at `at`, in place of the
    key that was meant where that is already there (`value` None: its value moves)."""
    config = _base()
    config["models"][0]["dynamic_shapes"] = {"x": {0: "batch"}}
    config["models"][0]["dims"] = {"batch": {"min": 1, "max": 8}}
    config["models"][0]["stages"] = {"trace": {"fallback": {}}}
    parent = config
    for part in at:
        parent = parent.setdefault(part, {}) if isinstance(part, str) else parent[part]
    meant = next((m for a, t, _, m in TYPOS if a == at and key in (t, m)), None)
    old = parent.pop(meant, None)
    parent[key] = old if value is None else value
    return config


@pytest.mark.parametrize(("at", "typo", "value", "meant"), TYPOS, ids=[t[1] for t in TYPOS])
def test_an_unknown_key_names_the_key_it_meant_at_that_place(
    at: tuple[Any, ...], typo: str, value: Any, meant: str, tmp_path: Path
) -> None:
    """Through the real `pt2flow validate`; the key it names, written instead, makes the config valid."""
    code, stderr = _validate(tmp_path, _config_with(at, typo, value))
    assert code == 2
    path = ".".join(p if isinstance(p, str) else f"[{p}]" for p in (*at, typo)).replace(".[", "[")
    assert f": {path}: unknown key; did you mean `{meant}`?" in stderr, stderr
    assert _validate(tmp_path, _config_with(at, meant, value)) == (0, "")


def test_an_unknown_key_far_from_every_key_gets_no_suggestion(tmp_path: Path) -> None:
    config = _base()
    config["models"][0]["colour"] = "red"
    code, stderr = _validate(tmp_path, config)
    assert code == 2
    assert stderr.strip().endswith("models[0].colour: unknown key"), stderr


def test_a_typo_of_a_stage_under_a_model_names_the_stage(tmp_path: Path) -> None:
    config = _base()
    config["models"][0]["stages"] = {"trce": {"strict": True}}
    code, stderr = _validate(tmp_path, config)
    assert code == 2
    assert "models[0].stages.trce: unknown stage 'trce'" in stderr and stderr.strip().endswith("did you mean `trace`?")
