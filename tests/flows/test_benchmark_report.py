"""The benchmark stage's summary in the drift report: run b's summary per model, the p50s as the
latency upgrade-check's `latency_up` judges (validate's medians only when no run benchmarked),
and its HTML page's latency-vs-size plot."""

from __future__ import annotations

import json
from typing import Any

from pt2flow.flows.report.compare import build_report
from pt2flow.flows.report.html import to_html
from pt2flow.flows.report.upgrade import model_verdicts
from pt2flow.storage import ArtifactStore
from tests.flows.test_report import by_model, chain, store  # noqa: F401  (store: the fixture)
from tests.records import h


def _summary(onnx: float, eager: float = 1.0, threads: int = 2) -> dict[str, Any]:
    points = ["batch=1", "batch=8"]
    return {
        "recommended": "onnx",
        "points": points,
        "best": {p: "onnx" for p in points},
        "speedup_vs_eager": {p: eager / onnx for p in points},
        "p50_ms": {"eager": {p: eager for p in points}, "onnx": {"batch=1": onnx, "batch=8": None}},
        "threads": threads,
    }


def _benchmarked(store: ArtifactStore, run: str, summary: dict[str, Any], **kwargs: Any) -> None:
    rows = chain(
        store,
        "m",
        run,
        validate={"validation": {"passed": True, "max_abs_err": 1e-6, "latency_ms": {"eager": 1.0, "archive": 1.0}}},
        **kwargs,
    )
    timed = {
        **rows["validate"],
        "record_id": h(f"bench/{run}"),
        "stage": "benchmark",
        "key": h(f"bench-key/{run}"),
        "sha256": h(f"bench-blob/{run}"),
        "details": json.dumps({"timings": summary}),
        "validation": None,
        "passed": None,
    }
    store.index.append([timed])


def test_the_benchmark_p50s_are_the_latency_compared_and_run_bs_summary_is_kept(store: ArtifactStore) -> None:  # noqa: F811
    _benchmarked(store, "run-1", _summary(onnx=0.2))
    _benchmarked(store, "run-2", _summary(onnx=0.4), salt="v2", offset=10)
    drift = build_report(store.index, "run-1", "run-2")
    m = by_model(drift.model_dump(mode="json"))["m"]
    assert set(m["latency_ms"]) == {
        "eager batch=1",
        "eager batch=8",
        "onnx batch=1",
    }  # not validate's medians; a failed size left out
    assert (m["latency_ms"]["onnx batch=1"]["a"], m["latency_ms"]["onnx batch=1"]["b"]) == (0.2, 0.4)
    assert m["timings"]["p50_ms"]["onnx"]["batch=1"] == 0.4
    [verdict] = model_verdicts(drift, {})
    assert verdict.verdict == "regressed"
    assert [f.message for f in verdict.regressions if f.rule == "latency_up"] == [
        "onnx batch=1 latency 0.2 ms → 0.4 ms (limit +25 %)"
    ]
    page = to_html(drift.model_dump(mode="json"))
    assert "Benchmark (after)" in page and "<polyline" in page and "onnx at batch=1: 0.4 ms" in page


def test_p50s_timed_on_other_thread_counts_are_not_compared(store: ArtifactStore) -> None:  # noqa: F811
    """A baseline benchmarked on two threads (before stage version 4, every core) against a run on
    one: each p50 shown under its own count, and no latency_up drawn from the difference."""
    _benchmarked(store, "run-1", _summary(onnx=0.2, threads=2))
    _benchmarked(store, "run-2", _summary(onnx=0.4, threads=1), salt="v2", offset=10)
    drift = build_report(store.index, "run-1", "run-2")
    latency = by_model(drift.model_dump(mode="json"))["m"]["latency_ms"]
    assert (latency["onnx batch=1, 2 threads"]["a"], latency["onnx batch=1, 2 threads"]["b"]) == (0.2, None)
    assert (latency["onnx batch=1, 1 thread"]["a"], latency["onnx batch=1, 1 thread"]["b"]) == (None, 0.4)
    assert "onnx batch=1" not in latency
    [verdict] = model_verdicts(drift, {})
    assert not [f for f in verdict.regressions if f.rule == "latency_up"]


