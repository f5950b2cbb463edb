"""The benchmark stage on a shipped fleet: configs/targets.yaml (default) or configs/quantized.yaml
run with `benchmark` after validate, into a scratch store, then every model's benchmark report as
a Markdown table and its latency-vs-size plot as an SVG (the README quotes both); for a fleet with
int8 artifacts, each one's accuracy on the model's held-out evaluation batches beside its speed-up
over the fastest float artifact.

    .venv/bin/python bench/targets_benchmark.py [--config configs/quantized.yaml] [--store DIR]
        [--out docs/benchmark] [--quick]

Writes OUT.md (every model's table and recommendation, the machine) and OUT-MODEL.svg per model
(OUT defaults to docs/benchmark for targets.yaml, docs/benchmark-quantized for quantized.yaml).
Two ordinary runs: the fleet to every artifact and validate, then the same stages with `benchmark`
and `--workers 1` (everything else a cache hit), so that no compile of another model shares the
cores with a timing. Run again into the same --store, the benchmark is a cache hit too (its key
covers the machine), so the numbers are those of the first run. --quick: fewer
timed calls (warmup 1, at most 10 runs, 2 s), for a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pt2flow.flows.report.benchmark import markdown, plot_file  # noqa: E402

DEFAULT_OUT = {"targets.yaml": "benchmark", "quantized.yaml": "benchmark-quantized"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "targets.yaml"), help="a shipped config")
    parser.add_argument("--store", help="the store to run into (default: a fresh temporary one)")
    parser.add_argument("--out", help="path prefix of the .md and .svg files (default: docs/benchmark[-quantized])")
    parser.add_argument("--quick", action="store_true", help="fewer timed calls: a smoke test of the script")
    args = parser.parse_args()
    shipped = Path(args.config).resolve()
    out_prefix = args.out or str(ROOT / "docs" / DEFAULT_OUT.get(shipped.name, shipped.stem))
    with tempfile.TemporaryDirectory(prefix="pt2flow-bench-") as scratch:
        config = Path(scratch) / shipped.name
        loaded = yaml.safe_load(shipped.read_text())
        if args.quick:
            loaded.setdefault("defaults", {})["benchmark"] = {"warmup": 1, "max_runs": 10, "max_seconds": 2.0}
        config.write_text(yaml.safe_dump(loaded, sort_keys=False))
        for module in shipped.parent.glob("*.py"):  # the factories and data callables it names
            (Path(scratch) / module.name).write_text(module.read_text())
        built = [stage for stage in loaded["stages"] if stage != "benchmark"]
        store = args.store or str(Path(scratch) / "store")
        bin_dir = Path(sys.executable).parent
        command = [str(bin_dir / "pt2flow"), "run", str(config), "--store", store, "--json"]
        # the artifacts first, then the benchmark alone, one worker: no compile shares the cores with a timing
        build = subprocess.run([*command, "--stages", ",".join(built)], capture_output=True, text=True, cwd=ROOT)
        if build.returncode not in (0, 1):
            print(build.stderr[-4000:], file=sys.stderr)
            return build.returncode
        run = subprocess.run(
            [*command, "--stages", ",".join([*built, "benchmark"]), "--workers", "1"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if not run.stdout.strip():
            print(run.stderr[-4000:], file=sys.stderr)
            return run.returncode or 1
        document = json.loads(run.stdout)
        sections, machine = [], None
        for model in document["models"]:
            stage = model["stages"].get("benchmark") or {}
            if not stage.get("artifact"):
                sections.append(
                    f"**{model['name']}**: not benchmarked ({model['status']} at {model['failed_stage']}: {model['error']})"
                )
                continue
            shown = subprocess.run(
                [str(bin_dir / "pt2flow"), "show", stage["artifact"], "--store", store, "--json"],
                capture_output=True,
                text=True,
                check=True,
            )
            report = json.loads(shown.stdout)["report"]
            machine = report["machine"]
            sections.append(markdown(report, title=model["name"]))
            if accuracy := _accuracy_rows(store, model, report):
                sections.append(accuracy)
            svg = Path(f"{out_prefix}-{model['name']}.svg")
            svg.parent.mkdir(parents=True, exist_ok=True)
            svg.write_text(plot_file(model["timings"], f"{model['name']}: p50 latency by size (log scale)") + "\n")
            print(f"wrote {svg}")
    invocation = ["python", "bench/targets_benchmark.py"]
    if shipped.name != "targets.yaml":
        invocation += ["--config", f"configs/{shipped.name}"]
    head = [
        f"# Benchmark of configs/{shipped.name}",
        "",
        f"`{' '.join(invocation)}` on {machine['cpu']} ({machine['arch']}), "
        f"{machine['cores']} cores, {machine['threads']} thread{'s' if machine['threads'] != 1 else ''} in every runtime; p50 / p90 in ms, * the fastest artifact at that size."
        if machine
        else "",
        "",
    ]
    out = Path(f"{out_prefix}.md")
    out.write_text("\n".join(head) + "\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {out}")
    return 0 if run.returncode == 0 else 1


def _accuracy_rows(store: str, model: dict, report: dict) -> str:
    """For each artifact validate judged by accuracy budgets (an int8 one): its metrics, measured
    on what (the model's held-out evaluation batches, or validate's samples), and at each size its
    speed-up over the fastest exact artifact there (eager aside). Empty for a model without one."""
    from pt2flow.storage import ArtifactStore

    validation = json.loads(ArtifactStore(store).get_blob(model["stages"]["validate"]["artifact"]))
    judged = {name: c for name, c in validation["candidates"].items() if "accuracy" in c}
    if not judged:
        return ""
    labels = [p["label"] for p in report["points"]]
    p50 = {
        name: {label: (a["points"].get(label) or {}).get("p50_ms") for label in labels}
        for name, a in report["artifacts"].items()
    }
    fastest = {}  # label -> (the fastest exact artifact there, its p50)
    for label in labels:
        exact = {name: ms[label] for name, ms in p50.items() if name not in judged and name != "eager" and ms[label]}
        if exact:
            best = min(exact, key=exact.__getitem__)
            fastest[label] = (best, exact[best])
    lines = [
        f"{model['name']}'s int8 artifacts: accuracy, and speed-up over the fastest float artifact at each size "
        f"({', '.join(f'{label}: {name} {ms:.3g} ms' for label, (name, ms) in fastest.items())})",
        "",
        "| artifact | measured on | sqnr_db | cosine | top1_agreement | max_abs_err | "
        + " | ".join(f"{label} speed-up" for label in labels)
        + " |",
        "|---|---|" + "---:|" * (4 + len(labels)),
    ]
    for name, candidate in judged.items():
        measured, metrics = candidate["accuracy"], candidate["accuracy"]["metrics"]
        on = f"{measured.get('measured_on', '?')} {measured.get('on', 'samples')}"
        passed = "" if candidate["verdict"]["passed"] else " (missed its budget)"
        top1 = metrics["top1_agreement"]
        speedups = []
        for label in labels:
            ms = p50.get(name, {}).get(label)
            speedups.append(f"{fastest[label][1] / ms:.2f}x" if ms and label in fastest else "not timed")
        lines.append(
            f"| {name}{passed} | {on} | {metrics['sqnr_db']:.1f} | {metrics['cosine']:.5f} | "
            f"{'' if top1 is None else f'{top1:.3f}'} | {metrics['max_abs_err']:.3g} | " + " | ".join(speedups) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
