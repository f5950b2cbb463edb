"""The config loader (docs/architecture.md §3): every bad config is rejected before anything runs,
with the key path, the YAML line and what was expected; good configs resolve to merged options."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from pt2flow.flows.config.checks import NAME_PATTERN, check_stage_list
from pt2flow.flows.config.issues import ConfigError, ConfigIssue
from pt2flow.flows.config.load import apply_overrides, load_config, parse_config
from pt2flow.flows.config.models import Pipeline
from pt2flow.flows import pipeline
from pt2flow.flows.config.reading import read_store_settings
from pt2flow.stages.options import Bound, FunctionalizeOptions, ValidateOptions
from tests.conftest import ROOT, run_cli, write_config

KNOWN = list(pipeline.names())  # the built-in stages and the targets, in pipeline order
# every candidate stage registered, in order: serialize or aot_compile or onnx or executorch...
CANDIDATES = " or ".join(pipeline.candidates())
STAGES = pipeline.default_stages()

CONFIGS = ROOT / "configs"
ALL_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")

# A valid one-model config; the line numbers in the comments are the ones the tests assert.
GOOD = """\
version: 1
models:
  - name: mlp
    factory: tests.models:tiny_mlp
    inputs:
      x: {shape: [4, 8], dtype: float32}
"""


def parse(text: str, base_dir: Path | str = ROOT) -> Pipeline:
    return parse_config(textwrap.dedent(text), source="cfg.yaml", base_dir=str(base_dir))


def issues_of(text: str, base_dir: Path | str = ROOT) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        parse(text, base_dir)
    assert info.value.issues, "a ConfigError must carry at least one issue"
    return info.value.issues


def only_issue(text: str, base_dir: Path | str = ROOT) -> ConfigIssue:
    issues = issues_of(text, base_dir)
    assert len(issues) == 1, issues
    return issues[0]


def one_model(**fields: str) -> str:
    """A config with one model whose YAML lines are: 3 name, 4 factory, 5 inputs, 6+ the extra fields."""
    body = {"name": "m", "factory": "tests.models:tiny_mlp", "inputs": "{x: {shape: [4, 8]}}", **fields}
    lines = ["version: 1", "models:"]
    for i, (key, value) in enumerate(body.items()):
        lines.append(f"{'  - ' if i == 0 else '    '}{key}: {value}")
    return "\n".join(lines) + "\n"


def test_the_reference_config_is_valid() -> None:
    pipeline = parse(GOOD)
    assert [m.name for m in pipeline.models] == ["mlp"]
    assert parse(one_model()).models[0].name == "m"


# ---------------------------------------------------------------------------------------------
# YAML itself


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("version: 1\nmodels:\n  - name: a\n   factory: x\n", 4, "expected <block end>"),
        (
            "version: 1\nmodels:\n  - name: a\n    inputs: {x: {shape: [2, 8]}\nstages: [trace]\n",
            5,
            "expected ',' or '}'",
        ),
        ("version: 1\nmodels:\n  - name: a\n\tfactory: x\n", 4, "found character '\\t'"),
    ],
    ids=["bad-indent", "unclosed-flow-mapping", "tab"],
)
def test_yaml_syntax_error_reports_its_line(text: str, line: int, fragment: str) -> None:
    issue = only_issue(text)
    assert issue.path == ""
    assert issue.line == line
    assert issue.message.startswith("YAML error: ")
    assert fragment in issue.message


@pytest.mark.parametrize(
    ("text", "got"),
    [("- a\n- b\n", "list"), ("just a string\n", "str"), ("", "NoneType"), ("42\n", "int")],
)
def test_top_level_must_be_a_mapping(text: str, got: str) -> None:
    issue = only_issue(text)
    assert issue.path == ""
    assert issue.message == f"expected a mapping at the top level, got {got}"
    assert issue.line == 1


@pytest.mark.parametrize(
    ("template", "line"),
    [
        ('!!python/object/apply:os.system ["touch {marker}"]\n', 1),
        ('version: 1\nstore: !!python/object/apply:os.system ["touch {marker}"]\nmodels: []\n', 2),
        (
            'version: 1\nmodels:\n  - name: a\n    kwargs: {{cb: !!python/object/apply:os.system ["touch {marker}"]}}\n',
            4,
        ),
        ("version: 1\nstore: !!python/name:os.system\nmodels: []\n", 2),
    ],
    ids=["whole-document", "store-value", "nested-kwargs", "python-name"],
)
def test_python_yaml_tags_are_rejected_and_never_executed(tmp_path: Path, template: str, line: int) -> None:
    marker = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(template.format(marker=marker))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    (issue,) = info.value.issues
    assert issue.line == line
    assert "could not determine a constructor for the tag" in issue.message
    assert "python/" in issue.message
    assert not marker.exists()


def test_the_python_tag_payload_is_live_so_the_safe_load_test_means_something(tmp_path: Path) -> None:
    """yaml's unsafe loader does run the payload the test above feeds to load_config."""
    marker = tmp_path / "ran"
    yaml.unsafe_load(f'!!python/object/apply:os.system ["touch {marker}"]\n')
    assert marker.exists()


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    (issue,) = info.value.issues
    assert issue.path == ""
    assert "cannot read the config file" in issue.message
    assert info.value.source == str(tmp_path / "absent.yaml")


# ---------------------------------------------------------------------------------------------
# unknown keys, wrong types, version


@pytest.mark.parametrize(
    ("text", "path", "line", "meant"),
    [
        (GOOD + "colour: red\n", "colour", 7, None),
        (GOOD + "    wieghts: w.pt\n", "models[0].wieghts", 7, "weights"),
        (
            "version: 1\ndefaults:\n  validate: {atoll: 1.0e-3}\n" + GOOD.split("\n", 1)[1],
            "defaults.validate.atoll",
            3,
            "atol",
        ),
        ("version: 1\ndefaults:\n  tracing: {strict: true}\n" + GOOD.split("\n", 1)[1], "defaults.tracing", 3, "trace"),
        (GOOD.replace("dtype: float32}", "dtpye: float32}"), "models[0].inputs.x.dtpye", 6, "dtype"),
        (GOOD + "    stages: {trace: {strictness: true}}\n", "models[0].stages.trace.strictness", 7, "strict"),
        (GOOD + "    dims: {b: {min: 1, max: 4, step: 2}}\n", "models[0].dims.b.step", 7, None),
    ],
    ids=[
        "top-level",
        "in-model",
        "in-defaults-validate",
        "defaults-unknown-stage",
        "in-input-spec",
        "in-model-stage-options",
        "in-dim",
    ],
)
def test_unknown_key_is_reported_at_its_path(text: str, path: str, line: int, meant: str | None) -> None:
    """With the key valid at that place that it most likely meant, when one is close."""
    issue = only_issue(text)
    assert issue.path == path
    assert issue.message == ("unknown key" if meant is None else f"unknown key; did you mean `{meant}`?")
    assert issue.line == line


def test_input_shape_must_be_a_list() -> None:
    issue = only_issue(one_model(inputs="{x: {shape: 8}}"))
    assert issue.path == "models[0].inputs.x.shape"
    assert issue.line == 5
    assert "valid list" in issue.message and "(got 8)" in issue.message


