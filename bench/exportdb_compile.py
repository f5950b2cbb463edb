"""torch's ExportDB through AOTInductor: every case shipped with the installed torch (or the ones
named) written as a config (tests/exportdb.py) and run through trace, functionalize, decompose,
serialize, aot_compile and validate, in one fleet run; each AOTInductor package is validated
like the archive, against eager. Prints one line per case and the tally; exits 1 when a case
ExportDB marks supported does not end ok.

    .venv/bin/python bench/exportdb_compile.py [--cases a,b,c] [--workers 2] [--json FILE]

`make bench-exportdb-compile` runs the three cases `make test` once compiled (nested inputs with
*args and **kwargs, an input mutated in place, torch.cond with a dynamic dim); without --cases,
every case (AOTInductor compiles take 5-30 s each on 2 cores). It is a benchmark, not a test: the
suite's ExportDB test (tests/integration/test_exportdb.py) stops at serialize and validate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ["trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated ExportDB case names (default: every case)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the per-case outcomes here")
    args = parser.parse_args()

    from pt2flow.flows.api.running import execute, prepare_run
    from tests import exportdb

    names = args.cases.split(",") if args.cases else None
    known = exportdb.cases()
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        parser.error(f"not ExportDB cases of this torch: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="pt2flow-exportdb-compile-") as folder:
        config = exportdb.write_fleet(Path(folder), names=names, stages=STAGES)
        start = time.perf_counter()
        document = json.loads(
            json.dumps(
                execute(prepare_run(config, store=str(Path(folder) / "store"), workers=args.workers)), default=str
            )
        )
        seconds = time.perf_counter() - start
        outcomes: dict[str, dict[str, object]] = {}
        for model in document["models"]:
            validate = model["stages"].get("validate", {})
            report = None
            if validate.get("artifact"):
                digest = validate["artifact"]
                report = json.loads((Path(folder) / "store" / "blobs" / "sha256" / digest[:2] / digest).read_text())
            compiled_ok = (
                bool(report)
                and "compiled" in report["candidates"]
                and all(s["ok"] for s in report["candidates"]["compiled"]["samples"])
            )
            outcomes[model["name"]] = {
                "status": model["status"],
                "error_class": model.get("error_class"),
                "compiled": bool(model["artifacts"].get("compiled")),
                "compiled_matches_eager": compiled_ok,
                "supported": model["name"] in known and known[model["name"]].support_level.name == "SUPPORTED",
            }
    bad = []
    for name, o in outcomes.items():
        print(
            f"{name:<40} {o['status']:<8} {o['error_class'] or '':<16} compiled={o['compiled']} matches_eager={o['compiled_matches_eager']}"
        )
        if o["supported"] and not (o["status"] == "ok" and o["compiled_matches_eager"]):
            bad.append(name)
    print(f"{len(outcomes)} cases in {seconds:.0f} s; supported but not ok: {len(bad)} {bad if bad else ''}")
    if args.json:
        args.json.write_text(json.dumps({"seconds": seconds, "cases": outcomes}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
