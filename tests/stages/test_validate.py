"""validate: artifacts against eager on planned samples; mismatch, nondeterminism, training mode."""

from __future__ import annotations

import copy
from typing import Any
from collections.abc import Callable

import pytest
import torch
from torch.export.graph_signature import OutputKind

from pt2flow.stages.errors import StageError
from pt2flow.stages.options import ValidateOptions
from pt2flow.stages.serialize import serialize
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.comparison import compare
from pt2flow.stages.sample_plan import Sample, plan_samples
from pt2flow.stages.validate import validate
from tests import models
from tests.stages.helpers import builder, decomposed, mlp_inputs, regressor_inputs, static_inputs


def _archive(ep: torch.export.ExportedProgram) -> bytes:
    return serialize(ep, {}).output


@pytest.fixture(scope="module")
def mlp() -> dict[str, Any]:
    build = builder(models.tiny_mlp)
    tr, dec = decomposed(build, mlp_inputs(1, 16))
    return {"build": build, "dims": tr.metadata["dims"], "program": dec.output, "archive": _archive(dec.output)}


def _recording(build: Callable[[], torch.nn.Module], shapes: list[tuple[int, ...]]) -> Callable[[], torch.nn.Module]:
    """build, with a hook that records the shape of every eager call's first input."""

    def wrapped() -> torch.nn.Module:
        model = build()
        model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
        return model

    return wrapped


# --- a matching candidate ---------------------------------------------------------------------


def test_matching_archive_passes_with_errors_and_samples_at_min_and_max(mlp: dict[str, Any]) -> None:
    shapes: list[tuple[int, ...]] = []
    result = validate(
        _recording(mlp["build"], shapes),
        mlp_inputs(1, 16),
        mlp["dims"],
        ValidateOptions(samples=4, seed=0),
        archive=mlp["archive"],
    )
    report = result.output
    assert report["passed"] is True and report["nondeterministic"] is False
    assert report["samples"] == 4
    plan = report["plan"]
    assert [p["label"] for p in plan] == ["example", "min", "max", "random-1"]
    assert plan[0]["sizes"] == {} and plan[1]["sizes"] == {"batch": 1} and plan[2]["sizes"] == {"batch": 16}
    assert 1 <= plan[3]["sizes"]["batch"] <= 16
    # the eager reference (and its twin) really ran at those sizes
    batches = [s[0] for s in shapes]
    assert batches == [b for b in (4, 1, 16, plan[3]["sizes"]["batch"]) for _ in range(2)]
    archive = report["candidates"]["archive"]
    assert [s["label"] for s in archive["samples"]] == ["example", "min", "max", "random-1"]
    assert all(s["ok"] and s["failures"] == [] for s in archive["samples"])
    for key in ("max_abs_err", "max_rel_err"):
        assert isinstance(report[key], float) and 0.0 <= report[key] <= 1e-5
        assert archive[key] == max(s[key] for s in archive["samples"]) == report[key]
    assert result.metadata == {
        "passed": True,
        "max_abs_err": report["max_abs_err"],
        "max_rel_err": report["max_rel_err"],
    }
    assert "latency_ms" not in report


def test_stateful_model_validates_across_samples() -> None:
    # BufferCounter's output depends on buffers updated by every earlier call: the archive only
    # keeps up with eager if the buffer mutations were lifted and applied
    build = builder(models.buffer_counter)
    tr, dec = decomposed(build, mlp_inputs(2, 16))
    result = validate(
        build, mlp_inputs(2, 16), tr.metadata["dims"], ValidateOptions(samples=4), archive=_archive(dec.output)
    )
    assert result.output["passed"] is True
    assert result.output["plan"][1]["sizes"] == {"batch": 2}


def test_benchmark_records_latency(mlp: dict[str, Any]) -> None:
    result = validate(
        mlp["build"],
        mlp_inputs(1, 16),
        mlp["dims"],
        ValidateOptions(samples=1, benchmark=True, benchmark_runs=3),
        archive=mlp["archive"],
    )
    latency = result.output["latency_ms"]
    assert set(latency) == {"eager", "archive"}
    assert all(v > 0 for v in latency.values())


# --- failures -----------------------------------------------------------------------------------


def test_perturbed_candidate_is_a_numeric_mismatch(mlp: dict[str, Any]) -> None:
    ep = copy.deepcopy(mlp["program"])
    with torch.no_grad():
        ep.state_dict["fc2.bias"].add_(1e-3)  # every output element moves by exactly 1e-3
    with pytest.raises(StageError) as info:
        validate(mlp["build"], mlp_inputs(1, 16), mlp["dims"], ValidateOptions(samples=3), archive=_archive(ep))
    err = info.value
    assert err.error_class == "numeric_mismatch"
    assert "atol=1e-05" in err.message
    report = err.details
    assert report["passed"] is False and report["nondeterministic"] is False
    assert report["max_abs_err"] == pytest.approx(1e-3, rel=1e-3)
    samples = report["candidates"]["archive"]["samples"]
    assert [s["ok"] for s in samples] == [False, False, False]
    assert all(s["max_abs_err"] == pytest.approx(1e-3, rel=1e-3) for s in samples)


