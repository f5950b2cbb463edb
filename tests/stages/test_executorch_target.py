"""executorch target: to_edge_transform_and_lower (XNNPACK) then to_executorch, the .pte run by the
ExecuTorch runtime against eager; bounded dynamic dims, dict outputs, an op XNNPACK does not take
(portable fallback, or `lowering` naming it), training refused, repro in a fresh process."""

from __future__ import annotations

import pytest
import torch

from pt2flow.stages.compat import check_artifact
from pt2flow.stages.errors import StageError
from pt2flow.stages.executorch_target import load_pte, lower_executorch
from pt2flow.stages.options import ValidateOptions
from pt2flow.stages.result import StageResult
from pt2flow.stages.target_options import ExecutorchOptions
from pt2flow.stages.targets import TargetArtifact
from pt2flow.stages.validate import validate
from pt2flow.stages.validation_io import unpack
from tests.stages.conftest import TargetCase
from tests.stages.helpers import runner_errors_at

pytest.importorskip("executorch")


@pytest.fixture(scope="module")
def seq_pte(seq_case: TargetCase) -> StageResult:
    return lower_executorch(seq_case.program, ExecutorchOptions())


@pytest.fixture(scope="module")
def dict_pte(dict_case: TargetCase) -> StageResult:
    return lower_executorch(dict_case.program, ExecutorchOptions())


@pytest.mark.integration  # lowers an encoder to ExecuTorch
def test_dynamic_batch_and_sequence_match_eager_at_min_middle_and_max(
    seq_case: TargetCase, seq_pte: StageResult
) -> None:
    meta = seq_pte.metadata
    assert meta["backends"] == ["XnnpackBackend"] and meta["partitions"] >= 1
    assert meta["delegated_ops"].get("aten.linear.default") == 2  # proj and score, kept whole for XNNPACK
    assert meta["delegated_nodes"] == sum(meta["delegated_ops"].values())
    assert meta["portable_nodes"] == sum(meta["portable_ops"].values())
    assert meta["size"] == len(seq_pte.output) and seq_pte.output[4:8] == b"ET12"  # the .pte flatbuffer's identifier
    runner = load_pte(seq_pte.output)
    for sizes in ({"batch": 1, "seq": 2}, {"batch": 5, "seq": 9}, {"batch": 8, "seq": 16}):
        assert max(runner_errors_at(seq_case, runner, sizes)) < 1e-5, sizes


def test_validate_runs_the_pte_at_the_edges_of_every_dim(seq_case: TargetCase, seq_pte: StageResult) -> None:
    report = validate(
        seq_case.build,
        seq_case.inputs,
        seq_case.dims,
        ValidateOptions(samples=4),
        targets={"executorch": TargetArtifact(seq_pte.output, load_pte)},
    ).output
    assert report["passed"] is True
    entry = report["candidates"]["executorch"]
    assert [s["sizes"] for s in entry["samples"][1:3]] == [{"batch": 1, "seq": 2}, {"batch": 8, "seq": 16}]
    assert all(s["ok"] for s in entry["samples"]) and 0 < entry["max_abs_err"] < 1e-5


def test_an_op_xnnpack_does_not_take_falls_back_to_portable_and_is_listed(
    dict_case: TargetCase, dict_pte: StageResult
) -> None:
    meta = dict_pte.metadata
    assert meta["portable_ops"].get("aten.argmax.default") == 1  # XNNPACK has no argmax
    assert "aten.argmax.default" not in meta["delegated_ops"] and meta["delegated_nodes"] > 0
    errors = runner_errors_at(dict_case, load_pte(dict_pte.output), {"batch": 6})
    assert len(errors) == 3 and max(errors) < 1e-5  # hidden, pooled and argmax (int64) all match


