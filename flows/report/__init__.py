"""Drift between two runs (`pt2flow report`): what changed for each model, by name, and which
changes are regressions.

Pure functions over the metadata index: no torch, no Prefect. compare_runs() builds one
JSON-ready dict; the terminal table, `--json`, `--html` and the fleet flow's markdown artifact
all render that same dict.

    runs.py      the runs of the index (list, the pair a report compares, resolve a prefix)
    compare.py   comparing two runs model by model -> the comparison dict
    rules.py     regression rules and the order views list models in
    text.py      plain-text pieces every view shares
    markdown.py  Markdown (the fleet flow's Prefect artifact)
    terminal.py  the rich table of `pt2flow report`
    html.py      the self-contained HTML page (templates/report.html.j2)
    plot.py      inline SVG bar charts
"""

from __future__ import annotations

from pt2flow.flows.report.compare import (
    REPORT_VERSION,
    compare_default,
    compare_runs,
    compare_with_previous,
    graph_stages,
    stage_columns,
)
from pt2flow.flows.report.html import PLOT_MODELS, to_html
from pt2flow.flows.report.markdown import to_markdown
from pt2flow.flows.report.rules import COST_GROWTH, VALIDATION_FLOOR, VALIDATION_GROWTH, regressions
from pt2flow.flows.report.runs import NotEnoughRuns, RunSelection, fleet_runs, list_runs, report_pair, resolve_run
from pt2flow.flows.report.terminal import render_terminal

__all__ = [
    "COST_GROWTH",
    "PLOT_MODELS",
    "REPORT_VERSION",
    "VALIDATION_FLOOR",
    "VALIDATION_GROWTH",
    "NotEnoughRuns",
    "RunSelection",
    "compare_default",
    "compare_runs",
    "compare_with_previous",
    "fleet_runs",
    "graph_stages",
    "list_runs",
    "report_pair",
    "regressions",
    "render_terminal",
    "resolve_run",
    "stage_columns",
    "to_html",
    "to_markdown",
]
