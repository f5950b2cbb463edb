"""The benchmark stage on the demo's targets fleet: configs/targets.yaml run with `benchmark` after
validate, into a scratch store, then every model's benchmark report as a Markdown table and its
latency-vs-size plot as an SVG (the README quotes both).

    .venv/bin/python bench/targets_benchmark.py [--store DIR] [--out docs/benchmark] [--quick]

Writes OUT.md (every model's table and recommendation, the machine) and OUT-MODEL.svg per model.
Two ordinary runs: the fleet to every target and validate, then the same stages with `benchmark`
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

STAGES = "trace,functionalize,decompose,serialize,aot_compile,onnx,executorch,openvino,validate,benchmark"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="the store to run into (default: a fresh temporary one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmark"), help="path prefix of the .md and .svg files")
    parser.add_argument("--quick", action="store_true", help="fewer timed calls: a smoke test of the script")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pt2flow-bench-") as scratch:
        config = Path(scratch) / "targets.yaml"
        loaded = yaml.safe_load((ROOT / "configs" / "targets.yaml").read_text())
        if args.quick:
            loaded.setdefault("defaults", {})["benchmark"] = {"warmup": 1, "max_runs": 10, "max_seconds": 2.0}
        config.write_text(yaml.safe_dump(loaded, sort_keys=False))
        (Path(scratch) / "demo_models.py").write_text((ROOT / "configs" / "demo_models.py").read_text())
        store = args.store or str(Path(scratch) / "store")
        bin_dir = Path(sys.executable).parent
        command = [str(bin_dir / "pt2flow"), "run", str(config), "--store", store, "--json"]
        # the artifacts first, then the benchmark alone, one worker: no compile shares the cores with a timing
        build = subprocess.run(
            [*command, "--stages", STAGES.removesuffix(",benchmark")], capture_output=True, text=True, cwd=ROOT
        )
        if build.returncode not in (0, 1):
            print(build.stderr[-4000:], file=sys.stderr)
            return build.returncode
        run = subprocess.run([*command, "--stages", STAGES, "--workers", "1"], capture_output=True, text=True, cwd=ROOT)
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
            svg = Path(f"{args.out}-{model['name']}.svg")
            svg.parent.mkdir(parents=True, exist_ok=True)
            svg.write_text(plot_file(model["timings"], f"{model['name']}: p50 latency by size (log scale)") + "\n")
            print(f"wrote {svg}")
    head = [
        "# Benchmark of configs/targets.yaml",
        "",
        f"`{' '.join(['python', 'bench/targets_benchmark.py'])}` on {machine['cpu']} ({machine['arch']}), "
        f"{machine['cores']} cores, {machine['threads']} torch threads; p50 / p90 in ms, * the fastest artifact at that size."
        if machine
        else "",
        "",
    ]
    out = Path(f"{args.out}.md")
    out.write_text("\n".join(head) + "\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {out}")
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
