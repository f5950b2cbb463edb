"""Terminal rendering of a run document: a per-model table, then each failure in full."""

from __future__ import annotations

from typing import Any, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pt2flow.stages import STAGES

_MARK = {"ok": ("✓", "green"), "cached": ("●", "blue"), "failed": ("✗", "red")}


def _stage_cell(stages: Mapping[str, Any], order: list[str]) -> Text:
    text = Text()
    for stage in order:
        info = stages.get(stage)
        if info is None:
            text.append("·", style="dim")
            continue
        kind = "failed" if info["status"] != "ok" else ("cached" if info.get("cached") else "ok")
        mark, style = _MARK[kind]
        text.append(mark, style=style)
    return text


def _fmt_err(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2e}"


def render_run(document: Mapping[str, Any], console: Console) -> None:
    used = [s for s in STAGES if any(s in m["stages"] for m in document["models"])] or list(STAGES)
    table = Table(title=f"pt2flow run {document['run_id']}", title_justify="left")
    table.add_column("model", style="bold")
    table.add_column("status")
    table.add_column("stages\n" + " ".join(s[:2] for s in used), no_wrap=True)
    table.add_column("validation", justify="right")
    table.add_column("max abs err", justify="right")
    table.add_column("max rel err", justify="right")
    table.add_column("serialized", no_wrap=True)
    table.add_column("seconds", justify="right")
    for model in document["models"]:
        status = Text("ok", style="green") if model["status"] == "ok" else Text(
            f"{model['error_class']} @ {model['failed_stage'] or 'setup'}", style="red"
        )
        if model.get("static_fallback"):
            status.append(" static!", style="yellow")
        validation = model.get("validation") or {}
        verdict = "-" if not validation else ("passed" if validation.get("passed") else "FAILED")
        seconds = sum((s.get("seconds") or 0.0) for s in model["stages"].values())
        serialized = (model["artifacts"].get("serialized") or "-")[:12]
        stage_text = Text(" ").join(_stage_cell(model["stages"], [s]) for s in used)
        table.add_row(
            model["name"],
            status,
            stage_text,
            verdict,
            _fmt_err(validation.get("max_abs_err")),
            _fmt_err(validation.get("max_rel_err")),
            serialized,
            f"{seconds:.1f}",
        )
    console.print(table)
    summary = document["summary"]
    console.print(
        f"[green]{summary['ok']} ok[/green], [red]{summary['failed']} failed[/red] in {summary['seconds']:.1f} s "
        f"(✓ ran, ● cached, ✗ failed) — store {document['store']}"
        + (f", {document['workers']} worker process{'es' if document['workers'] != 1 else ''}" if document.get("workers") else "")
    )
    static = [m["name"] for m in document["models"] if m.get("static_fallback")]
    if static:
        console.print(
            f"[yellow]static! {len(static)} model(s) exported with static shapes: every dynamic-shape strategy failed, "
            f"so the program accepts only the example's sizes ({', '.join(static)}); "
            "set trace: {fallback: {static: false}} to fail instead[/yellow]"
        )
    for model in document["models"]:
        if model["status"] != "ok":
            head = Text(f"✗ {model['name']}", style="red")
            head.append(f" [{model['error_class']}] at {model['failed_stage'] or 'setup'}:")
            console.print(head)
            console.print(Text("    " + str(model["error"]).replace("\n", "\n    ")))
            if model.get("stderr_tail"):
                tail = model["stderr_tail"].strip().splitlines()[-8:]
                console.print(Text("    worker stderr (last lines):\n      " + "\n      ".join(tail), style="dim"))
