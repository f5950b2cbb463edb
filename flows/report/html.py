"""A comparison as one self-contained HTML page (`pt2flow report --html`), rendered from
templates/report.html.j2: inline CSS and SVG plots, no scripts, nothing fetched."""

from __future__ import annotations

import functools
import json
import re
from html import escape
from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows import pipeline
from pt2flow.flows.report.compare import REPORT_VERSION
from pt2flow.flows.report.plot import Row, bar_chart
from pt2flow.flows.report.rules import COST_GROWTH, VALIDATION_GROWTH, flagged_fields, regressions, row_order
from pt2flow.flows.report.templating import environment
from pt2flow.flows.report.text import (
    artifact_rows,
    counted,
    format_size,
    arrow,
    compile_text,
    err,
    latency_text,
    ops_text,
    pct,
    ranges_text,
    secs,
    signature_cell,
    signature_text,
    status_text,
    torch_line,
    when,
)

PLOT_MODELS = 40  # bars per plot; a fleet shows the models that changed most

_HEADINGS = (
    "model",
    "status",
    "artifacts",
    "changes",
    "nodes",
    "ops after decompose",
    "signature",
    "range constraints",
    "archive",
    "package",
    "compile time",
    "max abs err",
    "latency",
)
# (field, its regression rule, caption, value format)
_PLOTS = (
    ("compile_seconds", "compile_time_up", "AOTInductor compile time per model", secs),
    ("archive_size", "archive_size_up", "Serialized archive (.pt2) size per model", format_size),
    ("package_size", "package_size_up", "AOTInductor package size per model", format_size),
)


def anchor(name: str) -> str:
    """The id of a model's row, for links from the regression list."""
    return "model-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _source_value(field: str, value: Any) -> str:
    return json.dumps(value, sort_keys=True) if field == "kwargs" else (str(value)[:16] if value else "none")


def _escape(value: Any) -> Any:
    """Every {{ value }} is escaped as html.escape does (`&quot;`, `&#x27;`), so the page reads
    exactly as before the template; markup (a macro's output, an SVG plot) passes as it is."""
    from markupsafe import Markup

    return value if isinstance(value, Markup) else Markup(escape(str(value), quote=True))


def _joined(items: Sequence[Any]) -> str:
    return ", ".join(str(item) for item in items)


@functools.lru_cache(maxsize=1)
def _template() -> Any:
    env = environment(finalize=_escape)
    env.globals.update(
        anchor=anchor,
        status_text=status_text,
        signature_text=signature_text,
        ranges_text=ranges_text,
        source_value=_source_value,
        joined=_joined,
    )
    return env.get_template("report.html.j2")


def to_html(comparison: Mapping[str, Any], *, plot_models: int = PLOT_MODELS) -> str:
    """One self-contained HTML page: runs, torch versions, regressions, a per-model table,
    SVG plots of compile time and sizes per model (before vs after), op changes per model."""
    from markupsafe import Markup

    runs = comparison["runs"]
    found = regressions(comparison)
    ordered = row_order(comparison)
    flagged = flagged_fields(found)
    plots = []
    for field, rule, label, unit in _PLOTS:
        rows, note = _plot_rows(comparison, field, rule, found, plot_models)
        plots.append(Markup(bar_chart(label, unit, rows, note=note, binary=unit is format_size)))
    return str(
        _template().render(
            title=f"pt2flow drift report: {runs['a']['run_id']} → {runs['b']['run_id']}",
            runs=[_run(runs[side], label) for side, label in (("a", "before"), ("b", "after"))],
            selection=(comparison.get("selection") or {}).get("reason"),
            failure_groups=comparison.get("failure_groups") or [],
            torch_changed=comparison["torch"]["changed"],
            torch_line=torch_line(comparison),
            chips=_chips(comparison["summary"], found),
            regressions=found,
            headings=_HEADINGS,
            rows=[_model_row(entry, flagged.get(entry["model"], set())) for entry in ordered],
            artifacts=[
                {"model": m, "kind": k, "size": size, "verdict": verdict, "lost": lost}
                for m, k, size, verdict, lost in artifact_rows(comparison, ordered)
            ],
            plots=plots,
            benchmarks=_benchmarks(ordered),
            detailed=[m for m in ordered if m["presence"] == "both" and m["changes"]],
            only=[
                {"label": label, "models": comparison["only_in_" + side]}
                for side, label in (("a", "before"), ("b", "after"))
                if comparison["only_in_" + side]
            ],
            version=comparison.get("report_version", REPORT_VERSION),
            validation_growth=f"{VALIDATION_GROWTH:g}",
            cost_growth_pct=f"{(COST_GROWTH - 1) * 100:.0f}",
        )
    )


