"""benchmark: time every validated artifact of a model against eager at each size (docs/architecture.md §6).

Artifacts: eager (the model built from its factory and weights), the archive, the AOTInductor
package and each target's artifact (their candidate loaders, stages/targets.py), one at a time:
loaded from bytes (timed, its peak resident memory measured), then called at every size with the
same inputs. Sizes: every dynamic dim at its min, example size and max (stages/sample_plan.py plan_samples)
or the configured ones. At each size: untimed calls (at least `warmup` of them, and for at least
`warmup_s`: a call of a few microseconds takes thousands of calls to reach its steady speed),
then timed samples (a sample: one call, or a batch of calls lasting at least SAMPLE_MIN_S when a
call takes microseconds; its time per call) until the median of all calls moves by less than
`stable_fraction` over the last `window` calls and the calls have gone on for `min_seconds` (at
least `min_runs`, at most `max_runs` and `max_seconds`). The recommendation at each size is the
artifact with the lowest p50, or the first of those within `tie_margin` of it (eager is the
baseline, never recommended).

Every artifact runs on `threads` intra-op threads (1 unless configured): torch's, and each
target's runtime's where its loader takes `threads` (stages/targets.py TargetArtifact.candidate;
a runner's `close` gives back what loading it changed in the process). Two threads on a shared
VM wait for the slower of two cores, which the host slows for seconds at a time.

Every artifact is called under torch.inference_mode, as eager is: under no_grad an exported
program's module paid autograd's version-counter bookkeeping on each call, 5-10 % of a small
model's call (bench/benchmark_agreement.py times the files under inference_mode, as a
deployment does).

An artifact that fails to load or raises at a size is reported with its error and left out of
the recommendation there; the stage fails only when no artifact could be timed at all.

How a call is timed, the memory measured and the machine's load watched: stages/timing.py.

Timings that hold (issue 43): the caller runs this while no other stage work of pt2flow runs on
the machine (flows/engine/worker/turns.py). Before timing, it waits up to `quiet_wait_s` for the
rest of the machine to go quiet (OtherWork: the CPU time other processes use, from /proc/stat);
while timing, it measures that load again. A measurement is `noisy` when other work kept more
than `max_load` cores busy meanwhile, when fewer than `min_runs` of its samples were taken at full
speed (a canary timed between samples within `max_slowdown` of its fastest in this benchmark: the
host slows a VM's process down for seconds at a time, unseen by the load; a sample taken
meanwhile is left out of the figures), when its p90 is more than `max_spread` times its p50, or
when the medians of its first and second halves of calls differ by more than `max_drift`; no
recommendation is drawn at a size where any artifact's measurement is noisy (the report says why),
and a recommended artifact slower than eager is marked so. Artifacts within `tie_margin` of the
fastest p50 at a size are tied there: the first of them in the report's order is recommended
(recommend), so that two benchmarks of the same files agree.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
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
from pt2flow.stages.timing import Canary, OtherWork, PeakMemory, Timing, cores, rounded, time_calls, wait_for_quiet
from pt2flow.stages.vocabulary import ErrorClass

EAGER = "eager"


@dataclass(frozen=True)
class Point:
    """One size the artifacts are timed at: its label ("batch=1 seq=2") and each dynamic dim's size."""

    label: str
    sizes: dict[str, int]
    batch: int  # samples per call: the batch dim's size (the first dim named "batch", else 1)


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
    attempts: dict[str, int] = field(default_factory=dict)  # a size measured more than once (_time_point)
    passes: dict[str, list[float]] = field(default_factory=dict)  # each pass's p50 at a size (fastest_pass)
    threads: int | None = None  # the intra-op threads it ran on (None: its runtime's own)


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
    own_threads: list[str] = []  # targets whose loader cannot be told the thread count
    torch.set_num_threads(threads)
    try:
        quiet = wait_for_quiet(options)
        with (
            tempfile.TemporaryDirectory(prefix="pt2flow-benchmark-") as workdir,
            quiet_torch() as sink,
            OtherWork() as other,
        ):
            start = time.perf_counter()
            with PeakMemory() as memory:
                reference = build_reference().eval()
            eager_ms = (time.perf_counter() - start) * 1000.0
            example = bind_inputs(reference, model_inputs, seed=seed)
            points = plan_points(dims, model_inputs, example, options)
            inputs = {p.label: bind_inputs(reference, model_inputs, seed=seed, dim_sizes=p.sizes) for p in points}
            canary = Canary()  # the machine's speed beside every sample of this benchmark
            timers: list[Callable[[], Measured]] = [
                functools.partial(_time_eager, reference, eager_ms, memory.peak_mb, points, inputs, options, canary)
            ]
            loaders: list[tuple[str, int, Callable[[], Callable[..., Any]]]] = []
            if archive is not None:
                loaders.append(("archive", len(archive), lambda: load_archive(archive)[0].module()))
            if package is not None:
                loaders.append(("compiled", len(package), lambda: load_runner(package, workdir, device)))
            for name, target in (targets or {}).items():
                loaders.append((name, len(target.data), functools.partial(target.candidate, threads)))
                if not target.takes_threads:
                    own_threads.append(name)
            timers += [
                functools.partial(_time_artifact, n, b, load, points, inputs, options, canary) for n, b, load in loaders
            ]
            measured = timed_in_passes(timers, options.passes, options)
    finally:
        torch.set_num_threads(saved_threads)
    for m in measured:
        m.threads = None if m.name in own_threads else threads
    notes = [
        f"{name}: its loader takes no `threads`: timed on its runtime's own thread count, not {threads}"
        for name in own_threads
    ]
    if not any(m.timings for m in measured[1:]) and len(measured) > 1:
        shown = "; ".join(f"{m.name}: {m.error or next(iter(m.errors.values()), '?')}" for m in measured[1:])
        raise StageError(ErrorClass.RUNTIME, f"no artifact could be timed: {shown}")
    machine_load = {**quiet, "during": rounded(other.cores), "max_load": options.max_load}
    if options.max_slowdown is not None and math.isfinite(canary.fastest):
        machine_load["canary_fastest_us"] = round(canary.fastest * 1e6, 3)
    busy = other.cores is not None and other.cores > options.max_load
    noisy = noisy_points(measured, points, options, f"{other.cores:.2f} other cores busy" if busy else None)
    report = {
        "machine": {**machine, "threads": threads},
        "options": options.model_dump(mode="json"),
        "load": machine_load,
        "points": [{"label": p.label, "sizes": p.sizes, "batch": p.batch} for p in points],
        "artifacts": {m.name: _artifact_report(m, points, options) for m in measured},
        "recommendation": recommend(measured, points, noisy, options.tie_margin),
        "warnings": [*notes, *sink.items],
    }
    return StageResult(output=report, metadata={"summary": summary(report)}, warnings=(*notes, *sink.items))


