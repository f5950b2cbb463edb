"""Do the benchmark stage's timings hold? configs/targets.yaml benchmarked twice, and against a
plain timing loop over `pt2flow get`'s files (issue 43).

    .venv/bin/python bench/benchmark_agreement.py [--workdir /tmp/pt2-agreement] [--json-out FILE]

1. configs/targets.yaml built into a scratch store with default workers (every artifact, validate),
   then `benchmark` with one worker: run A.
2. The benchmark again (only it: its `quiet_wait_s` nudged so that its key changes and it measures
   anew, every other stage a cache hit): run B.
3. Each model's artifacts copied out with `pt2flow get`, and each timed at each of the report's
   sizes by a plain loop in a fresh process that imports no pt2flow: torch.export.load(...).module(),
   aoti_load_package, onnxruntime.InferenceSession, ExecuTorch's Runtime, OpenVINO's Core, on
   random inputs of the sizes' shapes, on the report's thread count in every runtime (torch's,
   ONNX Runtime's intra-op threads, ExecuTorch's thread pool, OpenVINO's inference threads, as
   the stage sets them), converted to each runtime's own input type once, outside
   the timed call (as the stage does: it times the runtime, not the conversion); everything under
   torch.inference_mode, as the stage calls every artifact; OpenVINO compiled at the precision the
   artifact records; warm-up calls, then calls for about half a second, the median of those made
   while the machine ran at full speed (a canary of its own, sum(range(500)) timed between calls,
   within 25 % of its fastest in that process: as the stage's `max_slowdown`, and what the host's
   unseen slow stretches make necessary, docs/benchmarks.md, twenty-ninth session), and beside it
   the median of every call; in as many passes over the artifacts as the benchmark made
   (`passes`, every other one in the reverse order, each artifact loaded again), the lowest
   median of the passes, as the stage reports.

Prints, per model and size: the artifact A and B recommend (or why not: noisy), and each
artifact's p50 in A against the plain loop's, and at how many sizes the two picks are the same or
one is tied with the other (`tied_with`: within the tie margin of the pick, as fast on that
benchmark's evidence: a pair near the margin's edge is tied in one benchmark and not in the
other). The goals: A and B recommend the same artifact at
every size where both recommend one; each p50 within 20 % of the plain loop's.

What the machine allows, beside it: the plain loop runs `--plain-runs` times (default 2) per model,
each in a fresh process, one after another; A is compared with the first, and the later runs
with the first as well: how often the plain loop agrees with itself within 20 %, the floor under
which A's agreement says nothing about the stage (on this project's VM a process runs at one
speed for seconds and the next at another: docs/benchmarks.md, twenty-eighth session). B's p50s
against A's are counted too. Each count is given twice: with the plain loop's full-speed calls
(the goal's reference) and with all its calls (the canary unheeded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from fleet_overhead import compile_checkout, emit_json  # noqa: E402

# the stages configs/targets.yaml builds: every artifact and validate
BUILD = yaml.safe_load((ROOT / "configs" / "targets.yaml").read_text())["stages"]
# the report's artifact name -> `get --artifact` kind and file suffix
KINDS = {"archive": ("serialized", ".pt2"), "compiled": ("compiled", ".pt2"), "onnx": ("onnx", ".onnx")}
KINDS.update({"executorch": ("pte", ".pte"), "openvino": ("openvino", ".zip")})
TOLERANCE = 0.20

PLAIN_LOOP = r'''
"""Time `pt2flow get`'s files with each runtime's own API (no pt2flow): argv JOB.json OUT.json."""
import importlib, json, statistics, sys, time, zipfile, tempfile, os
import torch

job = json.load(open(sys.argv[1]))
sys.path.insert(0, job["factories"])
torch.set_num_threads(job["threads"])


def tensors(sizes):
    out = {}
    for name, spec in job["inputs"].items():
        shape = list(spec["shape"])
        for axis, dim in job["dynamic"].get(name, {}).items():
            shape[int(axis)] = sizes[dim]
        dtype = getattr(torch, spec.get("dtype", "float32"))
        if "value" in spec:
            out[name] = torch.full(shape, spec["value"], dtype=dtype)
        elif dtype.is_floating_point:
            out[name] = torch.randn(shape, dtype=dtype)
        else:
            out[name] = torch.randint(spec.get("low", 0), spec.get("high", 10), shape, dtype=dtype)
    return out


def spin():
    return sum(range(500))  # a loop in C: a bytecode loop runs slower after torch-heavy Python calls


FASTEST = [1.0]


def canary():
    """This process's speed now: sum(range(500)), the faster of two runs (seconds)."""
    best = 1.0
    for _ in range(2):
        start = time.perf_counter()
        spin()
        best = min(best, time.perf_counter() - start)
    FASTEST[0] = min(FASTEST[0], best)
    return best


