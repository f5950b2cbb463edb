"""benchmark: time every validated artifact of a model against eager at each size (docs/architecture.md §6).

Artifacts: eager (the model built from its factory and weights), the archive, the AOTInductor
package and each target's artifact (their candidate loaders, stages/targets.py), one at a time:
loaded from bytes (timed, its peak resident memory measured), then called at every size with the
same inputs. Sizes: every dynamic dim at its min, example size and max (stages/sample_plan.py plan_samples)
or the configured ones. At each size: `warmup` untimed calls, then timed calls until the median of
all calls moves by less than `stable_fraction` over the last `window` calls (at least `min_runs`,
at most `max_runs` and `max_seconds`). The recommendation at each size is the artifact with the
lowest p50 (eager is the baseline, never recommended).

An artifact that fails to load or raises at a size is reported with its error and left out of
the recommendation there; the stage fails only when no artifact could be timed at all.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from pt2flow.stages.aot_compile import load_runner
from pt2flow.stages.binding import bind_inputs
from pt2flow.stages.classify import short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import BoundInputs, ModelInputs
from pt2flow.stages.options import BenchmarkOptions
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.serialize import load_archive
from pt2flow.stages.targets import TargetArtifact
from pt2flow.stages.sample_plan import plan_samples
from pt2flow.stages.vocabulary import ErrorClass

EAGER = "eager"


@dataclass(frozen=True)
class Point:
    """One size the artifacts are timed at: its label ("batch=1 seq=2") and each dynamic dim's size."""

    label: str
    sizes: dict[str, int]
    batch: int  # samples per call: the batch dim's size (the first dim named "batch", else 1)


@dataclass(frozen=True)
class Timing:
    """The timed calls of one artifact at one size (milliseconds, in call order)."""

    times_ms: tuple[float, ...]
    stable: bool

    @property
    def p50(self) -> float:
        return percentile(self.times_ms, 50)

    @property
    def p90(self) -> float:
        return percentile(self.times_ms, 90)


