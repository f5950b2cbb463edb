"""The benchmark stage's parts without a run: the stabilisation window, percentiles, the sizes
timed, the recommendation, peak memory, which candidates of validate's report are timed, and a
key that covers the machine."""

from __future__ import annotations

import gc
import subprocess
import sys

from typing import Any
from collections.abc import Iterator

import pytest
import torch

from pt2flow.stages.benchmark import Measured, Point, plan_points, recommend
from pt2flow.stages.binding import bind_inputs
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.options import BenchmarkOptions
from pt2flow.stages.timing import Canary, Timing, percentile, time_calls


class FakeClock:
    """perf_counter for time_calls: each call of the timed function takes the next duration (s)."""

    def __init__(self, durations: Iterator[float]) -> None:
        self.now, self.durations, self.calls = 0.0, durations, 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += next(self.durations)


def test_timing_stops_once_the_median_is_stable() -> None:
    clock = FakeClock(iter([0.010] * 1000))
    options = BenchmarkOptions(
        warmup=2, warmup_s=0, min_runs=5, max_runs=50, window=3, stable_fraction=0.02, min_seconds=0
    )
    timing = time_calls(clock.work, options, clock)
    assert timing.stable and len(timing.times_ms) == 5  # stable as soon as min_runs allow
    assert clock.calls == 2 + 5 and timing.p50 == pytest.approx(10.0)


def test_timing_goes_on_for_min_seconds_though_the_median_is_stable() -> None:
    """A stable median of a few milliseconds of calls is one moment of a shared VM, whose slow
    stretches last hundreds of them: the calls go on for min_seconds (here 16 calls of 1/64 s)."""
    clock = FakeClock(iter([1 / 64] * 1000))
    options = BenchmarkOptions(warmup=0, warmup_s=0, min_runs=5, max_runs=1000, window=3, min_seconds=0.25)
    timing = time_calls(clock.work, options, clock)
    assert timing.stable and len(timing.times_ms) == 16
    capped = time_calls(clock.work, options.model_copy(update={"max_runs": 8}), clock)
    assert capped.stable and len(capped.times_ms) == 8  # max_runs still bounds it, and says it was stable


def test_warm_up_lasts_warmup_s_as_well_as_warmup_calls() -> None:
    """A call of a few microseconds is slower for its first thousands of calls: the warm-up goes
    on for warmup_s as well as `warmup` calls (here 10 ms calls: 0.095 s is 10 calls, not 2)."""
    clock = FakeClock(iter([0.010] * 1000))
    options = BenchmarkOptions(warmup=2, warmup_s=0.095, min_runs=5, max_runs=50, window=3, min_seconds=0)
    time_calls(clock.work, options, clock)
    assert clock.calls == 10 + 5
    slow = FakeClock(iter([1.0] * 1000))  # one call is past warmup_s: the `warmup` calls still run
    time_calls(slow.work, options, slow)
    assert slow.calls == 2 + 5


def test_timing_goes_on_while_the_median_moves_and_stops_at_max_runs() -> None:
    growing = (0.001 * 1.5**i for i in range(1000))  # every call slower: the median never settles
    clock = FakeClock(growing)
    timing = time_calls(
        clock.work, BenchmarkOptions(warmup=0, min_runs=3, max_runs=12, window=2, max_seconds=1e9), clock
    )
    assert not timing.stable and len(timing.times_ms) == 12


def test_timing_stops_at_max_seconds() -> None:
    clock = FakeClock(0.3 * (i + 1) for i in range(1000))  # every call slower: never stable
    timing = time_calls(
        clock.work, BenchmarkOptions(warmup=0, min_runs=1, max_runs=100, window=2, max_seconds=2.0), clock
    )
    assert len(timing.times_ms) == 4 and not timing.stable  # 0.3 + 0.6 + 0.9 < 2 s <= + 1.2


