"""How a candidate's outputs are judged against eager's (docs/architecture.md §6): every output leaf
by structure, shape, dtype, then `allclose(atol, rtol)` (tolerance: fixed) or, for floating leaves
under tolerance: auto, against a float64 reference: within `noise_multiple` times eager's own
error against it, or a floor of FLOOR_ULPS units in the last place of the leaf's largest value.
Mutated user inputs and buffers are judged as outputs are (compare_observed). Used by validate
(stages/validate.py) and check-compat (stages/compat.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree


def leaves_by_path(tree: Any) -> dict[str, Any]:
    flat, _ = pytree.tree_flatten_with_path(tree)
    return {pytree.keystr(path) or "output": leaf for path, leaf in flat}


@dataclass
class Comparison:
    ok: bool
    max_abs_err: float
    max_rel_err: float
    failures: list[str]
    noise: dict[str, dict[str, Any]] = field(default_factory=dict)  # tolerance: auto, per leaf (LeafNoise.as_report)


# tolerance: auto. The floor where eager float32 happens to be exact (integer-valued outputs, a
# mask, a copy): a candidate computing in the leaf's dtype may still be a few units in the last
# place off, e.g. a product rounded once where eager rounded it twice (docs/architecture.md §6).
FLOOR_ULPS = 8.0


@dataclass(frozen=True)
class NoiseReference:
    """What tolerance: auto judges floating leaves against: the float64 copy's outputs (the same
    tree as eager's), the multiple of eager's own error a candidate may have, the floor in ulps."""

    exact: Any
    multiple: float
    floor_ulps: float = FLOOR_ULPS


@dataclass(frozen=True)
class LeafNoise:
    """One floating leaf under tolerance: auto: max |x - float64 reference| of the candidate and
    of eager, the leaf's largest |reference|, and the bound: max(multiple x eager's error, floor)."""

    err: float
    eager_err: float
    scale: float
    multiple: float
    floor: float
    dtype: str

    @property
    def allowed(self) -> float:
        return max(self.multiple * self.eager_err, self.floor)

    @property
    def ok(self) -> bool:
        return self.err <= self.allowed

    @property
    def ratio(self) -> float | None:
        """The candidate's error over eager's; None where eager is exact and the candidate is not."""
        if self.eager_err > 0:
            return self.err / self.eager_err
        return 0.0 if self.err == 0 else None

    def as_report(self) -> dict[str, Any]:
        """err / eager_err: max absolute errors against float64; rel_err / eager_rel_err: the same
        over the leaf's largest |reference|; ratio: err / eager_err; allowed: the bound on err."""
        scale = self.scale if self.scale > 0 else 1.0
        return {
            "err": self.err,
            "eager_err": self.eager_err,
            "ratio": self.ratio,
            "rel_err": self.err / scale,
            "eager_rel_err": self.eager_err / scale,
            "allowed": self.allowed,
            "ok": self.ok,
        }

    def describe(self) -> str:
        if self.ratio is None:
            return (
                f"error vs float64 {self.err:.3g} where eager {self.dtype} is exact "
                f"(allowed: the floor, {self.floor:.3g})"
            )
        return (
            f"error vs float64 {self.err:.3g} is {self.ratio:.3g}x eager {self.dtype}'s {self.eager_err:.3g} "
            f"(allowed {self.multiple:g}x, floor {self.floor:.3g})"
        )


def _max_abs_diff(a64: torch.Tensor, b64: torch.Tensor) -> float:
    """max |a-b|, where equal values (infinities included) and NaN against NaN count as 0; inf
    where one side is NaN and the other not."""
    diff = (a64 - b64).abs()
    same = (a64 == b64) | (a64.isnan() & b64.isnan())
    diff = torch.where(same, torch.zeros_like(diff), diff)
    err = float(diff.max())
    return float("inf") if err != err else err


def leaf_noise(
    candidate: torch.Tensor, eager: torch.Tensor, exact: Any, multiple: float, floor_ulps: float
) -> LeafNoise | None:
    """The noise comparison of one floating leaf (shapes and dtypes already match eager's); None
    where it cannot judge it (no float64 counterpart, or eager itself is not finite against it:
    the fixed tolerance then judges that leaf)."""
    if not (eager.is_floating_point() and isinstance(exact, torch.Tensor) and exact.is_floating_point()):
        return None
    if tuple(exact.shape) != tuple(eager.shape) or eager.numel() == 0:
        return None
    r = exact.detach().cpu().to(torch.float64)
    eager_err = _max_abs_diff(eager.detach().cpu().to(torch.float64), r)
    if eager_err == float("inf"):
        return None
    err = _max_abs_diff(candidate.detach().cpu().to(torch.float64), r)
    finite = r[r.isfinite()].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    info = torch.finfo(eager.dtype)
    floor = floor_ulps * info.eps * max(scale, info.tiny)
    return LeafNoise(err, eager_err, scale, multiple, floor, str(eager.dtype).removeprefix("torch."))


