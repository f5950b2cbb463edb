"""validate checks each artifact's signature against the configured inputs and eager's outputs
before it compares a number (stages/signature.py): another model's program is caught even where
its kernel would accept the inputs (an embedding takes int64 and int32 ids alike)."""

from __future__ import annotations

import pytest
import torch

from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.options import ValidateOptions
from pt2flow.stages.serialize import serialize
from pt2flow.stages.validate import validate
from tests import models
from tests.stages.helpers import builder, decomposed, mlp_inputs, static_inputs


def _ids(dtype: str, *shape: int) -> ModelInputs:
    return ModelInputs({"input": InputSpec(tuple(shape), dtype=dtype, low=0, high=16)})


def _archive_for(factory, inputs: ModelInputs) -> tuple[bytes, dict]:
    tr, dec = decomposed(builder(factory), inputs)
    return serialize(dec.output, {}).output, tr.metadata["dims"]


def _validate(factory, inputs: ModelInputs, archive: bytes, dims: dict) -> dict:
    return validate(builder(factory), inputs, dims, ValidateOptions(samples=3), archive=archive).output


def test_an_int64_archive_is_refused_for_int32_ids() -> None:
    archive, dims = _archive_for(models.embedding, _ids("int64", 2, 3))
    assert _validate(models.embedding, _ids("int64", 2, 3), archive, dims)["passed"] is True
    with pytest.raises(StageError) as caught:
        _validate(models.embedding, _ids("int32", 2, 3), archive, dims)
    error = caught.value
    assert error.error_class == "numeric_mismatch"
    assert error.message == "signature mismatch: input input: the artifact takes int64, the config gives int32"
    assert error.details["signature"] == ["input input: the artifact takes int64, the config gives int32"]
    assert error.details["candidates"]["archive"]["samples"] == []  # no number was compared


def test_a_static_archive_is_refused_for_other_shapes() -> None:
    archive, dims = _archive_for(models.plain, static_inputs(2, 8, name="input"))
    with pytest.raises(StageError, match=r"input input: dim 0 is 2 in the artifact, 3 in the config"):
        _validate(models.plain, static_inputs(3, 8, name="input"), archive, dims)
    with pytest.raises(
        StageError, match=r"input input: the artifact takes 2 dims \[2, 8\], the config gives \[5, 4, 8\]"
    ):
        _validate(models.plain, static_inputs(5, 4, 8, name="input"), archive, dims)


def test_dynamic_dims_and_their_ranges_must_agree() -> None:
    archive, dims = _archive_for(models.tiny_mlp, mlp_inputs(1, 16))
    assert _validate(models.tiny_mlp, mlp_inputs(1, 16), archive, dims)["signature"] == []
    # the config now says batch takes [1, 8]: the artifact's range is another model's
    narrow = mlp_inputs(1, 8)
    narrow_dims = {"batch": {**dims["batch"], "max": 8}}
    with pytest.raises(
        StageError, match=r"input x: dim 0 \(batch\) takes \[1, 16\] in the artifact, \[1, 8\] in the config"
    ):
        _validate(models.tiny_mlp, narrow, archive, narrow_dims)
    # a static archive where the config wants a dynamic batch
    static_archive, _ = _archive_for(models.tiny_mlp, static_inputs(4, 8))
    with pytest.raises(StageError, match=r"dim 0 \(batch\) is dynamic in the config but static \(4\) in the artifact"):
        _validate(models.tiny_mlp, mlp_inputs(1, 16), static_archive, dims)


def test_output_dtype_must_match_eager() -> None:
    """A float64 program served for a float32 model: its inputs and outputs both say so."""
    archive, dims = _archive_for(models.plain, static_inputs(2, 8, name="input"))
    double = torch.export.export(models.plain().double(), (torch.randn(2, 8, dtype=torch.float64),))
    with pytest.raises(StageError) as caught:
        _validate(models.plain, static_inputs(2, 8, name="input"), serialize(double, {}).output, dims)
    assert "input input: the artifact takes float64, the config gives float32" in caught.value.message
    assert _validate(models.plain, static_inputs(2, 8, name="input"), archive, dims)["passed"] is True