def test_input_shape_sizes_must_be_non_negative() -> None:
    issue = only_issue(one_model(inputs="{x: {shape: [2, -1]}}"))
    assert issue.path == "models[0].inputs.x.shape"
    assert "sizes must be >= 0" in issue.message


def test_dtype_must_be_one_of_the_allowed_names_and_the_message_lists_them() -> None:
    text = (
        "version: 1\nmodels:\n"
        + "  - name: a\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [2, 8]}}\n" * 1
    )
    text += "  - name: b\n    factory: tests.models:tiny_mlp\n    inputs:\n      x: {shape: [2, 8], dtype: float}\n"
    issue = only_issue(text)
    assert issue.path == "models[1].inputs.x.dtype"
    assert issue.line == 9
    assert "(got 'float')" in issue.message
    for dtype in ALL_DTYPES:
        assert f"'{dtype}'" in issue.message


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_documented_dtype_is_accepted(dtype: str) -> None:
    model = parse(one_model(inputs=f"{{x: {{shape: [4, 8], dtype: {dtype}}}}}")).models[0]
    assert model.inputs["x"].dtype == dtype


def test_atol_as_a_non_numeric_string_is_rejected_in_defaults() -> None:
    text = "version: 1\ndefaults:\n  validate: {atol: loose}\n" + GOOD.split("\n", 1)[1]
    issue = only_issue(text)
    assert issue.path == "defaults.validate.atol"
    assert issue.line == 3
    assert "valid number" in issue.message and "'loose'" in issue.message


def test_kwargs_must_be_a_mapping_and_dims_must_be_positive() -> None:
    issues = issues_of(one_model(kwargs="[1, 2]", dims="{b: {min: 0, max: 3}}"))
    by_path = {i.path: i for i in issues}
    assert set(by_path) == {"models[0].kwargs", "models[0].dims.b.min"}
    assert "valid dictionary" in by_path["models[0].kwargs"].message
    assert by_path["models[0].kwargs"].line == 6
    assert "greater than or equal to 1" in by_path["models[0].dims.b.min"].message
    assert by_path["models[0].dims.b.min"].line == 7


@pytest.mark.parametrize(("models", "fragment"), [("[]", "at least 1 item"), ("{a: 1}", "valid list")])
def test_models_must_be_a_non_empty_list(models: str, fragment: str) -> None:
    issue = only_issue(f"version: 1\nmodels: {models}\n")
    assert issue.path == "models"
    assert issue.line == 2
    assert fragment in issue.message


def test_missing_models_and_inputs_are_required_keys() -> None:
    issues = issues_of("version: 1\nstore: x\n")
    assert [(i.path, i.message) for i in issues] == [("models", "required key is missing")]
    issue = only_issue("version: 1\nmodels:\n  - name: a\n    factory: tests.models:tiny_mlp\n")
    assert (issue.path, issue.message, issue.line) == ("models[0].inputs", "required key is missing", 3)


def test_empty_inputs_are_rejected() -> None:
    issue = only_issue(one_model(inputs="{}"))
    assert (issue.path, issue.line) == ("models[0].inputs", 5)
    assert issue.message == "at least one input is required"


def test_version_is_required() -> None:
    issue = only_issue(GOOD.replace("version: 1\n", "store: ./s\n"))
    assert issue.path == "version"
    assert issue.message == "required key is missing"


@pytest.mark.parametrize("version", ["2", "0", "'1'", "true", "1.0", "null"])
def test_only_version_1_is_read(version: str) -> None:
    issue = only_issue(GOOD.replace("version: 1", f"version: {version}"))
    assert issue.path == "version"
    assert issue.line == 1
    assert "unsupported config version" in issue.message
    assert "reads version 1" in issue.message


# ---------------------------------------------------------------------------------------------
# model names


def test_duplicate_model_name_names_both_places() -> None:
    text = GOOD + "  - name: other\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    text += "  - name: mlp\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    issue = only_issue(text)
    assert issue.path == "models[2].name"
    assert issue.line == 10
    assert issue.message == "duplicate model name 'mlp' (also models[0])"


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", "x\x00y", "..", ".", "a..b", "a" * 129, "%2e%2e", "abc\n", "", "a b", "név", "a\\b"],
    ids=[
        "dotdot-slash",
        "slash",
        "nul",
        "dotdot",
        "dot",
        "inner-dotdot",
        "129-chars",
        "percent-encoded",
        "trailing-newline",
        "empty",
        "space",
        "non-ascii",
        "backslash",
    ],
)
def test_invalid_model_names_are_rejected(name: str) -> None:
    issue = only_issue(one_model(name=json.dumps(name)))  # a JSON string is a YAML double-quoted scalar
    assert issue.path == "models[0].name"
    assert issue.line == 3
    assert issue.message == f"{name!r} is not a valid model name: use 1-128 of [A-Za-z0-9._-], no '..'"


def test_percent_is_outside_the_name_pattern() -> None:
    assert NAME_PATTERN.fullmatch("%2e%2e") is None
    assert NAME_PATTERN.fullmatch("ok.name_1-2") is not None


@pytest.mark.parametrize("name", ["a" * 128, "v1.2_model-X", "a.b", "-x", "_"])
def test_valid_model_names_are_accepted(name: str) -> None:
    assert parse(one_model(name=json.dumps(name))).models[0].name == name


# ---------------------------------------------------------------------------------------------
# dynamic shapes and dims


def test_dim_without_definition() -> None:
    issue = only_issue(one_model(dynamic_shapes="{x: {0: batch}}"))
    assert issue.path == "models[0].dynamic_shapes.x[0]"
    assert issue.line == 6
    assert issue.message == "dim 'batch' has no definition under dims; define it: dims: {batch: {min: 1, max: 64}}"


def test_dynamic_shapes_naming_an_unknown_input() -> None:
    issue = only_issue(one_model(dynamic_shapes="{y: {0: batch}}", dims="{batch: {min: 1, max: 8}}"))
    assert issue.path == "models[0].dynamic_shapes.y"
    assert issue.line == 6
    assert issue.message == "no input named 'y' (inputs: ['x'])"


@pytest.mark.parametrize("index", [2, 7, -1])
def test_dim_index_out_of_range(index: int) -> None:
    issue = only_issue(one_model(dynamic_shapes=f"{{x: {{{index}: batch}}}}", dims="{batch: {min: 1, max: 8}}"))
    assert issue.path == f"models[0].dynamic_shapes.x[{index}]"
    assert issue.line == 6
    assert issue.message == f"dim index {index} is out of range for a rank-2 input"


@pytest.mark.parametrize(("size", "bounds"), [(40, (1, 16)), (1, (2, 16))])
def test_example_size_outside_the_dim_range(size: int, bounds: tuple[int, int]) -> None:
    issue = only_issue(
        one_model(
            inputs=f"{{x: {{shape: [{size}, 8]}}}}",
            dynamic_shapes="{x: {0: batch}}",
            dims=f"{{batch: {{min: {bounds[0]}, max: {bounds[1]}}}}}",
        )
    )
    assert issue.path == "models[0].inputs.x.shape"
    assert issue.line == 5
    wider = f"dims: {{batch: {{min: {min(bounds[0], size)}, max: {max(bounds[1], size)}}}}}"
    assert issue.message == (
        f"example size {size} of dim 'batch' is outside its range [{bounds[0]}, {bounds[1]}]; to take it: {wider}"
    )


