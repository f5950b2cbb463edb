"""stages.source, stages.example_inputs and stages.binding: inputs bound to forward() by name, shared dynamic dims, the training wrapper."""

from __future__ import annotations

import inspect
import io

import pytest
import torch

from pt2flow.stages.errors import StageError
from pt2flow.stages.binding import bind_inputs, export_dynamic_shapes
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.source import build_model, load_state_dict, training_step
from tests import models


def _dict_out_inputs() -> ModelInputs:
    # config order differs from forward()'s: binding is by name
    return ModelInputs(
        {"scale": InputSpec((), value=0.5), "x": InputSpec((3, 5, 6))},
        {"x": {0: "batch", 1: "seq"}},
        {"batch": (1, 8), "seq": (2, 10)},
    )


def test_inputs_bind_by_name_with_their_specs() -> None:
    model = models.dict_out()
    bound = bind_inputs(model, _dict_out_inputs(), seed=3)
    assert bound.order == ("x", "scale")
    x, scale = bound.args
    assert x.shape == (3, 5, 6) and x.dtype == torch.float32
    assert scale.shape == () and float(scale) == 0.5
    again = bind_inputs(model, _dict_out_inputs(), seed=3)
    assert torch.equal(again.args[0], x)  # seeded
    assert not torch.equal(bind_inputs(model, _dict_out_inputs(), seed=4).args[0], x)
    resized = bind_inputs(model, _dict_out_inputs(), dim_sizes={"batch": 1, "seq": 10})
    assert resized.args[0].shape == (1, 10, 6)


def test_integer_and_bool_specs() -> None:
    class Two(torch.nn.Module):
        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return ids * mask

    inputs = ModelInputs(
        {"ids": InputSpec((64,), dtype="int64", low=5, high=9), "mask": InputSpec((64,), dtype="bool")}
    )
    ids, mask = bind_inputs(Two(), inputs).args
    assert ids.dtype == torch.int64 and int(ids.min()) >= 5 and int(ids.max()) <= 8
    assert mask.dtype == torch.bool


def test_inputs_that_do_not_match_forward_are_a_config_error() -> None:
    with pytest.raises(StageError) as info:
        bind_inputs(models.tiny_mlp(), ModelInputs({"y": InputSpec((2, 8))}))
    assert info.value.error_class == "config"


def test_one_dim_object_per_name_shared_by_every_input() -> None:
    inputs = ModelInputs(
        {"x": InputSpec((4, 4)), "y": InputSpec((4,))},
        {"x": {0: "batch"}, "y": {0: "batch"}},
        {"batch": (2, 16)},
    )
    bound = bind_inputs(models.regressor(), inputs)
    spec = export_dynamic_shapes(inputs, bound)
    assert spec[0][0] is spec[1][0]
    assert (spec[0][0].min, spec[0][0].max) == (2, 16)
    assert (
        export_dynamic_shapes(
            ModelInputs({"x": InputSpec((4, 8))}), bind_inputs(models.tiny_mlp(), ModelInputs({"x": InputSpec((4, 8))}))
        )
        is None
    )


def test_training_step_loss_and_signature() -> None:
    model = build_model(models.dict_out, {}, training=True)
    step = training_step(model)
    assert list(inspect.signature(step.forward).parameters) == ["x", "scale"]
    assert step.training
    x, scale = torch.randn(2, 5, 6), torch.tensor(1.5)
    out = model(x, scale)
    expected = out["hidden"].pow(2).mean() + out["pooled"].pow(2).mean()  # argmax (int64) is left out
    torch.testing.assert_close(step(x, scale), expected)
    assert torch.equal(training_step(model, loss_output=1)(x, scale), out["pooled"])


def test_build_model_is_seeded_and_sets_the_mode() -> None:
    a, b = build_model(models.tiny_mlp, {}), build_model(models.tiny_mlp, {})
    assert torch.equal(a.fc1.weight, b.fc1.weight)
    assert not a.training
    assert build_model(models.tiny_mlp, {}, training=True).training
    with pytest.raises(StageError) as info:
        build_model(models.tiny_mlp, {}, {"fc1.weight": torch.zeros(1)})
    assert info.value.error_class == "weights"


def test_checkpoints_are_loaded_without_arbitrary_pickles() -> None:
    state = models.tiny_mlp().state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = load_state_dict(buffer.getvalue(), "w.pt")
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    evil = io.BytesIO()
    torch.save({"fc1.weight": models.Holder(torch.zeros(1))}, evil)
    with pytest.raises(StageError) as info:
        load_state_dict(evil.getvalue(), "evil.pt")
    assert info.value.error_class == "weights"
