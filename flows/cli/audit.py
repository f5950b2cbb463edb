"""`pt2flow audit`: is the cache honest? A sample of a run's program records rebuilt in fresh
worker processes and compared with what the records say (flows/engine/maintenance/audit.py). Exit 1 naming
every record whose blob or rebuild disagrees with its fingerprint."""

from __future__ import annotations

import click

from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK
from pt2flow.flows.cli.support import Args, command, dump, json_option, open_store, store_options


@command(
    "audit",
    help="Check a sample of RUN's program records (trace, functionalize, decompose, serialize, and the int8 .pte of "
    "executorch_int8, rebuilt byte for byte; default run: the newest) in fresh "
    "worker processes: each record's blob must load as the program its fingerprint names, and the stage run again on the "
    "record's inputs (its parent program, its options; trace from --config's model) must give that program again. "
    "Exit 1 naming every record that does not. Nightly, this proves that what the cache serves is what a cold run would build.",
    arguments={"RUN": "run ID or unique prefix (default: the newest run)"},
)
@click.argument("run", metavar="[RUN]", required=False)
@click.option("--run", "run_option", metavar="RUN", help="the same as the RUN argument")
@click.option(
    "--sample",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=1.0,
    show_default=True,
    metavar="FRACTION",
    help="fraction of the records to check, drawn from each record ID and --seed",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="seed of the sample draw (the same seed picks the same records)",
)
@click.option(
    "--workers",
    type=int,
    default=None,
    metavar="N",
    help="models checked in parallel, each on a fresh worker process of its own (default: as run: $PT2FLOW_WORKERS "
    "where set, else one per core and per 3 GiB of free memory)",
)
@store_options(
    config_help="the run's config: its models' trace records are re-traced too, and its store is read (unless --store)"
)
@json_option("one JSON document on stdout")
def audit_command(args: Args) -> int:
    from pt2flow.flows.api import Store, audit

    doc = audit(
        Store.of(open_store(args)),
        args.run or args.run_option,
        sample=args.sample,
        seed=args.seed,
        config=args.config,
        workers=args.workers,
    )
    if args.json:
        dump(doc)
    else:
        sample = doc["sample"]
        print(
            f"audit of run {doc['run_id']}: {sample['checked']} of {sample['records']} program records checked, "
            f"{doc['summary']['rebuilt']} rebuilt"
        )
        for entry in doc["records"]:
            mark = "ok" if entry["status"] == "ok" else "FAILED"
            how = "stored+rebuilt" if entry["rebuilt"] else "stored"
            line = f"  {mark:6} {entry['model']} {entry['stage']} {entry['sha256'][:12]} ({how})"
            print(line + (f": {entry['problem']}" if entry["problem"] else ""))
        print(f"{doc['summary']['ok']} ok, {doc['summary']['failed']} failed")
    return EXIT_FAILED if doc["summary"]["failed"] else EXIT_OK
