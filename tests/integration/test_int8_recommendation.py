"""Ship what pays (issue 42): the benchmark recommends an int8 `.pte` where it met its accuracy
budget and is the faster artifact, and the float `.pte` where it is not: a wide MLP whose int8
program runs about 3x faster than its float one at batch 64, a narrow MLP whose int8 program
(dynamic activations: a scale computed per call, per row) runs about 4x slower at batch 1024,
and a model whose int8 artifact misses its budget (an outlier channel), which is not timed at all.
Which is faster is checked from outside pt2flow: the two `.pte` files `get` serves, timed by the
ExecuTorch runtime in a plain interpreter."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli, run_plain_script, write_config

pytest.importorskip("executorch")
pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "executorch", "executorch_int8", "validate", "benchmark"]

# the sizes asserted, each where one artifact is several times faster than the other (AMD EPYC,
# 2 cores, quiet or beside CPU hogs: wide's int8 2.7-3.8x faster at batch 64, narrow's float
# 3.3-5.7x faster at batch 1024); at batch 1 the narrow model's two are within 5 %
WIDE, NARROW = "batch=64", "batch=1024"

# pytest runs two workers side by side on a 2-core machine: other work keeps a core busy while
# the stage times, and a sample the scheduler interrupts widens a measurement's p90 and moves
# one half's median. The stage then rightly withholds its pick (max_load, max_spread, max_drift,
# max_slowdown),
# which would leave nothing to check here; the gates are opened (more cores than a CI machine
# has, spreads and drifts load makes) and the sizes above have margins no such noise closes.
# What the test checks is not the gates but the pick: among the artifacts that met their
# budgets, the fastest. More timed samples than the fleets' few (BENCHMARK_FEW_RUNS) steady the p50.
BENCHMARK = {
    "warmup": 3,
    "min_runs": 10,
    "max_runs": 30,
    "window": 3,
    "max_seconds": 1.0,
    "quiet_wait_s": 0.5,
    "max_load": 64.0,
    "max_spread": 1000.0,
    "max_drift": 1000.0,
    "max_slowdown": None,
    "passes": 2,
}

# both `.pte` files in one fresh interpreter with the ExecuTorch runtime and no pt2flow: each
# call's time at one size, the two timed in turns so that load on the machine weighs on both
PLAIN_TIMING = """
import json, statistics, sys, time
import torch
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
paths, batch, features = sys.argv[1:3], int(sys.argv[3]), int(sys.argv[4])
blobs = [open(path, "rb").read() for path in paths]  # kept: the runtime reads the programs from these bytes
runtimes = [_load_for_executorch_from_buffer(blob) for blob in blobs]
x = torch.randn(batch, features, generator=torch.Generator().manual_seed(0))

def per_call_ms(runtime, calls):
    start = time.perf_counter()
    for _ in range(calls):
        runtime.forward((x,))
    return (time.perf_counter() - start) * 1000 / calls

for runtime in runtimes:
    per_call_ms(runtime, 50)
times = [[], []]
for _ in range(15):
    for runtime, seen in zip(runtimes, times):
        seen.append(per_call_ms(runtime, 20))
