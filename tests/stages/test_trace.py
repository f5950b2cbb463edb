"""trace: torch.export.export with the fallback ladder, failure classes and program metadata."""

from __future__ import annotations

import re

import pytest
import torch

from pt2flow.stages.errors import StageError
from pt2flow.stages.options import TraceOptions
from pt2flow.stages.serialize import stored_program
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.trace import trace
from tests import models
from tests.stages.helpers import builder, mlp_inputs, static_inputs, traced


def _strategies(attempts) -> list[tuple[str, bool, str | None]]:
    return [(a["strategy"], a["strict"], a["error_class"]) for a in attempts]


# --- the configured strategy works ------------------------------------------------------------


def test_dynamic_mlp_exports_with_the_configured_strategy() -> None:
    build = builder(models.tiny_mlp)
    result = traced(build, mlp_inputs())
    meta = result.metadata
    assert meta["strategy"] == "configured"
    assert meta["strict"] is False
    assert _strategies(meta["attempts"]) == [("configured", False, None)]
    assert meta["attempts"][0]["dynamic_shapes"] == [{"0": "batch"}]
    assert result.warnings == ()
    # the program really is dynamic: it runs at a batch other than the example's, as eager does
    x = torch.randn(7, 8)
    torch.testing.assert_close(result.output.module()(x), build()(x))


def test_metadata_of_a_dynamic_mlp() -> None:
    result = traced(builder(models.tiny_mlp), mlp_inputs(1, 16))
    meta, ep = result.metadata, result.output
    assert meta["op_histogram"] == {"aten.linear.default": 2, "aten.relu.default": 1}
    # 4 parameters + x, linear, relu, linear, output
    assert meta["node_count"] == 9 == len(ep.graph.nodes)
    sig = meta["signature"]
    assert sig["counts"] == {"in.PARAMETER": 4, "in.USER_INPUT": 1, "out.USER_OUTPUT": 1}
    assert len(sig["inputs"]) == 1 and sig["inputs"][0]["name"] == "x"
    batch_symbol, features = sig["inputs"][0]["shape"]
    assert features == "8" and sig["inputs"][0]["dtype"] == "float32"
    assert re.fullmatch(r"s\d+", batch_symbol)
    assert sig["outputs"] == [{"kind": "USER_OUTPUT", "target": None, "shape": [batch_symbol, "4"], "dtype": "float32"}]
    assert meta["range_constraints"] == {batch_symbol: [1, 16]}
    assert meta["dims"] == {"batch": {"min": 1, "max": 16, "static": False, "value": None}}
    assert meta["training"] is False
    # no fingerprint of the in-memory program: the record's is the stored program's, computed once
    # when it is published (stages.serialize.stored_program; test_serialize checks it is stable)
    assert "fingerprint" not in meta
    assert re.fullmatch(r"[0-9a-f]{64}", stored_program(result.output).fingerprint)


def test_metadata_of_a_static_program_and_a_training_model() -> None:
    inputs = ModelInputs({"x": InputSpec((3, 4)), "y": InputSpec((3,))})
    meta = traced(builder(models.regressor, training=True, loss_output=0), inputs).metadata
    assert meta["range_constraints"] == {}
    assert meta["dims"] == {}
    assert meta["training"] is True
    assert [i["shape"] for i in meta["signature"]["inputs"]] == [["3", "4"], ["3"]]
    assert [i["name"] for i in meta["signature"]["inputs"]] == ["x", "y"]
    # the TrainingStep wrapper returns the scalar loss: one 0-d output
    assert meta["signature"]["outputs"][0]["shape"] == []
    assert meta["signature"]["counts"]["in.PARAMETER"] == 6  # fc1, norm, fc2: weight and bias each


# --- the fallback ladder ----------------------------------------------------------------------


def test_non_strict_failure_falls_back_to_strict() -> None:
    result = traced(builder(models.numpy_round_trip), static_inputs(2, 3), strict=False)
    meta = result.metadata
    assert meta["strategy"] == "other_strictness"
    assert meta["strict"] is True
    steps = _strategies(meta["attempts"])
    assert [s[:2] for s in steps] == [("configured", False), ("other_strictness", True)]
    assert steps[0][2] is not None and steps[1][2] is None
    assert meta["attempts"][0]["error"]  # the failure is kept, not just its class
    assert result.warnings[0].startswith("exported with fallback strategy 'other_strictness' after configured:")
    x = torch.randn(2, 3)
    torch.testing.assert_close(result.output.module()(x), x * 3)


def test_strict_failure_falls_back_to_non_strict() -> None:
    result = traced(builder(models.graph_break), static_inputs(2, 3), strict=True)
    assert result.metadata["strategy"] == "other_strictness"
    assert result.metadata["strict"] is False
    assert [s[:2] for s in _strategies(result.metadata["attempts"])] == [
        ("configured", True),
        ("other_strictness", False),
    ]
    x = torch.randn(2, 3)
    torch.testing.assert_close(result.output.module()(x), (x + 1) * 2)