def test_dim_min_greater_than_max() -> None:
    issues = issues_of(one_model(dims="{batch: {min: 9, max: 4}}"))
    assert [(i.path, i.line, i.message) for i in issues] == [("models[0].dims.batch", 6, "min 9 is greater than max 4")]


def test_validate_samples_below_3_with_dynamic_dims() -> None:
    issue = only_issue(
        one_model(dynamic_shapes="{x: {0: batch}}", dims="{batch: {min: 1, max: 8}}", stages="{validate: {samples: 2}}")
    )
    assert issue.path == "models[0].stages.validate.samples"
    assert issue.line == 8
    assert issue.message == "must be >= 3 for a model with dynamic dims (example, min and max)"


def test_validate_samples_below_3_from_the_defaults_is_reported_per_dynamic_model() -> None:
    text = "version: 1\ndefaults: {validate: {samples: 2}}\nmodels:\n"
    text += "  - name: dyn\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    text += "    dynamic_shapes: {x: {0: batch}}\n    dims: {batch: {min: 1, max: 8}}\n"
    text += "  - name: static\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    issue = only_issue(text)
    assert issue.path == "models[0].stages.validate.samples"


def test_two_samples_are_fine_for_a_static_model() -> None:
    model = parse(one_model(stages="{validate: {samples: 2}}")).models[0]
    assert model.options["validate"].samples == 2  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# factories: resolved statically, never imported


@pytest.mark.parametrize(
    "factory",
    [
        "os.system",
        "a:b:c",
        "x; rm -rf /",
        "mod:",
        ":make",
        "1mod:make",
        "mod:make()",
        "mod:make\n",
        "tests.models:tiny_mlp\n",
        "../evil:make",
    ],
)
def test_factory_not_of_the_form_module_callable(factory: str) -> None:
    issue = only_issue(one_model(factory=json.dumps(factory)))
    assert issue.path == "models[0].factory"
    assert issue.line == 4
    assert issue.message == f"{factory!r} is not of the form 'package.module:callable'"


def test_factory_module_not_found(tmp_path: Path) -> None:
    issue = only_issue(one_model(factory="pt2flow_no_such_module_q7:make"), base_dir=tmp_path)
    assert issue.path == "models[0].factory"
    assert issue.line == 4
    assert "module 'pt2flow_no_such_module_q7' not found" in issue.message
    assert str(tmp_path) in issue.message


def test_a_data_factory_is_checked_where_it_is_written(tmp_path: Path) -> None:
    """`data:` (a model's own calibration data): its factory resolves as `factory` does, without
    running its module, and a bad one is named at its own key path."""
    issue = only_issue(one_model(data="{factory: pt2flow_no_such_data_q7:batches}"), base_dir=tmp_path)
    assert issue.path == "models[0].data.factory" and issue.line == 6
    assert "module 'pt2flow_no_such_data_q7' not found" in issue.message
    module = _marker_module(tmp_path, "calib_q7", "def batches():\n    yield {}\n")
    model = parse(one_model(data="{factory: calib_q7:batches, calibration: 3}"), base_dir=tmp_path).models[0]
    assert (model.data.factory, model.data.calibration) == ("calib_q7:batches", 3)
    assert not module.with_suffix(".imported").exists()  # checked, never run
    issue = only_issue(one_model(data="{factory: calib_q7:batches, calibration: 0}"), base_dir=tmp_path)
    assert issue.path == "models[0].data.calibration" and "greater than or equal to 1" in issue.message


def test_calibration_and_evaluation_batches_are_consecutive_and_both_counted(tmp_path: Path) -> None:
    """`data.evaluation` takes the batches after the calibration ones, never one of them; a
    factory that gives fewer than both ask for is a config error naming both counts."""
    from pt2flow.flows.engine.stage_api import data_batches
    from pt2flow.stages.errors import StageError

    (tmp_path / "split_q7.py").write_text(
        "import torch\n\ndef batches():\n    for i in range(5):\n        yield {'x': torch.full((4, 8), float(i))}\n"
    )
    model = parse(one_model(data="{factory: split_q7:batches, calibration: 3, evaluation: 2}"), tmp_path).models[0]
    firsts = {
        part: [float(kwargs["x"][0, 0]) for _, kwargs in data_batches(model, part)]
        for part in ("calibration", "evaluation")
    }
    assert firsts == {"calibration": [0.0, 1.0, 2.0], "evaluation": [3.0, 4.0]}
    model = parse(one_model(data="{factory: split_q7:batches, calibration: 4, evaluation: 2}"), tmp_path).models[0]
    with pytest.raises(StageError) as caught:
        data_batches(model, "calibration")  # a calibration the factory could give: both parts are read
    assert caught.value.error_class == "config"
    assert caught.value.message == (
        "data.factory split_q7:batches gave 5 batches and data.calibration asks for 4 and data.evaluation for 2 more"
    )


def test_a_data_file_gives_the_same_batches_in_each_format_and_its_bytes_are_the_key(tmp_path: Path) -> None:
    """`data.file`: the user's batches saved by numpy (.npz: arrays by forward() argument name,
    batch index first), safetensors or torch.save (a list of batches) give the same (args, kwargs)
    batches, split into calibration and evaluation as a factory's are; the file's sha256 is in the
    model's source manifest, so changing one value of it changes the model's source identity, and
    a factory model's manifest keeps the form it had before files existed."""
    import numpy
    import torch
    from safetensors.torch import save_file

    from pt2flow.flows.engine.common.inputs import inputs_manifest
    from pt2flow.flows.engine.stage_api import data_batches

    stacked = numpy.arange(5 * 4 * 8, dtype=numpy.float32).reshape(5, 4, 8)
    numpy.savez(tmp_path / "batches.npz", x=stacked)
    save_file({"x": torch.from_numpy(stacked.copy())}, str(tmp_path / "batches.safetensors"))
    torch.save([{"x": torch.from_numpy(stacked[i].copy())} for i in range(5)], tmp_path / "batches.pt")
    seen = {}
    for name in ("batches.npz", "batches.safetensors", "batches.pt"):
        model = parse(one_model(data=f"{{file: {name}, calibration: 3, evaluation: 2}}"), tmp_path).models[0]
        parts = [data_batches(model, part) for part in ("calibration", "evaluation")]
        assert [len(p) for p in parts] == [3, 2] and all(args == () for p in parts for args, _ in p), name
        seen[name] = [kwargs["x"] for p in parts for _, kwargs in p]
        assert [tuple(x.shape) for x in seen[name]] == [(4, 8)] * 5, name
        assert all(torch.equal(x, torch.from_numpy(stacked[i])) for i, x in enumerate(seen[name])), name

    model = parse(one_model(data="{file: batches.npz, calibration: 3, evaluation: 2}"), tmp_path).models[0]
    before = inputs_manifest(model)["data"]
    assert set(before) == {"file", "calibration", "evaluation", "sha256"} and before["file"] == "batches.npz"
    stacked[4, 0, 0] += 1.0  # one value of an evaluation batch
    numpy.savez(tmp_path / "batches.npz", x=stacked)
    assert inputs_manifest(model)["data"]["sha256"] != before["sha256"]
    (tmp_path / "own_q7.py").write_text("def batches():\n    yield {}\n")
    factory = parse(one_model(data="{factory: own_q7:batches}"), tmp_path).models[0]
    assert set(inputs_manifest(factory)["data"]) == {"factory", "calibration", "evaluation", "code_hash"}


