"""Start-up benchmark: how long a small cold run takes to reach its first stage (issue 23 item 3).

    .venv/bin/python bench/startup.py [--runs 3] [--workdir /tmp/pt2-bench-startup] [--json-out FILE]

One model (a tiny MLP of configs/demo_models.py) through trace, functionalize, decompose,
serialize and validate, each run `pt2flow run --workers 1 --json` as a whole process on an empty
store: cold for the store, but not the first run on this machine (one run first warms what a
machine keeps between runs: the OS page cache, Python's bytecode caches, Prefect's database
under PREFECT_HOME, pt2flow's toolchain cache). Per run, from the moment the process is started:

  source      the orchestrator begins the model's source stage (its record's started_at)
  trace       the first export stage begins (the source stage ran in a worker that imported torch)
  end         the process has exited (the command's whole wall time)
  summary     what the run's summary reports as its time (`summary.seconds`)

Two arms, one after the other: PT2FLOW_PREFECT_SERVER=private (a Prefect server per run, as
before) and shared (the default: the first run starts a server the next ones reuse).
Goal (issue 23): trace <= 3 s. Prints one table (medians) and a JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from pt2flow.flows.engine.services.prefect_runtime import stop_shared_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
BIN = Path(sys.executable).parent

from fleet_overhead import compile_checkout  # noqa: E402

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]


def _config(workdir: Path) -> Path:
    shutil.copy(ROOT / "configs" / "demo_models.py", workdir / "demo_models.py")
    config = {
        "version": 1,
        "stages": STAGES,
        "models": [
            {
                "name": "mlp",
                "factory": "demo_models:mlp",
                "kwargs": {"hidden": 32},
                "inputs": {"x": {"shape": [4, 16]}},
                "dynamic_shapes": {"x": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 32}},
            }
        ],
    }
    path = workdir / "one.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _stage_starts(store: Path, run_id: str) -> dict[str, float]:
    from pt2flow.storage import ArtifactStore

    rows = ArtifactStore(str(store)).index.read(columns=["run_id", "stage", "started_at"]).to_pylist()
    starts: dict[str, float] = {}
    for row in rows:
        if row["run_id"] == run_id and isinstance(row["started_at"], datetime):
            starts[row["stage"]] = row["started_at"].timestamp()
    return starts


def one_run(config: Path, store: Path, env: dict[str, str]) -> dict[str, float]:
    """One cold run of the config; seconds from the process's start to each mark."""
    shutil.rmtree(store, ignore_errors=True)
    launched = time.time()
    proc = subprocess.run(
        [str(BIN / "pt2flow"), "run", str(config), "--store", str(store), "--workers", "1", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"pt2flow run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    document = json.loads(proc.stdout)
    starts = _stage_starts(store, document["run_id"])
    return {
        "source": round(starts["source"] - launched, 3),
        "trace": round(starts["trace"] - launched, 3),
        "end": round(ended - launched, 3),
        "summary": float(document["summary"]["seconds"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/pt2-bench-startup")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    compile_checkout()
    config = _config(workdir)
    results: dict[str, Any] = {}
    print(f"{'':22}{'source':>9}{'trace':>9}{'end':>9}{'summary':>9}   (seconds from process start)")
    for mode in ("private", "shared"):  # a Prefect server per run (the old way), the shared one (the default)
        home = workdir / f"prefect-home-{mode}"
        env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PT2FLOW_CACHE_DIR": str(workdir / "cache"),
            "PT2FLOW_PREFECT_SERVER": mode,
            "PT2FLOW_PREFECT_SERVER_IDLE_S": "120",
        }
        env.pop("PREFECT_API_URL", None)
        first = one_run(config, workdir / "store-first", env)  # the machine's first run
        runs = [one_run(config, workdir / f"store-{i}", env) for i in range(args.runs)]
        median = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        results[mode] = {"first": first, "runs": runs, "median": median}
        print(f"{mode + ', first run':22}" + "".join(f"{first[k]:9.2f}" for k in ("source", "trace", "end", "summary")))
        print(
            f"{mode + ', cold, median':22}"
            + "".join(f"{median[k]:9.2f}" for k in ("source", "trace", "end", "summary"))
        )
        stop_shared_server(home)
    print(
        f"goal: trace <= 3 s (shared server, the default): {'met' if results['shared']['median']['trace'] <= 3.0 else 'NOT met'}"
    )
    line = json.dumps(results)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")


if __name__ == "__main__":
    main()
