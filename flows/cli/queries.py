"""Index queries for the CLI: ls, show, lineage, diff. Storage only: no torch, no Prefect.

pyarrow, rich and the storage modules are imported inside the commands: `--help` needs none."""

from __future__ import annotations

import json
import sys
from datetime import datetime, UTC
from typing import Any
from collections.abc import Mapping

import click

from pt2flow.flows.cli.errors import EXIT_OK, CommandUsageError
from pt2flow.flows.cli.support import (
    Args,
    command,
    dump,
    format_size,
    json_option,
    open_store,
    rich_console,
    store_options,
)

from pt2flow.flows import pipeline

STAGE_NAMES = ("source", *pipeline.names())  # the stages registered here (flows/pipeline), in pipeline order


# ---------------------------------------------------------------------------------------------
# helpers


def _short(digest: Any, n: int = 12) -> str:
    return str(digest)[:n] if digest else "-"


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return str(value or "-")


# ---------------------------------------------------------------------------------------------
# ls


def ls_filter(args: Args, store: Any) -> Any:
    """The pyarrow filter of ls's --model, --stage, ... (all must hold); None without any."""
    from pt2flow.flows.api.store import Store

    return Store.of(store).filter(
        model=args.model,
        stage=args.stage,
        status=args.status,
        torch=args.torch,
        archive_version=args.archive_version,
        run=args.run,
        since=args.since,
        until=args.until,
    )


def unknown_model_hint(store: Any, model: str, shown: int = 20) -> str | None:
    """What to say when `--model NAME` matched no record: the store has no model of that name
    (the closest names first, then the others, from the index's `model` column alone), or None
    when it has (the other filters left nothing)."""
    import difflib

    import pyarrow.compute as pc

    names = sorted(str(n) for n in pc.unique(store.index.scan(["model"]).column("model")).to_pylist() if n is not None)
    if model in names:
        return None
    if not names:
        return f"no model named {model!r}: the index of {store.url} holds no records"
    close = difflib.get_close_matches(model, names, n=3, cutoff=0.5)
    rest = [n for n in names if n not in close]
    listed = ", ".join([*close, *rest][:shown]) + (f", … {len(names) - shown} more" if len(names) > shown else "")
    return (
        f"no model named {model!r} in {store.url}"
        + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
        + f"; its models: {listed}"
    )


LS_COLUMNS = (
    "record_id",
    "run_id",
    "model",
    "stage",
    "status",
    "cached",
    "sha256",
    "size",
    "seconds",
    "error_class",
    "ended_at",
    "torch_version",
    "max_abs_err",
    "passed",
    "archive_version",
)


@command("ls", help="List stage records, newest first, with filters.")
@store_options
@click.option("--model", metavar="NAME")
@click.option("--stage", metavar="S", type=click.Choice(STAGE_NAMES))
@click.option("--status", type=click.Choice(["ok", "failed"]))
@click.option(
    "--torch",
    metavar="VERSION",
    help="only records made with this torch version (2.13.0 matches every local build: 2.13.0+cpu, ...)",
)
@click.option(
    "--archive-version",
    "archive_version",
    metavar="MAJOR.MINOR",
    help="only serialize records whose archive has this torch.export schema version",
)
@click.option("--run", metavar="RUN", help="only records of this run (ID, or a unique prefix or suffix of one)")
@click.option("--since", metavar="DATE", help="only records that ended at or after this ISO date/time (UTC)")
@click.option("--until", metavar="DATE", help="only records that ended at or before this ISO date/time (UTC)")
@click.option(
    "--limit",
    type=int,
    default=100,
    metavar="LIMIT",
    help="show at most this many (newest first; 0 = all; default 100)",
)
@json_option("a JSON array of records")
def ls_command(args: Args) -> int:
    from pt2flow.storage.lineage import decode

    store = open_store(args)
    table = store.index.scan(None if args.json else LS_COLUMNS, filter=ls_filter(args, store))
    table = table.sort_by([("ended_at", "descending")])
    total = table.num_rows
    if args.limit and args.limit > 0:
        table = table.slice(0, args.limit)
    rows = table.to_pylist()
    if total == 0 and args.model:
        hint = unknown_model_hint(store, args.model)
        if hint:
            print(hint, file=sys.stderr)
    if args.json:
        dump([decode(r) for r in rows])
        return EXIT_OK
    from rich.table import Table

    # the heading is a line of its own, never wrapped: a table's title wraps at the table's width,
    # which broke a long store path in two (an empty table is ~75 columns wide)
    heading = f"{total} record(s) in {store.url}" + (f", newest {len(rows)} shown" if len(rows) < total else "")
    view = Table()
    for column in ("ended (UTC)", "model", "stage", "status", "artifact", "size", "seconds", "run"):
        view.add_column(column, no_wrap=column in ("artifact", "ended (UTC)"))
    for r in rows:
        status = r["status"] if r["status"] != "ok" else ("ok (cached)" if r.get("cached") else "ok")
        if r.get("error_class"):
            status = f"{r['status']}: {r['error_class']}"
        view.add_row(
            _when(r["ended_at"]),
            r["model"],
            r["stage"],
            status,
            _short(r["sha256"]),
            format_size(r["size"]),
            f"{r['seconds']:.2f}" if r.get("seconds") is not None else "-",
            r.get("run_id") or "-",
        )
    console = rich_console()
    console.print(heading, soft_wrap=True, markup=False, highlight=False)
    console.print(view)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# show