def test_the_timed_calls_run_without_the_collector_after_a_full_collection() -> None:
    """Inside time_calls the collector is off (a collection inside a call of microseconds would be
    timed) and is given back after; before the calls the whole heap is collected, as timeit does
    (a young collection only was tried and undone: docs/benchmarks.md, twenty-seventh session)."""
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    enabled_in_calls: list[bool] = []
    clock = FakeClock(iter([0.010] * 1000))

    def work() -> None:
        enabled_in_calls.append(gc.isenabled())
        clock.work()

    options = BenchmarkOptions(warmup=2, warmup_s=0, min_runs=5, max_runs=50, window=3, min_seconds=0)
    assert gc.isenabled()
    gc.callbacks.append(seen)
    try:
        time_calls(work, options, clock)
    finally:
        gc.callbacks.remove(seen)
    assert gc.isenabled()  # given back
    assert 2 in collections, collections
    assert enabled_in_calls[:2] == [True, True] and not any(enabled_in_calls[2:]), enabled_in_calls


class SlowingHost(FakeClock):
    """A FakeClock whose host runs this process slower for stretches (an unseen neighbour): each
    timed call takes its duration times the speed factor of that call (`factors`), and so does
    the canary's work, at the factor of the call before it."""

    def __init__(self, duration: float, factors: Iterator[float]) -> None:
        super().__init__(duration * f for f in self._noted(factors))
        self.factor = 1.0

    def _noted(self, factors: Iterator[float]) -> Iterator[float]:
        for factor in factors:
            self.factor = factor
            yield factor

    def canary_work(self) -> None:
        self.now += 0.000006 * self.factor


def test_samples_taken_while_the_host_ran_slow_are_left_out_of_the_figures() -> None:
    """The host runs a VM's process 2x slower for stretches, with nothing in the VM busy (no
    load, no steal: docs/benchmarks.md, twenty-ninth session). Here 7 samples in 10 are taken in
    such stretches: all samples give a p50 of 2 ms, the artifact's speed is 1 ms; the canary
    timed between samples sees which are which, and only full-speed samples make the figures."""
    pattern = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    options = BenchmarkOptions(warmup=0, warmup_s=0, min_runs=20, max_runs=20, window=3, min_seconds=0, max_seconds=1e9)
    host = SlowingHost(0.001, iter(pattern * 100))
    canary = Canary(host, host.canary_work)
    timing = time_calls(host.work, options, host, canary)
    assert timing.p50 == pytest.approx(1.0) and timing.p90 == pytest.approx(1.0)
    assert timing.slow_samples > 0 and len(timing.kept) == 20 and len(timing.times_ms) > 40
    assert timing.noise(options) is None
    # a sample is full speed only with the canaries on both its sides: the first fast sample
    # after a slow stretch had a slow canary before it
    assert timing.slowed[3] == pytest.approx(2.0) and timing.slowed[10] == pytest.approx(2.0)
    assert timing.slowed[11] == pytest.approx(1.0)
    # unwatched (max_slowdown null, or no canary), every sample counts: the slow stretches' 2 ms
    unwatched = SlowingHost(0.001, iter(pattern * 100))
    everything = time_calls(unwatched.work, options.model_copy(update={"max_slowdown": None}), unwatched, canary)
    assert everything.p50 == pytest.approx(2.0) and everything.slow_samples == 0 and not everything.slowed
    assert time_calls(unwatched.work, options, unwatched).p50 == pytest.approx(2.0)