def test_without_portable_fallback_the_op_left_out_is_lowering_naming_it(dict_case: TargetCase) -> None:
    with pytest.raises(StageError) as info:
        lower_executorch(dict_case.program, ExecutorchOptions(portable_fallback=False))
    assert info.value.error_class == "lowering"
    assert "aten.argmax.default (x1)" in info.value.message and "portable_fallback is false" in info.value.message
    assert "aten.argmax.default" in info.value.details["ops"]
    assert "aten.linear.default" not in info.value.details["ops"]  # delegated ops are not blamed


def test_dict_outputs_validate_in_their_structure(dict_case: TargetCase, dict_pte: StageResult) -> None:
    report = validate(
        dict_case.build,
        dict_case.inputs,
        dict_case.dims,
        ValidateOptions(samples=3),
        targets={"executorch": TargetArtifact(dict_pte.output, load_pte)},
    ).output
    assert report["passed"] is True and report["candidates"]["executorch"]["samples"][2]["sizes"] == {"batch": 8}


def test_no_partitioner_runs_everything_on_portable_kernels(seq_case: TargetCase) -> None:
    result = lower_executorch(seq_case.program, ExecutorchOptions(partitioners=[]))
    meta = result.metadata
    assert meta["backends"] == [] and meta["delegated_nodes"] == 0 and meta["partitions"] == 0
    assert meta["portable_ops"].get("aten.native_layer_norm.default") == 1
    assert max(runner_errors_at(seq_case, load_pte(result.output), {"batch": 3, "seq": 4})) < 1e-5


def test_portable_fallback_off_without_a_partitioner_is_a_config_error(seq_case: TargetCase) -> None:
    with pytest.raises(StageError) as info:
        lower_executorch(seq_case.program, ExecutorchOptions(partitioners=[], portable_fallback=False))
    assert info.value.error_class == "config"


def test_an_unbounded_dim_fails_before_lowering_asking_for_a_max() -> None:
    model = torch.nn.Linear(8, 4).eval()
    program = torch.export.export(model, (torch.randn(3, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    with pytest.raises(StageError) as info:
        lower_executorch(program, ExecutorchOptions())
    assert info.value.error_class == "dynamic_shape"
    assert "unbounded: input 'input' dim 0" in info.value.message and "dim's max" in info.value.message


def test_a_training_program_is_refused(joint_program: torch.export.ExportedProgram) -> None:
    with pytest.raises(StageError) as info:
        lower_executorch(joint_program, ExecutorchOptions())
    assert info.value.error_class == "config"
    assert "takes inference programs" in info.value.message and "LOSS_OUTPUT" in info.value.message


def test_validate_refuses_targets_in_training_mode(
    joint_program: torch.export.ExportedProgram, seq_pte: StageResult
) -> None:
    from tests import models
    from tests.stages.helpers import builder, regressor_inputs

    with pytest.raises(StageError) as info:
        validate(
            builder(models.regressor, training=True),
            regressor_inputs(),
            {},
            ValidateOptions(),
            training=True,
            targets={"executorch": TargetArtifact(seq_pte.output, load_pte)},
        )
    assert info.value.error_class == "config" and "inference" in info.value.message


def test_check_compat_reruns_the_stored_samples(seq_case: TargetCase, seq_pte: StageResult) -> None:
    done = validate(
        seq_case.build,
        seq_case.inputs,
        seq_case.dims,
        ValidateOptions(samples=3),
        targets={"executorch": TargetArtifact(seq_pte.output, load_pte)},
    )
    samples = unpack(done.side["io"])
    result = check_artifact("pte", seq_pte.output, samples, 1e-5, 1e-4, flat=load_pte, target="executorch")
    assert (result["loads"], result["runs"], result["matches"], result["samples"]) == (True, True, True, 3)
    moved = [type(s)(s.label, s.args, s.kwargs, [o * 2 for o in s.outputs]) for s in samples]
    assert (
        check_artifact("pte", seq_pte.output, moved, 1e-5, 1e-4, flat=load_pte, target="executorch")["error_class"]
        == "numeric_mismatch"
    )
