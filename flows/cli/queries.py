"""Index queries for the CLI: ls, show, lineage, diff. Storage only: no torch, no Prefect.

pyarrow, rich and the storage modules are imported inside the commands: `--help` needs none."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Mapping

import click

from pt2flow.flows.cli.errors import EXIT_OK, CommandUsageError
from pt2flow.flows.cli.support import Args, command, dump, format_size, json_option, open_store, rich_console, store_options

STAGE_NAMES = ("source", "trace", "functionalize", "decompose", "serialize", "aot_compile", "validate")


# ---------------------------------------------------------------------------------------------
# helpers


def _short(digest: Any, n: int = 12) -> str:
    return str(digest)[:n] if digest else "-"


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return str(value or "-")


def _parse_time(text: str, flag: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise CommandUsageError(f"{flag}: {text!r} is not an ISO date or time (e.g. 2026-11-01 or 2026-11-01T03:00)") from exc
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


# ---------------------------------------------------------------------------------------------
# ls


def ls_filter(args: Args) -> Any:
    """The pyarrow filter of ls's --model, --stage, ... (all must hold); None without any."""
    import pyarrow.compute as pc

    conditions = []
    if args.model:
        conditions.append(pc.field("model") == args.model)
    if args.stage:
        conditions.append(pc.field("stage") == args.stage)
    if args.status:
        conditions.append(pc.field("status") == args.status)
    if args.torch:
        conditions.append(pc.field("torch_version") == args.torch)
    if args.archive_version:
        conditions.append(pc.field("archive_version") == args.archive_version)
    if args.run:
        conditions.append(pc.field("run_id") == args.run)
    if args.since:
        conditions.append(pc.field("ended_at") >= _parse_time(args.since, "--since"))
    if args.until:
        conditions.append(pc.field("ended_at") <= _parse_time(args.until, "--until"))
    expression = None
    for condition in conditions:
        expression = condition if expression is None else expression & condition
    return expression


LS_COLUMNS = (
    "record_id", "run_id", "model", "stage", "status", "cached", "sha256", "size", "seconds",
    "error_class", "ended_at", "torch_version", "max_abs_err", "passed", "archive_version",
)


@command("ls", help="List stage records, newest first, with filters.")
@store_options
@click.option("--model", metavar="NAME")
@click.option("--stage", metavar="S", type=click.Choice(STAGE_NAMES))
@click.option("--status", type=click.Choice(["ok", "failed"]))
@click.option("--torch", metavar="VERSION", help="only records made with this torch version")
@click.option("--archive-version", "archive_version", metavar="MAJOR.MINOR", help="only serialize records whose archive has this torch.export schema version")
@click.option("--run", metavar="RUN_ID", help="only records of this run")
@click.option("--since", metavar="DATE", help="only records that ended at or after this ISO date/time (UTC)")
@click.option("--until", metavar="DATE", help="only records that ended at or before this ISO date/time (UTC)")
@click.option("--limit", type=int, default=100, metavar="LIMIT", help="show at most this many (newest first; 0 = all; default 100)")
@json_option("a JSON array of records")
def ls_command(args: Args) -> int:
    from pt2flow.storage.lineage import decode

    store = open_store(args)
    table = store.index.scan(None if args.json else LS_COLUMNS, filter=ls_filter(args))
    table = table.sort_by([("ended_at", "descending")])
    total = table.num_rows
    if args.limit and args.limit > 0:
        table = table.slice(0, args.limit)
    rows = table.to_pylist()
    if args.json:
        dump([decode(r) for r in rows])
        return EXIT_OK
    from rich.table import Table

    view = Table(title=f"{total} record(s) in {store.url}" + (f", newest {len(rows)} shown" if len(rows) < total else ""), title_justify="left")
    for column in ("ended (UTC)", "model", "stage", "status", "artifact", "size", "seconds", "run"):
        view.add_column(column, no_wrap=column in ("artifact", "ended (UTC)"))
    for r in rows:
        status = r["status"] if r["status"] != "ok" else ("ok (cached)" if r.get("cached") else "ok")
        if r.get("error_class"):
            status = f"{r['status']}: {r['error_class']}"
        view.add_row(
            _when(r["ended_at"]), r["model"], r["stage"], status, _short(r["sha256"]), format_size(r["size"]),
            f"{r['seconds']:.2f}" if r.get("seconds") is not None else "-", r.get("run_id") or "-",
        )
    rich_console().print(view)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# show