def timed_in_passes(
    timers: Sequence[Callable[[], Measured]], passes: int, options: BenchmarkOptions | None = None
) -> list[Measured]:
    """Each timer (an artifact: loaded, then timed at every size) run `passes` times, in passes
    over all of them (every other pass in the reverse order, so that no artifact is always timed
    first or last), and per artifact what fastest_pass keeps. An artifact that does not load is
    not tried again."""
    runs: list[list[Measured]] = [[] for _ in timers]
    for index in range(passes):
        order = list(range(len(timers)))
        for at in order if index % 2 == 0 else reversed(order):
            if runs[at] and runs[at][0].error is not None:
                continue
            runs[at].append(timers[at]())
            gc.collect()  # the artifact just timed, freed before the next loads (its memory is measured)
    return [fastest_pass(each, options) for each in runs]


def fastest_pass(runs: Sequence[Measured], options: BenchmarkOptions | None = None) -> Measured:
    """One artifact's measurements over several passes as one: its size, load time and peak
    memory from the first (its first load, as a deployment's), and at each size the timing of
    the pass with the lowest p50, each pass's p50 kept beside it (`passes`). The VM's speed moves
    by tens of percent over seconds with nothing else running; the fastest pass is the
    artifact's own speed, the others that and the VM's. With `options`, a pass whose measurement
    there is noisy (stages/timing.py Timing.noise) is kept only when every pass's is: a handful
    of samples at full speed among thousands slowed has a low p50 and says little."""
    first = runs[0]
    kept = Measured(first.name, first.size_bytes, first.load_ms, first.peak_memory_mb, first.error)
    for label in dict.fromkeys(label for run in runs for label in [*run.timings, *run.errors]):
        timed = [run for run in runs if label in run.timings]
        if not timed:
            kept.errors[label] = next(run.errors[label] for run in runs if label in run.errors)
            continue
        clean = [run for run in timed if options is None or run.timings[label].noise(options) is None]
        best = min(clean or timed, key=lambda run: run.timings[label].p50)
        kept.timings[label] = best.timings[label]
        if label in best.attempts:
            kept.attempts[label] = best.attempts[label]
        if len(timed) > 1:
            kept.passes[label] = [run.timings[label].p50 for run in timed]
    return kept


