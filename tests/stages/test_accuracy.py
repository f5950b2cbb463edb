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


def test_top5_agreement_counts_rows_whose_five_largest_hold_eagers_argmax() -> None:
    """Ten classes, four rows: eager's argmax is class 0 in each. The artifact ranks it first in
    row 0, third in row 1, fifth in row 2 and sixth in row 3: top-1 1/4, top-5 3/4. An output with
    three classes has top1_agreement and no top5_agreement, and a goal on it says what it needs."""
    reference = torch.zeros(4, 10)
    reference[:, 0] = 10.0
    output = torch.zeros(4, 10)
    for row, rank in enumerate([0, 2, 4, 5]):
        output[row, 1 : rank + 1] = torch.arange(rank + 1, 1, -1, dtype=torch.float32) + 10  # `rank` classes above it
        output[row, 0] = 10.0
    accuracy = Accuracy()
    ids = torch.tensor([1, 2])  # an integer leaf after the class dims: named by the sample's label
    accuracy.add(
        "a",
        {"logits": output, "small": torch.eye(3), "z": ids + 1},
        {"logits": reference, "small": torch.eye(3), "z": ids},
    )
    measured = accuracy.measure()
    assert (measured["['logits']"]["top1_agreement"], measured["['logits']"]["top5_agreement"]) == (0.25, 0.75)
    assert (measured["['small']"]["top1_agreement"], measured["['small']"]["top5_agreement"]) == (1.0, None)
    entry, missed = judge(accuracy, {"top5_agreement": {"min": 0.9}})
    assert entry["metrics"]["top5_agreement"] == 0.75
    assert missed == ["['z'] (integer) differs from eager on a", "top5_agreement 0.75 < 0.9 (min), by 0.15"]
    small = Accuracy()
    small.add("a", {"small": torch.eye(3)}, {"small": torch.eye(3)})
    _, missed = judge(small, {"top5_agreement": {"min": 0.9}})
    assert missed == ["top5_agreement: no output leaf has it (top5_agreement needs a class dim of more than 5)"]


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
