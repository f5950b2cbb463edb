"""stages.validation_io: validate's inputs and eager outputs as safetensors, read back exactly."""

from __future__ import annotations

import pytest
import torch

from pt2flow.stages.validation_io import IOSample, NotStorable, pack, unpack


def test_nested_inputs_and_plain_values_round_trip() -> None:
    x = torch.randn(2, 3)
    ids = torch.randint(0, 9, (2, 5))
    samples = [
        IOSample(
            "example",
            (x, [ids, 3]),
            {"mode": "mean", "scale": None, "mask": {"a": torch.ones(2, dtype=torch.bool)}},
            [x * 2, 7, torch.zeros(1)],
        ),
        IOSample(
            "max",
            (x[:1], [ids[:1], 4]),
            {"mode": "sum", "scale": 0.5, "mask": {"a": torch.zeros(1, dtype=torch.bool)}},
            [x[:1]],
        ),
    ]
    back = unpack(pack(samples))
    assert [s.label for s in back] == ["example", "max"]
    first = back[0]
    assert isinstance(first.args, tuple) and isinstance(first.args[1], list) and first.args[1][1] == 3
    assert (
        torch.equal(first.args[0], x) and torch.equal(first.args[1][0], ids) and first.args[1][0].dtype == torch.int64
    )
    assert first.kwargs["mode"] == "mean" and first.kwargs["scale"] is None
    assert first.kwargs["mask"]["a"].dtype == torch.bool
    assert torch.equal(first.outputs[0], x * 2) and first.outputs[1] == 7
    assert back[1].kwargs["scale"] == 0.5 and torch.equal(back[1].outputs[0], x[:1])


def test_what_cannot_be_stored_is_refused_by_name() -> None:
    class Opaque:
        pass

    with pytest.raises(NotStorable, match="Opaque leaf"):
        pack([IOSample("example", (Opaque(),), {}, [])])


def test_other_bytes_are_not_taken_for_validation_io() -> None:
    from safetensors.torch import save

    with pytest.raises(ValueError, match="not a pt2flow validation-io file"):
        unpack(b"garbage bytes")
    with pytest.raises(ValueError, match="not a pt2flow validation-io file"):
        unpack(save({"w": torch.ones(1)}))
