"""Does a model cost the same in a fleet of 1,000 as in a fleet of 100? (issue 43)

    .venv/bin/python bench/fleet_scale.py [--models 1000] [--workers N] [--no-audit]
        [--workdir /tmp/pt2-bench-scale] [--json-out FILE]

Two `pt2flow run`s (default workers unless --workers), each into an empty store: --baseline
(100) and then --models (1,000) tiny MLPs through trace, functionalize, decompose, serialize and
validate, no compile. The models
are as alike in size as distinct models can be: hidden 8-57 and outputs 2 + i // 50 (every
model's key differs, its size stays within the same small range), so a later model costs what an
early one costs unless the run itself grows slower. bench/fleet_overhead.py's small fleet grows
its hidden size with the model's number (8 + i): over 1,000 models that is 100x the weights,
which is the models' cost, not the run's.

Prints, for the large run, per 100 models in the order they started, the wall seconds between
the first's start and the last's end and the stage seconds per model (from the index records);
then each run's seconds per model (its whole wall time, start-up and the index compaction at
its end included) and their ratio, and a JSON line with every figure. The goal (issue 43): the
large run's seconds per model within 10 % of the small run's. The last 100 models' span against
the first 100's is reported too: how much a model's cost drifts within one long run.

Between the two runs (unless --no-audit), `pt2flow audit --config` of the small run's store, with
the same workers: every program record (trace, functionalize, decompose, serialize) loaded and
rebuilt in fresh worker processes. Its wall time against the small run's cold build is issue 43's
"audit costs what it rebuilds" (goal: at most 1.2x); every record must come back ok.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from fleet_overhead import SMALL_STAGES, _env, _timed, compile_checkout, emit_json  # noqa: E402

WINDOW = 100


def write_config(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo_models.py").write_text((ROOT / "configs" / "demo_models.py").read_text())
    models = [
        {
            "name": f"mlp-{i:04d}",
            "factory": "demo_models:mlp",
            "kwargs": {"hidden": 8 + i % 50, "out_features": 2 + i // 50},
            "inputs": {"x": {"shape": [4, 16]}},
            "dynamic_shapes": {"x": {0: "batch"}},
            "dims": {"batch": {"min": 1, "max": 32}},
            "stages": {"validate": {"atol": 1e-4}},
        }
        for i in range(count)
    ]
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "stages": SMALL_STAGES, "models": models}, sort_keys=False))
    return path


def windows(store: Path) -> list[dict[str, Any]]:
    """Per WINDOW models in the order they started: their wall span and stage seconds per model."""
    import pyarrow.dataset as ds

    rows = ds.dataset(store / "index", format="parquet").to_table(
        columns=["model", "started_at", "ended_at", "seconds"]
    )
    by_model: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows.to_pylist():
        by_model[row["model"]].append(row)
    spans = sorted(
        (
            min(r["started_at"] for r in records),
            max(r["ended_at"] for r in records),
            sum(r["seconds"] or 0.0 for r in records),
        )
        for records in by_model.values()
    )
    out = []
    for i in range(0, len(spans), WINDOW):
        chunk = spans[i : i + WINDOW]
        out.append(
            {
                "models": f"{i}-{i + len(chunk) - 1}",
                "span_s": round((chunk[-1][1] - chunk[0][0]).total_seconds(), 2),
                "stage_s_per_model": round(sum(c[2] for c in chunk) / len(chunk), 4),
            }
        )
    return out


def _pt2flow(*args: str, workers: int | None) -> list[str]:
    """This environment's `pt2flow` with `args`, and --workers when given."""
    return [str(Path(sys.executable).parent / "pt2flow"), *args, *(["--workers", str(workers)] if workers else [])]


def _run(workdir: Path, count: int, workers: int | None) -> tuple[float, list[dict[str, Any]], Any]:
    """One cold run of `count` models into an empty store: its wall seconds, windows and worker count."""
    config = write_config(workdir / f"fleet-{count}", count)
    store = workdir / f"store-{count}"
    argv = _pt2flow("run", str(config), "--json", "--store", str(store), workers=workers)
    seconds, out = _timed(argv, _env(workdir, f"scale-{count}"), workdir)
    document = json.loads(out.strip().splitlines()[-1])
    if document["summary"]["ok"] != count:
        raise SystemExit(f"expected {count} ok models: {document['summary']}")
    return seconds, windows(store), document.get("workers")


def _audit(workdir: Path, count: int, workers: int | None) -> tuple[float, dict[str, Any]]:
    """`pt2flow audit --config` of the store _run(workdir, count, ...) built: its wall seconds and summary."""
    config, store = workdir / f"fleet-{count}" / "fleet.yaml", workdir / f"store-{count}"
    argv = _pt2flow("audit", "--config", str(config), "--store", str(store), "--json", workers=workers)
    seconds, out = _timed(argv, _env(workdir, f"audit-{count}"), workdir)
    document = json.loads(out)
    summary = document["summary"]
    if summary["failed"] or not summary["ok"]:
        raise SystemExit(f"audit of the {count}-model store: {summary}")
    return seconds, {"records": document["sample"]["records"], **summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--baseline", type=int, default=100, help="the small run's model count (default 100)")
    parser.add_argument("--workers", type=int, default=None, help="default: as pt2flow run chooses")
    parser.add_argument(
        "--audit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="audit the small run's store and compare with its cold build (default: on)",
    )
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "pt2-bench-scale"))
    parser.add_argument("--json-out", metavar="FILE")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    compile_checkout()
    small_s, _, _ = _run(workdir, args.baseline, args.workers)
    audit_s, audited = _audit(workdir, args.baseline, args.workers) if args.audit else (None, None)
    seconds, table, workers = _run(workdir, args.models, args.workers)
    for row in table:
        print(
            f"  models {row['models']:>9s}: {row['span_s']:6.1f} s, stage seconds per model {row['stage_s_per_model']:.3f}"
        )
    per_model, small_per_model = seconds / args.models, small_s / args.baseline
    figures = {
        "models": args.models,
        "baseline": args.baseline,
        "workers": workers,
        "cores": os.cpu_count(),
        "run_s": round(seconds, 2),
        "baseline_run_s": round(small_s, 2),
        "windows": table,
        "ratios": {
            "per_model_over_baseline": round(per_model / small_per_model, 3),
            "last_over_first_window": round(table[-1]["span_s"] / table[0]["span_s"], 3),
        },
    }
    print(
        f"{args.baseline} models: {small_s:.1f} s ({small_per_model:.3f} s a model); {args.models} models: {seconds:.1f} s "
        f"({per_model:.3f} s a model, {figures['ratios']['per_model_over_baseline']:.3f}x; goal <= 1.10); {workers} "
        f"workers; within the large run the last {WINDOW} models took {figures['ratios']['last_over_first_window']:.3f}x "
        f"the first {WINDOW}'s span",
        file=sys.stderr,
    )
    if audit_s is not None:
        figures["audit_s"] = round(audit_s, 2)
        figures["audit"] = audited
        figures["ratios"]["audit_over_baseline_cold"] = round(audit_s / small_s, 3)
        print(
            f"audit of the {args.baseline}-model store: {audit_s:.1f} s for {audited['ok']} records "
            f"({figures['ratios']['audit_over_baseline_cold']:.3f}x its cold build; goal <= 1.2)",
            file=sys.stderr,
        )
    emit_json(figures, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
