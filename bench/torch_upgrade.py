"""A real torch upgrade through `pt2flow upgrade-check` (issue 30): torch 2.13.0+cpu (this
environment, `make install`) against torch 2.14.1, the CUDA build pip takes from this machine's
local wheel cache (about 6 GB with its CUDA runtime wheels; it runs on the CPU).

    .venv/bin/python bench/torch_upgrade.py [--venv .cache/torch-2.14.1] [--out bench/results/torch_upgrade]
    make bench-torch-upgrade

1. Builds (once) the candidate virtualenv: `pip install torch==2.14.1`, then pt2flow (editable,
   this checkout) with the versions requirements.lock pins for everything torch does not bring
   itself, and transformers for the fleet's models. pyproject declares the torch range pt2flow
   supports, so pip keeps the candidate's torch. Not part of `make test`.
2. Runs the mixed fleet (tiny random transformers models, plain models with a buffer and a dict
   output, known failures; the default stages, aot_compile included) in this environment: the
   baseline run, into a fresh store.
3. Runs `pt2flow upgrade-check --python <candidate>` and writes its JSON, text and HTML report
   and the wall times into --out. Exit 0 whatever the verdict (the report is the result).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CANDIDATE_TORCH = "2.14.1"
TRANSFORMERS = "5.23.0"  # the same as the baseline's (requirements.lock): only torch changes
IDS = {"shape": [2, 8], "dtype": "int64", "low": 0, "high": 100}
TEXT = {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}}
FLEET: list[dict[str, Any]] = [
    {"name": "bert", "factory": "tests.hf_models:bert_tiny", "inputs": TEXT},
    {"name": "distilbert", "factory": "tests.hf_models:distilbert_tiny", "inputs": TEXT},
    {
        "name": "roberta",
        "factory": "tests.hf_models:roberta_tiny",
        "inputs": {"input_ids": {**IDS, "low": 3}, "attention_mask": {**IDS, "value": 1}},
    },
    {"name": "gpt2", "factory": "tests.hf_models:gpt2_tiny", "inputs": {"input_ids": IDS}},
    {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}},
    {"name": "counter", "factory": "tests.models:buffer_counter", "inputs": {"x": {"shape": [2, 8]}}},
    {
        "name": "dict-out",
        "factory": "tests.models:dict_out",
        "inputs": {"x": {"shape": [2, 3, 6]}, "scale": {"shape": []}},
    },
    # known failures: each fails the same way under both torches
    {"name": "data-dependent", "factory": "tests.models:data_dependent", "inputs": {"x": {"shape": [2, 8]}}},
    {"name": "python-object-out", "factory": "tests.models:python_object_out", "inputs": {"x": {"shape": [2, 8]}}},
    {
        "name": "noisy",
        "factory": "tests.models:noisy",
        "inputs": {"x": {"shape": [2, 8]}},
        "stages": {"validate": {"samples": 2}},
    },
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet", *args], check=True, cwd=ROOT
    )


def build_candidate(venv: Path) -> tuple[Path, float]:
    """The candidate's python (made once: a `ready` file marks a finished build) and the seconds it took."""
    python = venv / "bin" / "python"
    if (venv / "ready").is_file():
        return python, 0.0
    start = time.monotonic()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(python, f"torch=={CANDIDATE_TORCH}")
    # the lock's pins for everything the candidate's torch did not install itself
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True, text=True
    ).stdout
    have = {entry["name"].lower().replace("_", "-") for entry in json.loads(listed)}
    pins = [
        line
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if line.strip()
        and not line.startswith("#")
        and line.split("==")[0].strip().lower().replace("_", "-") not in have | {"torch", "torchao"}
    ]
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    _pip(python, "-c", str(constraints), "-e", str(ROOT), f"transformers=={TRANSFORMERS}")
    version = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if not version.startswith(CANDIDATE_TORCH):
        sys.exit(f"the candidate has torch {version}, not {CANDIDATE_TORCH}")
    (venv / "ready").write_text(version + "\n")
    return python, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv",
        default=str(ROOT / ".cache" / f"torch-{CANDIDATE_TORCH}"),
        help="the candidate virtualenv (built once)",
    )
    parser.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "torch_upgrade"), help="folder for the store and the reports"
    )
    args = parser.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out / "store", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    pt2flow = [sys.executable, "-m", "pt2flow.flows.cli.main"]  # exits with the command's code

    candidate, built_s = build_candidate(Path(args.venv).resolve())
    config = out / "fleet.yaml"
    stages = ["trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"]
    config.write_text(
        yaml.safe_dump({"version": 1, "store": str(out / "store"), "stages": stages, "models": FLEET}, sort_keys=False)
    )

    start = time.monotonic()
    baseline = subprocess.run(
        [*pt2flow, "run", str(config), "--json"], capture_output=True, text=True, env=_env(), cwd=ROOT
    )
    baseline_s = time.monotonic() - start
    if baseline.returncode not in (0, 1):
        sys.stderr.write(baseline.stderr[-4000:])
        return 2
    baseline_run = json.loads(baseline.stdout)["run_id"]

    start = time.monotonic()
    check = subprocess.run(
        [
            *pt2flow,
            "upgrade-check",
            str(config),
            "--python",
            str(candidate),
            "--baseline",
            baseline_run,
            "--repro-dir",
            str(out / "repro"),
            "--html",
            str(out / "report.html"),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    check_s = time.monotonic() - start
    if check.returncode not in (0, 1):
        sys.stderr.write(check.stderr[-4000:])
        return 2
    report = json.loads(check.stdout)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    from pt2flow.flows.report.upgrade import UpgradeReport, render_text

    text = render_text(UpgradeReport.model_validate(report))  # the terminal view of the same report
    (out / "report.txt").write_text(text + "\n")
    timing = {
        "candidate_build_s": round(built_s, 1),
        "baseline_run_s": round(baseline_s, 1),
        "upgrade_check_s": round(check_s, 1),
        "upgrade_check_exit": check.returncode,
        "baseline_run": baseline_run,
        "candidate_run": report["candidate"]["run_id"],
        "baseline_torch": report["baseline"]["torch"],
        "candidate_torch": report["candidate"]["torch"],
        "summary": report["summary"],
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    print(text)
    print(json.dumps(timing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
