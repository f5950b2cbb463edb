"""tolerance: auto through a real `pt2flow run` (docs/architecture.md §6): a tiny config whose
validate judges against a float64 copy of the eager model; the run document's validation says
so, and the report `pt2flow get` serves holds both errors per candidate, sample and leaf."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]


def test_run_with_tolerance_auto_reports_both_errors(tmp_path: Path) -> None:
    models = [
        {
            "name": "mlp",
            "factory": "tests.models:tiny_mlp",
            "inputs": {"x": {"shape": [4, 8]}},
            "dynamic_shapes": {"x": {0: "batch"}},
            "dims": {"batch": {"min": 1, "max": 16}},
            "stages": {"validate": {"tolerance": "auto", "noise_multiple": 10}},
        }
    ]
    config = write_config(tmp_path / "auto.yaml", models, stages=STAGES)
    store = str(tmp_path / "store")
    code, document, stderr = run_json(["run", str(config), "--store", store])
    assert code == 0, stderr[-3000:]
    (model,) = document["models"]
    validation = model["validation"]
    assert validation["passed"] is True and validation["samples"] == 3
    assert validation["tolerance"] == "auto" and 0 <= validation["max_noise_ratio"] <= 10
    assert validation["max_abs_err"] <= 1e-5  # still the error against eager

    out = tmp_path / "report.json"
    proc = run_cli(["get", "--model", "mlp", "--artifact", "report", "-o", str(out), "--store", store])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tolerance"]["mode"] == report["tolerance"]["applied"] == "auto"
    assert report["tolerance"]["noise_multiple"] == 10 and report["tolerance"]["fallback"] is None
    assert report["tolerance"]["reference_ms"] > 0
    archive = report["candidates"]["archive"]
    assert [s["label"] for s in archive["samples"]] == ["example", "min", "max"]
    for sample in archive["samples"]:
        row = sample["noise"]["output"]
        assert row["ok"] is True and 0 < row["eager_err"] < 1e-5 and row["err"] <= row["allowed"]
        assert row["ratio"] == pytest.approx(row["err"] / row["eager_err"])
    assert archive["max_noise_ratio"] == report["max_noise_ratio"] == validation["max_noise_ratio"]

    # an unchanged re-run is served from the cache; the fixed tolerance is another validate key
    code, again = run_in_process(config, store=store)
    assert code == 0 and again["models"][0]["stages"]["validate"]["cached"] is True
    models[0]["stages"] = {"validate": {"tolerance": "fixed"}}
    write_config(config, models, stages=STAGES)
    code, fixed = run_in_process(config, store=store)
    assert code == 0 and fixed["models"][0]["stages"]["validate"]["cached"] is False
    assert fixed["models"][0]["stages"]["serialize"]["cached"] is True
    assert "tolerance" not in fixed["models"][0]["validation"]  # the fixed tolerance's document is as before