@dataclass
class Measured:
    """One artifact: its size in bytes, load time, peak resident memory increase over load and
    calls, and its timing (or error) at each point."""

    name: str
    size_bytes: int
    load_ms: float | None = None
    peak_memory_mb: float | None = None
    error: str | None = None
    timings: dict[str, Timing] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values`, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def time_calls(
    call: Callable[[], Any], options: BenchmarkOptions, clock: Callable[[], float] = time.perf_counter
) -> Timing:
    """Warm up, then time `call` until the median is stable (see the module's docstring)."""
    for _ in range(options.warmup):
        call()
    times: list[float] = []
    medians: list[float] = []
    deadline = clock() + options.max_seconds
    stable = False
    while len(times) < options.max_runs:
        start = clock()
        call()
        end = clock()
        times.append((end - start) * 1000.0)
        medians.append(statistics.median(times))
        if len(times) >= options.min_runs and len(medians) > options.window:
            before, now = medians[-1 - options.window], medians[-1]
            if abs(now - before) <= options.stable_fraction * now:
                stable = True
                break
        if end >= deadline:
            break
    return Timing(tuple(times), stable)


def plan_points(
    dims: Mapping[str, Mapping[str, Any]], model_inputs: ModelInputs, example: BoundInputs, options: BenchmarkOptions
) -> list[Point]:
    """The sizes to time at: the configured ones (every combination; other dims at their example
    size), else validate's min and max samples beside the example (duplicates dropped).
    StageError(config) for a configured dim the model does not have or a size outside its range."""
    example_sizes = example_dim_sizes(example)
    ranges = {s.label: s.sizes for s in plan_samples(dims, model_inputs.dims, 3, 0)}
    bounds = {d: (ranges["min"][d], ranges["max"][d]) for d in ranges.get("min", {})}
    if options.sizes:
        problems = [
            f"{d}: not a dynamic dim of this model (dims: {sorted(bounds) or 'none'})"
            for d in options.sizes
            if d not in bounds
        ]
        problems += [
            f"{d}={v}: outside the program's range {bounds[d][0]}..{bounds[d][1]}"
            for d, values in options.sizes.items()
            if d in bounds
            for v in values
            if not bounds[d][0] <= v <= bounds[d][1]
        ]
        if problems:
            raise StageError(ErrorClass.CONFIG, "benchmark.sizes: " + "; ".join(problems))
        names = list(options.sizes)
        wanted = [
            {**example_sizes, **dict(zip(names, combo))}
            for combo in itertools.product(*(options.sizes[d] for d in names))
        ]
    else:
        wanted = [{**example_sizes, **ranges.get("min", {})}, example_sizes, {**example_sizes, **ranges.get("max", {})}]
    points: dict[str, Point] = {}
    for sizes in sorted(wanted, key=lambda s: [s[d] for d in sorted(s)]):
        label = " ".join(f"{d}={v}" for d, v in sizes.items()) or "example"
        points.setdefault(label, Point(label, dict(sizes), _batch(sizes)))
    return list(points.values())


def example_dim_sizes(example: BoundInputs) -> dict[str, int]:
    """Each dynamic dim's size in the example inputs (the first tensor naming it)."""
    sizes: dict[str, int] = {}
    for _path, tensor, dims in example.tensor_leaves():
        for index, name in (dims or {}).items():
            sizes.setdefault(name, int(tensor.shape[index]))
    return sizes


def _batch(sizes: Mapping[str, int]) -> int:
    return next((v for d, v in sizes.items() if "batch" in d.lower()), 1)


class PeakMemory:
    """The peak resident memory a block adds, in MiB: Linux's high-water mark (VmHWM) reset
    through /proc/self/clear_refs before it, read after it; None where that is not possible."""

    def __enter__(self) -> PeakMemory:
        self.start = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
        except OSError:
            self.start = None
        self.peak_mb: float | None = None
        return self

    def __exit__(self, *exc: Any) -> None:
        peak = _status_kib("VmHWM")
        if self.start is not None and peak is not None:
            self.peak_mb = max(0.0, (peak - self.start) / 1024.0)


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def benchmark(
    build_reference: Callable[[], torch.nn.Module],
    model_inputs: ModelInputs,
    dims: Mapping[str, Mapping[str, Any]],
    options: BenchmarkOptions,
    *,
    archive: bytes | None = None,
    package: bytes | None = None,
    device: str = "cpu",
    targets: Mapping[str, TargetArtifact] | None = None,
    machine: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> StageResult:
    """Output: the benchmark report (a dict: machine, options, points, per artifact its size,
    load time, peak memory and p50/p90/throughput at each point, the recommendation). Only the
    artifacts given are timed: the caller passes the ones validate passed. machine: what the
    caller knows of the machine (its kind, in the stage's key), recorded in the report."""
    machine = {**(machine or {}), "cores": (machine or {}).get("cores") or cores()}
    threads = options.threads or int(machine["cores"])
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="pt2flow-benchmark-") as workdir, quiet_torch() as sink:
            start = time.perf_counter()
            with PeakMemory() as memory:
                reference = build_reference().eval()
            eager_ms = (time.perf_counter() - start) * 1000.0
            example = bind_inputs(reference, model_inputs, seed=seed)
            points = plan_points(dims, model_inputs, example, options)
            inputs = {p.label: bind_inputs(reference, model_inputs, seed=seed, dim_sizes=p.sizes) for p in points}
            measured = [_time_eager(reference, eager_ms, memory.peak_mb, points, inputs, options)]
            loaders: list[tuple[str, int, Callable[[], Callable[..., Any]]]] = []
            if archive is not None:
                loaders.append(("archive", len(archive), lambda: load_archive(archive)[0].module()))
            if package is not None:
                loaders.append(("compiled", len(package), lambda: load_runner(package, workdir, device)))
            for name, target in (targets or {}).items():
                loaders.append((name, len(target.data), target.candidate))
            for name, size, load in loaders:
                measured.append(_time_artifact(name, size, load, points, inputs, options))
                gc.collect()
    finally:
        torch.set_num_threads(saved_threads)
    if not any(m.timings for m in measured[1:]) and len(measured) > 1:
        shown = "; ".join(f"{m.name}: {m.error or next(iter(m.errors.values()), '?')}" for m in measured[1:])
        raise StageError(ErrorClass.RUNTIME, f"no artifact could be timed: {shown}")
    report = {
        "machine": {**machine, "threads": threads},
        "options": options.model_dump(mode="json"),
        "points": [{"label": p.label, "sizes": p.sizes, "batch": p.batch} for p in points],
        "artifacts": {m.name: _artifact_report(m, points) for m in measured},
        "recommendation": recommend(measured, points),
        "warnings": list(sink.items),
    }
    return StageResult(output=report, metadata={"summary": summary(report)}, warnings=tuple(sink.items))


def _time_eager(
    reference: torch.nn.Module,
    load_ms: float,
    peak_mb: float | None,
    points: list[Point],
    inputs: Mapping[str, BoundInputs],
    options: BenchmarkOptions,
) -> Measured:
    state = sum(t.numel() * t.element_size() for t in [*reference.parameters(), *reference.buffers()])
    measured = Measured(EAGER, state, load_ms, peak_mb)
    with PeakMemory() as memory, torch.inference_mode():
        for point in points:
            bound = inputs[point.label]
            _time_point(measured, point, functools.partial(bound.call, reference), options)
    measured.peak_memory_mb = max((v for v in (peak_mb, memory.peak_mb) if v is not None), default=None)
    return measured


def _time_artifact(
    name: str,
    size: int,
    load: Callable[[], Callable[..., Any]],
    points: list[Point],
    inputs: Mapping[str, BoundInputs],
    options: BenchmarkOptions,
) -> Measured:
    measured = Measured(name, size)
    with PeakMemory() as memory:
        start = time.perf_counter()
        try:
            fn = load()
        except Exception as exc:  # noqa: BLE001 - reported as this artifact's error; the others are still timed
            measured.error = f"does not load: {short_message(exc)}"
            return measured
        measured.load_ms = (time.perf_counter() - start) * 1000.0
        with torch.no_grad():
            for point in points:
                bound = inputs[point.label]
                _time_point(measured, point, functools.partial(bound.call, fn), options)
        del fn
    measured.peak_memory_mb = memory.peak_mb
    return measured


def _time_point(measured: Measured, point: Point, call: Callable[[], Any], options: BenchmarkOptions) -> None:
    try:
        measured.timings[point.label] = time_calls(call, options)
    except Exception as exc:  # noqa: BLE001 - a size this artifact fails at is reported, not fatal
        measured.errors[point.label] = short_message(exc, 300)


def _artifact_report(measured: Measured, points: list[Point]) -> dict[str, Any]:
    per_point: dict[str, dict[str, Any]] = {}
    for point in points:
        timing = measured.timings.get(point.label)
        if timing is None:
            per_point[point.label] = {"error": measured.errors.get(point.label, measured.error)}
            continue
        per_point[point.label] = {
            "p50_ms": timing.p50,
            "p90_ms": timing.p90,
            "runs": len(timing.times_ms),
            "stable": timing.stable,
            "throughput": point.batch / (timing.p50 / 1000.0) if timing.p50 > 0 else None,
        }
    return {
        "size_bytes": measured.size_bytes,
        "load_ms": measured.load_ms,
        "peak_memory_mb": measured.peak_memory_mb,
        "error": measured.error,
        "points": per_point,
    }


def recommend(measured: Sequence[Measured], points: Sequence[Point]) -> dict[str, Any]:
    """Per point the artifact with the lowest p50 (eager excluded) and its speedup over eager;
    overall the artifact fastest at the most points (ties: the lowest p50 summed over points)."""
    eager = next((m for m in measured if m.name == EAGER), None)
    per_point: dict[str, Any] = {}
    for point in points:
        timed = [(m.timings[point.label].p50, m.name) for m in measured if m.name != EAGER and point.label in m.timings]
        if not timed:
            per_point[point.label] = None
            continue
        p50, name = min(timed)
        base = eager.timings[point.label].p50 if eager is not None and point.label in eager.timings else None
        per_point[point.label] = {
            "artifact": name,
            "p50_ms": p50,
            "speedup_vs_eager": base / p50 if base and p50 > 0 else None,
        }
    wins: dict[str, int] = {}
    for choice in per_point.values():
        if choice is not None:
            wins[choice["artifact"]] = wins.get(choice["artifact"], 0) + 1
    total = {m.name: sum(t.p50 for t in m.timings.values()) for m in measured}
    best = min(wins, key=lambda n: (-wins[n], total[n]), default=None)
    return {"artifact": best, "wins": wins.get(best, 0) if best else 0, "points": per_point}


def summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The compact part of a report the index record, the run document and the views carry: the
    recommendation and each artifact's p50 (ms) at each point (None where it failed)."""
    return {
        "recommended": report["recommendation"]["artifact"],
        "points": [p["label"] for p in report["points"]],
        "best": {
            label: choice["artifact"] if choice else None
            for label, choice in report["recommendation"]["points"].items()
        },
        "speedup_vs_eager": {
            label: choice["speedup_vs_eager"] if choice else None
            for label, choice in report["recommendation"]["points"].items()
        },
        "p50_ms": {
            name: {label: entry.get("p50_ms") for label, entry in a["points"].items()}
            for name, a in report["artifacts"].items()
        },
        "threads": report["machine"]["threads"],
    }
