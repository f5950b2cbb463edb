"""A comparison as a rich table on the terminal (`pt2flow report` without --json)."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from pt2flow.flows.report.rules import flagged_fields, regressions, row_order
from pt2flow.flows.report.text import (
    arrow,
    artifact_rows,
    compile_text,
    err,
    format_size,
    latency_text,
    ops_text,
    pct,
    status_text,
    torch_line,
    when,
)

_COLUMNS = (
    ("model", "left"),
    ("status", "left"),
    ("changes", "left"),
    ("nodes", "right"),
    ("ops after decompose", "left"),
    ("archive", "right"),
    ("package", "right"),
    ("compile", "right"),
    ("max abs err", "right"),
    ("latency", "left"),
)
_STATUS_STYLE = {
    "newly_failing": "bold red",
    "still_failing": "red",
    "newly_passing": "green",
    "only_in_a": "dim",
    "only_in_b": "cyan",
}


def render_terminal(comparison: Mapping[str, Any], console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    runs = comparison["runs"]
    found = regressions(comparison)
    flagged = flagged_fields(found)
    console.print(
        f"[bold]drift[/bold] {runs['a']['run_id']} ({when(runs['a']['started_at'])}) → {runs['b']['run_id']} ({when(runs['b']['started_at'])})",
        highlight=False,
    )
    if comparison.get("selection"):
        console.print(Text(f"runs: {comparison['selection']['reason']}", style="dim"))
    console.print(Text(torch_line(comparison), style="bold yellow" if comparison["torch"]["changed"] else ""))
    view = Table(title_justify="left")
    for column, justify in _COLUMNS:
        view.add_column(column, justify=justify)  # type: ignore[arg-type]
    order = row_order(comparison)
    for entry in order:
        view.add_row(*_row(entry, flagged.get(entry["model"], set())))
    console.print(view)
    rows = artifact_rows(comparison, order)
    if rows:  # every artifact kind, the targets' too: its size and its own verdict
        kinds = Table(title="artifacts", title_justify="left")
        for column, justify in (("model", "left"), ("artifact", "left"), ("size", "right"), ("verdict", "left")):
            kinds.add_column(column, justify=justify)  # type: ignore[arg-type]
        for model, kind, size, verdict, lost in rows:
            kinds.add_row(model, kind, size, Text(verdict, style="bold red" if lost else ""))
        console.print(kinds)
    if found:
        console.print(f"[bold red]{len(found)} regression(s):[/bold red]")
        for r in found:
            console.print(Text(f"  ✗ {r['model']}: {r['message']}", style="red"))
    else:
        console.print("[green]no regressions[/green]")
    if comparison.get("failure_groups"):
        from pt2flow.flows.report.failure_views import render_run_groups

        render_run_groups(comparison["failure_groups"], console)


def _row(entry: Mapping[str, Any], marks: set[str]) -> list[Any]:
    from rich.text import Text

    def cell(field: str, text: str) -> Text:
        return Text(text, style="bold red" if field in marks else "")

    return [
        Text(entry["model"], style="bold red" if marks else "bold"),
        Text(status_text(entry), style=_STATUS_STYLE.get(entry["status"]["change"], "")),
        Text(", ".join(entry["changes"]) or "-", style="yellow" if entry["changes"] else "dim"),
        arrow(entry["graph"]["node_count"], str),
        Text(ops_text(entry, limit=3)),
        cell("archive_size", arrow(entry["archive_size"], format_size) + pct(entry["archive_size"])),
        cell("package_size", arrow(entry["package_size"], format_size) + pct(entry["package_size"])),
        cell("compile_seconds", compile_text(entry)),
        cell("max_abs_err", arrow(entry["validation"]["max_abs_err"], err)),
        latency_text(entry),
    ]