def test_a_data_file_that_is_not_batches_is_named(tmp_path: Path) -> None:
    """Where `data.file` goes wrong, the config check or the read says where: neither or both
    ways given, another kind of file, a file that is not there, arrays of unequal batch counts, a
    pickle the safe loader refuses, fewer batches than the parts ask for."""
    import numpy
    import torch

    from pt2flow.flows.engine.stage_api import data_batches
    from pt2flow.stages.errors import StageError

    (tmp_path / "own_q7.py").write_text("def batches():\n    yield {}\n")
    (tmp_path / "batches.csv").write_text("1,2\n")
    for data, path, message in [
        ("{calibration: 2}", "models[0].data", "give the data one way: factory"),
        ("{factory: own_q7:batches, file: b.npz}", "models[0].data", "exactly one"),
        ("{file: batches.csv}", "models[0].data.file", "data.file must end in one of ['.npz'"),
        ("{file: missing.npz}", "models[0].data.file", f"file not found: {tmp_path / 'missing.npz'}"),
    ]:
        issue = only_issue(one_model(data=data), base_dir=tmp_path)
        assert issue.path == path and issue.line == 6 and message in issue.message, (data, issue)

    def refusal(name: str) -> StageError:
        model = parse(one_model(data=f"{{file: {name}, calibration: 2, evaluation: 1}}"), tmp_path).models[0]
        with pytest.raises(StageError) as caught:
            data_batches(model)
        assert caught.value.error_class == "config"
        return caught.value

    numpy.savez(tmp_path / "uneven.npz", x=numpy.zeros((3, 4)), mask=numpy.ones((2, 4)))
    assert "every array must hold as many batches (its leading axis); got x 3, mask 2" in refusal("uneven.npz").message
    torch.save([{"x": torch.zeros(2)}, {"x": torch.ones(2)}], tmp_path / "two.pt")
    assert refusal("two.pt").message == (
        "data.file two.pt holds 2 batches and data.calibration asks for 2 and data.evaluation for 1 more"
    )
    torch.save([{"x": torch.zeros(2)}, 7, {"x": torch.ones(2)}], tmp_path / "odd.pt")
    assert "odd.pt batch 1 must give (args, kwargs) for forward()" in refusal("odd.pt").message

    class Evil:
        def __reduce__(self) -> Any:
            return (print, ("never run",))

    torch.save([Evil()], tmp_path / "evil.pt")
    assert "evil.pt: refused to load data batches (torch.load with weights_only=True)" in refusal("evil.pt").message
    from pt2flow.stages.source import load_example_inputs

    with pytest.raises(StageError, match=r"evil.pt: refused to load example inputs \(torch.load with weights_only"):
        load_example_inputs((tmp_path / "evil.pt").read_bytes(), "evil.pt")  # the same refusal for an inputs_file


def test_the_defaults_data_is_every_models_that_names_none_but_a_generative_ones(tmp_path: Path) -> None:
    """`defaults.data`: a fleet of models fed the same data (image classifiers on one set of
    images) names it once. A model's own `data:` wins; a generative model gets none (its prompts
    are pt2flow's); a factory that does not resolve is named at `defaults.data.factory`."""
    _marker_module(tmp_path, "shared_q7", "def batches():\n    yield {}\n\ndef own():\n    yield {}\n")
    (tmp_path / "gen_q7.py").write_text("def tiny():\n    raise RuntimeError('never built here')\n")
    text = textwrap.dedent(
        """\
        version: 1
        defaults:
          data: {factory: shared_q7:batches, calibration: 2, evaluation: 1}
        models:
          - {name: plain, factory: tests.models:tiny_mlp, inputs: {x: {shape: [4, 8]}}}
          - name: own
            factory: tests.models:tiny_mlp
            inputs: {x: {shape: [4, 8]}}
            data: {factory: shared_q7:own}
          - {name: lm, factory: "gen_q7:tiny", generate: {prompt_lens: [2]}}
        """
    )
    models = {m.name: m for m in parse_config(text, source="cfg.yaml", base_dir=str(tmp_path)).models}
    assert models["plain"].data is not None
    assert (models["plain"].data.factory, models["plain"].data.calibration, models["plain"].data.evaluation) == (
        "shared_q7:batches",
        2,
        1,
    )
    assert models["own"].data is not None and (models["own"].data.factory, models["own"].data.evaluation) == (
        "shared_q7:own",
        0,
    )
    assert models["lm"].data is None
    with pytest.raises(ConfigError) as info:
        parse_config(text.replace("shared_q7:batches", "no_such_q7:batches"), source="cfg.yaml", base_dir=str(tmp_path))
    (issue,) = info.value.issues
    assert issue.path == "defaults.data.factory" and issue.line == 3 and "no_such_q7" in issue.message


def test_a_top_level_accuracy_is_validate_accuracy_per_model_and_in_defaults() -> None:
    """DESIGN §3's `accuracy:` (per model, or in defaults) is validate's accuracy budget: the same
    resolved options, so the same keys, as `stages.validate.accuracy`; a model's wins over the
    defaults'; one budget given both ways at one level is refused where it is written."""
    text = textwrap.dedent(
        """\
        version: 1
        defaults:
          accuracy: {sqnr_db: {min: 25}}
        models:
          - {name: inherits, factory: tests.models:tiny_mlp, inputs: {x: {shape: [4, 8]}}}
          - name: own
            factory: tests.models:tiny_mlp
            inputs: {x: {shape: [4, 8]}}
            accuracy: {top1_agreement: {min: 0.99}}
          - name: spelled-out
            factory: tests.models:tiny_mlp
            inputs: {x: {shape: [4, 8]}}
            stages: {validate: {accuracy: {top1_agreement: {min: 0.99}}}}
        """
    )
    models = {m.name: m.options["validate"] for m in parse(text).models}
    assert models["inherits"].accuracy == {"sqnr_db": Bound(min=25.0)}
    assert models["own"].accuracy == {"top1_agreement": Bound(min=0.99)} and models["own"] == models["spelled-out"]
    twice = text.replace(
        "stages: {validate: {accuracy:", "accuracy: {cosine: {min: 0.9}}\n    stages: {validate: {accuracy:"
    )
    issue = only_issue(twice)
    assert issue.path == "models[2].accuracy" and "given twice" in issue.message
    issue = only_issue(
        text.replace("  accuracy: {sqnr_db", "  validate: {accuracy: {cosine: {min: 0.5}}}\n  accuracy: {sqnr_db")
    )
    assert issue.path == "defaults.accuracy" and "defaults.validate.accuracy" in issue.message


def test_factory_submodule_of_a_plain_module_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "flatmod_q7.py").write_text("def make():\n    return None\n")
    issue = only_issue(one_model(factory="flatmod_q7.sub:make"), base_dir=tmp_path)
    assert issue.path == "models[0].factory"
    assert "not found" in issue.message or "cannot be found" in issue.message


def _marker_module(folder: Path, name: str, body: str) -> Path:
    """A module that leaves <name>.imported beside itself if it is ever executed."""
    source = f"from pathlib import Path\nPath(__file__).with_suffix('.imported').write_text('ran')\n\n{body}"
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


