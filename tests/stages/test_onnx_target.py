"""onnx target: torch.onnx.export of the functional program, run in ONNX Runtime against eager;
the dynamic dims kept, dict outputs, external data, training refused, an untranslatable op named
as `lowering`, its repro in a fresh process, validate and check-compat running the model."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from pt2flow.stages.compat import check_artifact
from pt2flow.stages.errors import StageError
from pt2flow.stages.onnx_target import FORMAT_SINGLE, FORMAT_ZIP, export_onnx, load_onnx
from pt2flow.stages.options import ValidateOptions
from pt2flow.stages.result import StageResult
from pt2flow.stages.target_options import OnnxOptions
from pt2flow.stages.targets import TargetArtifact
from pt2flow.stages.validate import validate
from pt2flow.stages.validation_io import unpack
from tests import models
from tests.stages.conftest import TargetCase
from tests.stages.helpers import runner_errors_at

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def seq_onnx(seq_case: TargetCase) -> StageResult:
    return export_onnx(seq_case.program, OnnxOptions(), dim_names=seq_case.dim_names)


@pytest.fixture(scope="module")
def dict_onnx(dict_case: TargetCase) -> StageResult:
    return export_onnx(dict_case.program, OnnxOptions(), dim_names=dict_case.dim_names)


def test_dynamic_batch_and_sequence_stay_dynamic_and_match_eager_at_min_middle_and_max(
    seq_case: TargetCase, seq_onnx: StageResult
) -> None:
    meta = seq_onnx.metadata
    assert meta["format"] == FORMAT_SINGLE and seq_onnx.output[:4] != b"PK\x03\x04"
    assert meta["inputs"] == [{"name": "x", "shape": ["batch", "seq", 8], "dtype": "float"}]
    assert [o["shape"] for o in meta["outputs"]] == [["batch", "seq", 8], ["batch", 8]]
    assert meta["opset"] >= 18 and meta["node_count"] == sum(meta["op_histogram"].values()) > 0
    assert "LayerNormalization" in meta["op_histogram"] and "Softmax" in meta["op_histogram"]
    runner = load_onnx(seq_onnx.output)
    for sizes in ({"batch": 1, "seq": 2}, {"batch": 5, "seq": 9}, {"batch": 8, "seq": 16}):
        assert max(runner_errors_at(seq_case, runner, sizes)) < 1e-5, sizes
    # what the benchmark times: the session on inputs converted once, the same outputs as a call
    x = torch.randn(3, 4, 8)
    prepared = runner.prepare([x])  # type: ignore[attr-defined]
    for _ in range(2):  # called again on the same converted inputs
        for raw, called in zip(prepared(), runner([x]), strict=True):
            torch.testing.assert_close(torch.from_numpy(raw), called)


def test_without_dim_names_the_programs_symbols_name_the_dims(seq_case: TargetCase) -> None:
    shape = export_onnx(seq_case.program, OnnxOptions()).metadata["inputs"][0]["shape"]
    symbols = sorted(str(s) for s in seq_case.program.range_constraints)
    assert sorted(shape[:2]) == symbols and shape[2] == 8


def test_validate_runs_the_onnx_model_at_the_edges_of_every_dim(seq_case: TargetCase, seq_onnx: StageResult) -> None:
    report = validate(
        seq_case.build,
        seq_case.inputs,
        seq_case.dims,
        ValidateOptions(samples=4),
        targets={"onnx": TargetArtifact(seq_onnx.output, load_onnx)},
    ).output
    assert report["passed"] is True
    onnx = report["candidates"]["onnx"]
    assert [s["sizes"] for s in onnx["samples"][:3]] == [{}, {"batch": 1, "seq": 2}, {"batch": 8, "seq": 16}]
    assert all(s["ok"] for s in onnx["samples"]) and len(onnx["samples"]) == 4
    assert 0 < onnx["max_abs_err"] < 1e-5  # compared for real: float32 kernels differ a little from eager


def test_validate_catches_an_onnx_model_of_other_weights(seq_case: TargetCase) -> None:
    other = seq_case.build()
    with torch.no_grad():
        other.proj.bias.add_(0.5)  # (a constant added to every weight would cancel: layer norm centres x)
    program = torch.export.export(
        other,
        (torch.randn(3, 5, 8),),
        dynamic_shapes=({0: torch.export.Dim("b", max=8), 1: torch.export.Dim("s", min=2, max=16)},),
    )
    wrong = export_onnx(program, OnnxOptions()).output
    with pytest.raises(StageError) as info:
        validate(
            seq_case.build,
            seq_case.inputs,
            seq_case.dims,
            ValidateOptions(samples=3),
            targets={"onnx": TargetArtifact(wrong, load_onnx)},
        )
    assert info.value.error_class == "numeric_mismatch"
    assert "onnx on example" in info.value.message
    assert info.value.details["candidates"]["onnx"]["max_abs_err"] > 1e-3


def test_dict_outputs_keep_every_leaf(dict_case: TargetCase, dict_onnx: StageResult) -> None:
    outputs = dict_onnx.metadata["outputs"]
    assert [o["dtype"] for o in outputs] == ["float", "float", "int64"]  # hidden, pooled, argmax
    assert dict_onnx.metadata["op_histogram"]["ArgMax"] == 1
    runner = load_onnx(dict_onnx.output)
    errors = runner_errors_at(dict_case, runner, {"batch": 7})
    assert len(errors) == 3 and max(errors) < 1e-5
    report = validate(
        dict_case.build,
        dict_case.inputs,
        dict_case.dims,
        ValidateOptions(samples=3),
        targets={"onnx": TargetArtifact(dict_onnx.output, load_onnx)},
    ).output
    assert report["passed"] is True and report["candidates"]["onnx"]["samples"][2]["sizes"] == {"batch": 8}


def test_weights_above_the_threshold_go_to_external_data_in_a_zip() -> None:
    model = models.tiny_mlp(64, 256, 4).eval()  # fc1's weight: 64 KiB, past the saver's 1 KiB inline limit
    program = torch.export.export(model, (torch.randn(3, 64),), dynamic_shapes=({0: torch.export.Dim("batch", max=8)},))
    single = export_onnx(program, OnnxOptions())
    zipped = export_onnx(program, OnnxOptions(external_data_threshold_mb=0.01))
    assert single.metadata["format"] == FORMAT_SINGLE and zipped.metadata["format"] == FORMAT_ZIP
    assert zipped.metadata["weights_bytes"] == single.metadata["weights_bytes"] > 64 * 256 * 4
    with zipfile.ZipFile(io.BytesIO(zipped.output)) as archive:
        assert archive.namelist() == ["model.onnx", "model.onnx.data"]
        assert archive.getinfo("model.onnx.data").file_size >= 64 * 256 * 4 > archive.getinfo("model.onnx").file_size
    x = torch.randn(5, 64)
    from_zip, from_single = load_onnx(zipped.output)([x]), load_onnx(single.output)([x])
    assert torch.equal(from_zip[0], from_single[0]) and torch.allclose(from_zip[0], model(x), atol=1e-5)


def test_small_weights_stay_inline_below_any_threshold(seq_case: TargetCase) -> None:
    result = export_onnx(seq_case.program, OnnxOptions(external_data_threshold_mb=0))
    assert result.metadata["format"] == FORMAT_SINGLE  # every tensor under 1 KiB: nothing to move out


def test_the_same_program_gives_the_same_bytes(seq_case: TargetCase, seq_onnx: StageResult) -> None:
    assert export_onnx(seq_case.program, OnnxOptions(), dim_names=seq_case.dim_names).output == seq_onnx.output


def test_opset_option_converts_the_model(seq_case: TargetCase) -> None:
    result = export_onnx(seq_case.program, OnnxOptions(opset=18))
    assert result.metadata["opset"] == 18


def test_a_training_program_is_refused(joint_program: torch.export.ExportedProgram) -> None:
    with pytest.raises(StageError) as info:
        export_onnx(joint_program, OnnxOptions())
    assert info.value.error_class == "config"
    assert "takes inference programs" in info.value.message and "GRADIENT_TO_PARAMETER" in info.value.message


def test_an_op_without_an_onnx_translation_is_lowering_naming_it(wobbly_case: TargetCase) -> None:
    with pytest.raises(StageError) as info:
        export_onnx(wobbly_case.program, OnnxOptions())
    assert info.value.error_class == "lowering"
    assert info.value.message.startswith("ONNX export cannot translate pt2flow_test.wobble.default")
    assert info.value.details["ops"][0] == "pt2flow_test.wobble.default"


def test_check_compat_reruns_the_stored_samples(seq_case: TargetCase, seq_onnx: StageResult) -> None:
    done = validate(
        seq_case.build,
        seq_case.inputs,
        seq_case.dims,
        ValidateOptions(samples=3),
        targets={"onnx": TargetArtifact(seq_onnx.output, load_onnx)},
    )
    samples = unpack(done.side["io"])
    result = check_artifact("onnx", seq_onnx.output, samples, 1e-5, 1e-4, flat=load_onnx, target="onnx")
    assert (result["loads"], result["runs"], result["matches"], result["samples"]) == (True, True, True, 3)
    moved = [type(s)(s.label, s.args, s.kwargs, [o + 1 for o in s.outputs]) for s in samples]
    failed = check_artifact("onnx", seq_onnx.output, moved, 1e-5, 1e-4, flat=load_onnx, target="onnx")
    assert failed["matches"] is False and failed["error_class"] == "numeric_mismatch"
    assert (
        check_artifact("onnx", b"not onnx", samples, 1e-5, 1e-4, flat=load_onnx, target="onnx")["error_class"]
        == "incompatible"
    )