def test_a_measurement_wholly_inside_a_slow_stretch_is_noisy_and_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement that lies wholly inside a slow stretch has a clean spread and drift; the
    canary, which ran at full speed earlier in the benchmark, says so: it is noisy (and _time_point
    takes it again), its figures those of all its samples. A later one at full speed is kept."""
    from pt2flow.stages import benchmark as stage

    options = BenchmarkOptions(warmup=0, warmup_s=0, min_runs=5, max_runs=20, window=3, min_seconds=0, max_seconds=0.5)
    host = SlowingHost(0.01, iter([1.0] * 4 + [2.0] * 60 + [1.0] * 1000))
    canary = Canary(host, host.canary_work)
    measured = Measured("onnx", 1)
    point = Point("batch=1", {"batch": 1}, 1)
    # the first 4 calls, at full speed, set the canary's fastest
    first = time_calls(host.work, options.model_copy(update={"min_runs": 4, "max_runs": 4}), host, canary)
    assert first.p50 == pytest.approx(10.0) and canary.fastest == pytest.approx(0.000006)
    slow = time_calls(host.work, options, host, canary)  # 2x for its whole half second
    assert (
        slow.p50 == pytest.approx(20.0)
        and slow.spread == pytest.approx(1.0)
        and slow.drift == pytest.approx(0, abs=1e-9)
    )
    assert slow.noise(options) == (
        f"{len(slow.times_ms)} of {len(slow.times_ms)} samples taken below full speed "
        "(the canary past 1.25x its fastest; max_slowdown 0.25)"
    )
    monkeypatch.setattr(stage, "time_calls", lambda call, options, canary=None: time_calls(call, options, host, canary))
    stage._time_point(measured, point, host.work, options, canary)  # the stretch ends during its first try
    kept = measured.timings["batch=1"]
    assert kept.p50 == pytest.approx(10.0) and kept.noise(options) is None and measured.attempts == {"batch=1": 2}
    report = stage._artifact_report(measured, [point], options)["points"]["batch=1"]
    assert report["runs"] == len(kept.kept) and report["slow_samples"] == kept.slow_samples


def test_percentiles_interpolate_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (
        percentile(values, 50) == 3.0 and percentile(values, 90) == pytest.approx(4.6) and percentile([7.0], 90) == 7.0
    )
    assert Timing((1.0, 2.0, 3.0, 100.0), True).p90 > Timing((1.0, 2.0, 3.0, 100.0), True).p50


class TwoDims(torch.nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float().sum(-1)


def _inputs() -> ModelInputs:
    return ModelInputs(
        {"ids": InputSpec(shape=(2, 12), dtype="int64", low=0, high=10)},
        {"ids": {0: "batch", 1: "seq"}},
        {"batch": (1, 8), "seq": (2, 64)},
    )


def test_the_default_sizes_are_each_dims_min_example_and_max() -> None:
    inputs = _inputs()
    example = bind_inputs(TwoDims(), inputs)
    points = plan_points({}, inputs, example, BenchmarkOptions())
    assert [p.sizes for p in points] == [{"batch": 1, "seq": 2}, {"batch": 2, "seq": 12}, {"batch": 8, "seq": 64}]
    assert [p.label for p in points] == ["batch=1 seq=2", "batch=2 seq=12", "batch=8 seq=64"] and [
        p.batch for p in points
    ] == [1, 2, 8]
    # the program's own range (trace's dims) narrows the configured one
    narrowed = plan_points({"batch": {"min": 1, "max": 4}}, inputs, example, BenchmarkOptions())
    assert narrowed[-1].sizes == {"batch": 4, "seq": 64}


def test_configured_sizes_are_every_combination_and_are_checked() -> None:
    inputs = _inputs()
    example = bind_inputs(TwoDims(), inputs)
    points = plan_points({}, inputs, example, BenchmarkOptions(sizes={"batch": [8, 1], "seq": [16, 32]}))
    assert [p.sizes for p in points] == [
        {"batch": 1, "seq": 16},
        {"batch": 1, "seq": 32},
        {"batch": 8, "seq": 16},
        {"batch": 8, "seq": 32},
    ]
    with pytest.raises(
        StageError, match=r"height: not a dynamic dim.*batch=9: outside the program.s range 1..8"
    ) as raised:
        plan_points({}, inputs, example, BenchmarkOptions(sizes={"batch": [9], "height": [3]}))
    assert raised.value.error_class.value == "config"


def _measured(name: str, p50s: dict[str, float]) -> Measured:
    return Measured(name, 1, timings={label: Timing((p50,), True) for label, p50 in p50s.items()})


def test_the_recommendation_is_the_fastest_artifact_at_each_size_never_eager() -> None:
    points = [Point("batch=1", {"batch": 1}, 1), Point("batch=8", {"batch": 8}, 8)]
    measured = [
        _measured("eager", {"batch=1": 0.1, "batch=8": 4.0}),  # fastest at batch 1, but the baseline
        _measured("archive", {"batch=1": 0.5, "batch=8": 3.0}),
        _measured("onnx", {"batch=1": 0.2, "batch=8": 2.0}),
        _measured("executorch", {"batch=1": 0.3}),  # failed at batch 8
    ]
    chosen = recommend(measured, points)
    assert chosen["artifact"] == "onnx" and chosen["wins"] == 2
    assert chosen["points"]["batch=1"] == {
        "artifact": "onnx",
        "p50_ms": 0.2,
        "speedup_vs_eager": pytest.approx(0.5),
        "slower_than_eager": True,  # the fastest artifact, at half eager's speed: said
    }
    assert chosen["points"]["batch=8"]["slower_than_eager"] is False
    assert chosen["points"]["batch=8"]["speedup_vs_eager"] == pytest.approx(2.0)
    assert recommend([_measured("eager", {"batch=1": 1.0})], points[:1])["artifact"] is None


PEAK_OF_A_NATIVE_ALLOCATION = """
import torch
from pt2flow.stages.timing import PeakMemory
with PeakMemory() as memory:
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, outside Python's allocator
    del block