calibrate_until = time.perf_counter() + 0.3
while time.perf_counter() < calibrate_until:
    canary()


def p50(call):
    """[median of the calls made at full speed (the canary on both sides within 25 % of its
    fastest), median of all calls]; calls go on until 20 at full speed and half a second (or
    1000 at full speed), for at most 5 s."""
    for _ in range(5):
        call()
    times, full, started = [], [], time.perf_counter()
    before = canary()
    while True:
        elapsed = time.perf_counter() - started
        if elapsed > 5.0 or (len(full) >= 20 and (elapsed >= 0.5 or len(full) >= 1000)):
            break
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1000.0)
        after = canary()
        if max(before, after) <= 1.25 * FASTEST[0]:
            full.append(times[-1])
        before = after
    return [statistics.median(full) if full else None, statistics.median(times)]


def runner(name, path):
    """prepare(inputs) -> a call of the artifact on them, its inputs converted to the runtime's
    own type once (outside the timed call)."""
    if name == "eager":
        module, attr = job["factory"].split(":")
        model = getattr(importlib.import_module(module), attr)(**job["kwargs"]).eval()
        return lambda kw: lambda: model(**kw)
    if name == "archive":
        module = torch.export.load(path).module()
        return lambda kw: lambda: module(*kw.values())  # exported on forward()'s arguments in order
    if name == "compiled":
        from torch._inductor import aoti_load_package
        package = aoti_load_package(path)
        return lambda kw: lambda: package(*kw.values())
    if name == "onnx":
        import onnxruntime
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = job["threads"]
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]

        def prepare(kw):
            feeds = {n: kw[n].numpy() for n in names}
            return lambda: session.run(None, feeds)

        return prepare
    if name == "executorch":
        from executorch.runtime import Runtime
        from executorch.extension.pybindings import portable_lib
        portable_lib._unsafe_reset_threadpool(job["threads"])  # the runtime's one pool (XNNPACK's)
        method = Runtime.get().load_program(path).load_method("forward")

        def prepare(kw):
            feeds = list(kw.values())
            return lambda: method.execute(feeds)

        return prepare
    if name == "openvino":
        import openvino
        folder = tempfile.mkdtemp()
        zipfile.ZipFile(path).extractall(folder)
        xml = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".xml"))
        core = openvino.Core()
        model = core.read_model(xml)
        # the precision the artifact records (f32 unless configured): this CPU's default is bf16
        # where it has avx512_bf16, which is another computation than the one validate passed
        key = ["pt2flow", "inference_precision"]
        precision = model.get_rt_info(key).astype(str) if model.has_rt_info(key) else "f32"
        config = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": job["threads"]}
        request = core.compile_model(model, "CPU", config).create_infer_request()

        def prepare(kw):
            feeds = [t.numpy() for t in kw.values()]
            return lambda: request.infer(feeds)

        return prepare
    raise ValueError(name)


result = {}
names = list(job["artifacts"])
with torch.inference_mode():
    for index in range(job["passes"]):
        for name in names if index % 2 == 0 else names[::-1]:
            run = runner(name, job["artifacts"][name])
            for label, sizes in job["points"].items():
                result.setdefault(name, {}).setdefault(label, []).append(p50(run(tensors(sizes))))
            del run