def _time_eager(
    reference: torch.nn.Module,
    load_ms: float,
    peak_mb: float | None,
    points: list[Point],
    inputs: Mapping[str, BoundInputs],
    options: BenchmarkOptions,
    canary: Canary | None = None,
) -> Measured:
    state = sum(t.numel() * t.element_size() for t in [*reference.parameters(), *reference.buffers()])
    measured = Measured(EAGER, state, load_ms, peak_mb)
    with PeakMemory() as memory, torch.inference_mode():
        for point in points:
            bound = inputs[point.label]
            _time_point(measured, point, functools.partial(bound.call, reference), options, canary)
    measured.peak_memory_mb = max((v for v in (peak_mb, memory.peak_mb) if v is not None), default=None)
    return measured


def _time_artifact(
    name: str,
    size: int,
    load: Callable[[], Callable[..., Any]],
    points: list[Point],
    inputs: Mapping[str, BoundInputs],
    options: BenchmarkOptions,
    canary: Canary | None = None,
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
        prepare = getattr(fn, "prepare", None)  # a target's runtime: its inputs converted once, untimed
        with torch.inference_mode():  # as eager is called, and as a deployment calls it
            for point in points:
                bound = inputs[point.label]
                try:
                    call = prepare(*bound.args, **bound.kwargs) if prepare else functools.partial(bound.call, fn)
                except Exception as exc:  # noqa: BLE001 - inputs this runtime refuses: reported at this size
                    measured.errors[point.label] = short_message(exc, 300)
                    continue
                _time_point(measured, point, call, options, canary)
        close = getattr(fn, "close", None)  # what loading it changed in this process, given back
        if close is not None:
            close()
        del fn
    measured.peak_memory_mb = memory.peak_mb
    return measured


def _time_point(
    measured: Measured,
    point: Point,
    call: Callable[[], Any],
    options: BenchmarkOptions,
    canary: Canary | None = None,
) -> None:
    """Time one artifact at one size; a measurement its own spread or drift makes noisy (a burst
    of other work, this VM's speed moving), or too few of its samples taken at full speed, is
    taken again, up to options.retries more times, and the first that is not noisy is kept (else
    the last)."""
    try:
        attempts = 0
        while True:
            timing = time_calls(call, options, canary=canary)
            attempts += 1
            if timing.noise(options) is None or attempts > options.retries:
                break
        measured.timings[point.label] = timing
        if attempts > 1:
            measured.attempts[point.label] = attempts
    except Exception as exc:  # noqa: BLE001 - a size this artifact fails at is reported, not fatal
        measured.errors[point.label] = short_message(exc, 300)


def noisy_points(
    measured: Sequence[Measured], points: Sequence[Point], options: BenchmarkOptions, machine: str | None
) -> dict[str, str]:
    """Per size whose timings cannot be compared, why: the machine was busy while timing
    (`machine`, every size), or the artifacts whose own measurement there is noisy."""
    noisy: dict[str, str] = {}
    for point in points:
        reasons = [machine] if machine else []
        for m in measured:
            timing = m.timings.get(point.label)
            reason = timing.noise(options) if timing is not None else None
            if reason:
                reasons.append(f"{m.name}: {reason}")
        if reasons:
            noisy[point.label] = "; ".join(reasons)
    return noisy


def _artifact_report(measured: Measured, points: list[Point], options: BenchmarkOptions) -> dict[str, Any]:
    per_point: dict[str, dict[str, Any]] = {}
    for point in points:
        timing = measured.timings.get(point.label)
        if timing is None:
            per_point[point.label] = {"error": measured.errors.get(point.label, measured.error)}
            continue
        per_point[point.label] = {
            "p50_ms": timing.p50,
            "p90_ms": timing.p90,
            "runs": len(timing.kept),
            **({"slow_samples": timing.slow_samples} if timing.slowed else {}),
            "stable": timing.stable,
            "spread": rounded(timing.spread),
            "drift": rounded(timing.drift),
            "noisy": timing.noise(options),
            "throughput": point.batch / (timing.p50 / 1000.0) if timing.p50 > 0 else None,
            **({"attempts": measured.attempts[point.label]} if point.label in measured.attempts else {}),
            **({"passes_p50_ms": measured.passes[point.label]} if point.label in measured.passes else {}),
        }
    return {
        "size_bytes": measured.size_bytes,
        "threads": measured.threads,
        "load_ms": measured.load_ms,
        "peak_memory_mb": measured.peak_memory_mb,
        "error": measured.error,
        "points": per_point,
    }


def recommend(
    measured: Sequence[Measured],
    points: Sequence[Point],
    noisy: Mapping[str, str] | None = None,
    tie_margin: float = 0.0,
) -> dict[str, Any]:
    """Per point the artifact with the lowest p50 (eager excluded), its speedup over eager and
    whether it is slower than eager; none at a point whose timings are noisy (`noisy`: point ->
    why, kept in the result); overall the artifact fastest at the most points (ties: the lowest
    p50 summed over points).

    Artifacts whose p50 is within `tie_margin` of the lowest are tied: their order is the
    machine's noise, not theirs (two runtimes a few microseconds apart traded places from one
    benchmark to the next), so the first of them in `measured`'s order (the report's: archive,
    compiled, then the targets as configured) is recommended, and the others are named
    (`tied_with`), each run the same."""
    noisy = dict(noisy or {})
    eager = next((m for m in measured if m.name == EAGER), None)
    per_point: dict[str, Any] = {}
    for point in points:
        timed = [(m.timings[point.label].p50, m.name) for m in measured if m.name != EAGER and point.label in m.timings]
        if not timed or point.label in noisy:
            per_point[point.label] = None
            continue
        fastest = min(p50 for p50, _ in timed)
        tied = [(p50, name) for p50, name in timed if p50 <= fastest * (1.0 + tie_margin)]
        p50, name = tied[0]
        base = eager.timings[point.label].p50 if eager is not None and point.label in eager.timings else None
        speedup = base / p50 if base and p50 > 0 else None
        per_point[point.label] = {
            "artifact": name,
            "p50_ms": p50,
            "speedup_vs_eager": speedup,
            "slower_than_eager": speedup is not None and speedup < 1.0,
            **({"tied_with": [other for _, other in tied[1:]]} if len(tied) > 1 else {}),
        }
    wins: dict[str, int] = {}
    for choice in per_point.values():
        if choice is not None:
            wins[choice["artifact"]] = wins.get(choice["artifact"], 0) + 1
    total = {m.name: sum(t.p50 for t in m.timings.values()) for m in measured}
    best = min(wins, key=lambda n: (-wins[n], total[n]), default=None)
    found = {"artifact": best, "wins": wins.get(best, 0) if best else 0, "points": per_point}
    return {**found, "noisy": noisy} if noisy else found


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
        **({"noisy": report["recommendation"]["noisy"]} if report["recommendation"].get("noisy") else {}),
        **({"load": report["load"]["during"]} if report.get("load", {}).get("during") is not None else {}),
    }
