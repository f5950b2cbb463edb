"""Where validate samples a model with dynamic dims (docs/architecture.md §6): the example inputs,
every dynamic dim at its min, then at its max, then random sizes in range, from a fixed seed. The
benchmark stage times at the same kind of points (stages/benchmark.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping


@dataclass(frozen=True)
class Sample:
    label: str
    sizes: dict[str, int]


def plan_samples(
    dims: Mapping[str, Mapping[str, Any]],
    configured: Mapping[str, tuple[int, int]],
    samples: int,
    seed: int,
) -> list[Sample]:
    """example, all dims at min, all at max, then random sizes; `samples` in all.

    dims: what the exported program accepts (trace metadata); a dim it specialized stays at its
    static value. configured: the config's (min, max), used where the program is unbounded.
    """
    ranges: dict[str, tuple[int, int]] = {}
    for name, (cmin, cmax) in configured.items():
        eff = dims.get(name, {})
        if eff.get("static"):
            continue
        lo = eff["min"] if eff.get("min") is not None else cmin
        hi = eff["max"] if eff.get("max") is not None else cmax
        lo, hi = max(int(lo), int(cmin)), min(int(hi), int(cmax))
        if lo <= hi:
            ranges[name] = (lo, hi)
    plan = [Sample("example", {})]
    if ranges:
        plan.append(Sample("min", {d: lo for d, (lo, _) in ranges.items()}))
        plan.append(Sample("max", {d: hi for d, (_, hi) in ranges.items()}))
    rng = random.Random(seed)
    index = 1
    while len(plan) < samples:
        sizes = {d: rng.randint(lo, hi) for d, (lo, hi) in sorted(ranges.items())}
        plan.append(Sample(f"random-{index}", sizes))
        index += 1
    return plan[:samples]
