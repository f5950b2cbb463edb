"""A comparison as Markdown: the fleet flow publishes it as a Prefect artifact."""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping, Sequence

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
    ranges_text,
    signature_text,
    status_text,
    torch_line,
    when,
)

_TABLE_HEAD = [
    "| model | status | changes | nodes | ops after decompose | archive | package | compile time | max abs err | latency |",
    "|---|---|---|---:|---|---:|---:|---:|---:|---|",
]


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(comparison: Mapping[str, Any], *, max_rows: int = 200) -> str:
    """A Markdown summary: runs, torch versions, regressions, a per-model table (regressed and
    changed models first, at most `max_rows`), op changes, models in only one run."""
    found = regressions(comparison)
    lines = _header(comparison)
    if found:
        lines += [f"## ⚠️ {len(found)} regression(s)", ""]
        lines += [f"- **{_md(r['model'])}**: {_md(r['message'])} (`{r['rule']}`)" for r in found]
    else:
        lines += ["## No regressions"]
    if comparison.get("failure_groups"):
        from pt2flow.flows.report.failure_views import groups_markdown

        lines += [
            "",
            *groups_markdown(comparison["failure_groups"], title="## Failure groups (run after, by root cause)"),
        ]
    lines += ["", "## Models", "", *_TABLE_HEAD]
    flagged = flagged_fields(found)
    rows = row_order(comparison)
    lines += [_table_row(entry, flagged.get(entry["model"], set())) for entry in rows[:max_rows]]
    if len(rows) > max_rows:
        lines.append(f"\n… {len(rows) - max_rows} more model(s) not shown (`pt2flow report --html` shows all).")
    kinds = artifact_rows(comparison, rows[:max_rows])
    if kinds:  # every artifact kind, the targets' too: its size and its own verdict
        lines += ["", "## Artifacts", "", "| model | artifact | size | verdict |", "|---|---|---:|---|"]
        lines += [
            f"| `{_md(model)}` | {kind} | {_md(size)} | {('**' + _md(verdict) + '** ⚠️') if lost else _md(verdict)} |"
            for model, kind, size, verdict, lost in kinds
        ]
    lines += _graph_and_source_changes(rows, max_rows)
    return "\n".join(lines) + "\n"


def _header(comparison: Mapping[str, Any]) -> list[str]:
    runs, summary = comparison["runs"], comparison["summary"]

    def run_line(label: str, run: Mapping[str, Any]) -> str:
        return (
            f"- {label}: `{run['run_id']}` ({when(run['started_at'])}, torch {', '.join(run['torch_versions']) or '?'}): "
            f"{run['ok']} ok, {run['failed']} failed"
        )

    return [
        f"# pt2flow drift report: `{runs['a']['run_id']}` → `{runs['b']['run_id']}`",
        "",
        run_line("before", runs["a"]),
        run_line("after", runs["b"]),
        *([f"- runs: {_md(comparison['selection']['reason'])}"] if comparison.get("selection") else []),
        f"- {torch_line(comparison)}",
        f"- {summary['models']} model(s): {summary['changed']} changed, {summary['unchanged']} unchanged, "
        f"{summary['newly_failing']} newly failing, {summary['newly_passing']} newly passing, "
        f"{summary['only_in_a']} only before, {summary['only_in_b']} only after",
        "",
    ]


def _table_row(entry: Mapping[str, Any], marks: set[str]) -> str:
    def cell(field: str, text: str) -> str:
        return f"**{_md(text)}** ⚠️" if field in marks else _md(text)

    cells = [
        ("⚠️ " if marks else "") + f"`{_md(entry['model'])}`",
        cell("status", status_text(entry)),
        _md(", ".join(entry["changes"]) or "-"),
        _md(arrow(entry["graph"]["node_count"], str)),
        _md(ops_text(entry)),
        cell("archive_size", arrow(entry["archive_size"], format_size) + pct(entry["archive_size"])),
        cell("package_size", arrow(entry["package_size"], format_size) + pct(entry["package_size"])),
        cell("compile_seconds", compile_text(entry)),
        cell("max_abs_err", arrow(entry["validation"]["max_abs_err"], err)),
        _md(latency_text(entry)),
    ]
    return "| " + " | ".join(cells) + " |"


def _graph_and_source_changes(rows: Sequence[Mapping[str, Any]], max_rows: int) -> list[str]:
    details = [
        m
        for m in rows
        if m["presence"] == "both"
        and (
            m["graph"]["signature"]["changed"]
            or m["graph"]["range_constraints"]["changed"]
            or m["source"]["kwargs"]["changed"]
        )
    ]
    if not details:
        return []
    lines = ["", "## Graph and source changes", ""]
    for entry in details[:max_rows]:
        graph, source, name = entry["graph"], entry["source"], entry["model"]
        if source["kwargs"]["changed"]:
            lines.append(
                f"- `{name}` kwargs: `{json.dumps(source['kwargs']['a'])}` → `{json.dumps(source['kwargs']['b'])}`"
            )
        if graph["signature"]["changed"]:
            lines.append(
                f"- `{name}` signature: `{_md(signature_text(graph['signature']['a']))}` → `{_md(signature_text(graph['signature']['b']))}`"
            )
        if graph["range_constraints"]["changed"]:
            lines.append(
                f"- `{name}` range constraints: {_md(ranges_text(graph['range_constraints']['a']))} → {_md(ranges_text(graph['range_constraints']['b']))}"
            )
    return lines
