"""Where a small model's time goes: pt2flow's own work against torch's, per process (issue 43).

    .venv/bin/python bench/profile_fleet.py [--small 100] [--workdir /tmp/pt2-profile] [--json-out FILE]

Runs bench/fleet_overhead.py's small fleet (--small tiny MLPs of distinct sizes through trace,
functionalize, decompose, serialize and validate, no compile) with `pt2flow run --workers 1`
into an empty store, twice:

- plain: nothing profiled. The CPU seconds of each process over the run: the orchestrator (its
  own rusage), the shared Prefect server (its /proc entry) and the rest of the machine (the
  worker, /proc/stat less the two); and the orchestrator's wall time split by what it waits on
  (each function below timed by a wrapper: cheap, so the split holds for the plain run).
- profiled: the worker runs each stage under cProfile (PT2FLOW_PROFILE_DIR,
  flows/engine/worker/process.py), and its seconds are split into torch's own work (export,
  run_decompositions, the validation calls) and pt2flow's (the round trip that checks a
  program loads back, its fingerprint, the store's writes, the model's build and manifest), on
  the first --profiled models.
  cProfile slows Python-heavy code: the shares hold, the seconds are the profiled run's.

Prints both tables and a JSON line with every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# what the orchestrator's time is spent in: (module, attribute path, label); nested ones are
# shown under their parent's label, so the rows do not add up to more than the wall time
ORCHESTRATOR_PARTS = [
    ("prefect.tasks", "Task.__call__", "stage tasks (Prefect task run, whole)"),
    # a stage sent ahead (runner.Ahead) is sent from the task before it and waited for in its own:
    # the answers waited for are the worker's share, whichever task waits
    (
        "pt2flow.flows.engine.orchestrator.supervisor",
        "Worker.receive",
        "  worker answers waited for (stage work + IPC)",
    ),
    ("pt2flow.flows.engine.orchestrator.bookkeeping", "StageRun.record", "  record a stage"),
    ("pt2flow.storage.index", "MetadataIndex.append", "    index append (one fsynced Parquet file)"),
    ("pt2flow.flows.engine.orchestrator.bookkeeping", "StageRun.lookup", "  cache lookup"),
    ("pt2flow.flows.engine.orchestrator.runner", "stage_key", "  stage key"),
    ("pt2flow.storage.index", "MetadataIndex.compact", "index compaction (end of run)"),
]

# the worker's profile: torch's work and pt2flow's, by the functions that do it (file suffix, name)
WORKER_PARTS = [
    ("torch", "torch.export.export (trace)", [("torch/export/__init__.py", "export")]),
    ("torch", "run_decompositions (functionalize, decompose)", [("exported_program.py", "run_decompositions")]),
    ("both", "validate, whole (eager and archive calls, comparisons)", [("stages/validate.py", "validate")]),
    ("pt2flow", "program round trip: torch.export.load", [("stages/serialize.py", "check_round_trip")]),
    ("pt2flow", "program save: torch.export.save", [("torch/export/__init__.py", "save")]),
    ("pt2flow", "fingerprint", [("stages/program.py", "fingerprint")]),
    ("pt2flow", "store writes (put_blob)", [("storage/store.py", "put_blob")]),
    ("pt2flow", "source: build, reads, manifest", [("flows/engine/worker/compute.py", "build_recorded")]),
    ("pt2flow", "loads from the store", [("flows/engine/worker/artifacts.py", "load_artifact")]),
]


def _wrap(module: str, path: str, label: str, totals: dict[str, list[float]]) -> None:
    import functools
    import importlib

    owner: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            entry = totals.setdefault(label, [0.0, 0])
            entry[0] += time.perf_counter() - started
            entry[1] += 1

    setattr(owner, name, timed)


def orchestrator(argv: list[str], out: str) -> int:
    """The child: `pt2flow run` in this process with the orchestrator's parts timed."""
    totals: dict[str, list[float]] = {}
    for module, path, label in ORCHESTRATOR_PARTS:
        _wrap(module, path, label, totals)
    # the runner imported stage_key by name: time the name it calls
    from pt2flow.flows.cli.main import main

    sys.argv = ["pt2flow", *argv]
    started = time.perf_counter()
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(
        json.dumps(
            {
                "wall_s": time.perf_counter() - started,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "parts": {k: {"s": round(v[0], 3), "calls": v[1]} for k, v in totals.items()},
            }
        )
    )
    return code if code in (0, 1) else code


def _busy_s() -> float:
    """CPU seconds the machine's processes have used (the benchmark stage's own reading of /proc/stat)."""
    from pt2flow.stages.timing import machine_busy_s

    busy = machine_busy_s()
    if busy is None:
        raise SystemExit("no /proc/stat here: the per-process CPU table needs Linux")
    return busy