def _report_of(store: Any, record: Mapping[str, Any]) -> Any:
    """A validate record's stored report (verified by digest), or None."""
    if record.get("stage") != "validate" or not record.get("sha256"):
        return None
    try:
        return json.loads(store.get_blob(record["sha256"], record.get("size")))
    except Exception as exc:  # noqa: BLE001 - shown to the user as part of the record
        return {"error": f"report unavailable: {exc}"}


@command(
    "show",
    help="Show the newest record of artifact ID (a sha256 or a unique prefix of 8+ characters): every field, the op histogram and, for validate, the report.",
)
@click.argument("id", metavar="ID")
@store_options
@json_option()
def show_command(args: Args) -> int:
    from pt2flow.storage.lineage import decode, records_for_id

    store = open_store(args)
    records = records_for_id(store.index, args.id)
    record = decode(records[0])
    record["recorded_in_runs"] = sorted({r["run_id"] for r in records if r.get("run_id")})
    report = _report_of(store, records[0])
    if report is not None:
        record["report"] = report
    if args.json:
        dump(record)
        return EXIT_OK
    from rich.table import Table

    console = rich_console()
    fields = Table(title=f"{record['stage']} of {record['model']} — {record['sha256']}", title_justify="left", show_header=False)
    fields.add_column("field", style="bold")
    fields.add_column("value", overflow="fold")
    for key, value in record.items():
        if key in ("op_histogram", "report") or value is None:
            continue
        shown = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
        fields.add_row(key, shown if len(shown) < 2000 else shown[:2000] + " …")
    console.print(fields)
    histogram = record.get("op_histogram") or {}
    if histogram:
        ops = Table(title=f"op histogram ({sum(histogram.values())} calls, {len(histogram)} ops)", title_justify="left")
        ops.add_column("op")
        ops.add_column("count", justify="right")
        for op, count in sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0])):
            ops.add_row(op, str(count))
        console.print(ops)
    if report is not None:
        console.print("validation report:")
        console.print_json(json.dumps(report, default=str))
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# lineage


def _brief(record: Mapping[str, Any]) -> str:
    if record.get("stage") == "source":
        weights = record.get("weights_digest")
        return f"source {record.get('factory')} kwargs={record.get('kwargs') or '{}'} weights={_short(weights, 16) if weights else 'none (factory init)'}"
    extra = f" [{record['error_class']}]" if record.get("error_class") else ""
    return f"{record.get('stage')} {_short(record.get('sha256'), 16)} {record.get('status')}{extra} ({format_size(record.get('size'))}, run {record.get('run_id')})"


@command(
    "lineage",
    help="The chain from the model's source (factory, kwargs, weights) to ID; --descendants adds everything derived from ID; "
    "--weights DIGEST lists everything built from a checkpoint.",
)
@click.argument("id", metavar="[ID]", required=False)
@store_options
@click.option("--descendants", is_flag=True, help="also list everything derived from ID")
@click.option("--weights", metavar="DIGEST", help="everything built from this checkpoint (sha256 or prefix)")
@json_option()
def lineage_command(args: Args) -> int:
    from pt2flow.storage import lineage

    store = open_store(args)
    if args.weights:
        result = lineage.by_weights(store.index, args.weights)
        if args.json:
            dump({"weights": result["weights"], "sources": [lineage.decode(r) for r in result["sources"]], "descendants": [lineage.decode(r) for r in result["descendants"]]})
            return EXIT_OK
        from rich.tree import Tree

        tree = Tree(f"weights {result['weights']}")
        for source in result["sources"]:
            branch = tree.add(f"{source['model']}: {_brief(source)}")
            for row in result["descendants"]:
                if row["model"] == source["model"]:
                    branch.add(_brief(row))
        rich_console().print(tree)
        return EXIT_OK
    if not args.id:
        raise CommandUsageError("give an artifact ID, or --weights DIGEST")
    record = lineage.resolve(store.index, args.id)
    chain = lineage.ancestors(store.index, record)
    below = lineage.descendants(store.index, record) if args.descendants else []
    if args.json:
        dump({"id": record["sha256"], "ancestors": [lineage.decode(r) for r in chain[:-1]], "record": lineage.decode(record), "descendants": [lineage.decode(r) for r in below]})
        return EXIT_OK
    from rich.tree import Tree

    tree = Tree(f"[bold]{record['model']}[/bold] lineage of {record['sha256']}")
    node = tree
    for row in chain:
        node = node.add(_brief(row) + ("  ◀" if row is chain[-1] else ""))
    if below:
        derived = tree.add("derived from it:")
        for row in below:
            derived.add(_brief(row))
    rich_console().print(tree)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# diff