def compare(
    candidate: Any, reference: Any, atol: float, rtol: float, noise: NoiseReference | None = None
) -> Comparison:
    """Structure, shape, dtype, then allclose, for every output leaf. Collects every failure.

    max_rel_err is max |a-b| / max(|b|, atol), so that near-zero references do not explode it.
    noise (tolerance: auto): a floating leaf is judged against the float64 reference instead of
    by allclose (leaf_noise); max_abs_err and max_rel_err stay the errors against `reference`.
    """
    cand, ref = leaves_by_path(candidate), leaves_by_path(reference)
    exact = leaves_by_path(noise.exact) if noise is not None else {}
    table: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    if set(cand) != set(ref):
        missing, extra = sorted(set(ref) - set(cand)), sorted(set(cand) - set(ref))
        failures.append(f"output structure differs: missing {missing}, unexpected {extra}")
    worst_abs, worst_rel = 0.0, 0.0
    for path in sorted(set(cand) & set(ref)):
        a, b = cand[path], ref[path]
        if not isinstance(b, torch.Tensor):
            if a != b:
                failures.append(f"{path}: {a!r} != {b!r}")
            continue
        if not isinstance(a, torch.Tensor):
            failures.append(f"{path}: expected a tensor, got {type(a).__name__}")
            continue
        if tuple(a.shape) != tuple(b.shape):
            failures.append(f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        if a.dtype != b.dtype:
            failures.append(f"{path}: dtype {a.dtype} != {b.dtype}")
            continue
        if b.numel() == 0:
            continue
        a64, b64 = a.detach().cpu().to(torch.float64), b.detach().cpu().to(torch.float64)
        diff = (a64 - b64).abs()
        both_nan = a64.isnan() & b64.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), diff)
        abs_err = float(diff.max())
        rel_err = float((diff / b64.abs().clamp_min(max(atol, 1e-12))).max())
        if abs_err != abs_err:  # NaN where the reference has none
            abs_err = rel_err = float("inf")
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
        judged = leaf_noise(a, b, exact.get(path), noise.multiple, noise.floor_ulps) if noise is not None else None
        if judged is not None:
            table[path] = judged.as_report()
            if not judged.ok:
                failures.append(f"{path}: {judged.describe()}")
        elif not torch.allclose(a64, b64, atol=atol, rtol=rtol, equal_nan=True):
            failures.append(f"{path}: max abs err {abs_err:.3g}, max rel err {rel_err:.3g}")
    return Comparison(not failures, worst_abs, worst_rel, failures, table)


@dataclass
class Observed:
    """What one call did: its output, the user inputs after the call (a forward that mutates its
    inputs in place is observed through them) and the mutated buffers after the call."""

    output: Any
    inputs: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def compare_observed(
    candidate: Observed,
    reference: Observed,
    atol: float,
    rtol: float,
    *,
    buffers: bool = True,
    exact: Observed | None = None,
    multiple: float = 0.0,
) -> Comparison:
    """Outputs (paths as compare() names them), then user inputs and buffers after the call.
    exact (tolerance: auto): the float64 copy's observation, floating leaves judged against it."""

    def noise(tree: Any) -> NoiseReference | None:
        return NoiseReference(tree, multiple) if exact is not None else None

    parts = [(compare(candidate.output, reference.output, atol, rtol, noise(exact and exact.output)), "")]
    if reference.inputs:
        parts.append((compare(candidate.inputs, reference.inputs, atol, rtol, noise(exact and exact.inputs)), "input "))
    if buffers and reference.buffers:
        parts.append(
            (compare(candidate.buffers, reference.buffers, atol, rtol, noise(exact and exact.buffers)), "buffer ")
        )
    failures = [prefix + f for result, prefix in parts for f in result.failures]
    return Comparison(
        not failures,
        max(r.max_abs_err for r, _ in parts),
        max(r.max_rel_err for r, _ in parts),
        failures,
        {prefix + path: leaf for result, prefix in parts for path, leaf in result.noise.items()},
    )
