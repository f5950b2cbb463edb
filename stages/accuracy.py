"""How an artifact that is not meant to equal eager (an int8 one) is judged: accuracy metrics of
its outputs against eager's over every validation sample, each held to a budget (the model's
`validate.accuracy`, else options.DEFAULT_ACCURACY), instead of allclose.

Per floating output leaf, over all samples (each flattened): sqnr_db, 10 log10(sum ref^2 / sum
(ref - out)^2), capped at SQNR_CAP_DB for an exact match; cosine similarity; max and mean absolute
error; top1_agreement, where the leaf has a class dim (two dims or more: argmax over the last),
the share of rows whose argmax is eager's; top5_agreement, where that dim has more than 5
classes, the share of rows whose five largest hold eager's argmax (top-5 accuracy, eager's
argmax as the label). A budget is judged on the worst leaf (the least sqnr,
cosine and agreement, the most error). Integer and bool leaves must be equal, as everywhere.

Where the model has evaluation batches of its own (`data.evaluation`: batches of its data that no
int8 stage calibrated on, labelled `evaluation[i]`), the metrics are measured on those alone: the
validation samples, drawn at random at the edges of every dynamic dim, still check that the
artifact runs there, but random inputs are not the data an int8 artifact is calibrated for.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pt2flow.stages.comparison import leaves_by_path

SQNR_CAP_DB = 200.0
EVALUATION = "evaluation"  # the label of the model's own evaluation batches: evaluation[0], ...


def evaluation_label(index: int) -> str:
    return f"{EVALUATION}[{index}]"


def is_evaluation(label: str) -> bool:
    return label.startswith(f"{EVALUATION}[")


# the direction that is worse for each metric: the worst leaf decides the verdict
LOWER_IS_WORSE = {
    "sqnr_db": True,
    "cosine": True,
    "top1_agreement": True,
    "top5_agreement": True,
    "max_abs_err": False,
    "mean_abs_err": False,
}
# what a leaf needs for each metric that not every floating leaf has
NEEDS = {"top1_agreement": "a class dim", "top5_agreement": "a class dim of more than 5"}
TOP_K = 5


@dataclass
class _Leaf:
    reference: list[torch.Tensor] = field(default_factory=list)
    output: list[torch.Tensor] = field(default_factory=list)
    agree: int = 0
    rows: int = 0
    agree_k: int = 0  # rows whose TOP_K largest hold eager's argmax (a class dim of more than TOP_K)
    rows_k: int = 0
    unequal: list[str] = field(default_factory=list)


@dataclass
class Accuracy:
    """The outputs of one candidate and eager, gathered sample by sample, then measured."""

    leaves: dict[str, _Leaf] = field(default_factory=lambda: defaultdict(_Leaf))
    problems: list[str] = field(default_factory=list)
    evaluation_only: bool = False  # measured on the model's evaluation batches alone (it has some)
    labels: list[str] = field(default_factory=list)  # the samples measured

    def add(self, label: str, output: Any, reference: Any) -> None:
        if self.evaluation_only and not is_evaluation(label):
            return
        self.labels.append(label)
        got, want = leaves_by_path(output), leaves_by_path(reference)
        if set(got) != set(want):
            self.problems.append(f"on {label}: output leaves {sorted(got)} are not eager's {sorted(want)}")
            return
        for path, ref in want.items():
            out = got[path]
            if not isinstance(ref, torch.Tensor):
                continue
            if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                self.problems.append(f"on {label}: {path} is {shape}, eager's is {tuple(ref.shape)}")
                continue
            leaf = self.leaves[path]
            if not ref.is_floating_point():
                if not torch.equal(out.to(ref.dtype), ref):
                    leaf.unequal.append(label)
                continue
            leaf.reference.append(ref.detach().double().flatten())
            leaf.output.append(out.detach().double().flatten())
            if ref.dim() >= 2 and ref.shape[-1] >= 2:
                eager_top = ref.argmax(-1)
                leaf.agree += int((out.argmax(-1) == eager_top).sum())
                leaf.rows += ref[..., 0].numel()
                if ref.shape[-1] > TOP_K:
                    leaf.agree_k += int((out.topk(TOP_K, dim=-1).indices == eager_top.unsqueeze(-1)).any(-1).sum())
                    leaf.rows_k += ref[..., 0].numel()

    def measure(self) -> dict[str, dict[str, float | None]]:
        """Each floating leaf's metrics (top1_agreement None without a class dim, top5_agreement
        without more than 5 classes)."""
        measured = {}
        for path, leaf in self.leaves.items():
            if not leaf.reference:
                continue
            ref, out = torch.cat(leaf.reference), torch.cat(leaf.output)
            diff = ref - out
            noise, signal = float((diff * diff).sum()), float((ref * ref).sum())
            sqnr = SQNR_CAP_DB if noise == 0 else min(SQNR_CAP_DB, 10 * math.log10(max(signal, 1e-300) / noise))
            norms = float(ref.norm() * out.norm())
            cosine = float((ref * out).sum()) / norms if norms > 0 else (1.0 if noise == 0 else 0.0)
            measured[path] = {
                "sqnr_db": round(sqnr, 3),
                "cosine": round(cosine, 6),
                "max_abs_err": float(diff.abs().max()),
                "mean_abs_err": float(diff.abs().mean()),
                "top1_agreement": round(leaf.agree / leaf.rows, 6) if leaf.rows else None,
                "top5_agreement": round(leaf.agree_k / leaf.rows_k, 6) if leaf.rows_k else None,
            }
        return measured


def worst(measured: Mapping[str, Mapping[str, float | None]]) -> dict[str, float | None]:
    """Each metric at its worst leaf (None: no leaf has it)."""
    result: dict[str, float | None] = {}
    for metric, lower_is_worse in LOWER_IS_WORSE.items():
        values = [v[metric] for v in measured.values() if v.get(metric) is not None]
        result[metric] = (min if lower_is_worse else max)(values) if values else None  # type: ignore[type-var]
    return result


def judge(accuracy: Accuracy, budget: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the report's accuracy entry, what missed the budget, one line each)."""
    measured = accuracy.measure()
    overall = worst(measured)
    missed = list(accuracy.problems)
    for path, leaf in accuracy.leaves.items():
        if leaf.unequal:
            missed.append(f"{path} (integer) differs from eager on {', '.join(leaf.unequal)}")
    for metric, bound in budget.items():
        low, high = _bounds(bound)
        value = overall.get(metric)
        if value is None:
            missed.append(
                f"{metric}: no output leaf has it" + (f" ({metric} needs {NEEDS[metric]})" if metric in NEEDS else "")
            )
        elif low is not None and value < low:
            missed.append(f"{metric} {value:.4g} < {low:g} (min), by {low - value:.3g}")
        elif high is not None and value > high:
            missed.append(f"{metric} {value:.4g} > {high:g} (max), by {value - high:.3g}")
    entry = {
        "on": EVALUATION if accuracy.evaluation_only else "samples",
        "measured_on": len(accuracy.labels),
        "metrics": overall,
        "leaves": measured,
        "budget": {metric: dict(zip(("min", "max"), _bounds(bound))) for metric, bound in budget.items()},
    }
    return entry, missed


def _bounds(bound: Any) -> tuple[float | None, float | None]:
    if isinstance(bound, Mapping):
        return bound.get("min"), bound.get("max")
    return bound.min, bound.max


def budget_of(configured: Mapping[Any, Any] | None, default: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model's budget; `default` only where it sets none (`accuracy: {}` is a budget with no
    goals: integer leaves must still be equal)."""
    return dict(configured) if configured is not None else dict(default)


__all__: Sequence[str] = (
    "Accuracy",
    "judge",
    "worst",
    "budget_of",
    "evaluation_label",
    "is_evaluation",
    "EVALUATION",
    "SQNR_CAP_DB",
)