def _prefect_server_cpu_s() -> dict[str, float]:
    """CPU seconds of each shared Prefect server process, by pid (empty when none runs)."""
    found: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"prefect_server" not in cmdline:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            found[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return found


def _server_cpu_used(before: dict[str, float], after: dict[str, float]) -> float:
    """What the servers alive at the end used since `before`: one started during the run counts
    from 0, one that stopped during it (another Prefect home's, idle) is left out."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def _run(config: Path, store: Path, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    shutil.rmtree(store, ignore_errors=True)
    out = store.parent / f"{store.name}.orchestrator.json"
    server_before, busy_before, started = _prefect_server_cpu_s(), _busy_s(), time.perf_counter()
    argv = ["run", str(config), "--json", "--store", str(store), "--workers", "1"]
    proc = subprocess.run(
        [sys.executable, __file__, "--orchestrator", str(out), "--", *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"pt2flow run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    figures = json.loads(out.read_text())
    server = _server_cpu_used(server_before, _prefect_server_cpu_s())
    machine = _busy_s() - busy_before
    stage_s: dict[str, float] = collections.Counter()
    for model in json.loads(proc.stdout)["models"]:
        for stage, info in model["stages"].items():
            stage_s[stage] += float(info.get("seconds") or 0)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": {
            "orchestrator": round(figures["cpu_s"], 2),
            "prefect_server": round(server, 2),
            "workers_and_rest": round(machine - figures["cpu_s"] - server, 2),
            "machine": round(machine, 2),
        },
        "orchestrator_parts": figures["parts"],
        "stage_s": {k: round(v, 2) for k, v in stage_s.items()},
    }


def _worker_profile(folder: Path) -> dict[str, Any]:
    """The worker's seconds under cProfile, by WORKER_PARTS (inclusive time of the functions named)."""
    files = sorted(folder.glob("worker-*.prof"))
    if not files:
        raise SystemExit(f"no worker profile under {folder}")
    stats = pstats.Stats(*map(str, files))
    raw: Any = stats.stats  # type: ignore[attr-defined]
    by_function: dict[tuple[str, str], float] = collections.defaultdict(float)
    for (filename, _line, name), (_cc, _nc, _tt, cumulative, _callers) in raw.items():
        by_function[(filename, name)] += cumulative
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in raw.values())
    parts = []
    for owner, label, functions in WORKER_PARTS:
        seconds = sum(
            s
            for (filename, name), s in by_function.items()
            for suffix, fn in functions
            if filename.endswith(suffix) and name == fn
        )
        parts.append({"owner": owner, "what": label, "s": round(seconds, 2), "share": round(seconds / total, 3)})
    return {"total_s": round(total, 2), "parts": parts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=100, help="fleet size (default 100)")
    parser.add_argument(
        "--profiled", type=int, default=30, help="models in the profiled run (default 30: cProfile makes it 4x slower)"
    )
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "pt2-profile"))
    parser.add_argument("--json-out", metavar="FILE")
    parser.add_argument("--orchestrator", metavar="OUT", help=argparse.SUPPRESS)  # the child
    args, rest = parser.parse_known_args()
    if args.orchestrator:
        return orchestrator([a for a in rest if a != "--"], args.orchestrator)

    from fleet_overhead import _env, compile_checkout, emit_json, write_config

    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    compile_checkout()
    config = write_config(workdir / "small", "small", args.small)
    env = _env(workdir, "plain")
    subprocess.run(  # the shared Prefect server up first, as on a machine that ran pt2flow lately
        [
            sys.executable,
            "-c",
            "from pt2flow.flows.engine.services import prefect_runtime\nwith prefect_runtime.prefect_api(): pass",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    plain = _run(config, workdir / "store-plain", env, workdir / "small")
    profile_dir = workdir / "profile"
    profile_dir.mkdir()
    profiled_env = {**_env(workdir, "profiled"), "PT2FLOW_PROFILE_DIR": str(profile_dir)}
    subset = write_config(workdir / "profiled", "small", min(args.profiled, args.small))
    profiled = _run(subset, workdir / "store-profiled", profiled_env, workdir / "profiled")
    worker = _worker_profile(profile_dir)
    figures = {
        "models": args.small,
        "cores": os.cpu_count(),
        "plain": plain,
        "profiled_models": min(args.profiled, args.small),
        "profiled_wall_s": profiled["wall_s"],
        "worker": worker,
    }

    per = 1000.0 / args.small
    print(f"\n{args.small} small models, `pt2flow run --workers 1`, {os.cpu_count()} cores: {plain['wall_s']:.1f} s")
    print("\nCPU seconds by process (plain run)          s    ms/model")
    for name, seconds in plain["cpu_s"].items():
        print(f"  {name:38s} {seconds:7.1f} {seconds * per:8.1f}")
    print("\norchestrator wall time (plain run)          s    calls   ms/call")
    for _module, _path, label in ORCHESTRATOR_PARTS:
        entry = plain["orchestrator_parts"].get(label, {"s": 0.0, "calls": 0})
        print(f"  {label:42s} {entry['s']:7.2f} {entry['calls']:6d} {1000 * entry['s'] / max(entry['calls'], 1):8.1f}")
    print(f"\nworker under cProfile ({figures['profiled_models']} models): {worker['total_s']:.1f} s of profiled time")
    for part in worker["parts"]:
        print(f"  {part['owner']:8s} {part['what']:46s} {part['s']:7.1f} s {100 * part['share']:5.1f} %")
    emit_json(figures, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