def test_factory_not_defined_at_the_top_level_and_module_never_executed(tmp_path: Path) -> None:
    module = _marker_module(
        tmp_path,
        "marker_models_q7",
        "def outer():\n    def make():\n        return None\n    return make\n\n\nclass Box:\n    make = None\n",
    )
    issue = only_issue(one_model(factory="marker_models_q7:make"), base_dir=tmp_path)
    assert issue.path == "models[0].factory"
    assert issue.line == 4
    assert issue.message == f"'make' is not defined at the top level of {module}"
    assert not module.with_suffix(".imported").exists()
    assert "marker_models_q7" not in sys.modules
    assert str(tmp_path) not in sys.path  # the config's folder is taken off sys.path again


def test_a_resolving_factory_is_found_without_executing_its_module(tmp_path: Path) -> None:
    module = _marker_module(tmp_path, "marker_ok_q7", "def make():\n    return None\n\n\nalias = make\n")
    pipeline = parse(one_model(factory="marker_ok_q7:make"), base_dir=tmp_path)
    assert pipeline.models[0].factory == "marker_ok_q7:make"
    assert pipeline.models[0].search_path == str(tmp_path)
    assert parse(one_model(factory="marker_ok_q7:alias"), base_dir=tmp_path).models[0].factory == "marker_ok_q7:alias"
    assert not module.with_suffix(".imported").exists()
    assert "marker_ok_q7" not in sys.modules
    # the probe is live: importing the module for real does leave the marker
    spec = importlib.util.spec_from_file_location("marker_ok_q7_probe", module)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert module.with_suffix(".imported").exists()


def test_a_dotted_factory_does_not_execute_its_parent_package(tmp_path: Path) -> None:
    package = tmp_path / "marker_pkg_q7"
    package.mkdir()
    init = _marker_module(package, "__init__", "")
    (package / "nets.py").write_text("def make():\n    return None\n")
    assert (
        parse(one_model(factory="marker_pkg_q7.nets:make"), base_dir=tmp_path).models[0].factory
        == "marker_pkg_q7.nets:make"
    )
    issue = only_issue(one_model(factory="marker_pkg_q7.nets:absent"), base_dir=tmp_path)
    assert issue.message == f"'absent' is not defined at the top level of {package / 'nets.py'}"
    assert not init.with_suffix(".imported").exists()
    assert "marker_pkg_q7" not in sys.modules


def test_an_edited_factory_module_is_checked_as_it_now_reads(tmp_path: Path) -> None:
    """A module's names are parsed once per process (a fleet's models share a few modules), but
    an edit is seen by the next check in the same process, as `serve` checks before every run."""
    module = tmp_path / "edited_q7.py"
    module.write_text("def make():\n    return None\n")
    entries = "".join(
        f"  - name: m{i}\n    factory: edited_q7:make\n    inputs: {{x: {{shape: [4, 8]}}}}\n" for i in range(3)
    )
    fleet = parse(f"version: 1\nmodels:\n{entries}", base_dir=tmp_path)
    assert [m.factory for m in fleet.models] == ["edited_q7:make"] * 3
    module.write_text("def build():\n    return None\n")
    issue = only_issue(one_model(factory="edited_q7:make"), base_dir=tmp_path)
    assert issue.message == f"'make' is not defined at the top level of {module}"
    module.write_text("def make(:\n")
    assert "has a syntax error at line 1" in only_issue(one_model(factory="edited_q7:make"), base_dir=tmp_path).message
    module.write_text("def make():\n    return None\n")
    assert parse(one_model(factory="edited_q7:make"), base_dir=tmp_path).models[0].factory == "edited_q7:make"


def test_factory_module_with_a_syntax_error(tmp_path: Path) -> None:
    (tmp_path / "broken_syntax_q7.py").write_text("import os\n\ndef make(:\n    return None\n")
    issue = only_issue(one_model(factory="broken_syntax_q7:make"), base_dir=tmp_path)
    assert issue.path == "models[0].factory"
    assert issue.line == 4
    assert "has a syntax error at line 3" in issue.message
    assert "broken_syntax_q7" in issue.message


def test_factory_names_bound_by_import_assignment_or_class_resolve(tmp_path: Path) -> None:
    (tmp_path / "bindings_q7.py").write_text(
        "from tests.models import tiny_mlp as imported\nassigned = imported\nannotated: object = imported\n\n\nclass Made:\n    pass\n"
    )
    for name in ("imported", "assigned", "annotated", "Made"):
        assert (
            parse(one_model(factory=f"bindings_q7:{name}"), base_dir=tmp_path).models[0].factory
            == f"bindings_q7:{name}"
        )


def test_factories_resolve_against_the_config_files_folder(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "local_models_q7.py").write_text("def make():\n    return None\n")
    config = folder / "pipeline.yaml"
    config.write_text(one_model(factory="local_models_q7:make"))
    pipeline = load_config(config)
    assert pipeline.path == str(config)
    assert pipeline.models[0].search_path == str(folder)
    # the same text resolved against another folder does not find the module
    issue = only_issue(one_model(factory="local_models_q7:make"), base_dir=tmp_path)
    assert "not found" in issue.message


# ---------------------------------------------------------------------------------------------
# weights


@pytest.mark.parametrize(
    "weights", ["model.ckpt", "model.onnx", "s3://bucket/weights", "w.pt.gz", "w.safetensors.json"]
)
def test_weights_with_an_unsupported_suffix(weights: str) -> None:
    issue = only_issue(one_model(weights=json.dumps(weights)))
    assert issue.path == "models[0].weights"
    assert issue.line == 6
    assert issue.message == "weights must be a state_dict file ending in one of ['.safetensors', '.pt', '.pth', '.bin']"


@pytest.mark.parametrize(
    "weights", ["w.safetensors", "w.pt", "w.pth", "w.bin", "s3://b/x/W.PT?versionId=3", "memory://w.safetensors"]
)
def test_weights_with_a_supported_suffix(weights: str) -> None:
    assert parse(one_model(weights=json.dumps(weights))).models[0].weights == weights


# ---------------------------------------------------------------------------------------------
# stage lists and per-model overrides


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        (["trace", "bogus"], [f"unknown stage(s) ['bogus']; stages are {KNOWN}"]),
        (["functionalize", "trace"], [f"stages must keep the pipeline order {KNOWN}"]),
        (["functionalize", "decompose"], ["trace is required: every other stage starts from its program"]),
        ([], ["trace is required: every other stage starts from its program"]),
        (["trace", "validate"], [f"validate needs {CANDIDATES} (it compares their artifacts with eager)"]),
        (["trace", "decompose", "validate"], [f"validate needs {CANDIDATES} (it compares their artifacts with eager)"]),
        (["trace", "trace"], ["a stage is listed twice", f"stages must keep the pipeline order {KNOWN}"]),
    ],
    ids=["unknown", "order", "missing-trace", "empty", "validate-alone", "validate-without-artifact", "duplicate"],
)
def test_check_stage_list_problems(stages: list[str], expected: list[str]) -> None:
    assert check_stage_list(stages) == expected


