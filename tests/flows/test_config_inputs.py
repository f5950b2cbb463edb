"""Config inputs beyond tensors (schema v1 extended): scalars, strings, null, lists, {tuple: [...]},
dicts, nested; dims trees mirroring them; inputs_factory and inputs_file; trace.fallback.static.
Every problem is reported at load time at its YAML path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pt2flow.flows.config.inputs import InputConfig
from pt2flow.flows.config.issues import ConfigError, ConfigIssue
from pt2flow.flows.config.load import parse_config
from pt2flow.flows.config.models import Pipeline
from pt2flow.flows.engine.common.inputs import dynamic_json, inputs_manifest, model_inputs, tree_json
from pt2flow.stages.binding import bind_inputs
from pt2flow.stages.example_inputs import InputSpec
from tests.conftest import ROOT

NESTED = """\
version: 1
models:
  - name: nested
    factory: tests.models:tiny_mlp
    inputs:
      xs: [{shape: [4, 3]}, {shape: [2], dtype: int64, low: 0, high: 5}]
      pair: {tuple: [{shape: [3]}, {w: {shape: [], value: 0.5}}]}
      cfg: {bias: {shape: [3]}, scale: 2.5, steps: 3, flag: true, mode: fast, none: null}
      odd_keys: {dict: {shape: 1, tuple: [1, 2]}}
      ints: {1: {shape: [2]}, 2: hello}
    dynamic_shapes:
      xs: [{0: batch}, null]
      pair: [{0: batch}, null]
      cfg: {bias: {0: batch}}
    dims: {batch: {min: 1, max: 8}}