def test_every_output_leaf_is_compared() -> None:
    build = builder(models.dict_out)
    inputs = ModelInputs(
        {"x": InputSpec((3, 5, 6)), "scale": InputSpec((), value=2.0)}, {"x": {0: "batch"}}, {"batch": (1, 8)}
    )
    tr, dec = decomposed(build, inputs)
    ep = dec.output
    with torch.no_grad():
        ep.state_dict["proj.bias"].add_(0.01)  # hidden and pooled move by 0.02
    with pytest.raises(StageError) as info:
        validate(build, inputs, tr.metadata["dims"], ValidateOptions(samples=2), archive=_archive(ep))
    failures = info.value.details["candidates"]["archive"]["samples"][0]["failures"]
    failing_leaves = {f.split(":")[0] for f in failures}
    assert {"['hidden']", "['pooled']"} <= failing_leaves
    assert info.value.details["max_abs_err"] == pytest.approx(0.02, rel=1e-3)


def test_noisy_forward_is_nondeterministic_not_a_mismatch() -> None:
    build = builder(models.noisy)
    tr, dec = decomposed(build, static_inputs(4, 8))
    with pytest.raises(StageError) as info:
        validate(
            build, static_inputs(4, 8), tr.metadata["dims"], ValidateOptions(samples=2), archive=_archive(dec.output)
        )
    err = info.value
    assert err.error_class == "nondeterministic"
    assert "disagrees with itself" in err.message
    assert err.details["nondeterministic"] is True and err.details["passed"] is False


def test_candidate_that_raises_is_a_runtime_error() -> None:
    # an archive whose batch takes [1, 8], validated up to 16 (no trace dims to say otherwise)
    build = builder(models.tiny_mlp)
    tr, dec = decomposed(build, mlp_inputs(1, 8))
    with pytest.raises(StageError) as info:
        validate(build, mlp_inputs(1, 16), {}, ValidateOptions(samples=3), archive=_archive(dec.output))
    err = info.value
    assert err.error_class == "runtime"
    assert "archive raised on sample max {'batch': 16}" in err.message
    samples = err.details["candidates"]["archive"]["samples"]
    assert [(s["label"], s["ok"]) for s in samples] == [("example", True), ("min", True), ("max", False)]


def test_a_static_archive_for_a_dynamic_config_fails_before_any_sample() -> None:
    build = builder(models.tiny_mlp)
    tr, dec = decomposed(build, static_inputs(4, 8))
    with pytest.raises(StageError) as info:
        validate(build, mlp_inputs(1, 16), {}, ValidateOptions(samples=3), archive=_archive(dec.output))
    assert info.value.error_class == "numeric_mismatch"
    assert (
        info.value.message
        == "signature mismatch: input x: dim 0 (batch) is dynamic in the config but static (4) in the artifact"
    )
    assert info.value.details["candidates"]["archive"]["samples"] == []


def test_a_dim_the_export_specialized_is_not_varied() -> None:
    build = builder(models.batch_of_four)
    tr, dec = decomposed(build, mlp_inputs(1, 16))
    assert tr.metadata["dims"]["batch"]["static"] is True
    result = validate(
        build, mlp_inputs(1, 16), tr.metadata["dims"], ValidateOptions(samples=3), archive=_archive(dec.output)
    )
    assert result.output["passed"] is True
    assert [p["sizes"] for p in result.output["plan"]] == [{}, {}, {}]


def test_no_candidate_is_a_config_error(mlp: dict[str, Any]) -> None:
    with pytest.raises(StageError) as info:
        validate(mlp["build"], mlp_inputs(), mlp["dims"], ValidateOptions())
    assert info.value.error_class == "config"


def test_unreadable_archive_is_a_serialization_error(mlp: dict[str, Any]) -> None:
    with pytest.raises(StageError) as info:
        validate(mlp["build"], mlp_inputs(), mlp["dims"], ValidateOptions(), archive=b"not a zip")
    assert info.value.error_class == "serialization"


# --- training mode ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def regressor_joint() -> dict[str, Any]:
    build = builder(models.regressor, training=True, loss_output=0)
    tr, dec = decomposed(build, regressor_inputs(), mode="training")
    return {"build": build, "dims": tr.metadata["dims"], "program": dec.output}


def test_training_mode_compares_loss_and_gradients(regressor_joint: dict[str, Any]) -> None:
    result = validate(
        regressor_joint["build"],
        regressor_inputs(),
        regressor_joint["dims"],
        ValidateOptions(samples=3),
        archive=_archive(regressor_joint["program"]),
        training=True,
    )
    report = result.output
    assert report["passed"] is True and report["training"] is True
    assert [p["sizes"] for p in report["plan"]] == [{}, {"batch": 2}, {"batch": 16}]
    assert report["max_abs_err"] <= 1e-5