def _histogram_diff(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, Any]:
    added = {op: b[op] for op in sorted(set(b) - set(a))}
    removed = {op: a[op] for op in sorted(set(a) - set(b))}
    changed = {op: [a[op], b[op]] for op in sorted(set(a) & set(b)) if a[op] != b[op]}
    return {"added": added, "removed": removed, "changed": changed, "counts": {"added": len(added), "removed": len(removed), "changed": len(changed)}}


def diff_records(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """What differs between two decoded records (the fields `pt2flow diff` compares)."""
    def pair(key: str) -> dict[str, Any]:
        return {"a": a.get(key), "b": b.get(key), "same": a.get(key) == b.get(key)}

    va, vb = a.get("validation") or {}, b.get("validation") or {}
    return {
        "a": {k: a.get(k) for k in ("sha256", "model", "stage", "run_id", "torch_version")},
        "b": {k: b.get(k) for k in ("sha256", "model", "stage", "run_id", "torch_version")},
        "signature": pair("signature"),
        "op_histogram": _histogram_diff(a.get("op_histogram") or {}, b.get("op_histogram") or {}),
        "node_count": pair("node_count"),
        "range_constraints": pair("range_constraints"),
        "size": pair("size"),
        "fingerprint": pair("fingerprint"),
        "validation": {"a": va.get("max_abs_err"), "b": vb.get("max_abs_err"), "a_passed": va.get("passed"), "b_passed": vb.get("passed")},
        "seconds": pair("seconds"),
    }


@command("diff", help="Compare graph signature, op histogram, node count, range constraints, sizes, validation errors and timings of two records.")
@click.argument("id_a", metavar="ID_A")
@click.argument("id_b", metavar="ID_B")
@store_options
@json_option()
def diff_command(args: Args) -> int:
    from pt2flow.storage import lineage

    store = open_store(args)
    a = lineage.decode(lineage.resolve(store.index, args.id_a))
    b = lineage.decode(lineage.resolve(store.index, args.id_b))
    result = diff_records(a, b)
    if args.json:
        dump(result)
        return EXIT_OK
    from rich.table import Table

    view = Table(title=f"diff {_short(a['sha256'])} ({a['model']}/{a['stage']}) → {_short(b['sha256'])} ({b['model']}/{b['stage']})", title_justify="left")
    view.add_column("field", style="bold")
    view.add_column("A")
    view.add_column("B")
    view.add_column("")
    for key in ("node_count", "size", "seconds", "fingerprint"):
        item = result[key]
        view.add_row(key, str(item["a"]), str(item["b"]), "same" if item["same"] else "[yellow]changed")
    sig = result["signature"]
    view.add_row("signature", f"{len((sig['a'] or {}).get('inputs', []))} in / {len((sig['a'] or {}).get('outputs', []))} out",
                 f"{len((sig['b'] or {}).get('inputs', []))} in / {len((sig['b'] or {}).get('outputs', []))} out", "same" if sig["same"] else "[yellow]changed")
    rc = result["range_constraints"]
    view.add_row("range constraints", json.dumps(rc["a"]), json.dumps(rc["b"]), "same" if rc["same"] else "[yellow]changed")
    v = result["validation"]
    view.add_row("validation max abs err", str(v["a"]), str(v["b"]), "")
    counts = result["op_histogram"]["counts"]
    view.add_row("op histogram", "", "", f"+{counts['added']} ops, -{counts['removed']} ops, {counts['changed']} changed")
    console = rich_console()
    console.print(view)
    hist = result["op_histogram"]
    for op, n in hist["added"].items():
        console.print(f"  [green]+ {op}[/green] ×{n}")
    for op, n in hist["removed"].items():
        console.print(f"  [red]- {op}[/red] ×{n}")
    for op, (x, y) in hist["changed"].items():
        console.print(f"  [yellow]~ {op}[/yellow] {x} → {y}")
    return EXIT_OK