@pytest.mark.parametrize(
    "stages",
    [
        list(STAGES),
        ["trace"],
        ["trace", "serialize", "validate"],
        ["trace", "aot_compile", "validate"],
        ["trace", "functionalize", "decompose"],
    ],
)
def test_check_stage_list_accepts_ordered_subsets(stages: list[str]) -> None:
    assert check_stage_list(stages) == []


def test_stage_list_problems_in_the_config_point_at_stages() -> None:
    issues = issues_of("version: 1\nstages: [trace, validate, bogus]\n" + GOOD.split("\n", 1)[1])
    assert [(i.path, i.line) for i in issues] == [("stages", 2)]
    assert "unknown stage(s) ['bogus']" in issues[0].message
    issues = issues_of("version: 1\nstages: [serialize, decompose]\n" + GOOD.split("\n", 1)[1])
    assert [(i.path, i.line, i.message) for i in issues] == [
        ("stages", 2, f"stages must keep the pipeline order {KNOWN}"),
        ("stages", 2, "trace is required: every other stage starts from its program"),
    ]


def test_a_stage_whose_libraries_are_missing_is_a_config_error_naming_the_extra() -> None:
    """A registered stage needing a distribution that is not installed: a config naming it is
    refused before anything runs, saying what to install (as onnx or executorch would be)."""
    from pt2flow.flows.pipeline import Input, Stage, register, unregister

    register(
        Stage(
            "elsewhere",
            1,
            compute="tests.plugin_stage:compute",
            inputs=(Input("program", ("trace",)),),
            libraries=("no-such-distribution-for-pt2flow",),
            extra="elsewhere",
        )
    )
    try:
        issue = only_issue("version: 1\nstages: [trace, elsewhere]\n" + GOOD.split("\n", 1)[1])
        assert issue.path == "stages"
        assert issue.message == (
            "the elsewhere stage needs no-such-distribution-for-pt2flow, which is not installed here: "
            "pip install 'pt2flow[elsewhere]'"
        )
        # the targets' libraries are installed here (make install): the same check lets them through
        assert parse("version: 1\nstages: [trace, onnx, executorch]\n" + GOOD.split("\n", 1)[1], ROOT).stages == (
            "trace",
            "onnx",
            "executorch",
        )
    finally:
        unregister("elsewhere")


def test_per_model_override_for_an_unknown_stage() -> None:
    issue = only_issue(one_model(stages="{tracing: {strict: true}}"))
    assert issue.path == "models[0].stages.tracing"
    assert issue.line == 6
    assert issue.message == f"unknown stage 'tracing'; per-model overrides are for {KNOWN}; did you mean `trace`?"


@pytest.mark.parametrize(
    ("override", "path", "fragment"),
    [
        ("{validate: {atol: loose}}", "models[1].stages.validate.atol", "valid number"),
        ("{validate: {atol: -1.0}}", "models[1].stages.validate.atol", "greater than or equal to 0"),
        ("{validate: {samples: 0}}", "models[1].stages.validate.samples", "greater than or equal to 1"),
        ("{functionalize: {mode: train}}", "models[1].stages.functionalize.mode", "'inference' or 'training'"),
        ("{decompose: {table: all}}", "models[1].stages.decompose.table", "'core_aten' or 'none'"),
        ("{trace: {strict: maybe}}", "models[1].stages.trace.strict", "valid boolean"),
    ],
)
def test_invalid_option_value_in_a_per_model_override(override: str, path: str, fragment: str) -> None:
    text = GOOD + "  - name: second\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    text += f"    stages: {override}\n"
    issue = only_issue(text)
    assert issue.path == path
    assert issue.line == 10
    assert fragment in issue.message


# ---------------------------------------------------------------------------------------------
# storage options


def test_storage_options_expand_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT2_TEST_HOST", "minio.local")
    monkeypatch.setenv("PT2_TEST_SECRET", "s3cr3t")
    text = GOOD.replace(
        "version: 1\n",
        "version: 1\nstorage_options:\n  secret: ${PT2_TEST_SECRET}\n"
        "  client_kwargs: {endpoint_url: 'http://${PT2_TEST_HOST}:9000'}\n  hosts: ['${PT2_TEST_HOST}', plain]\n  retries: 3\n",
    )
    pipeline = parse(text)
    assert dict(pipeline.storage_options) == {
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://minio.local:9000"},
        "hosts": ["minio.local", "plain"],
        "retries": 3,
    }


def test_an_unset_environment_variable_is_reported_at_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PT2_TEST_UNSET_Q7", raising=False)
    monkeypatch.setenv("PT2_TEST_HOST", "minio.local")
    text = GOOD.replace(
        "version: 1\n",
        "version: 1\nstorage_options:\n  key: ok-${PT2_TEST_HOST}\n  client_kwargs:\n    endpoint_url: http://${PT2_TEST_UNSET_Q7}:9000\n",
    )
    issue = only_issue(text)
    assert issue.path == "storage_options.client_kwargs.endpoint_url"
    assert issue.line == 5
    assert issue.message == "environment variable ${PT2_TEST_UNSET_Q7} is not set"


# ---------------------------------------------------------------------------------------------
# every problem at once


def test_every_semantic_problem_of_a_file_is_reported_in_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PT2_TEST_UNSET_Q7", raising=False)
    text = """\
version: 1
stages: [functionalize, decompose]
storage_options: {token: "${PT2_TEST_UNSET_Q7}"}
models:
  - name: ../escape
    factory: os.system
    weights: w.ckpt
    inputs: {x: {shape: [4, 8]}}
    dynamic_shapes: {x: {0: batch}, y: {0: batch}}
  - name: ok
    factory: pt2flow_no_such_module_q7:make
    inputs: {x: {shape: [4, 8]}}
    stages: {validate: {atol: loose}, tracing: {}}
  - name: ok
    factory: tests.models:tiny_mlp
    inputs: {x: {shape: [4, 8]}}
    dims: {b: {min: 5, max: 2}}
"""
    with pytest.raises(ConfigError) as info:
        parse(text)
    expected = [
        ("storage_options.token", 3),
        ("stages", 2),
        ("models[0].name", 5),
        ("models[0].factory", 6),
        ("models[0].weights", 7),
        ("models[0].dynamic_shapes.x[0]", 9),
        ("models[0].dynamic_shapes.y", 9),
        ("models[1].factory", 11),
        ("models[1].stages.tracing", 13),
        ("models[1].stages.validate.atol", 13),
        ("models[2].name", 14),
        ("models[2].dims.b", 17),
    ]
    error = info.value
    assert sorted((i.path, i.line) for i in error.issues) == sorted(expected)
    rendered = error.render()
    assert rendered.splitlines()[0] == f"cfg.yaml: {len(expected)} problems in the config:"
    for issue in error.issues:
        assert f"  cfg.yaml:{issue.line}: {issue.path}: {issue.message}" in rendered.splitlines()
    assert str(error) == rendered


def test_every_schema_problem_of_a_file_is_reported_in_one_error() -> None:
    text = """\
version: 1
colour: red
defaults: {validate: {}, tracing: {}}
models:
  - name: a
    factory: tests.models:tiny_mlp
    inputs: {x: {shape: 8, dtype: float}}
  - name: b
    inputs: {x: {shape: [2, 8], dtpye: int64}}
    dims: {b: {min: 0, max: 3}}
"""
    issues = issues_of(text)
    assert sorted((i.path, i.line) for i in issues) == sorted(
        [
            ("colour", 2),
            ("defaults.tracing", 3),
            ("models[0].inputs.x.shape", 7),
            ("models[0].inputs.x.dtype", 7),
            ("models[1].factory", 8),
            ("models[1].inputs.x.dtpye", 9),
            ("models[1].dims.b.min", 10),
        ]
    )