print(memory.peak_mb)
"""


@pytest.mark.integration  # a fresh process
def test_peak_memory_sees_a_native_allocation() -> None:
    """In a fresh process: in a long-lived one (an xdist worker after hundreds of tests) the 64 MiB
    may come from memory the process already holds resident, and the peak rightly stays 0."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_OF_A_NATIVE_ALLOCATION], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak = done.stdout.strip().splitlines()[-1]
    if peak == "None":
        pytest.skip("no /proc/self/clear_refs here")
    assert 60 <= float(peak) < 200, peak


def test_only_the_candidates_validate_passed_are_timed() -> None:
    from pt2flow.flows.builtin.benchmark import validated

    old_style: dict[str, Any] = {"passed": True, "candidates": {"archive": {}, "onnx": {}}}
    assert validated(old_style) == {"archive", "onnx"}
    assert validated({**old_style, "passed": False}) == set()
    verdicts = {
        "passed": True,
        "candidates": {
            "archive": {"verdict": {"passed": True}},
            "executorch": {"verdict": {"passed": False, "error_class": "runtime"}},
        },
    }
    assert validated(verdicts) == {"archive"}


def test_the_key_covers_the_machine_and_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from pt2flow.flows import pipeline
    from pt2flow.flows.builtin import benchmark as declared
    from pt2flow.flows.config.load import parse_config
    from pt2flow.flows.engine.common.documents import Outcome
    from pt2flow.flows.engine.orchestrator.stage_keys import stage_key
    from tests.conftest import ROOT

    def key(options: str = "") -> str:
        text = f"version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {{x: {{shape: [3, 8]}}}}\n{options}"
        model = parse_config(text, source="k.yaml", base_dir=str(ROOT)).models[0]
        inputs = {
            "source": Outcome(key="s" * 64),
            "validate": Outcome(key="v" * 64),
            "serialize": Outcome(artifact="a" * 64),
        }
        return stage_key(pipeline.get("benchmark"), model, inputs)

    here = key()
    assert key() == here  # stable on one machine
    assert key("    stages: {benchmark: {sizes: {batch: [1]}}}\n") != here
    machine = declared.machine()
    assert machine["cores"] >= 1 and "host" not in machine
    monkeypatch.setattr(declared, "machine", lambda: {**machine, "cores": machine["cores"] + 1})
    assert key() != here
    monkeypatch.setattr(declared, "machine", lambda: {**machine, "cpu": "another CPU"})
    assert key() != here


