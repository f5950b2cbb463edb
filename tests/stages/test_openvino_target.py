"""openvino target (stages/openvino_target.py, declared in flows/builtin/openvino.py), with the real OpenVINO: the shipped demo models
converted and validated against eager at the edges of every dynamic dim through load_runner; the
same program giving the same bytes in one process and in two; ops the frontend refuses named as
`lowering`; training and stateful programs refused; the repro body run as a plain script; the
stage's declaration, importable without torch or openvino."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from pt2flow.flows.builtin import openvino as target
from pt2flow.stages import openvino_target as runtime
from pt2flow.stages.openvino_target import (
    FORMAT,
    convert,
    load_openvino as load_runner,
    openvino_repro_body as repro_body,
)
from pt2flow.stages.target_options import OpenvinoOptions
from pt2flow.flows.config import load_config
from pt2flow.flows.engine.common.inputs import model_inputs
from pt2flow.flows.pipeline.stage import Stage
from pt2flow.stages.errors import StageError
from pt2flow.stages.functionalize import functionalize
from pt2flow.stages.options import FunctionalizeOptions, ValidateOptions
from pt2flow.stages.source import build_model, import_factory
from pt2flow.stages.targets import TargetArtifact
from pt2flow.stages.validate import validate
from tests.stages.conftest import TargetCase
from tests.stages.helpers import run_repro, runner_errors_at, traced

ROOT = Path(__file__).resolve().parents[2]


# --- the shipped demo models (configs/targets.yaml, and demo.yaml's inference models) ---------


@cache
def _shipped() -> dict[str, Any]:
    """Every inference model of the two shipped configs, by name (targets.yaml's are demo.yaml's)."""
    found = {}
    for config in ("demo.yaml", "targets.yaml"):
        for model in load_config(ROOT / "configs" / config).models:
            if not model.training:
                found[model.name] = model
    return found


@cache
def _demo_case(name: str) -> tuple[TargetCase, ValidateOptions]:
    model = _shipped()[name]
    factory = import_factory(model.factory, model.search_path)

    def build() -> torch.nn.Module:
        return build_model(factory, model.kwargs)

    inputs = model_inputs(model)
    tr = traced(build, inputs)
    program = functionalize(tr.output, FunctionalizeOptions()).output
    return TargetCase(build, inputs, tr.metadata["dims"], program, []), model.options["validate"]


# the demo models OpenVINO converts (all but the running normalizer, which updates buffers)
CONVERTED = ["mlp", "small-cnn", "tiny-encoder", "multi-head"]


def test_the_shipped_configs_inference_models_are_the_ones_tested() -> None:
    assert sorted(_shipped()) == sorted([*CONVERTED, "running-normalizer"])


@pytest.mark.parametrize("name", CONVERTED)
def test_a_demo_model_matches_eager_at_the_min_and_max_of_every_dynamic_dim(name: str) -> None:
    case, options = _demo_case(name)
    result = convert(case.program, OpenvinoOptions())
    assert result.metadata["format"] == FORMAT and result.output[:4] == b"PK\x03\x04"
    report = validate(
        case.build, case.inputs, case.dims, options, targets={"openvino": TargetArtifact(result.output, load_runner)}
    ).output
    assert report["passed"] is True, report
    samples = report["candidates"]["openvino"]["samples"]
    dims = case.inputs.dims
    assert [s["label"] for s in samples] == ["example", "min", "max"]
    assert samples[1]["sizes"] == {d: low for d, (low, _) in dims.items()}
    assert samples[2]["sizes"] == {d: high for d, (_, high) in dims.items()}
    assert all(s["ok"] for s in samples)
    assert report["candidates"]["openvino"]["max_abs_err"] < options.atol


def test_the_inputs_keep_static_dims_and_the_dynamic_dims_ranges() -> None:
    meta = convert(_demo_case("multi-head")[0].program, OpenvinoOptions()).metadata
    assert meta["inputs"] == [
        {"name": "x", "shape": ["1..8", "2..32", 12], "dtype": "f32"},
        {"name": "mask", "shape": ["1..8", "2..32"], "dtype": "f32"},
    ]
    # the dict's leaves, in the program's order: logits, score, label (argmax: int64, as eager)
    assert [o["dtype"] for o in meta["outputs"]] == ["f32", "f32", "i64"]
    assert [o["shape"] for o in meta["outputs"]] == [["1..8", "2..32", 5], ["1..8", "2..32"], ["1..8", "2..32"]]
    assert meta["node_count"] == sum(meta["op_histogram"].values()) and meta["op_histogram"]["MatMul"] == 3
    with zipfile.ZipFile(io.BytesIO(convert(_demo_case("mlp")[0].program, OpenvinoOptions()).output)) as archive:
        assert archive.namelist() == ["model.xml", "model.bin"]
        assert {i.date_time for i in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_a_runner_returns_torch_tensors_of_the_eager_dtypes(dict_case: TargetCase) -> None:
    runner = load_runner(convert(dict_case.program, OpenvinoOptions()).output)
    for sizes in ({"batch": 1}, {"batch": 8}):
        errors = runner_errors_at(dict_case, runner, sizes)  # checks shapes and dtypes (argmax: int64) leaf by leaf
        assert len(errors) == 3 and max(errors) < 1e-5
    with pytest.raises(ValueError, match="takes 2 tensors"):
        runner([torch.randn(2, 3, 6)])


class _NoneBetween(torch.nn.Module):
    def forward(self, x: torch.Tensor, options: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        return x * 3 + y if options["mask"] is None else x * 3 + y * options["mask"]


def test_a_none_between_tensor_inputs_leaves_each_input_its_own_shape() -> None:
    """A None the program was traced with (Qwen2's prefill mask) is a placeholder, and convert_model
    makes a Parameter of it: each tensor keeps its own shape and the converted model takes the
    tensors alone. Before, `y`'s shape went to the None's Parameter and `y` got none, and a runner
    fed two tensors to a model of three inputs; Qwen2's prefill failed to convert."""
    x, y = torch.randn(4, 3), torch.randn(3)
    program = torch.export.export(
        _NoneBetween().eval(),
        (x, {"mask": None}, y),
        dynamic_shapes=({0: torch.export.Dim("rows", min=2, max=8)}, {"mask": None}, None),
    ).run_decompositions({})
    assert [type(s.arg).__name__ for s in program.graph_signature.input_specs] == [
        "TensorArgument",
        "ConstantArgument",
        "TensorArgument",
    ]
    converted = convert(program, OpenvinoOptions())
    assert [i["shape"] for i in converted.metadata["inputs"]] == [["2..8", 3], [3]]
    runner = load_runner(converted.output)
    for rows in (2, 8):
        x = torch.randn(rows, 3)
        (out,) = runner([x, y])
        torch.testing.assert_close(out, x * 3 + y)


# --- the same program, the same bytes ----------------------------------------------------------


_CONVERT_IN_A_PROCESS = """
import hashlib, sys
import torch
from pt2flow.stages.openvino_target import convert
from pt2flow.stages.target_options import OpenvinoOptions
program = torch.export.load(sys.argv[1])
torch.nn.Linear(3, 3)  # unrelated work first: the converter's counters move on
print(hashlib.sha256(convert(program, OpenvinoOptions()).output).hexdigest())
"""


@pytest.mark.integration  # a fresh process
def test_the_same_program_gives_the_same_bytes_in_one_process_and_in_two(tmp_path: Path) -> None:
    program = _demo_case("tiny-encoder")[0].program
    first = convert(program, OpenvinoOptions()).output
    convert(_demo_case("small-cnn")[0].program, OpenvinoOptions())  # another model in between
    assert convert(program, OpenvinoOptions()).output == first
    torch.export.save(program, str(tmp_path / "program.pt2"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    fresh = subprocess.run(
        [sys.executable, "-c", _CONVERT_IN_A_PROCESS, str(tmp_path / "program.pt2")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    import hashlib

    assert fresh.stdout.split()[-1] == hashlib.sha256(first).hexdigest()


def test_the_options_change_the_bytes_and_the_precision_is_recorded_for_the_runner() -> None:
    program = _demo_case("mlp")[0].program
    plain = convert(program, OpenvinoOptions())
    half = convert(program, OpenvinoOptions(compress_to_fp16=True, inference_precision="bf16"))
    assert half.metadata["weights_bytes"] < plain.metadata["weights_bytes"]
    assert half.output != plain.output and half.metadata["inference_precision"] == "bf16"
    assert runtime.OpenvinoRunner(plain.output).precision == "f32"
    assert runtime.OpenvinoRunner(half.output).precision == "bf16"
    with pytest.raises(pydantic.ValidationError, match="inference_precision"):
        OpenvinoOptions(inference_precision="f64")
    with pytest.raises(pydantic.ValidationError, match="unknown"):
        OpenvinoOptions(unknown=1)


# --- refusals -----------------------------------------------------------------------------------


class _Apply(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _program(fn: Any, *args: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(_Apply(fn).eval(), args).run_decompositions({})


@pytest.mark.parametrize(
    ("fn", "shape", "op"),
    [
        (lambda x: torch.linalg.inv(x), (3, 4, 4), "aten.linalg_inv_ex.default"),
        (lambda x: torch.fft.rfft(x).abs(), (2, 8), "aten._fft_r2c.default"),
        (lambda x: torch.median(x, dim=1).values, (3, 4), "aten.median.dim"),
    ],
    ids=["linalg.inv", "fft.rfft", "median"],
)
def test_an_op_without_a_conversion_rule_is_lowering_naming_it(fn: Any, shape: tuple[int, ...], op: str) -> None:
    with pytest.raises(StageError) as info:
        convert(_program(fn, torch.randn(*shape)), OpenvinoOptions())
    assert info.value.error_class == "lowering"
    assert info.value.message.startswith(f"OpenVINO cannot convert {op}: No conversion rule found for operations: {op}")
    assert info.value.details["ops"] == [op]


def test_a_custom_op_is_named_and_the_failure_is_openvinos_not_the_models(wobbly_case: TargetCase) -> None:
    from pt2flow.stages.classify import failure_origin

    with pytest.raises(StageError) as info:
        convert(wobbly_case.program, OpenvinoOptions())
    assert info.value.error_class == "lowering" and info.value.details["ops"] == ["pt2flow_test.wobble.default"]
    from pt2flow.flows import pipeline

    # as the worker asks (flows/engine/worker/compute.py): the stages' declared libraries are framework
    origin = failure_origin(
        info.value, framework=pipeline.libraries()
    )  # the nearest frame outside it: this test's call
    assert origin is not None and not origin["module"].startswith("openvino")


def test_an_op_whose_conversion_fails_is_named_after_the_op_it_lacks() -> None:
    program = _program(lambda x: torch.view_as_real(torch.fft.fft(x)), torch.randn(2, 8))
    with pytest.raises(StageError) as info:
        convert(program, OpenvinoOptions())
    assert info.value.error_class == "lowering"
    assert info.value.details["ops"] == ["aten._fft_r2c.default", "aten.view_as_real.default"]
    assert "Conversion is failed for: aten.view_as_real.default" in info.value.message


def test_a_program_that_updates_buffers_is_refused() -> None:
    case, _ = _demo_case("running-normalizer")
    with pytest.raises(StageError) as info:
        convert(case.program, OpenvinoOptions())
    assert info.value.error_class == "lowering" and "stateless" in info.value.message
    assert info.value.details["buffers"] == ["calls", "running_mean"]


def test_a_training_program_is_refused(joint_program: torch.export.ExportedProgram) -> None:
    with pytest.raises(StageError) as info:
        convert(joint_program, OpenvinoOptions())
    assert info.value.error_class == "config" and "takes inference programs" in info.value.message


def test_without_openvino_the_stage_and_the_runner_say_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    for call in (lambda: convert(_demo_case("mlp")[0].program, OpenvinoOptions()), lambda: load_runner(b"")):
        with pytest.raises(StageError) as info:
            call()
        assert info.value.error_class == "config"
        assert info.value.message == "the openvino target needs openvino: pip install 'pt2flow[openvino]'"


def test_bytes_that_are_not_its_zip_do_not_load() -> None:
    with pytest.raises(zipfile.BadZipFile):
        load_runner(b"not a zip")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model.onnx", b"")
    with pytest.raises(ValueError, match="not a pt2flow OpenVINO zip"):
        load_runner(buffer.getvalue())


# --- the repro body ----------------------------------------------------------------------------


@pytest.fixture
def declined(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `import openvino` starts its telemetry unless declined: the test's scripts decline it."""
    monkeypatch.setenv("CI", "true")


def _script(body: str) -> str:
    return (
        "import torch\nimport tests.custom_op_models  # registers the custom op\nprogram = torch.export.load('program.pt2')\n"
        + body
    )


@pytest.mark.integration  # a fresh process
def test_the_repro_body_converts_and_runs_the_stored_program_in_a_plain_process(tmp_path: Path, declined: None) -> None:
    body = repro_body(OpenvinoOptions())
    assert "pt2flow" not in body
    proc = run_repro(_script(body), _demo_case("multi-head")[0].program, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran it: [(3, 6, 5), (3, 6), (3, 6)]" in proc.stdout and "did not reproduce" in proc.stdout
    assert "1..8" in (tmp_path / "model.xml").read_text()  # the same input shapes as the stage's


@pytest.mark.integration  # a fresh process
def test_the_repro_body_raises_the_frontends_refusal(wobbly_case: TargetCase, tmp_path: Path, declined: None) -> None:
    proc = run_repro(_script(repro_body(OpenvinoOptions())), wobbly_case.program, tmp_path)
    assert proc.returncode != 0
    assert (
        "OpConversionFailure" in proc.stderr
        and "No conversion rule found for operations: pt2flow_test.wobble.default" in proc.stderr
    )


# --- the declaration ---------------------------------------------------------------------------


def test_the_declaration_names_its_functions_and_imports_without_torch_or_openvino() -> None:
    stage = target.STAGE
    assert isinstance(stage, Stage) and (stage.name, stage.position, stage.accepts_training) == ("openvino", 80, False)
    assert stage.options is OpenvinoOptions and stage.libraries == ("openvino",) and stage.extra == "openvino"
    from pt2flow.flows.pipeline.stage import resolve

    assert (
        resolve(stage.compute) is target.compute
        and resolve(stage.candidate) is load_runner
        and resolve(stage.repro) is target.repro
    )
    probe = (
        "import sys, json; import pt2flow.flows.builtin.openvino; "
        "print(json.dumps(sorted(m for m in ('torch', 'openvino', 'numpy') if m in sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