def test_broken_defaults_do_not_hide_per_model_problems() -> None:
    text = "version: 1\ndefaults:\n  validate: {atol: loose}\nmodels:\n"
    text += "  - name: a/b\n    factory: pt2flow_no_such_module_q7:make\n    inputs: {x: {shape: [4, 8]}}\n"
    text += "    stages: {validate: {rtol: 1.0e-3}}\n"
    issues = issues_of(text)
    # the per-model option check is skipped (it would only repeat the defaults' error) but nothing else is
    assert [(i.path, i.line) for i in issues] == [
        ("defaults.validate.atol", 3),
        ("models[0].name", 5),
        ("models[0].factory", 6),
    ]


def test_a_single_problem_renders_in_the_singular() -> None:
    with pytest.raises(ConfigError) as info:
        parse(GOOD + "colour: red\n")
    assert info.value.render() == "cfg.yaml: 1 problem in the config:\n  cfg.yaml:7: colour: unknown key"


# ---------------------------------------------------------------------------------------------
# --only and --stages


def _two_models() -> Pipeline:
    return parse(
        GOOD
        + "  - name: cnn\n    factory: tests.models:dict_out\n    inputs: {x: {shape: [2, 6]}, scale: {shape: []}}\n"
    )


def test_apply_overrides_only_with_an_unknown_name() -> None:
    pipeline = _two_models()
    with pytest.raises(ConfigError) as info:
        apply_overrides(pipeline, only=["mlp", "nope"])
    (issue,) = info.value.issues
    assert issue.path == "--only"
    assert issue.line is None
    assert issue.message == "no model named ['nope'] in the config (models: ['cnn', 'mlp'])"
    assert "cfg.yaml: --only:" in info.value.render()


def test_apply_overrides_only_keeps_the_named_models_in_config_order() -> None:
    pipeline = _two_models()
    assert [m.name for m in apply_overrides(pipeline, only=["cnn"]).models] == ["cnn"]
    assert [m.name for m in apply_overrides(pipeline, only=["cnn", "mlp"]).models] == ["mlp", "cnn"]
    assert [m.name for m in apply_overrides(pipeline).models] == ["mlp", "cnn"]