def test_without_fallback_only_the_configured_strategy_is_tried() -> None:
    with pytest.raises(StageError) as info:
        traced(builder(models.numpy_round_trip), static_inputs(2, 3), strict=False, fallback=False)
    err = info.value
    assert [a["strategy"] for a in err.attempts] == ["configured"]
    assert err.error_class == "unsupported_op"
    assert "(tried: configured)" in err.message


def test_suggested_fix_specializes_a_baked_in_batch() -> None:
    result = traced(builder(models.batch_of_four), mlp_inputs(1, 16))
    meta = result.metadata
    assert meta["strategy"] == "suggested_fixes"
    steps = _strategies(meta["attempts"])
    assert steps == [("configured", False, "dynamic_shape"), ("suggested_fixes", False, None)]
    assert meta["attempts"][1]["dynamic_shapes"] == [{"0": 4}]  # torch's fix: batch = 4
    assert meta["dims"] == {"batch": {"min": 4, "max": 4, "static": True, "value": 4}}
    assert meta["range_constraints"] == {}
    assert meta["signature"]["inputs"][0]["shape"] == ["4", "8"]
    assert "dynamic dims specialized to static sizes: batch" in result.warnings


def test_suggested_fix_narrows_a_range_and_keeps_the_dim_dynamic() -> None:
    result = traced(builder(models.branch_on_batch), mlp_inputs(1, 16))
    meta = result.metadata
    assert meta["strategy"] == "suggested_fixes"
    assert "Suggested fixes" in meta["attempts"][0]["error"]
    assert meta["attempts"][1]["dynamic_shapes"] == [{"0": "batch"}]
    dims = meta["dims"]["batch"]
    assert dims["static"] is False and dims["max"] == 4
    module = result.output.module()
    x = torch.randn(3, 8)
    torch.testing.assert_close(module(x), x + 1)  # batch 3 is in the refined range
    with pytest.raises(AssertionError, match=r"Guard failed: .*\[0\] <= 4"):
        module(torch.randn(5, 8))  # batch 5 is not: the program guards on it


def test_static_fallback_when_no_dynamic_strategy_works() -> None:
    # the example batch (4) lies outside the configured range [1, 2]: no dynamic export can
    # succeed and torch has no fix to suggest, so the ladder ends with static shapes
    result = traced(builder(models.tiny_mlp), mlp_inputs(1, 2))
    meta = result.metadata
    assert meta["strategy"] == "static"
    assert _strategies(meta["attempts"]) == [
        ("configured", False, "dynamic_shape"),
        ("other_strictness", True, "dynamic_shape"),
        ("static", False, None),
    ]
    assert meta["attempts"][-1]["dynamic_shapes"] is None
    assert meta["dims"] == {"batch": {"min": 4, "max": 4, "static": True, "value": 4}}
    assert meta["range_constraints"] == {}
    assert result.warnings[0] == (
        "exported with fallback strategy 'static' after configured: dynamic_shape; other_strictness: dynamic_shape"
    )


def test_no_static_fallback_unless_allowed() -> None:
    with pytest.raises(StageError) as info:
        traced(builder(models.tiny_mlp), mlp_inputs(1, 2), fallback=False)
    assert info.value.error_class == "dynamic_shape"
    assert [a["strategy"] for a in info.value.attempts] == ["configured"]


# --- failures: class, attempts, draft_export report -------------------------------------------


def test_data_dependent_control_flow_is_classified_and_keeps_a_draft_export_report() -> None:
    with pytest.raises(StageError) as info:
        traced(builder(models.data_dependent), static_inputs(3))
    err = info.value
    assert err.error_class == "data_dependent"
    assert _strategies(err.attempts) == [
        ("configured", False, "data_dependent"),
        ("other_strictness", True, "data_dependent"),
    ]
    assert err.details["attempts"] == list(err.attempts)
    assert err.report is not None
    report = err.report.lower()
    # draft_export's own diagnosis, pointing at the user's line (not an empty "no issues" report)
    assert "data dependent error" in report
    assert "no issues are found" not in report
    assert "x.sum() > 0" in err.report
    assert "\x1b[" not in err.report  # ANSI colours stripped


def test_output_of_an_unregistered_class_is_a_pytree_error() -> None:
    with pytest.raises(StageError) as info:
        traced(builder(models.python_object_out), static_inputs(3))
    err = info.value
    assert err.error_class == "pytree"
    assert "Holder" in err.message
    assert {a["error_class"] for a in err.attempts} == {"pytree"}
    assert err.report  # a diagnostic is kept even when draft_export cannot run either


def test_a_model_that_fails_in_eager_is_a_runtime_error_that_says_so() -> None:
    with pytest.raises(StageError) as info:
        traced(builder(models.tiny_mlp), static_inputs(4, 5))  # 5 features; fc1 wants 8
    err = info.value
    assert err.error_class == "runtime"
    assert "fails in eager mode" in err.message
    assert "shapes cannot be multiplied" in err.message


def test_trace_never_prints(capsys: pytest.CaptureFixture[str]) -> None:
    # torch.export print()s the partial graph of a failed export to stderr: stages never print
    with pytest.raises(StageError):
        trace(models.data_dependent(), static_inputs(3), TraceOptions())
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""