def test_a_measurement_is_noisy_past_its_spread_or_drift_and_no_recommendation_is_drawn_from_it() -> None:
    from pt2flow.stages.benchmark import noisy_points

    options = BenchmarkOptions(max_spread=3)  # max_drift 0.25
    steady = Timing((1.0, 1.1, 1.0, 1.05, 1.0, 1.1), True)
    spiky = Timing((1.0, 1.0, 1.0, 1.0, 1.0, 9.0), False)  # p90 5x p50
    drifting = Timing((1.0, 1.0, 1.0, 2.0, 2.0, 2.0), False)  # halves 1 ms apart, the median 1.5
    assert steady.noise(options) is None
    assert "p90 5.0x p50" in str(spiky.noise(options)) and "max_spread 3" in str(spiky.noise(options))
    assert drifting.spread is not None and drifting.spread < 3 and "67% apart" in str(drifting.noise(options))
    points = [Point("batch=1", {"batch": 1}, 1), Point("batch=8", {"batch": 8}, 8)]
    measured = [
        Measured("eager", 1, timings={"batch=1": steady, "batch=8": Timing((4.0,) * 6, True)}),
        Measured("onnx", 1, timings={"batch=1": spiky, "batch=8": Timing((2.0,) * 6, True)}),
        Measured("archive", 1, timings={"batch=1": steady, "batch=8": Timing((8.0,) * 6, True)}),
    ]
    noisy = noisy_points(measured, points, options, None)
    assert list(noisy) == ["batch=1"] and noisy["batch=1"].startswith("onnx: p90")
    chosen = recommend(measured, points, noisy)
    # onnx's p50 at batch 1 (1.0) would tie the fastest: its spiky timing keeps that size out
    assert chosen["points"]["batch=1"] is None and chosen["noisy"] == noisy
    assert chosen["points"]["batch=8"]["artifact"] == "onnx" and chosen["artifact"] == "onnx" and chosen["wins"] == 1
    # a busy machine: every size noisy, nothing recommended, and the reason says so
    busy = noisy_points(measured, points, options, "1.80 other cores busy")
    assert set(busy) == {"batch=1", "batch=8"} and busy["batch=8"] == "1.80 other cores busy"
    assert recommend(measured, points, busy)["artifact"] is None


def test_a_recommendation_slower_than_eager_says_so() -> None:
    points = [Point("batch=1", {"batch": 1}, 1)]
    measured = [_measured("eager", {"batch=1": 1.0}), _measured("onnx", {"batch=1": 1.6})]
    chosen = recommend(measured, points)["points"]["batch=1"]
    assert chosen["artifact"] == "onnx" and chosen["slower_than_eager"] is True
    assert chosen["speedup_vs_eager"] == pytest.approx(1 / 1.6)


HOG = "while True: pass"


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_a_benchmark_beside_a_cpu_hog_waits_for_a_quiet_machine_then_flags_its_numbers() -> None:
    """Two busy-looping processes (one per core here) run beside the benchmark of a small model
    for its whole length: it waits for a quiet machine for `quiet_wait_s`, measures the load
    while timing, and draws no recommendation from numbers taken beside it."""
    from pt2flow.stages.benchmark import benchmark

    inputs = ModelInputs({"x": InputSpec(shape=(4, 16))}, {"x": {0: "batch"}}, {"batch": (1, 8)})
    torch.manual_seed(0)
    program = torch.export.export(
        Small(), (torch.randn(4, 16),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},)
    )
    import io

    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    # one pass, no retries: beside the hogs every measurement is noisy, and taking it again (up to
    # 3 passes x 3 tries x 1 s a size) only makes this test longer
    options = BenchmarkOptions(
        warmup=1, min_runs=3, max_runs=20, window=2, max_seconds=1.0, quiet_wait_s=1.0, passes=1, retries=0
    )
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    try:
        torch.manual_seed(0)
        report = benchmark(Small, inputs, {}, options, archive=buffer.getvalue()).output
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    load = report["load"]
    assert load["waited_s"] >= 1.0 and load["before"] > 0.5, load  # it waited, and the machine stayed busy
    assert load["during"] > options.max_load, load
    recommendation = report["recommendation"]
    assert recommendation["artifact"] is None and all(c is None for c in recommendation["points"].values())
    assert set(recommendation["noisy"]) == {p["label"] for p in report["points"]}
    assert all("other cores busy" in why for why in recommendation["noisy"].values()), recommendation["noisy"]
    # the timings are still reported, each with its spread and drift, and what the canary left out
    points = report["artifacts"]["archive"]["points"].values()
    assert all(e["p50_ms"] > 0 and e["spread"] >= 1 and e["slow_samples"] >= 0 and e["runs"] >= 1 for e in points)
    assert load["canary_fastest_us"] > 0, load