def _benchmarks(models: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per model the after run benchmarked: its recommendation and its latency-vs-size plot."""
    from markupsafe import Markup

    from pt2flow.flows.report.benchmark import plot, summary_line

    return [
        {
            "model": m["model"],
            "line": summary_line(m["timings"]),
            "plot": Markup(plot(m["timings"], f"{m['model']}: p50 latency by size")),
        }
        for m in models
        if m.get("timings")
    ]


def _run(run: Mapping[str, Any], label: str) -> dict[str, Any]:
    return {
        "label": label,
        "run_id": run["run_id"],
        "started": when(run["started_at"]),
        "torch": ", ".join(run["torch_versions"]) or "?",
        "ok": run["ok"],
        "failed": run["failed"],
    }


def _chips(summary: Mapping[str, Any], found: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    chips = [
        (counted(summary["models"], "model"), ""),
        (f"{summary['changed']} changed", ""),
        (f"{summary['unchanged']} unchanged", ""),
        (f"{summary['newly_failing']} newly failing", "bad" if summary["newly_failing"] else ""),
        (f"{summary['newly_passing']} newly passing", "good" if summary["newly_passing"] else ""),
        (f"{summary['only_in_a']} only before", ""),
        (f"{summary['only_in_b']} only after", ""),
        (f"{len(found)} regressions", "bad" if found else "good"),
    ]
    return [{"text": text, "css": css} for text, css in chips]


def _cell(text: str, *, num: bool = False, bad: bool = False) -> dict[str, str]:
    return {"text": text, "classes": " ".join(c for c in ("num" if num else "", "bad" if bad else "") if c)}


def _model_row(entry: Mapping[str, Any], marks: set[str]) -> dict[str, Any]:
    graph, after = entry["graph"], entry["status"]["b"] or {}
    return {
        "model": entry["model"],
        "css": "regressed" if marks else ("changed" if entry["changes"] else ""),
        "status": status_text(entry),
        "status_css": "bad"
        if "status" in marks
        else ("failed" if after.get("status") in ("failed", "partial") else "ok"),
        "status_title": after.get("error") or "",
        "cells": [
            _cell(verdicts_text(after), bad=bool(after.get("failed_artifacts"))),
            _cell(", ".join(entry["changes"]) or "-"),
            _cell(arrow(graph["node_count"], str), num=True),
            _cell(ops_text(entry)),
            _cell(signature_cell(entry)),
            _cell(arrow(graph["range_constraints"], ranges_text)),
            _cell(
                arrow(entry["archive_size"], format_size) + pct(entry["archive_size"]),
                num=True,
                bad="archive_size" in marks,
            ),
            _cell(
                arrow(entry["package_size"], format_size) + pct(entry["package_size"]),
                num=True,
                bad="package_size" in marks,
            ),
            _cell(compile_text(entry), num=True, bad="compile_seconds" in marks),
            _cell(arrow(entry["validation"]["max_abs_err"], err), num=True, bad="max_abs_err" in marks),
            _cell(latency_text(entry)),
        ],
    }


def verdicts_text(state: Mapping[str, Any]) -> str:
    """Each artifact's own validation verdict in the later run: `serialized ✓ onnx ✓ pte ✗`."""
    verdicts = state.get("verdicts") or {}
    order = [
        *pipeline.document_slots(),
        *sorted(verdicts),
    ]  # the pipeline's order; a kind it lacks (another pt2flow's) last
    return (
        " ".join(f"{kind} {'✓' if verdicts[kind] else '✗'}" for kind in dict.fromkeys(order) if kind in verdicts) or "-"
    )


def _plot_rows(
    comparison: Mapping[str, Any], field: str, rule: str, found: Sequence[Mapping[str, Any]], limit: int
) -> tuple[list[Row], str]:
    """(model, before, after, regressed) for one plot; a fleet keeps the `limit` that moved most."""
    bad = {r["model"] for r in found if r["rule"] == rule}
    rows = [
        (m["model"], m[field]["a"], m[field]["b"], m["model"] in bad)
        for m in comparison["models"]
        if m[field]["a"] is not None or m[field]["b"] is not None
    ]
    if len(rows) <= limit:
        return rows, ""

    def movement(row: Row) -> float:
        a, b = row[1], row[2]
        return float("inf") if a is None or b is None or not a else abs(b / a - 1)

    keep = {r[0] for r in sorted(rows, key=lambda r: (not r[3], -movement(r), r[0]))[:limit]}
    return [r for r in rows if r[0] in keep], f"the {limit} of {len(rows)} models that moved most"