def _double_gradient(ep: torch.export.ExportedProgram, target: str) -> None:
    """Rewrite the joint program so that it returns twice the gradient of `target`."""
    graph = ep.graph
    out = next(n for n in graph.nodes if n.op == "output")
    specs = ep.graph_signature.output_specs
    index = next(i for i, s in enumerate(specs) if s.kind == OutputKind.GRADIENT_TO_PARAMETER and s.target == target)
    node = out.args[0][index]
    with graph.inserting_before(out):
        doubled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 2.0))
    doubled.meta = dict(node.meta)
    values = list(out.args[0])
    values[index] = doubled
    out.args = (tuple(values),)
    specs[index].arg.name = doubled.name
    ep.graph_module.recompile()


@pytest.mark.parametrize("parameter", ["model.fc1.weight", "model.norm.bias", "model.fc2.bias"])
def test_training_mode_checks_every_gradient(parameter: str) -> None:
    build = builder(models.regressor, training=True, loss_output=0)
    tr, dec = decomposed(build, regressor_inputs(), mode="training")
    _double_gradient(dec.output, parameter)
    with pytest.raises(StageError) as info:
        validate(
            build,
            regressor_inputs(),
            tr.metadata["dims"],
            ValidateOptions(samples=2),
            archive=_archive(dec.output),
            training=True,
        )
    assert info.value.error_class == "numeric_mismatch"
    failures = info.value.details["candidates"]["archive"]["samples"][0]["failures"]
    assert [f.split(":")[0] for f in failures] == [f"[1]['{parameter}']"]  # the loss ([0]) still matches


# --- the sample plan and the comparison -------------------------------------------------------


def test_plan_uses_the_programs_range_within_the_configured_one() -> None:
    dims = {"batch": {"min": 0, "max": 4, "static": False}, "seq": {"min": 3, "max": 3, "static": True, "value": 3}}
    plan = plan_samples(dims, {"batch": (1, 16), "seq": (2, 64)}, samples=5, seed=7)
    assert plan[:3] == [Sample("example", {}), Sample("min", {"batch": 1}), Sample("max", {"batch": 4})]
    assert [s.label for s in plan[3:]] == ["random-1", "random-2"]
    assert all(set(s.sizes) == {"batch"} and 1 <= s.sizes["batch"] <= 4 for s in plan[3:])
    assert plan == plan_samples(dims, {"batch": (1, 16), "seq": (2, 64)}, samples=5, seed=7)  # seeded
    assert plan_samples(dims, {"batch": (1, 16)}, samples=1, seed=0) == [Sample("example", {})]


def test_compare_checks_structure_shape_dtype_and_values() -> None:
    a = {"x": torch.ones(2), "n": torch.tensor([1, 2])}
    assert compare(a, {"x": torch.ones(2), "n": torch.tensor([1, 2])}, 1e-5, 1e-4).ok
    assert "structure" in compare({"x": torch.ones(2)}, a, 1e-5, 1e-4).failures[0]
    assert "shape" in compare({"x": torch.ones(3), "n": a["n"]}, a, 1e-5, 1e-4).failures[0]
    assert "dtype" in compare({"x": torch.ones(2, dtype=torch.float64), "n": a["n"]}, a, 1e-5, 1e-4).failures[0]
    off = compare({"x": torch.tensor([1.0, 1.5]), "n": a["n"]}, a, 1e-5, 1e-4)
    assert not off.ok and off.max_abs_err == pytest.approx(0.5) and off.max_rel_err == pytest.approx(0.5)
    nan = torch.tensor([float("nan"), 1.0])
    assert compare(nan, nan.clone(), 1e-5, 1e-4).ok
    assert not compare(torch.tensor([float("nan"), 1.0]), torch.ones(2), 1e-5, 1e-4).ok


# --- the compiled package as a candidate (shares the session's one compile) ---------------------


@pytest.mark.compile
def test_compiled_package_and_archive_both_validate(compiled_mlp) -> None:
    result = validate(
        builder(models.tiny_mlp),
        mlp_inputs(1, 16),
        compiled_mlp.trace.metadata["dims"],
        ValidateOptions(samples=3),
        archive=_archive(compiled_mlp.program),
        package=compiled_mlp.package.output,
    )
    report = result.output
    assert report["passed"] is True
    assert set(report["candidates"]) == {"archive", "compiled"}
    compiled = report["candidates"]["compiled"]
    assert [s["label"] for s in compiled["samples"]] == ["example", "min", "max"]
    assert all(s["ok"] for s in compiled["samples"])
    assert report["max_abs_err"] == max(c["max_abs_err"] for c in report["candidates"].values())
    assert report["max_abs_err"] <= 1e-5
