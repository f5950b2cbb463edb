"""Failure groups (flows/report/failures.py) on the terminal, in Markdown and as an HTML page.
Each view renders the JSON dict of a FailureReport (or its `groups`)."""

from __future__ import annotations

import html
from typing import Any
from collections.abc import Collection, Mapping, Sequence

from pt2flow.flows.report.failures import SUBJECT_CHARS
from pt2flow.flows.report.text import clipped, counted

_STATUS_STYLE = {"new": "bold red", "persisting": "red", "gone": "green"}


def _models(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … {len(names) - limit} more" if len(names) > limit else "")


def _fit(line: str, console: Any) -> str:
    """One line cut to the console's width at a word boundary (the whole message is in --json and --html)."""
    return clipped(line, max(40, int(getattr(console, "width", 160) or 160)))


def shown_subject(subject: str) -> str:
    """A group's subject as the views show it: one cut at SUBJECT_CHARS (mid-word: the signature
    keeps it so) ends at the word before, with `…`."""
    if len(subject) < SUBJECT_CHARS:
        return subject
    space = subject.rfind(" ")
    return (subject[: space + 1] if space > SUBJECT_CHARS // 2 else subject) + "…"


def shown_where(where: Any) -> str:
    """` · WHERE` after a subject, or nothing where the group has no place in code (`-`)."""
    return f" · {where}" if where and where != "-" else ""


def _headline(report: Mapping[str, Any]) -> str:
    s = report["summary"]
    against = f" against {report['against']}" if report.get("against") else ""
    return (
        f"{s['failures']} failed model(s) in {s['groups']} group(s){against}: {s['new']} new, {s['persisting']} persisting, "
        f"{s['gone']} gone"
    )


def render_failures(report: Mapping[str, Any], console: Any) -> None:
    """`pt2flow failures` on the terminal: one block per group, largest first, gone groups last."""
    from rich.text import Text

    console.print(
        Text(
            f"failures of run {report['run_id']}" + (f" in {report['store']}" if report.get("store") else ""),
            style="bold",
        )
    )
    console.print(Text(_headline(report)))
    console.print(Text(f"runs: {report['selection']}", style="dim"))
    for i, group in enumerate(report["groups"], 1):
        console.print()
        render_group(group, console, number=i)


def render_group(group: Mapping[str, Any], console: Any, *, number: int | None = None, verbose: bool = True) -> None:
    from rich.text import Text

    head = Text(f"{number}. " if number is not None else "")
    head.append(f"[{group['status']}] ", style=_STATUS_STYLE.get(group["status"], ""))
    count = group["count"] if group["status"] != "gone" else len(group["models_against"])
    head.append(f"{count} model(s) · {group['error_class']} at {group['stage']}", style="bold")
    head.append(f"  ({group['id']})", style="dim")
    console.print(head)
    console.print(Text(f"   cause:  {shown_subject(group['subject'])}"))
    console.print(
        Text(_fit(f"   where:  {group['where']}" + (f"  ({group['code']})" if group.get("code") else ""), console))
    )
    if group["status"] == "gone":
        console.print(Text(f"   was:    {_models(group['models_against'])}", style="green"))
        return
    console.print(Text(f"   models: {_models(group['models'])}"))
    if not verbose:
        return
    message = [line for line in group["message"].strip().splitlines() if line.strip()]
    for i, line in enumerate(message[:2]):
        console.print(Text(_fit(("   error:  " if i == 0 else "           ") + line.strip(), console), style="dim"))
    if group.get("repro"):
        console.print(Text(f"   repro:  {group['repro']}", style="cyan"))
    elif group.get("repro_note"):
        console.print(Text(f"   repro:  none ({group['repro_note']})", style="dim"))
    draft = group.get("draft_report") or []
    if draft:
        total = sum(d["issues"] for d in draft)
        console.print(
            Text(
                f"   draft_export ({group['representative']['model']}): {total} issue(s), {len(draft)} distinct cause(s)"
            )
        )
        for issue in draft:
            code = f"  `{issue['code']}`" if issue.get("code") and issue["code"] not in issue["where"] else ""
            console.print(
                Text(
                    f"     ×{issue['occurrences']} {shown_subject(issue['subject'])}{shown_where(issue['where'])}{code}",
                    style="dim",
                )
            )


def render_run_groups(
    groups: Sequence[Mapping[str, Any]],
    console: Any,
    command: str | None = None,
    expected: Collection[tuple[str, str]] = (),
) -> None:
    """The run summary's failure groups: one line each with its models (the models' errors follow).
    `command`: the exact `pt2flow failures` command that shows them in full (the run's store).
    `expected`: (model, stage) failures the model does not require (it is partial by its config's
    `require:`); a group of those alone is shown as not required, not as a failure to fix."""
    from rich.text import Text

    live = [g for g in groups if g["status"] != "gone"]
    gone = [g for g in groups if g["status"] == "gone"]
    if not live and not gone:
        return
    optional = [id(g) for g in live if g["models"] and all((model, g["stage"]) in expected for model in g["models"])]
    failures, unneeded = sum(g["count"] for g in live), sum(g["count"] for g in live if id(g) in optional)
    console.print(
        Text(
            f"{counted(failures, 'failure')}{f' ({unneeded} not required)' if unneeded else ''} in {counted(len(live), 'group')} by root cause"
            + (f"; {counted(len(gone), 'group')} of the previous run gone" if gone else "")
            + (f" (in full: {command}):" if command else " (pt2flow failures):"),
            style="bold",
        )
    )
    for g in live:
        if id(g) in optional:
            line = Text(f"  [{g['status']}, not required] ", style="yellow")
        else:
            line = Text(f"  [{g['status']}] ", style=_STATUS_STYLE.get(g["status"], ""))
        line.append(
            f"{g['count']} × {g['error_class']} at {g['stage']}: {shown_subject(g['subject'])}{shown_where(g['where'])}"
        )
        line.append(f" — {_models(g['models'], 6)}", style="dim")
        console.print(line)
    for g in gone:
        console.print(
            Text(
                f"  [gone] {g['error_class']} at {g['stage']}: {shown_subject(g['subject'])}{shown_where(g['where'])} — was {_models(g['models_against'], 6)}",
                style="green",
            )
        )


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def groups_markdown(groups: Sequence[Mapping[str, Any]], *, title: str = "## Failure groups") -> list[str]:
    """Markdown lines: one table row per group (the fleet's Prefect artifact, the drift report)."""
    if not groups:
        return []
    lines = [title, "", "| status | models | class @ stage | cause | where | repro |", "|---|---|---|---|---|---|"]
    for g in groups:
        names = g["models"] if g["status"] != "gone" else g["models_against"]
        repro = f"`{g['repro']}`" if g.get("repro") else "-"
        lines.append(
            f"| {g['status']} | {len(names)}: {_md(_models(names, 8))} | {g['error_class']} @ {g['stage']} | "
            f"{_md(shown_subject(g['subject']))} | `{_md(g['where'])}` | {repro} |"
        )
    return lines + [""]


def failures_html(report: Mapping[str, Any]) -> str:
    """A self-contained HTML page of the groups."""
    e = html.escape
    rows = []
    for g in report["groups"]:
        names = g["models"] if g["status"] != "gone" else g["models_against"]
        draft = "".join(
            f"<li>×{d['occurrences']} {e(shown_subject(d['subject']))} · <code>{e(d['where'])}</code></li>"
            for d in g.get("draft_report") or []
        )
        rows.append(
            f"<tr class='{e(g['status'])}'><td>{e(g['status'])}</td><td>{len(names)}</td><td>{e(g['error_class'])} @ {e(g['stage'])}</td>"
            f"<td>{e(shown_subject(g['subject']))}<br><code>{e(g['where'])}</code></td><td>{e(', '.join(names))}</td>"
            f"<td><pre>{e(g['message'])}</pre>{'<ul>' + draft + '</ul>' if draft else ''}</td>"
            f"<td>{'<code>' + e(g['repro']) + '</code>' if g.get('repro') else e(g.get('repro_note') or '-')}</td></tr>"
        )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>pt2flow failures {e(report["run_id"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}}
tr.new td:first-child{{color:#b00;font-weight:bold}}tr.gone{{color:#080}}pre{{white-space:pre-wrap;max-width:50em;margin:0}}</style></head>
<body><h1>pt2flow failures: run <code>{e(report["run_id"])}</code></h1>
<p>{e(_headline(report))}</p><p><small>runs: {e(report["selection"])}</small></p>
<table><tr><th>status</th><th>models</th><th>class @ stage</th><th>cause · where</th><th>models</th><th>message</th><th>repro</th></tr>
{"".join(rows)}
</table></body></html>
"""