@pytest.mark.parametrize(
    ("stages", "fragment"),
    [
        (["trace", "compile"], "unknown stage(s) ['compile']"),
        (["serialize"], "trace is required"),
        (["trace", "validate"], "validate needs serialize or aot_compile"),
        (["decompose", "trace"], "pipeline order"),
    ],
)
def test_apply_overrides_stages_bad_list(stages: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(_two_models(), stages=stages)
    assert all(i.path == "--stages" for i in info.value.issues)
    assert any(fragment in i.message for i in info.value.issues)


def test_apply_overrides_stages_good_list() -> None:
    pipeline = _two_models()
    assert pipeline.stages == STAGES
    chosen = apply_overrides(pipeline, stages=["trace", "functionalize", "serialize"])
    assert chosen.stages == ("trace", "functionalize", "serialize")
    assert [m.name for m in chosen.models] == ["mlp", "cnn"]


def test_apply_overrides_reports_only_and_stages_together() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(_two_models(), only=["nope"], stages=["bogus"])
    assert [i.path for i in info.value.issues] == ["--only", "--stages"]


# ---------------------------------------------------------------------------------------------
# shipped configs


SHIPPED = sorted(CONFIGS.glob("*.yaml"))


def test_the_shipped_configs_are_found() -> None:
    assert {p.name for p in SHIPPED} >= {"demo.yaml", "failures.yaml"}


@pytest.mark.parametrize("config", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_validates(config: Path) -> None:
    pipeline = load_config(config)
    raw_names = [m["name"] for m in yaml.safe_load(config.read_text())["models"]]
    assert [m.name for m in pipeline.models] == raw_names
    assert all(m.search_path == str(CONFIGS) for m in pipeline.models)
    assert check_stage_list(pipeline.stages) == []
    # first the editor's schema line (tests/flows/test_config_schema.py), then how to run it
    assert config.read_text().splitlines()[1].startswith("# Run with: pt2flow run configs/")


# ---------------------------------------------------------------------------------------------
# good-path values


def test_defaults_are_merged_under_per_model_overrides() -> None:
    text = """\
version: 1
defaults:
  validate: {atol: 1.0e-5, rtol: 1.0e-3, seed: 7}
  trace: {strict: true}
models:
  - name: loose
    factory: tests.models:tiny_mlp
    inputs: {x: {shape: [4, 8]}}
    stages: {validate: {atol: 1.0e-2}}
  - name: plain
    factory: tests.models:tiny_mlp
    inputs: {x: {shape: [4, 8]}}
"""
    pipeline = parse(text)
    loose = pipeline.model("loose").options["validate"]
    plain = pipeline.model("plain").options["validate"]
    assert isinstance(loose, ValidateOptions) and isinstance(plain, ValidateOptions)
    assert (loose.atol, loose.rtol, loose.seed, loose.samples) == (1.0e-2, 1.0e-3, 7, 3)
    assert (plain.atol, plain.rtol, plain.seed) == (1.0e-5, 1.0e-3, 7)
    assert pipeline.model("loose").options["trace"].strict is True  # type: ignore[attr-defined]
    assert set(pipeline.model("plain").options) == set(KNOWN)
    with pytest.raises(KeyError):
        pipeline.model("absent")


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("./own-store", "{folder}/own-store"),
        ("own-store", "{folder}/own-store"),
        ("../shared/store", "{parent}/shared/store"),
        ("/abs/store", "/abs/store"),
        ("~/pt2", "{home}/pt2"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("memory://x", "memory://x"),
        ("file:///data/store", "file:///data/store"),
    ],
)
def test_store_resolves_against_the_config_folder_not_the_current_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, expected: str
) -> None:
    folder = tmp_path / "configs"
    config = folder / "own.yaml"
    folder.mkdir()
    config.write_text(textwrap.dedent(GOOD) + f"store: {store}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    want = expected.format(folder=folder, parent=tmp_path, home=os.path.expanduser("~"))
    assert load_config(config).store == want
    assert load_config(os.path.relpath(config)).store == want  # a relative config path, read from elsewhere
    assert read_store_settings(config) == (want, {})  # what the query commands' --config read


def test_store_settings_alone_ignore_the_models_and_report_their_own_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ls --config` reads a config's store even when its models could not run here; a store or
    storage_options of the wrong type is a ConfigError at its YAML line; ${ENV} is expanded."""
    monkeypatch.setenv("PT2_TEST_ENDPOINT", "http://127.0.0.1:9")
    config = tmp_path / "c.yaml"
    config.write_text(
        "version: 1\nstore: s3://b/p\nstorage_options: {client_kwargs: {endpoint_url: '${PT2_TEST_ENDPOINT}'}}\n"
        "models: [{name: m, factory: 'no_such_module:f'}]\n"
    )
    assert read_store_settings(config) == ("s3://b/p", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})
    with pytest.raises(ConfigError):
        load_config(config)  # the full load refuses the factory
    config.write_text("version: 1\nstore: [a, b]\nstorage_options: 3\nmodels: []\n")
    with pytest.raises(ConfigError) as info:
        read_store_settings(config)
    assert [(i.path, i.line) for i in info.value.issues] == [("store", 2), ("storage_options", 3)]
    with pytest.raises(ConfigError) as info:
        read_store_settings(tmp_path / "missing.yaml")
    assert "cannot read the config file" in info.value.issues[0].message


def test_omitted_sections_take_the_documented_defaults() -> None:
    pipeline = parse(GOOD)
    assert pipeline.store == str(ROOT / "pt2-store")  # ./pt2-store beside the config, like any relative path in it
    assert pipeline.stages == STAGES
    assert dict(pipeline.storage_options) == {}
    model = pipeline.models[0]
    assert model.weights is None and dict(model.kwargs) == {}
    assert dict(model.dynamic_shapes) == {} and dict(model.dims) == {}
    validate = model.options["validate"]
    assert (validate.atol, validate.rtol, validate.samples, validate.seed, validate.benchmark) == (
        1.0e-5,
        1.0e-4,
        3,
        0,
        False,
    )  # type: ignore[attr-defined]
    assert model.options["decompose"].table == "core_aten"  # type: ignore[attr-defined]
    assert model.options["aot_compile"].device == "cpu"  # type: ignore[attr-defined]
    assert model.training is False


def test_dims_become_min_max_tuples_and_dynamic_shapes_keep_int_indices() -> None:
    text = one_model(
        inputs="{ids: {shape: [2, 12], dtype: int64, low: 0, high: 100}, mask: {shape: [2, 12], dtype: int64, value: 1}}",
        dynamic_shapes="{ids: {0: batch, 1: seq}, mask: {0: batch, 1: seq}}",
        dims="{batch: {min: 1, max: 16}, seq: {min: 2, max: 64}}",
    )
    model = parse(text).models[0]
    assert dict(model.dims) == {"batch": (1, 16), "seq": (2, 64)}
    assert {k: dict(v) for k, v in model.dynamic_shapes.items()} == {
        "ids": {0: "batch", 1: "seq"},
        "mask": {0: "batch", 1: "seq"},
    }
    ids = model.inputs["ids"]
    assert (ids.shape, ids.dtype, ids.low, ids.high, ids.value) == ([2, 12], "int64", 0, 100, None)
    assert model.inputs["mask"].value == 1


def test_training_mode_is_exposed_on_the_resolved_model() -> None:
    text = "version: 1\ndefaults: {functionalize: {mode: training}}\nmodels:\n"
    text += "  - name: reg\n    factory: tests.models:regressor\n    inputs: {x: {shape: [4, 4]}, y: {shape: [4]}}\n"
    text += "    stages: {functionalize: {loss_output: 0}}\n"
    text += "  - name: inf\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    text += "    stages: {functionalize: {mode: inference}}\n"
    pipeline = parse(text)
    reg = pipeline.model("reg")
    assert reg.training is True
    assert isinstance(reg.options["functionalize"], FunctionalizeOptions)
    assert reg.options["functionalize"].loss_output == 0  # type: ignore[attr-defined]
    assert pipeline.model("inf").training is False


def test_the_raw_config_keeps_unexpanded_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT2_TEST_SECRET", "s3cr3t")
    pipeline = parse(GOOD.replace("version: 1\n", "version: 1\nstorage_options: {secret: '${PT2_TEST_SECRET}'}\n"))
    assert pipeline.storage_options["secret"] == "s3cr3t"
    assert "s3cr3t" not in repr(pipeline)
    assert pipeline.raw["storage_options"] == {"secret": "${PT2_TEST_SECRET}"}


# ---------------------------------------------------------------------------------------------
# the CLI


BAD = """\
version: 1
models:
  - name: mlp
    factory: tests.models:tiny_mlp
    inputs:
      x: {shape: [4, 8], dtype: float}
  - name: mlp
    factory: tests.models:tiny_mlp
    inputs: {x: {shape: [4, 8]}}
"""


@pytest.mark.integration  # `pt2flow validate` as a subprocess
def test_cli_validate_accepts_a_good_config(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "good.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}}],
        stages=["trace", "serialize"],
    )
    proc = run_cli(["validate", str(config)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{config}: ok" in proc.stdout
    proc = run_cli(["validate", str(config), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "config": str(config),
        "valid": True,
        "models": ["mlp"],
        "stages": ["trace", "serialize"],
        "imported": 1,
        "notes": [],
    }


@pytest.mark.integration  # `pt2flow validate` as a subprocess
def test_cli_validate_rejects_a_bad_config_with_path_and_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(BAD.replace("dtype: float}", "dtype: float}\n    colour: red"))
    proc = run_cli(["validate", str(config)], timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"{config}:6: models[0].inputs.x.dtype:" in proc.stderr
    assert f"{config}:7: models[0].colour: unknown key" in proc.stderr
    proc = run_cli(["validate", str(config), "--json"], timeout=120)
    assert proc.returncode == 2
    assert f"{config}:6: models[0].inputs.x.dtype:" in proc.stderr


@pytest.mark.integration  # `pt2flow validate` as a subprocess
def test_cli_validate_reports_semantic_problems(tmp_path: Path) -> None:
    config = tmp_path / "dup.yaml"
    config.write_text(BAD.replace("dtype: float}", "dtype: float32}"))
    proc = run_cli(["validate", str(config)], timeout=120)
    assert proc.returncode == 2
    assert f"{config}:7: models[1].name: duplicate model name 'mlp' (also models[0])" in proc.stderr


def test_cli_validate_on_a_missing_file_exits_2(tmp_path: Path) -> None:
    proc = run_cli(["validate", str(tmp_path / "absent.yaml")], timeout=120)
    assert proc.returncode == 2
    assert "cannot read the config file" in proc.stderr


def test_cli_run_on_a_bad_config_exits_2_and_creates_no_store(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(BAD)
    store = tmp_path / "store"
    proc = run_cli(["run", str(config), "--store", str(store), "--json"], timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"{config}: 2 problems in the config:" in proc.stderr
    assert f"{config}:6: models[0].inputs.x.dtype:" in proc.stderr
    assert not store.exists()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--only", "nope"], "--only: no model named ['nope']"),
        (["--stages", "trace,validate"], "--stages: validate needs serialize"),
    ],
)
def test_cli_run_with_bad_overrides_exits_2_and_creates_no_store(
    tmp_path: Path, extra: list[str], fragment: str
) -> None:
    config = write_config(
        tmp_path / "good.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}}],
    )
    store = tmp_path / "store"
    proc = run_cli(["run", str(config), "--store", str(store), *extra], timeout=120)
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert not store.exists()


def test_a_weights_url_with_credentials_is_refused_without_echoing_them() -> None:
    text = "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n"
    text += "    weights: https://reader:t0ken-sentinel@example.com/w.safetensors\n    inputs: {x: {shape: [3, 8]}}\n"
    with pytest.raises(ConfigError) as caught:
        parse(text)
    rendered = caught.value.render()
    assert "models[0].weights: the weights URL holds credentials" in rendered
    assert "t0ken-sentinel" not in rendered