assert not [name for name in sys.modules if name.startswith("pt2flow")]
print(json.dumps({"float_ms": statistics.median(times[0]), "int8_ms": statistics.median(times[1])}))
"""


def _config(tmp_path: Path) -> Path:
    def mlp(
        name: str, features: int, hidden: int, out: int, batch: int, sizes: list[int], **more: Any
    ) -> dict[str, Any]:
        return {
            "name": name,
            "factory": "tests.models:tiny_mlp",
            "kwargs": {"features": features, "hidden": hidden, "out": out},
            "inputs": {"x": {"shape": [4, features]}},
            "dynamic_shapes": {"x": {0: "batch"}},
            "dims": {"batch": {"min": 1, "max": batch}},
            "stages": {"benchmark": {"sizes": {"batch": sizes}}, **more},
        }

    wide = mlp("wide", 256, 1024, 10, 64, [64])  # as configs/quantized.yaml's wide-mlp
    narrow = mlp("narrow", 8, 16, 4, 1024, [1024], executorch_int8={"activations": "dynamic"})
    outlier = {
        "name": "outlier",
        "factory": "tests.models:outlier_mlp",
        "inputs": {"x": {"shape": [4, 8]}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 64}},
        "stages": {"validate": {"accuracy": {"sqnr_db": {"min": 25}}}, "benchmark": {"sizes": {"batch": [1, 64]}}},
    }
    return write_config(
        tmp_path / "ship.yaml",
        [wide, narrow, outlier],
        stages=STAGES,
        store="store",
        defaults={
            "executorch": {"partitioners": ["xnnpack"]},
            "executorch_int8": {"per_channel": True, "activations": "static"},
            "validate": {"accuracy": {"sqnr_db": {"min": 20}}},
            "require": ["pte"],  # an int8 artifact may miss its budget without failing its model
            "benchmark": BENCHMARK,
        },
    )


def _report(store: str, artifact: str) -> dict[str, Any]:
    shown = run_cli(["show", artifact, "--store", store, "--json"])
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["report"]


def _plain_timing(float_pte: Path, int8_pte: Path, batch: int, features: int) -> dict[str, float]:
    return run_plain_script(PLAIN_TIMING, float_pte, int8_pte, batch, features)


def test_the_recommendation_is_int8_where_it_is_faster_and_within_budget_else_float(tmp_path: Path) -> None:
    config = _config(tmp_path)
    store = str(tmp_path / "store")
    proc = run_cli(["run", str(config)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # outlier: partial, not failed
    printed = " ".join(proc.stdout.split())  # the summary's lines, unwrapped
    records = json.loads(run_cli(["ls", "--store", store, "--stage", "benchmark", "--json"]).stdout)
    reports = {r["model"]: _report(store, r["sha256"]) for r in records}
    assert sorted(reports) == ["narrow", "outlier", "wide"], sorted(reports)

    # wide: its int8 program met its budget, and is the faster; the line says what it costs
    wide = reports["wide"]
    picked = wide["recommendation"]["points"][WIDE]
    assert picked is not None and picked["artifact"] == "executorch_int8", wide["recommendation"]
    assert wide["recommendation"]["artifact"] == "executorch_int8"
    wide_p50 = {name: a["points"][WIDE]["p50_ms"] for name, a in wide["artifacts"].items()}
    assert wide_p50["executorch_int8"] < wide_p50["executorch"], wide_p50
    assert "⏱ wide: recommended: executorch_int8, fastest at 1 of 1 sizes" in printed, proc.stdout[-3000:]
    # the speed-up over the float .pte and the accuracy it costs, in one line (issue 42)
    gain = re.search(
        r"⏱ wide: .*?; ([0-9.]+)x faster than executorch; within its accuracy budget: top1_agreement", printed
    )
    assert gain, proc.stdout[-3000:]
    assert float(gain.group(1)) == pytest.approx(wide_p50["executorch"] / wide_p50["executorch_int8"], rel=0.06)

    # narrow: its int8 program met its budget too, was timed, and is the slower: float is recommended
    narrow = reports["narrow"]
    picked = narrow["recommendation"]["points"][NARROW]
    assert picked is not None and picked["artifact"] == "executorch", narrow["recommendation"]
    narrow_p50 = {name: a["points"][NARROW]["p50_ms"] for name, a in narrow["artifacts"].items()}
    assert narrow_p50["executorch"] < narrow_p50["executorch_int8"], narrow_p50
    assert "⏱ narrow: recommended: executorch, fastest at 1 of 1 sizes" in printed, proc.stdout[-3000:]

    # outlier: its int8 artifact missed its budget, so it is not timed at all: float everywhere
    outlier = reports["outlier"]
    assert set(outlier["artifacts"]) == {"eager", "executorch"}, set(outlier["artifacts"])
    assert {label: (c or {}).get("artifact") for label, c in outlier["recommendation"]["points"].items()} == {
        "batch=1": "executorch",
        "batch=64": "executorch",
    }, outlier["recommendation"]
    refused = run_cli(["get", "--model", "outlier", "--artifact", "pte-int8", "-o", "-", "--store", store])
    assert refused.returncode != 0 and "misses its accuracy budget: sqnr_db" in refused.stderr, refused.stderr

    # from outside pt2flow: the two .pte files `get` serves, timed in a plain interpreter
    seen = {}
    for name, batch, features in (("wide", 64, 256), ("narrow", 1024, 8)):
        paths = []
        for kind in ("pte", "pte-int8"):
            path = tmp_path / f"{name}.{kind}.pte"
            got = run_cli(["get", "--model", name, "--artifact", kind, "-o", str(path), "--store", store])
            assert got.returncode == 0, got.stderr
            paths.append(path)
        seen[name] = _plain_timing(paths[0], paths[1], batch, features)
    assert seen["wide"]["int8_ms"] < seen["wide"]["float_ms"], seen  # as the stage picked
    assert seen["narrow"]["float_ms"] < seen["narrow"]["int8_ms"], seen