def test_a_call_of_microseconds_is_timed_in_batches() -> None:
    """A 10 µs call is timed 100 calls at a time (each sample at least SAMPLE_MIN_S, 1 ms, as
    timeit does), and each sample is the time per call."""
    clock = FakeClock(iter([0.00001] * 100000))
    options = BenchmarkOptions(warmup=2, warmup_s=0, min_runs=5, max_runs=5, window=3)
    timing = time_calls(clock.work, options, clock)
    assert len(timing.times_ms) == 5 and clock.calls == 2 + 5 * 100
    assert timing.p50 == pytest.approx(0.01)


def test_artifacts_within_the_tie_margin_are_tied_and_the_first_in_the_reports_order_is_recommended() -> None:
    """Two runtimes a few microseconds apart traded places from one benchmark to the next
    (bench/benchmark_agreement.py): within tie_margin of the fastest, the pick is the first in
    the report's order, whichever measured faster this time, and the others are named."""
    from pt2flow.flows.report.benchmark import recommendation_sentence

    points = [Point("batch=1", {"batch": 1}, 1), Point("batch=8", {"batch": 8}, 8)]
    for onnx_p50 in (0.0056, 0.0058):  # faster, then slower than executorch: the same answer
        measured = [
            _measured("eager", {"batch=1": 0.025, "batch=8": 0.9}),
            _measured("archive", {"batch=1": 0.088, "batch=8": 1.0}),
            _measured("onnx", {"batch=1": onnx_p50, "batch=8": 0.30}),
            _measured("executorch", {"batch=1": 0.0057, "batch=8": 0.45}),  # 1.5x onnx at batch 8: not tied
        ]
        chosen = recommend(measured, points, tie_margin=0.1)
        assert chosen["points"]["batch=1"]["artifact"] == "onnx"
        assert chosen["points"]["batch=1"]["tied_with"] == ["executorch"]
        assert chosen["points"]["batch=1"]["p50_ms"] == onnx_p50
        assert chosen["points"]["batch=8"]["artifact"] == "onnx" and "tied_with" not in chosen["points"]["batch=8"]
        sentence = recommendation_sentence(chosen, [p.label for p in points])
        assert sentence.endswith("; as fast (within the tie margin): executorch at batch=1"), sentence
    # without a margin the fastest alone is picked, as before
    assert recommend(measured, points)["points"]["batch=1"]["artifact"] == "executorch"
    # the margin is the stage's option, 0.1 by default
    assert BenchmarkOptions().tie_margin == 0.1
    with pytest.raises(ValueError):
        BenchmarkOptions(tie_margin=1.0)