@command(
    "show",
    help="Show the newest record of artifact ID (a sha256 or a unique prefix of 8+ characters): every field, the op histogram and, for validate, the report (for benchmark, its table).",
)
@click.argument("id", metavar="ID")
@store_options
@json_option()
def show_command(args: Args) -> int:
    from pt2flow.flows.api.store import Store

    record = Store.of(open_store(args)).show(args.id)
    report = record.get("report")
    if args.json:
        dump(record)
        return EXIT_OK
    from rich.table import Table

    console = rich_console()
    fields = Table(
        title=f"{record['stage']} of {record['model']} — {record['sha256']}", title_justify="left", show_header=False
    )
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
    if report is not None and "recommendation" in report:  # a benchmark's report: its table
        from pt2flow.flows.report.benchmark import recommendation_sentence, table

        header, rows = table(report)
        timings = Table(
            title=f"benchmark on {report['machine'].get('cpu', '?')}, {report['machine'].get('threads')} threads (* fastest at that size)",
            title_justify="left",
        )
        for column in header:
            timings.add_column(column, justify="left" if column == "artifact" else "right")
        for row in rows:
            timings.add_row(*row)
        console.print(timings)
        console.print(recommendation_sentence(report["recommendation"], [p["label"] for p in report["points"]]))
    elif report is not None:
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
    from pt2flow.flows.api.store import Store

    store = Store.of(open_store(args))
    if args.weights:
        result = store.built_from_weights(args.weights)
        if args.json:
            dump(result)
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
    found = store.lineage(args.id, descendants=args.descendants)
    if args.json:
        dump(found)
        return EXIT_OK
    record, below = found["record"], found["descendants"]
    chain = [*found["ancestors"], record]
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


@command(
    "diff",
    help="Compare graph signature, op histogram, node count, range constraints, sizes, validation errors and timings of two records.",
)
@click.argument("id_a", metavar="ID_A")
@click.argument("id_b", metavar="ID_B")
@store_options
@json_option()
def diff_command(args: Args) -> int:
    from pt2flow.flows.api.store import Store

    result = Store.of(open_store(args)).diff(args.id_a, args.id_b)
    a, b = result["a"], result["b"]
    if args.json:
        dump(result)
        return EXIT_OK
    from rich.table import Table

    view = Table(
        title=f"diff {_short(a['sha256'])} ({a['model']}/{a['stage']}) → {_short(b['sha256'])} ({b['model']}/{b['stage']})",
        title_justify="left",
    )
    view.add_column("field", style="bold")
    view.add_column("A")
    view.add_column("B")
    view.add_column("")
    for key in ("node_count", "size", "seconds", "fingerprint"):
        item = result[key]
        if item["same"] is None:  # a cached record's seconds: the index lookup's, not the stage's
            shown = [f"{item[side]} (cached)" if item["cached"][side] else str(item[side]) for side in ("a", "b")]
            view.add_row(key, *shown, "not compared")
            continue
        view.add_row(key, str(item["a"]), str(item["b"]), "same" if item["same"] else "[yellow]changed")
    sig = result["signature"]
    view.add_row(
        "signature",
        f"{len((sig['a'] or {}).get('inputs', []))} in / {len((sig['a'] or {}).get('outputs', []))} out",
        f"{len((sig['b'] or {}).get('inputs', []))} in / {len((sig['b'] or {}).get('outputs', []))} out",
        "same" if sig["same"] else "[yellow]changed",
    )
    rc = result["range_constraints"]
    view.add_row(
        "range constraints", json.dumps(rc["a"]), json.dumps(rc["b"]), "same" if rc["same"] else "[yellow]changed"
    )
    v = result["validation"]
    view.add_row("validation max abs err", str(v["a"]), str(v["b"]), "")
    counts = result["op_histogram"]["counts"]
    view.add_row(
        "op histogram", "", "", f"+{counts['added']} ops, -{counts['removed']} ops, {counts['changed']} changed"
    )
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