def test_without_a_benchmark_validates_medians_stay_the_latency(store: ArtifactStore) -> None:  # noqa: F811
    chain(store, "m", "run-1", validate={"validation": {"passed": True, "latency_ms": {"eager": 1.0}}})
    chain(
        store,
        "m",
        "run-2",
        salt="v2",
        offset=10,
        validate={"validation": {"passed": True, "latency_ms": {"eager": 1.1}}},
    )
    m = by_model(build_report(store.index, "run-1", "run-2").model_dump(mode="json"))["m"]
    assert set(m["latency_ms"]) == {"eager"} and m["timings"] is None


def test_an_int8_recommendation_says_what_accuracy_it_costs() -> None:
    """The run summary's line for a model whose fastest artifact is judged by accuracy budgets
    names the metrics validate measured (the benchmark stage copies them into its summary);
    a float recommendation's line is as before, and the summary validates as the run document's."""
    from pt2flow.flows.engine.common.documents import BenchmarkSummary
    from pt2flow.flows.report.benchmark import summary_line

    summary = {
        **_summary(onnx=0.5),
        "recommended": "executorch_int8",
        "best": {"batch=1": "executorch_int8", "batch=8": "onnx"},
        "speedup_vs_eager": {"batch=1": 2.5, "batch=8": 1.5},
        "accuracy": {"executorch_int8": {"sqnr_db": 31.25, "cosine": 0.9996, "top1_agreement": 0.984375}},
    }
    summary["p50_ms"] = {
        "eager": {"batch=1": 1.0, "batch=8": 1.0},
        "onnx": {"batch=1": 0.5, "batch=8": 0.6},  # the fastest float artifact at batch=1: 0.5 / 0.4
        "executorch": {"batch=1": 0.9, "batch=8": None},
        "aot_compile_int8": {"batch=1": 0.45, "batch=8": None},  # judged by budgets too: no float baseline
        "executorch_int8": {"batch=1": 0.4, "batch=8": 0.7},
    }
    summary["accuracy"]["aot_compile_int8"] = {"sqnr_db": 20.0}
    line = summary_line(BenchmarkSummary(**summary).model_dump())
    assert line == (
        "recommended: executorch_int8, fastest at 1 of 2 sizes (2.5x eager); onnx at batch=8; "
        "1.2x faster than onnx; within its accuracy budget: top1_agreement 0.9844, sqnr_db 31.25, cosine 0.9996"
    )
    plain = {k: v for k, v in _summary(onnx=0.5).items()}
    assert "accuracy" not in BenchmarkSummary(**plain).model_dump()  # not given: not in the document
    assert summary_line(plain) == "recommended: onnx, fastest at 2 of 2 sizes (2x eager)"


def test_the_summary_line_says_slower_than_eager_and_where_timings_were_noisy() -> None:
    """issue 43: a recommended artifact slower than eager is said to be; sizes whose timings were
    noisy have no recommendation and are named; a benchmark with every size noisy recommends
    nothing and says why. The summary with `noisy` and `load` validates as the run document's."""
    from pt2flow.flows.engine.common.documents import BenchmarkSummary
    from pt2flow.flows.report.benchmark import summary_line

    slower = _summary(onnx=1.6)  # eager 1.0 ms: the fastest artifact is 0.62x eager
    assert summary_line(slower) == "recommended: onnx, fastest at 2 of 2 sizes (0.62x eager, slower than eager)"
    partly = {
        **_summary(onnx=0.5),
        "best": {"batch=1": "onnx", "batch=8": None},
        "speedup_vs_eager": {"batch=1": 2.0, "batch=8": None},
        "noisy": {"batch=8": "eager: p90 4.1x p50 (max_spread 3)"},
        "load": 0.12,
    }
    line = summary_line(BenchmarkSummary(**partly).model_dump())
    assert line == "recommended: onnx, fastest at 1 of 2 sizes (2x eager); noisy at batch=8 (none recommended there)"
    busy = {
        **partly,
        "recommended": None,
        "best": {"batch=1": None, "batch=8": None},
        "noisy": {"batch=1": "1.84 other cores busy", "batch=8": "1.84 other cores busy"},
        "load": 1.84,
    }
    dumped = BenchmarkSummary(**busy).model_dump()
    assert dumped["load"] == 1.84 and summary_line(dumped) == (
        "no recommendation: timings noisy at 2 of 2 sizes (1.84 other cores busy)"
    )
    assert "noisy" not in BenchmarkSummary(**_summary(onnx=0.5)).model_dump()  # not given: not in the document