def test_a_noisy_measurement_is_taken_again_and_the_first_clean_one_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of other work makes one measurement drift; the size is measured again (up to
    `retries` more times) instead of being given up, and the report says how many times."""
    from pt2flow.stages import benchmark as stage

    drifting = Timing((1.0, 1.0, 1.0, 2.0, 2.0, 2.0), False)
    clean = Timing((1.0, 1.05, 1.0, 1.0, 1.05, 1.0), True)
    options = BenchmarkOptions()  # retries 2
    point = Point("batch=1", {"batch": 1}, 1)

    def measure(sequence: list[Timing], retries: int) -> Measured:
        given = iter(sequence)
        monkeypatch.setattr(stage, "time_calls", lambda call, options, canary=None: next(given))
        measured = Measured("onnx", 1)
        stage._time_point(measured, point, lambda: None, options.model_copy(update={"retries": retries}))
        return measured

    second = measure([drifting, clean, drifting], retries=2)
    assert second.timings["batch=1"] is clean and second.attempts == {"batch=1": 2}
    assert stage._artifact_report(second, [point], options)["points"]["batch=1"]["attempts"] == 2
    first = measure([clean, drifting], retries=2)
    assert (
        first.timings["batch=1"] is clean
        and first.attempts == {}
        and "attempts" not in (stage._artifact_report(first, [point], options)["points"]["batch=1"])
    )
    given_up = measure([drifting, drifting, drifting, clean], retries=2)  # three tries, all noisy: the last kept
    assert given_up.timings["batch=1"] is drifting and given_up.attempts == {"batch=1": 3}
    assert stage._artifact_report(given_up, [point], options)["points"]["batch=1"]["noisy"]
    assert measure([drifting, clean], retries=0).timings["batch=1"] is drifting  # retries 0: as before


def test_each_artifact_is_timed_in_passes_and_each_size_reports_its_fastest_pass() -> None:
    """The VM's speed moves by tens of percent over seconds: every artifact is timed `passes`
    times, in passes over all of them (the second in the reverse order), and at each size the
    pass with the lowest p50 is the one reported, each pass's p50 beside it; the load time and
    peak memory are the first pass's (the first load), and an artifact that does not load is
    not tried again."""
    from pt2flow.stages import benchmark as stage

    order: list[str] = []
    slow_pass = {"archive": 0, "onnx": 1}  # the pass each ran while the VM was slower (2x)

    def timer(name: str, base: dict[str, float]) -> Any:
        def run() -> Measured:
            this = sum(1 for n in order if n == name)
            order.append(name)
            factor = 2.0 if slow_pass.get(name) == this else 1.0
            return Measured(
                name,
                10,
                load_ms=5.0 + this,
                peak_memory_mb=1.0 + this,
                timings={label: Timing((p50 * factor,), True) for label, p50 in base.items()},
                errors={"batch=8": "refused"} if name == "onnx" else {},
            )

        return run

    def broken() -> Measured:
        order.append("executorch")
        return Measured("executorch", 10, error="does not load: no")

    timers = [
        timer("eager", {"batch=1": 1.0, "batch=8": 4.0}),
        timer("archive", {"batch=1": 0.5, "batch=8": 3.0}),
        timer("onnx", {"batch=1": 0.2}),
        broken,
    ]
    eager, archive, onnx, executorch = stage.timed_in_passes(timers, 2)
    assert order == ["eager", "archive", "onnx", "executorch", "onnx", "archive", "eager"]
    assert archive.timings["batch=1"].p50 == 0.5 and archive.passes["batch=1"] == [1.0, 0.5]  # its slow pass dropped
    assert onnx.timings["batch=1"].p50 == 0.2 and onnx.passes["batch=1"] == [0.2, 0.4]
    assert onnx.errors == {"batch=8": "refused"} and "batch=8" not in onnx.timings
    assert (archive.load_ms, archive.peak_memory_mb) == (5.0, 1.0)  # the first load's
    assert executorch.error == "does not load: no" and not executorch.timings
    report = stage._artifact_report(archive, [Point("batch=1", {"batch": 1}, 1)], BenchmarkOptions())
    assert report["points"]["batch=1"]["passes_p50_ms"] == [1.0, 0.5] and report["points"]["batch=1"]["p50_ms"] == 0.5
    order.clear()
    (single,) = stage.timed_in_passes([timer("archive", {"batch=1": 0.5})], 1)  # passes 1: as before
    assert order == ["archive"] and single.timings["batch=1"].p50 == 1.0 and single.passes == {}
    assert BenchmarkOptions().passes == 3


def test_a_noisy_pass_is_reported_only_when_every_pass_is() -> None:
    """A pass spent almost wholly in a slow stretch keeps a handful of samples at full speed,
    whose p50 can be lower than a clean pass's (the twenty-ninth session's first agreement run:
    3 samples of 7,226 at full speed, the size given up as noisy though two other passes were
    clean); the clean pass with the lowest p50 is reported, a noisy one only when all are."""
    from pt2flow.stages import benchmark as stage

    options = BenchmarkOptions(min_runs=5)
    few = Timing((0.9, 0.9, 0.9) + (2.0,) * 100, False, (1.0,) * 3 + (2.0,) * 100, 1.25)  # 3 at full speed
    clean = Timing((1.1,) * 20, True, (1.0,) * 20, 1.25)
    cleaner = Timing((1.0,) * 20, True, (1.0,) * 20, 1.25)
    assert few.noise(options) and few.p50 == pytest.approx(0.9) and clean.noise(options) is None
    runs = [Measured("archive", 1, timings={"batch=1": t}) for t in (few, clean, cleaner)]
    assert stage.fastest_pass(runs, options).timings["batch=1"] is cleaner
    assert stage.fastest_pass(runs[:2], options).timings["batch=1"] is clean
    assert stage.fastest_pass(runs[:1], options).timings["batch=1"] is few  # all noisy: the lowest of them
    assert stage.fastest_pass(runs).timings["batch=1"] is few  # without options, the lowest p50 as before


@pytest.mark.integration  # exports an encoder to ONNX, ExecuTorch and OpenVINO
def test_every_runtime_is_timed_on_the_benchmarks_thread_count(seq_case: Any) -> None:
    """`threads` reaches each target's runtime, read back from the runtime itself: ONNX Runtime's
    session options, OpenVINO's compiled model, ExecuTorch's thread pool (given back afterwards:
    it is the process's own); a plugin's loader that takes no `threads` is timed on its runtime's
    own count, and the report says so."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    pytest.importorskip("openvino")
    from executorch.extension.pybindings import portable_lib

    from pt2flow.stages.benchmark import benchmark
    from pt2flow.stages.executorch_target import load_pte, lower_executorch
    from pt2flow.stages.onnx_target import export_onnx, load_onnx
    from pt2flow.stages.openvino_target import convert, load_openvino
    from pt2flow.stages.target_options import ExecutorchOptions, OnnxOptions, OpenvinoOptions
    from pt2flow.stages.targets import TargetArtifact

    pool = portable_lib._threadpool_get_thread_count()  # every core: each runtime's own default
    if pool < 2:
        pytest.skip("one core: every runtime's default is already one thread")
    threads = 1  # the stage's default (OpenVINO takes no more threads than there are cores)
    seen: dict[str, Any] = {}

    def onnx_runner(data: bytes, threads: int | None = None) -> Any:
        seen["onnx"] = load_onnx(data, threads)
        return seen["onnx"]

    def pte_runner(data: bytes, threads: int | None = None) -> Any:
        runner = load_pte(data, threads)
        seen["executorch"] = portable_lib._threadpool_get_thread_count()
        return runner

    def openvino_runner(data: bytes, threads: int | None = None) -> Any:
        seen["openvino"] = load_openvino(data, threads)
        return seen["openvino"]

    def plugin_runner(data: bytes) -> Any:  # a plugin's loader of the same ONNX bytes, no `threads`
        seen["plugin"] = load_onnx(data)
        return seen["plugin"]

    onnx = export_onnx(seq_case.program, OnnxOptions(), dim_names=seq_case.dim_names).output
    targets = {
        "onnx": TargetArtifact(onnx, onnx_runner),
        "executorch": TargetArtifact(lower_executorch(seq_case.program, ExecutorchOptions()).output, pte_runner),
        "openvino": TargetArtifact(convert(seq_case.program, OpenvinoOptions()).output, openvino_runner),
        "plugin": TargetArtifact(onnx, plugin_runner),
    }
    options = BenchmarkOptions(
        threads=threads, warmup=1, min_runs=3, max_runs=5, window=2, max_seconds=0.5, quiet_wait_s=0, passes=1
    )
    report = benchmark(seq_case.build, seq_case.inputs, seq_case.dims, options, targets=targets).output

    assert seen["onnx"].session.get_session_options().intra_op_num_threads == threads
    assert seen["openvino"].compiled.get_property("INFERENCE_NUM_THREADS") == threads
    assert seen["executorch"] == threads and portable_lib._threadpool_get_thread_count() == pool
    assert seen["plugin"].session.get_session_options().intra_op_num_threads == 0  # ONNX Runtime's default
    assert report["machine"]["threads"] == threads
    assert {name: a["threads"] for name, a in report["artifacts"].items()} == {
        "eager": threads,
        "onnx": threads,
        "executorch": threads,
        "openvino": threads,
        "plugin": None,
    }
    assert report["warnings"][0].startswith("plugin: its loader takes no `threads`"), report["warnings"]
    assert all(a["points"][label]["p50_ms"] > 0 for a in report["artifacts"].values() for label in a["points"])


def test_one_thread_unless_set() -> None:
    assert BenchmarkOptions().threads == 1
    assert BenchmarkOptions(threads=None).threads is None  # every core this process may use
