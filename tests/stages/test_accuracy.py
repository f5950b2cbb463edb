"""The accuracy metrics an int8 artifact is judged by (stages/accuracy.py), on outputs whose
error is known: each value computed by hand here, the worst leaf deciding, integer leaves exact."""

from __future__ import annotations

import math

import pytest
import torch

from pt2flow.stages.accuracy import Accuracy, budget_of, judge
from pt2flow.stages.options import DEFAULT_ACCURACY, Bound


def test_each_metric_is_the_one_computed_by_hand_over_every_sample() -> None:
    reference = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 5.0]])  # energy 50 per sample
    noise = torch.tensor([[0.5, 0.0, 0.0], [0.0, -0.5, 0.0]])  # energy 0.5: argmax unchanged
    accuracy = Accuracy()
    accuracy.add("a", {"logits": reference + noise}, {"logits": reference})
    accuracy.add("b", {"logits": reference}, {"logits": reference})  # exact on this sample
    (measured,) = accuracy.measure().values()
    assert measured["sqnr_db"] == pytest.approx(10 * math.log10(100 / 0.5), abs=1e-3)  # 23.01 dB
    assert measured["max_abs_err"] == 0.5 and measured["mean_abs_err"] == pytest.approx(1.0 / 12)
    assert measured["top1_agreement"] == 1.0  # 4 rows, every argmax eager's
    flat_ref, flat_out = (
        torch.cat([reference.flatten()] * 2),
        torch.cat([(reference + noise).flatten(), reference.flatten()]),
    )
    cosine = float(flat_ref @ flat_out / (flat_ref.norm() * flat_out.norm()))
    assert measured["cosine"] == pytest.approx(cosine, abs=1e-6)


def test_the_worst_leaf_decides_and_a_miss_says_by_how_much() -> None:
    accuracy = Accuracy()
    good, bad = torch.ones(4, 3), torch.ones(4, 3)
    accuracy.add("a", (good, bad * 1.5), (good, bad))  # the second leaf: sqnr 10 log10(1 / 0.25) = 6.02
    entry, missed = judge(accuracy, {"sqnr_db": Bound(min=20.0), "max_abs_err": {"max": 0.1}})
    assert entry["metrics"]["sqnr_db"] == pytest.approx(6.021, abs=1e-3)
    assert entry["leaves"]["[0]"]["sqnr_db"] == 200.0  # exact: the cap
    assert missed == ["sqnr_db 6.021 < 20 (min), by 14", "max_abs_err 0.5 > 0.1 (max), by 0.4"]
    assert entry["budget"] == {"sqnr_db": {"min": 20.0, "max": None}, "max_abs_err": {"min": None, "max": 0.1}}


def test_integer_leaves_must_be_equal_and_an_empty_budget_has_no_goals() -> None:
    accuracy = Accuracy()
    accuracy.add("a", {"ids": torch.tensor([1, 2, 3])}, {"ids": torch.tensor([1, 2, 3])})
    accuracy.add("b", {"ids": torch.tensor([1, 2, 4])}, {"ids": torch.tensor([1, 2, 3])})
    assert budget_of({}, DEFAULT_ACCURACY) == {} and budget_of(None, DEFAULT_ACCURACY) == DEFAULT_ACCURACY
    _, missed = judge(accuracy, budget_of({}, DEFAULT_ACCURACY))
    assert missed == ["['ids'] (integer) differs from eager on b"]
    _, missed = judge(accuracy, budget_of(None, DEFAULT_ACCURACY))  # the default goal has no leaf to judge
    assert "sqnr_db: no output leaf has it" in missed[-1]
