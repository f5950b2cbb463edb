"""The benchmark stage end to end through `pt2flow run`: the session's shared targets fleet
(tests/fleets.py: configs/targets.yaml, the demo's inference models each to the archive, the
AOTInductor package, ONNX, ExecuTorch and OpenVINO) with `benchmark` after validate, cold then
warm: every validated artifact and eager timed at each dim's
min, example and max (or the configured sizes), a recommendation that is the fastest at each size,
cached on the warm run, shown by `pt2flow show`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.conftest import run_cli
from tests.fleets import BENCHMARK_FEW_RUNS, Fleet

pytestmark = [pytest.mark.integration, pytest.mark.compile]

STAGES = [
    "trace",
    "functionalize",
    "decompose",
    "serialize",
    "aot_compile",
    "onnx",
    "executorch",
    "openvino",
    "validate",
    "benchmark",
]


@pytest.fixture
def fleet(targets_fleet: Fleet) -> dict[str, Any]:
    """The shared targets fleet (tests/fleets.py): configs/targets.yaml with `benchmark` after
    validate, a few runs per point (BENCHMARK_FEW_RUNS), tiny-encoder at batch 1 and 4."""
    config = yaml.safe_load(targets_fleet.config.read_text())
    assert config["stages"] == STAGES and config["defaults"]["benchmark"] == BENCHMARK_FEW_RUNS
    return {"cold": targets_fleet.cold, "warm": targets_fleet.warm, "store": targets_fleet.store}


def _models(result: Any) -> dict[str, dict[str, Any]]:
    assert result.returncode == 0, result.stderr[-4000:]
    return {m["name"]: m for m in json.loads(result.stdout)["models"]}


def _report(store: str, model: dict[str, Any]) -> dict[str, Any]:
    shown = run_cli(["show", model["stages"]["benchmark"]["artifact"], "--store", store, "--json"])
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["report"]


def test_every_validated_artifact_is_timed_at_each_size(fleet: dict[str, Any]) -> None:
    models = _models(fleet["cold"])
    mlp = _report(fleet["store"], models["mlp"])
    # batch 1..32, example 4: the dim's min, example size and max, in order
    assert [p["sizes"] for p in mlp["points"]] == [{"batch": 1}, {"batch": 4}, {"batch": 32}]
    assert set(mlp["artifacts"]) == {"eager", "archive", "compiled", "onnx", "executorch", "openvino"}
    for name, artifact in mlp["artifacts"].items():
        assert artifact["error"] is None and artifact["load_ms"] > 0 and artifact["size_bytes"] > 0, name
        for point in mlp["points"]:
            timing = artifact["points"][point["label"]]
            assert 3 <= timing["runs"] <= 8, (name, timing)
            assert 0 < timing["p50_ms"] <= timing["p90_ms"], (name, timing)
            assert timing["throughput"] == pytest.approx(point["sizes"]["batch"] / (timing["p50_ms"] / 1000)), name
    # the configured sizes: batch 1 and 4, seq at its example size (12)
    encoder = _report(fleet["store"], models["tiny-encoder"])
    assert [p["sizes"] for p in encoder["points"]] == [{"batch": 1, "seq": 12}, {"batch": 4, "seq": 12}]
    assert encoder["machine"]["threads"] >= 1 and encoder["machine"]["cpu"]


def test_the_recommendation_is_the_fastest_artifact_at_each_size(fleet: dict[str, Any]) -> None:
    """...at each size whose timings hold, or the first in the report's order of those within
    the tie margin of the fastest (the others named); at a noisy one (other work on the machine
    while it was timed, or a measurement's own spread: this suite runs beside other tests) none,
    and why."""
    for name, model in _models(fleet["cold"]).items():
        report = _report(fleet["store"], model)
        load = report["load"]
        assert load["waited_s"] >= 0.25 and load["max_load"] == 0.5 and load["during"] is not None, load
        noisy = report["recommendation"].get("noisy", {})
        for point in report["points"]:
            label = point["label"]
            chosen = report["recommendation"]["points"][label]
            measured = {a: e["points"][label] for a, e in report["artifacts"].items()}
            own = [a for a, e in measured.items() if e.get("noisy")]
            busy = load["during"] > load["max_load"]
            assert (label in noisy) == (busy or bool(own)), (name, label, load, own)
            if label in noisy:
                assert chosen is None and all(a in noisy[label] for a in own), (name, noisy)
                continue
            p50 = {a: e["p50_ms"] for a, e in measured.items() if a != "eager"}  # the report's order
            fastest = min(p50.values())
            tied = [a for a, ms in p50.items() if ms <= fastest * (1 + report["options"]["tie_margin"])]
            assert chosen["artifact"] == tied[0], (name, label, p50)
            assert chosen.get("tied_with", []) == tied[1:], (name, label, p50)
            eager = report["artifacts"]["eager"]["points"][label]["p50_ms"]
            assert chosen["speedup_vs_eager"] == pytest.approx(eager / p50[tied[0]]), name
        summary = model["timings"]  # the run document's summary
        assert summary["recommended"] in summary["best"].values() or (
            summary["recommended"] is None and set(summary["noisy"]) == set(summary["points"])
        )
        assert summary["p50_ms"]["onnx"] == {
            label: e["p50_ms"] for label, e in report["artifacts"]["onnx"]["points"].items()
        }


def test_the_warm_run_serves_the_benchmark_from_the_cache(fleet: dict[str, Any]) -> None:
    cold, warm = _models(fleet["cold"]), _models(fleet["warm"])
    for name, model in warm.items():
        assert model["stages"]["benchmark"]["cached"] is True, name
        assert model["stages"]["benchmark"]["artifact"] == cold[name]["stages"]["benchmark"]["artifact"], name
        assert model["timings"] == cold[name]["timings"], name


def test_show_prints_the_benchmark_table(fleet: dict[str, Any]) -> None:
    model = _models(fleet["cold"])["mlp"]
    shown = run_cli(["show", model["stages"]["benchmark"]["artifact"], "--store", fleet["store"]])
    assert shown.returncode == 0, shown.stderr
    assert "batch=32" in shown.stdout and "onnx" in shown.stdout
    assert "recommended: " in shown.stdout or "no recommendation: timings noisy" in shown.stdout, shown.stdout