"""


def parse(text: str, base_dir: Path | str = ROOT) -> Pipeline:
    return parse_config(textwrap.dedent(text), source="cfg.yaml", base_dir=str(base_dir))


def issues_of(text: str, base_dir: Path | str = ROOT) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        parse(text, base_dir)
    return info.value.issues


def only_issue(text: str, base_dir: Path | str = ROOT) -> ConfigIssue:
    issues = issues_of(text, base_dir)
    assert len(issues) == 1, issues
    return issues[0]


def test_every_input_kind_parses_to_its_python_value() -> None:
    model = parse(NESTED).models[0]
    xs, pair, cfg = model.inputs["xs"], model.inputs["pair"], model.inputs["cfg"]
    assert isinstance(xs, list) and isinstance(xs[0], InputConfig) and xs[1].dtype == "int64"
    assert isinstance(pair, tuple) and pair[1]["w"].value == 0.5
    assert {k: v for k, v in cfg.items() if k != "bias"} == {
        "scale": 2.5,
        "steps": 3,
        "flag": True,
        "mode": "fast",
        "none": None,
    }
    assert type(cfg["steps"]) is int and type(cfg["flag"]) is bool
    assert model.inputs["odd_keys"] == {"shape": 1, "tuple": [1, 2]}  # {dict: ...} takes any keys
    assert set(model.inputs["ints"]) == {1, 2} and model.inputs["ints"][2] == "hello"
    assert model.dynamic_shapes == {
        "xs": [{0: "batch"}, None],
        "pair": [{0: "batch"}, None],
        "cfg": {"bias": {0: "batch"}},
    }


def test_nested_inputs_reach_the_stages_with_dynamic_dims_inside_containers() -> None:
    model = parse(NESTED).models[0]
    built = model_inputs(model)
    assert isinstance(built.inputs["pair"], tuple) and built.inputs["pair"][0] == InputSpec((3,))

    class Takes(__import__("torch").nn.Module):
        def forward(self, xs, pair, cfg, odd_keys, ints):  # type: ignore[no-untyped-def]
            return xs[0]

    bound = bind_inputs(Takes(), built, dim_sizes={"batch": 6})
    xs, pair, cfg, odd_keys, ints = bound.args
    assert xs[0].shape == (6, 3) and pair[0].shape == (6,) and cfg["bias"].shape == (6,) and xs[1].shape == (2,)
    assert cfg["mode"] == "fast" and odd_keys == {"shape": 1, "tuple": [1, 2]} and ints[2] == "hello"
    leaves = {path: dims for path, _, dims in bound.tensor_leaves()}
    assert leaves["args[0][0]"] == {0: "batch"} and leaves["args[0][1]"] is None


def test_narrow_integer_inputs_are_made_in_their_dtype_and_range() -> None:
    import torch

    from tests.models import byte_image

    model = parse("""\
        version: 1
        models:
          - name: bytes
            factory: tests.models:byte_image
            inputs:
              image: {shape: [2, 3, 8], dtype: uint8, low: 200, high: 256}
              offset: {shape: [2, 3, 8], dtype: int8, low: -128, high: -100}
              ids: {shape: [2, 5], dtype: int16, low: 290, high: 300}
        """).models[0]
    bound = bind_inputs(byte_image(), model_inputs(model), seed=0)
    image, offset, ids = bound.args
    assert (image.dtype, offset.dtype, ids.dtype) == (torch.uint8, torch.int8, torch.int16)
    assert (
        200 <= int(image.min()) and int(image.max()) <= 255 and -128 <= int(offset.min()) and int(offset.max()) < -100
    )
    assert 290 <= int(ids.min()) and int(ids.max()) < 300


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("{shape: [2], dtype: uint8, low: -1}", "low -1 is outside what uint8 holds (0 to 255)"),
        ("{shape: [2], dtype: uint8, high: 257}", "high 257 is outside what uint8 holds"),
        ("{shape: [2], dtype: int8, value: 128}", "value 128 is outside what int8 holds (-128 to 127)"),
        ("{shape: [2], dtype: int16, low: -40000}", "outside what int16 holds (-32768 to 32767)"),
    ],
)
def test_narrow_integer_bounds_are_checked_at_load_time(spec: str, fragment: str) -> None:
    issue = only_issue(
        f"version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {{x: {spec}}}\n"
    )
    assert issue.path.startswith("models[0].inputs.x") and fragment in issue.message, issue


def test_source_key_json_keeps_schema_v1_for_tensor_inputs_and_spells_containers() -> None:
    flat = parse(
        "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
        "    dynamic_shapes: {x: {0: b}}\n    dims: {b: {min: 1, max: 8}}\n"
    ).models[0]
    manifest = inputs_manifest(flat)
    assert manifest == {
        "inputs": {"x": {"shape": [4, 8], "dtype": "float32", "low": None, "high": None, "value": None}},
        "dynamic_shapes": {"x": {"0": "b"}},
    }
    nested = parse(NESTED).models[0]
    assert tree_json(nested.inputs["pair"])["tuple"][1] == {
        "dict": [["w", {"shape": [], "dtype": "float32", "low": None, "high": None, "value": 0.5}]]
    }
    assert tree_json([1, (2,)]) != tree_json([1, [2]])  # a tuple and a list are different inputs
    assert dynamic_json(nested.dynamic_shapes["xs"]) == [{"0": "batch"}, None]


@pytest.mark.parametrize(
    ("inputs", "path", "fragment"),
    [
        ("{x: {tuple: {shape: [2]}}}", "models[0].inputs.x.tuple", "takes a list"),
        ("{x: {tuple: [1], y: 2}}", "models[0].inputs.x", "takes no other keys"),
        ("{x: [{shape: [2], dtype: float}]}", "models[0].inputs.x[0].dtype", "float32"),
        ("{x: {a: {b: {shape: [2], colour: red}}}}", "models[0].inputs.x.a.b.colour", "unknown key"),
        ("{x: 2024-01-01}", "models[0].inputs.x", "got date"),
        ("{x: [1, 2], 3: {shape: [1]}}", "models[0].inputs[3]", "not a forward() argument name"),
        ("[1, 2]", "models[0].inputs", "expected a mapping"),
    ],
)
def test_bad_inputs_are_reported_at_their_path(inputs: str, path: str, fragment: str) -> None:
    issue = only_issue(f"version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {inputs}\n")
    assert issue.path == path
    assert fragment in issue.message
    assert issue.line == 5


def _with_dynamic(
    dynamic: str, inputs: str = "{xs: [{shape: [4, 3]}, {shape: [2]}], n: 3, d: {a: {shape: [2]}}}"
) -> str:
    return (
        "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n"
        f"    inputs: {inputs}\n    dynamic_shapes: {dynamic}\n    dims: {{batch: {{min: 1, max: 8}}}}\n"
    )


@pytest.mark.parametrize(
    ("dynamic", "path", "fragment"),
    [
        ("{xs: {0: batch}}", "models[0].dynamic_shapes.xs", "a list of 2 takes a list of 2"),
        ("{xs: [{0: batch}]}", "models[0].dynamic_shapes.xs", "a list of 2 takes a list of 2"),
        ("{xs: [{2: batch}, null]}", "models[0].dynamic_shapes.xs[0][2]", "out of range for a rank-2 input"),
        ("{xs: [{0: seq}, null]}", "models[0].dynamic_shapes.xs[0][0]", "dim 'seq' has no definition"),
        ("{xs: [null, {0: batch}], n: {0: batch}}", "models[0].dynamic_shapes.n", "a int input has no dims"),
        ("{d: {b: {0: batch}}}", "models[0].dynamic_shapes.d.b", "has no key 'b'"),
        ("{xs: [{x: batch}, null]}", "models[0].dynamic_shapes.xs[0].x", "is not an integer"),
    ],
)
def test_bad_dims_trees_are_reported_at_their_path(dynamic: str, path: str, fragment: str) -> None:
    issue = only_issue(_with_dynamic(dynamic))
    assert issue.path == path
    assert fragment in issue.message
    assert issue.line == 6


def test_example_size_of_a_dim_inside_a_container_is_checked() -> None:
    issue = only_issue(_with_dynamic("{xs: [{0: batch}, null]}", inputs="{xs: [{shape: [40, 3]}, {shape: [2]}]}"))
    assert issue.path == "models[0].inputs.xs[0].shape"
    assert "example size 40" in issue.message


def test_inputs_factory_is_resolved_without_importing(tmp_path: Path) -> None:
    (tmp_path / "my_inputs.py").write_text(
        "raise RuntimeError('imported at load time')\n\ndef make():\n    return (), {}\n"
    )
    good = "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs_factory: my_inputs:make\n    dynamic_shapes: {x: {0: b}}\n    dims: {b: {min: 1, max: 4}}\n"
    model = parse(good, tmp_path).models[0]
    assert model.inputs_factory == "my_inputs:make" and model.inputs == {} and model.dynamic_shapes == {"x": {0: "b"}}
    issue = only_issue(good.replace("my_inputs:make", "my_inputs:missing"), tmp_path)
    assert (issue.path, issue.line) == ("models[0].inputs_factory", 5)
    assert "'missing' is not defined at the top level" in issue.message
    issue = only_issue(good.replace("{0: b}", "{0: c}"), tmp_path)
    assert issue.path == "models[0].dynamic_shapes.x[0]" and "dim 'c' has no definition" in issue.message


def test_inputs_factory_runs_and_its_code_is_in_the_source_key(tmp_path: Path) -> None:
    module = tmp_path / "my_inputs.py"
    module.write_text("import torch\n\ndef make():\n    return (torch.ones(2, 8),), {}\n")
    model = parse(
        "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs_factory: my_inputs:make\n",
        tmp_path,
    ).models[0]
    built = model_inputs(model)
    assert len(built.positional) == 1 and built.positional[0].shape == (2, 8)
    before = inputs_manifest(model)["inputs_factory"]
    module.write_text(module.read_text() + "# changed\n")
    assert inputs_manifest(model)["inputs_factory"]["code_hash"] != before["code_hash"]


def test_inputs_file_is_checked_at_load_time_and_hashed(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.full((2, 8), 3.0)}, str(tmp_path / "ex.safetensors"))
    text = "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs_file: ex.safetensors\n"
    model = parse(text, tmp_path).models[0]
    built = model_inputs(model)
    assert torch.equal(built.inputs["x"], torch.full((2, 8), 3.0))  # real data, not random
    assert len(inputs_manifest(model)["inputs_file"]["sha256"]) == 64
    issue = only_issue(text.replace("ex.safetensors", "missing.safetensors"), tmp_path)
    assert (issue.path, issue.line) == ("models[0].inputs_file", 5) and "file not found" in issue.message
    issue = only_issue(text.replace("ex.safetensors", "ex.npy"), tmp_path)
    assert issue.path == "models[0].inputs_file" and ".safetensors" in issue.message
    issue = only_issue(text + "    inputs: {x: {shape: [2, 8]}}\n", tmp_path)
    assert "one way" in issue.message


def test_trace_fallback_takes_a_bool_or_rungs() -> None:
    base = "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [4, 8]}}\n"
    assert parse(base + "    stages: {trace: {fallback: false}}\n").models[0].options["trace"].fallback is False
    options = parse(base + "    stages: {trace: {fallback: {static: false}}}\n").models[0].options["trace"]
    assert options.allows("static") is False and options.allows("other_strictness") is True
    issue = only_issue(base + "    stages: {trace: {fallback: {statik: false}}}\n")
    assert (issue.path, issue.message, issue.line) == (
        "models[0].stages.trace.fallback.statik",
        "unknown key; did you mean `static`?",
        6,
    )
    issue = only_issue(base + "    stages: {trace: {fallback: maybe}}\n")
    assert issue.path == "models[0].stages.trace.fallback" and "valid boolean" in issue.message
