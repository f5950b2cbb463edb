"""Fleet overhead benchmark: pt2flow against a bare torch loop doing the same six stages by hand.

    .venv/bin/python bench/fleet_overhead.py [--models 8] [--workdir /tmp/pt2-bench-fleet]

Arms, back to back on this machine, each a whole process timed by wall clock (interpreter
start-up and imports included), each with its own empty TORCHINDUCTOR_CACHE_DIR so that no arm
reuses another's compiled kernels:

  bare        one process: export -> run_decompositions({}) -> core ATen -> torch.export.save ->
              aoti_compile_and_package -> reload both, compare with eager at each dim's min/max
  cold-1      `pt2flow run` on an empty store, 1 worker
  warm        `pt2flow run` again on the same store (every stage cached)
  cold-2      `pt2flow run --workers 2 --runner process` on another empty store

Goals (issue 4): cold-1 / bare <= 1.10; warm / cold-1 <= 0.05; cold-2 / cold-1 <= 0.65.
Prints one table and a JSON line with every figure (--json-out FILE also writes it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (name, factory in configs/demo_models.py, kwargs, inputs, dynamic shapes, dims)
FLEET: list[tuple[str, str, dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[int, str]], dict[str, tuple[int, int]]]] = [
    ("mlp-s", "mlp", {"hidden": 32}, {"x": {"shape": [4, 16]}}, {"x": {0: "batch"}}, {"batch": (1, 32)}),
    ("mlp-m", "mlp", {"hidden": 64}, {"x": {"shape": [4, 16]}}, {"x": {0: "batch"}}, {"batch": (1, 32)}),
    ("mlp-l", "mlp", {"hidden": 128, "out_features": 8}, {"x": {"shape": [4, 16]}}, {"x": {0: "batch"}}, {"batch": (1, 32)}),
    ("cnn-8", "small_cnn", {"channels": 8}, {"image": {"shape": [2, 3, 16, 16]}}, {"image": {0: "batch"}}, {"batch": (1, 8)}),
    ("cnn-16", "small_cnn", {"channels": 16}, {"image": {"shape": [2, 3, 16, 16]}}, {"image": {0: "batch"}}, {"batch": (1, 8)}),
    ("encoder", "tiny_encoder", {}, {"input_ids": {"shape": [2, 12], "dtype": "int64", "low": 0, "high": 100}}, {"input_ids": {0: "batch", 1: "seq"}}, {"batch": (1, 8), "seq": (2, 64)}),
    ("normalizer", "running_normalizer", {}, {"x": {"shape": [4, 8]}}, {"x": {0: "batch"}}, {"batch": (1, 16)}),
    ("multi-head", "multi_head", {}, {"x": {"shape": [3, 6, 12]}, "mask": {"shape": [3, 6], "value": 1}}, {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}, {"batch": (1, 8), "seq": (2, 32)}),
    ("mlp-xl", "mlp", {"hidden": 256}, {"x": {"shape": [4, 16]}}, {"x": {0: "batch"}}, {"batch": (1, 32)}),
    ("cnn-32", "small_cnn", {"channels": 32}, {"image": {"shape": [2, 3, 16, 16]}}, {"image": {0: "batch"}}, {"batch": (1, 8)}),
]

STAGES = ["trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"]


def write_config(folder: Path, count: int) -> Path:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "configs" / "demo_models.py", folder / "demo_models.py")
    models = []
    for name, factory, kwargs, inputs, dynamic, dims in FLEET[:count]:
        models.append({
            "name": name,
            "factory": f"demo_models:{factory}",
            "kwargs": kwargs,
            "inputs": inputs,
            "dynamic_shapes": dynamic,
            "dims": {d: {"min": lo, "max": hi} for d, (lo, hi) in dims.items()},
            "stages": {"validate": {"atol": 1e-4}},
        })
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "stages": STAGES, "models": models}, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------
# the bare loop (runs in its own process: `fleet_overhead.py --bare N WORKDIR`)


def _tensor(spec: dict[str, Any], sizes: dict[str, int] | None, dims_of: dict[int, str]) -> Any:
    import torch

    shape = list(spec["shape"])
    for axis, dim in dims_of.items():
        if sizes is not None:
            shape[axis] = sizes[dim]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    if "value" in spec:
        return torch.full(shape, spec["value"], dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(spec.get("low", 0), spec.get("high", 10), shape, dtype=dtype)


def bare_loop(count: int, workdir: Path) -> dict[str, float]:
    import copy

    import torch
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from torch.export import Dim

    sys.path.insert(0, str(workdir))
    import demo_models  # type: ignore[import-not-found]

    seconds: dict[str, float] = {}
    for name, factory, kwargs, inputs, dynamic, dims in FLEET[:count]:
        started = time.perf_counter()
        torch.manual_seed(0)
        model = getattr(demo_models, factory)(**kwargs).eval()
        objects = {d: Dim(d.replace("-", "_"), min=lo, max=hi) for d, (lo, hi) in dims.items()}
        example = {k: _tensor(v, None, dynamic.get(k, {})) for k, v in inputs.items()}
        shapes = {k: {axis: objects[d] for axis, d in dynamic.get(k, {}).items()} for k in inputs}
        pristine = copy.deepcopy(model)
        program = torch.export.export(model, (), kwargs=example, dynamic_shapes=shapes, strict=False)
        program = program.run_decompositions({})
        program = program.run_decompositions()
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        package = workdir / f"{name}.pt2"
        aoti_compile_and_package(program, package_path=str(package))
        archive = torch.export.load(io.BytesIO(buffer.getvalue())).module()
        compiled = aoti_load_package(str(package))
        for pick in (None, 0, 1):
            sizes = None if pick is None else {d: (lo, hi)[pick] for d, (lo, hi) in dims.items()}
            sample = {k: _tensor(v, sizes, dynamic.get(k, {})) for k, v in inputs.items()}
            expected = copy.deepcopy(pristine)(**sample)
            for candidate in (archive, compiled):
                got = candidate(**sample)
                flat_e, _ = torch.utils._pytree.tree_flatten(expected)
                flat_g, _ = torch.utils._pytree.tree_flatten(got)
                for e, g in zip(flat_e, flat_g):
                    if e.dtype.is_floating_point:
                        torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-3)
            archive = torch.export.load(io.BytesIO(buffer.getvalue())).module()  # fresh buffers each sample
            compiled = aoti_load_package(str(package))
        seconds[name] = time.perf_counter() - started
    return seconds


# ---------------------------------------------------------------------------------------------
# arms


def _timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return elapsed, proc.stdout


def _env(workdir: Path, arm: str) -> dict[str, str]:
    cache = workdir / "inductor-cache" / arm
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = dict(os.environ)
    env.update({
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "PREFECT_HOME": str(workdir / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    })
    env.pop("PREFECT_API_URL", None)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=8, help=f"fleet size (at most {len(FLEET)}; default 8)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "pt2-bench-fleet"))
    parser.add_argument("--json-out", metavar="FILE")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # the bare arm's child process
    args = parser.parse_args()
    workdir = Path(args.workdir)
    count = min(args.models, len(FLEET))

    if args.bare:
        print(json.dumps(bare_loop(count, workdir / "fleet")))
        return 0

    shutil.rmtree(workdir, ignore_errors=True)
    config = write_config(workdir / "fleet", count)
    pt2flow = str(Path(sys.executable).parent / "pt2flow")
    figures: dict[str, Any] = {"models": count}

    print(f"fleet of {count} models, {os.cpu_count()} cores; each arm a fresh process with its own inductor cache", file=sys.stderr)
    figures["bare_s"], out = _timed([sys.executable, __file__, "--bare", "--models", str(count), "--workdir", str(workdir)], _env(workdir, "bare"), ROOT)
    figures["bare_per_model_s"] = json.loads(out.strip().splitlines()[-1])
    print(f"  bare      {figures['bare_s']:7.1f} s", file=sys.stderr)

    run = [pt2flow, "run", str(config), "--json"]
    figures["cold1_s"], out = _timed([*run, "--store", str(workdir / "store-1")], _env(workdir, "cold1"), workdir)
    document = json.loads(out)
    assert document["summary"]["ok"] == count, document["summary"]
    figures["cold1_stage_s"] = _stage_totals(document)
    print(f"  cold-1    {figures['cold1_s']:7.1f} s", file=sys.stderr)

    figures["warm_s"], out = _timed([*run, "--store", str(workdir / "store-1")], _env(workdir, "warm"), workdir)
    warm = json.loads(out)
    assert all(s["cached"] for m in warm["models"] for s in m["stages"].values()), "warm run did stage work"
    print(f"  warm      {figures['warm_s']:7.1f} s", file=sys.stderr)

    figures["cold2_s"], out = _timed([*run, "--store", str(workdir / "store-2"), "--workers", "2", "--runner", "process"], _env(workdir, "cold2"), workdir)
    assert json.loads(out)["summary"]["ok"] == count
    print(f"  cold-2    {figures['cold2_s']:7.1f} s", file=sys.stderr)

    figures["ratios"] = {
        "cold1_over_bare": round(figures["cold1_s"] / figures["bare_s"], 3),
        "warm_over_cold1": round(figures["warm_s"] / figures["cold1_s"], 3),
        "cold2_over_cold1": round(figures["cold2_s"] / figures["cold1_s"], 3),
    }
    goals = {"cold1_over_bare": 1.10, "warm_over_cold1": 0.05, "cold2_over_cold1": 0.65}
    print("\nratio                 measured   goal", file=sys.stderr)
    for key, goal in goals.items():
        value = figures["ratios"][key]
        print(f"  {key:18s} {value:8.3f}   <= {goal:.2f}  {'met' if value <= goal else 'MISSED'}", file=sys.stderr)
    totals = figures["cold1_stage_s"]
    print("\ncold-1 stage seconds (sum over models): " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()), file=sys.stderr)
    line = json.dumps(figures)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    return 0


def _stage_totals(document: dict[str, Any]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for model in document["models"]:
        for stage, info in model["stages"].items():
            totals[stage] = round(totals.get(stage, 0.0) + float(info.get("seconds") or 0), 2)
    return totals


if __name__ == "__main__":
    sys.exit(main())