def lowest(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


json.dump(
    {
        kind: {n: {label: lowest(v[i] for v in by) for label, by in each.items()} for n, each in result.items()}
        for i, kind in enumerate(("full_speed", "all"))
    },
    open(sys.argv[2], "w"),
)
'''


def _pt2flow(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "pt2flow"), *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if check and done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def _benchmark(config: Path, store: Path) -> dict[str, dict[str, Any]]:
    """Run the benchmark (everything else cached) with one worker: each model's report."""
    done = _pt2flow(
        "run",
        str(config),
        "--store",
        str(store),
        "--json",
        "--workers",
        "1",
        "--stages",
        ",".join([*BUILD, "benchmark"]),
    )
    reports = {}
    for model in json.loads(done.stdout)["models"]:
        stage = model["stages"].get("benchmark") or {}
        if stage.get("artifact"):
            shown = _pt2flow("show", stage["artifact"], "--store", str(store), "--json")
            reports[model["name"]] = json.loads(shown.stdout)["report"]
    return reports


def _within(value: float, reference: float) -> bool:
    return abs(value / reference - 1) <= TOLERANCE


def _plain_loop(workdir: Path, name: str, run: int) -> dict[str, dict[str, dict[str, float | None]]]:
    """PLAIN_LOOP over one model's files in a fresh process: {"full_speed" | "all": {artifact:
    {size label: p50 ms}}}, the median of the calls at full speed and of every call."""
    out = workdir / f"{name}.plain{'' if run == 0 else f'-{run}'}.json"
    subprocess.run(
        [sys.executable, str(workdir / "plain_loop.py"), str(workdir / f"{name}.job.json"), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "pt2-agreement"))
    parser.add_argument("--json-out", metavar="FILE")
    parser.add_argument(
        "--plain-runs",
        type=int,
        default=2,
        help="fresh processes of the plain loop per model, one after another; the later ones are "
        "compared with the first (default 2; 1: none)",
    )
    args = parser.parse_args()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    compile_checkout()
    for module in (ROOT / "configs").glob("*.py"):
        shutil.copy(module, workdir / module.name)
    shipped = yaml.safe_load((ROOT / "configs" / "targets.yaml").read_text())
    store = workdir / "store"
    config = workdir / "targets.yaml"
    config.write_text(yaml.safe_dump(shipped, sort_keys=False))
    _pt2flow("run", str(config), "--store", str(store), "--json", "--stages", ",".join(BUILD))
    first = _benchmark(config, store)
    nudged = {**shipped, "defaults": {**shipped.get("defaults", {}), "benchmark": {"quiet_wait_s": 10.5}}}
    config.write_text(yaml.safe_dump(nudged, sort_keys=False))
    second = _benchmark(config, store)

    models = {m["name"]: m for m in shipped["models"]}
    figures: dict[str, Any] = {"models": {}}
    same, as_fast, compared, within, timed = 0, 0, 0, 0, 0
    plain_within, plain_pairs, b_within, b_pairs = 0, 0, 0, 0
    within_all, all_within = 0, 0  # the same against every call's median (the canary unheeded)
    for name, report in first.items():
        entry = models[name]
        files = {}
        for artifact in report["artifacts"]:
            if artifact == "eager":
                continue
            kind, suffix = KINDS[artifact]
            path = workdir / "files" / name / f"{artifact}{suffix}"
            path.parent.mkdir(parents=True, exist_ok=True)
            _pt2flow("get", "--model", name, "--artifact", kind, "--store", str(store), "-o", str(path))
            files[artifact] = str(path)
        job = {
            "factories": str(workdir),
            "factory": entry["factory"],
            "kwargs": entry.get("kwargs", {}),
            "inputs": entry["inputs"],
            "dynamic": entry.get("dynamic_shapes", {}),
            "threads": report["machine"]["threads"],
            "points": {p["label"]: p["sizes"] for p in report["points"]},
            "artifacts": {"eager": "", **files},
            "passes": report["options"].get("passes", 1),
        }
        (workdir / f"{name}.job.json").write_text(json.dumps(job))
        (workdir / "plain_loop.py").write_text(PLAIN_LOOP)
        runs = [_plain_loop(workdir, name, run) for run in range(max(1, args.plain_runs))]
        plain, *plain_again = [run["full_speed"] for run in runs]
        plain_all, *plain_all_again = [run["all"] for run in runs]
        rows = []
        for point in report["points"]:
            label = point["label"]
            pick_a = report["recommendation"]["points"].get(label) or {}
            pick_b = second[name]["recommendation"]["points"].get(label) or {}
            a, b = pick_a.get("artifact"), pick_b.get("artifact")
            if a and b:
                compared += 1
                same += a == b
                # tied_with: within the tie margin of the pick there, as fast on that benchmark's evidence
                as_fast += a == b or (b in pick_a.get("tied_with", ()) or a in pick_b.get("tied_with", ()))
            for artifact, timings in report["artifacts"].items():
                measured = (timings["points"].get(label) or {}).get("p50_ms")
                loop = plain.get(artifact, {}).get(label)
                loop_all = plain_all.get(artifact, {}).get(label)
                if measured and loop and loop_all:
                    timed += 1
                    ratio = measured / loop
                    within += _within(measured, loop)
                    within_all += _within(measured, loop_all)
                    rows.append((label, artifact, measured, loop, ratio, loop_all))
                    for again, again_all in zip(plain_again, plain_all_again):
                        other = again.get(artifact, {}).get(label)
                        other_all = again_all.get(artifact, {}).get(label)
                        if other and other_all:
                            plain_pairs += 1
                            plain_within += _within(other, loop)
                            all_within += _within(other_all, loop_all)
                    measured_b = (
                        (second[name]["artifacts"].get(artifact) or {}).get("points", {}).get(label) or {}
                    ).get("p50_ms")
                    if measured_b:
                        b_pairs += 1
                        b_within += _within(measured_b, measured)
            print(
                f"{name:13s} {label:18s} A: {a or 'none (' + report['recommendation'].get('noisy', {}).get(label, '?') + ')'}"
                f"  B: {b or 'none (' + second[name]['recommendation'].get('noisy', {}).get(label, '?') + ')'}"
            )
        for label, artifact, measured, loop, ratio, loop_all in rows:
            mark = "" if _within(measured, loop) else "  <- outside 20 %"
            print(
                f"    {label:18s} {artifact:11s} stage {measured:9.4f} ms  plain {loop:9.4f} ms  {ratio:5.2f}x"
                f"  (every call: {loop_all:9.4f} ms){mark}"
            )
        figures["models"][name] = {
            "recommended": {"A": report["recommendation"], "B": second[name]["recommendation"]},
            "load": {"A": report["load"], "B": second[name]["load"]},
            "p50": [
                {"size": r[0], "artifact": r[1], "stage_ms": r[2], "plain_ms": r[3], "plain_all_ms": r[5]} for r in rows
            ],
        }
    figures.update({"same": same, "as_fast": as_fast, "compared": compared, "within": within, "timed": timed})
    figures.update({"plain_within": plain_within, "plain_pairs": plain_pairs, "b_within": b_within, "b_pairs": b_pairs})
    figures.update({"within_all": within_all, "plain_all_within": all_within})
    print(f"\nsame recommendation in A and B: {same} of {compared} sizes where both recommend one")
    print(f"the same, or one's pick tied with the other's (within the tie margin): {as_fast} of {compared}")
    print(f"p50 within {TOLERANCE:.0%} of the plain loop's (its calls at full speed): {within} of {timed}")
    print(f"  (of the plain loop's median of every call, the canary unheeded: {within_all} of {timed})")
    print(f"what the machine allows: B's p50 within {TOLERANCE:.0%} of A's: {b_within} of {b_pairs}; the plain loop in")
    print(f"  another fresh process within {TOLERANCE:.0%} of its first: {plain_within} of {plain_pairs}")
    print(f"  (every call's median: {all_within} of {plain_pairs})")
    emit_json(figures, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
