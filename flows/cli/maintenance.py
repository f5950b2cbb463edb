"""Store upkeep for the CLI: verify (re-hash every blob) and gc (delete unreferenced blobs, compact
the index), printing what flows/api/upkeep.py finds. Storage only: no torch, no Prefect."""

from __future__ import annotations

import click

from pt2flow.flows.api.upkeep import DEFAULT_GRACE_SECONDS, collect_garbage, verify_store
from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK
from pt2flow.flows.cli.support import Args, command, dump, format_size, json_option, open_store, store_options


@command("verify", help="Re-hash every blob; exit 1 naming each missing or corrupt blob and the records that point to it.")
@store_options
@json_option()
def verify_command(args: Args) -> int:
    store = open_store(args)
    result = verify_store(store)
    bad = result["missing"] or result["corrupt"]
    if args.json:
        dump(result)
    else:
        print(f"checked {result['checked']} blob(s) in {store.url}: {len(result['missing'])} missing, {len(result['corrupt'])} corrupt")
        for label in ("missing", "corrupt"):
            for item in result[label]:
                users = ", ".join(f"{r['model']}/{r['stage']} (run {r['run_id']})" for r in item["records"]) or "no record"
                print(f"  {label}: {item['sha256']} — used by {users}")
    return EXIT_FAILED if bad else EXIT_OK


@command(
    "gc",
    help="Delete blobs that no index record references and that are older than the grace period "
    "(a run in progress never loses a blob it just wrote).",
)
@store_options
@click.option("--dry-run", is_flag=True, help="list what would be deleted, delete nothing")
@click.option("--grace", type=float, default=DEFAULT_GRACE_SECONDS, metavar="SECONDS", help=f"keep blobs younger than this (default {DEFAULT_GRACE_SECONDS})")
@click.option("--compact", is_flag=True, help="also merge the index files into one")
@json_option()
def gc_command(args: Args) -> int:
    store = open_store(args)
    result = collect_garbage(store, dry_run=args.dry_run, grace_seconds=args.grace)
    compacted = None
    if args.compact and not args.dry_run:
        compacted = store.index.compact()
    if args.json:
        if compacted is not None:
            result["compacted"] = {"merged_files": compacted.merged_files, "records": compacted.records}
        dump(result)
        return EXIT_OK
    key = "would_delete" if args.dry_run else "deleted"
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(result[key])} unreferenced blob(s), {format_size(result['bytes'])}; kept {result['kept_within_grace']} younger than the {args.grace:g} s grace period")
    for digest in result[key]:
        print(f"  {digest}")
    if compacted is not None:
        print(f"compacted {compacted.merged_files} index file(s) into one ({compacted.records} records)")
    return EXIT_OK
