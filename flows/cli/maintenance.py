"""Store upkeep for the CLI: verify (re-hash every blob) and gc (delete unreferenced blobs, compact
the index), printing what flows/api/upkeep.py finds. Storage only: no torch, no Prefect."""

from __future__ import annotations

import click

from pt2flow.flows.api.upkeep import DEFAULT_GRACE_SECONDS, collect_garbage, verify_store
from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK
from pt2flow.flows.cli.support import Args, command, dump, format_size, json_option, open_store, store_options


@command(
    "verify", help="Re-hash every blob; exit 1 naming each missing or corrupt blob and the records that point to it."
)
@store_options
@json_option()
def verify_command(args: Args) -> int:
    store = open_store(args)
    result = verify_store(store)
    bad = result["missing"] or result["corrupt"]
    if args.json:
        dump(result)
    else:
        print(
            f"checked {result['checked']} blob(s) in {store.url}: {len(result['missing'])} missing, {len(result['corrupt'])} corrupt"
        )
        for label in ("missing", "corrupt"):
            for item in result[label]:
                users = (
                    ", ".join(f"{r['model']}/{r['stage']} (run {r['run_id']})" for r in item["records"]) or "no record"
                )
                print(f"  {label}: {item['sha256']} — used by {users}")
    return EXIT_FAILED if bad else EXIT_OK


@command(
    "gc",
    help="Delete blobs that no index record references and that are older than the grace period "
    "(a run in progress never loses a blob it just wrote). With --keep-runs and/or --keep-days, first "
    "drop the index records of each model's runs that neither keeps, and the blobs only they name: "
    "each model's newest artifact of every kind (a .onnx of an older run included), and what a kept run or the "
    "lineage of a kept artifact needs, always stay; nothing goes while another "
    "run is in progress (its lease; the gc then says it was deferred, exit 0).",
)
@store_options
@click.option(
    "--keep-runs",
    type=click.IntRange(min=1),
    metavar="N",
    help="keep each model's N newest runs (and what their artifacts' lineage needs)",
)
@click.option(
    "--keep-days",
    type=click.FloatRange(min=0),
    metavar="DAYS",
    help="keep every run that ended within DAYS days (with --keep-runs: a run either keeps is kept)",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="list what would be deleted (per run, and per model and kind, with counts and bytes), delete nothing",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=DEFAULT_GRACE_SECONDS,
    metavar="SECONDS",
    help=f"keep blobs younger than this (default {DEFAULT_GRACE_SECONDS})",
)
@click.option("--compact", is_flag=True, help="also merge the index files into one")
@json_option()
def gc_command(args: Args) -> int:
    store = open_store(args)
    result = collect_garbage(
        store, dry_run=args.dry_run, grace_seconds=args.grace, keep_runs=args.keep_runs, keep_days=args.keep_days
    )
    compacted = None
    if args.compact and not args.dry_run:
        compacted = store.index.compact()
    if args.json:
        if compacted is not None:
            result["compacted"] = {"merged_files": compacted.merged_files, "records": compacted.records}
        dump(result)
        return EXIT_OK
    if "retention" in result:
        print_retention(result["retention"])
    key = "would_delete" if args.dry_run else "deleted"
    verb = "would delete" if args.dry_run else "deleted"
    if result["deferred"] and not args.dry_run:
        print(
            f"deferred: run(s) in progress ({', '.join(result['deferred'])}); no unreferenced blob deleted, try again when they end"
        )
    print(
        f"{verb} {len(result[key])} unreferenced blob(s), {format_size(result['bytes'])}; kept {result['kept_within_grace']} younger than the {args.grace:g} s grace period"
    )
    for digest in result[key]:
        print(f"  {digest}")
    if compacted is not None:
        print(f"compacted {compacted.merged_files} index file(s) into one ({compacted.records} records)")
    return EXIT_OK


def print_retention(retention: dict) -> None:
    """What a retention rule kept and dropped (or would), per run."""
    rule = retention["rule"]
    kept = ", ".join(f"{model}: {len(runs)}" for model, runs in retention["kept_runs"].items()) or "none"
    said = " or ".join(
        p
        for p in (
            f"{rule['keep_runs']} newest run(s)" if rule["keep_runs"] is not None else "",
            f"runs of the last {rule['keep_days']:g} day(s)" if rule["keep_days"] is not None else "",
        )
        if p
    )
    print(
        f"retention (keep each model's {said}): kept runs per model: {kept}; {retention['kept_records']} record(s) kept"
    )
    if retention["dry_run"]:
        print(
            f"would drop {retention['records']} record(s) of {len(retention['dropped_runs'])} run(s) and free {len(retention['blobs'])} blob(s), {format_size(retention['bytes'])}"
        )
    elif retention["deferred"] and not retention["records_dropped"]:
        print(
            f"deferred: run(s) in progress ({', '.join(retention['deferred'])}); nothing dropped, try again when they end"
        )
    else:
        print(
            f"dropped {retention['records_dropped']} record(s) of {len(retention['dropped_runs'])} run(s); freed {len(retention['deleted'])} blob(s), {format_size(retention['deleted_bytes'])}"
        )
        if retention["kept_within_grace"]:
            print(
                f"  {len(retention['kept_within_grace'])} blob(s) younger than the grace period stay (a later gc frees them)"
            )
        if retention["deferred"]:
            print(f"  stopped: run(s) in progress ({', '.join(retention['deferred'])}); a later gc frees the rest")
    for run in retention["dropped_runs"]:
        print(
            f"  run {run['run_id']}: {run['records']} record(s) of {', '.join(run['models'])}; {run['blobs']} blob(s), {format_size(run['bytes'])}"
        )
    if retention.get("dropped_kinds"):
        print("by model and kind:")
        for kind in retention["dropped_kinds"]:
            print(
                f"  {kind['model']} {kind['stage']}: {kind['records']} record(s) of {len(kind['runs'])} run(s); "
                f"{kind['blobs']} blob(s), {format_size(kind['bytes'])}"
            )
    newest_kept = [
        f"{model} {stage}"
        for model, stages in retention.get("kept_newest", {}).items()
        for stage, run in stages.items()
        if run not in retention["kept_runs"].get(model, [])
    ]
    if newest_kept:
        print(f"kept as the newest artifact of its kind, from an older run: {', '.join(newest_kept)}")
