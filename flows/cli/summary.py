"""Terminal rendering of a run document: a per-model table, then each failure in full."""

from __future__ import annotations

from typing import Any
from collections.abc import Collection, Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pt2flow.flows import pipeline
from pt2flow.flows.report.text import counted

_MARK = {
    "ok": ("✓", "green"),
    "cached": ("●", "blue"),
    "failed": ("✗", "red"),
    "cached failure": ("⊗", "red"),
    "not required": ("○", "yellow"),
}
LEGEND = "✓ ran, ● cached, ✗ failed, ⊗ failed (cached)"
NOT_REQUIRED = "○ failed, not required (partial)"
# the columns a narrow terminal gives up first, one at a time, until the table fits: never the
# model's name, its status or its stages
OPTIONAL_COLUMNS = ("serialized", "max rel err", "seconds", "max abs err", "validation")


def not_required(model: Mapping[str, Any]) -> list[str]:
    """The artifact kinds a partial model failed: by `require:`, none of them is required (a
    required one failing fails the model), so each is an expected refusal, not a failure to fix."""
    return failed_artifacts(model) if model["status"] == "partial" else []


def not_required_stages(model: Mapping[str, Any]) -> set[str]:
    """The stages whose artifact the model does not require and did not get (not_required)."""
    kinds = pipeline.artifact_kinds()
    return {kinds[kind] for kind in not_required(model) if kind in kinds}


def expected_failures(document: Mapping[str, Any]) -> set[tuple[str, str]]:
    """(model or `model/component`, stage) of every failed stage whose artifact its model does not require."""
    found: set[tuple[str, str]] = set()
    for model in document["models"]:
        for stage in not_required_stages(model):
            found.add((model["name"], stage))
            found.update((f"{model['name']}/{name}", stage) for name in model.get("components") or {})
    return found


def _stage_cell(stages: Mapping[str, Any], order: list[str], optional: Collection[str] = ()) -> Text:
    text = Text()
    for stage in order:
        info = stages.get(stage)
        if info is None:
            text.append("·", style="dim")
            continue
        if info["status"] != "ok" and stage in optional:
            kind = "not required"
        elif info["status"] != "ok":
            kind = "cached failure" if info.get("cached") else "failed"
        else:
            kind = "cached" if info.get("cached") else "ok"
        mark, style = _MARK[kind]
        text.append(mark, style=style)
    return text


def _fmt_err(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2e}"


def _cells(model: Mapping[str, Any], used: list[str]) -> dict[str, Any]:
    """A model's row, by column."""
    optional = not_required_stages(model)
    if model["status"] == "ok":
        status = Text("ok", style="green")
    elif model["status"] == "partial":
        status = Text(f"partial: {', '.join(not_required(model))} not required", style="yellow")
    else:
        status = Text(f"{model['error_class']} @ {model['failed_stage'] or 'setup'}", style="red")
    if model.get("static_fallback"):
        status.append(" static!", style="yellow")
    validation = model.get("validation") or {}
    return {
        "model": model["name"],
        "status": status,
        "stages": Text(" ").join(_stage_cell(model["stages"], [s], optional) for s in used),
        "validation": "-"
        if not validation
        else ("passed" if validation.get("passed") else ("partial" if model["status"] == "partial" else "FAILED")),
        "max abs err": _fmt_err(validation.get("max_abs_err")),
        "max rel err": _fmt_err(validation.get("max_rel_err")),
        "serialized": (model["artifacts"].get("serialized") or "-")[:12],
        "seconds": f"{sum((s.get('seconds') or 0.0) for s in model['stages'].values()):.1f}",
    }


def failed_artifacts(model: Mapping[str, Any]) -> list[str]:
    """The artifact kinds whose own verdict failed."""
    verdicts = (model.get("validation") or {}).get("verdicts") or {}
    return [kind for kind, verdict in verdicts.items() if not verdict.get("passed")]


def verdict_matrix(document: Mapping[str, Any]) -> Table | None:
    """Model x artifact: each artifact's own verdict (✓ passed, ✗ failed, · not built); None when
    no model has verdicts."""
    kinds = [
        kind
        for kind in pipeline.document_slots()
        if any(kind in ((m.get("validation") or {}).get("verdicts") or {}) for m in document["models"])
    ]
    if not kinds:
        return None
    optional = any(not_required(m) for m in document["models"])
    table = Table(
        title="validation per artifact (✓ passed, ✗ failed"
        + (", ○ failed, not required" if optional else "")
        + ", · not built)",
        title_justify="left",
    )
    table.add_column("model", style="bold", no_wrap=True)
    for kind in kinds:
        table.add_column(kind, justify="center", no_wrap=True)
    for model in document["models"]:
        verdicts = (model.get("validation") or {}).get("verdicts") or {}
        expected = not_required(model)
        cells = [
            Text("·", style="dim")
            if kind not in verdicts
            else Text("✓", style="green")
            if verdicts[kind].get("passed")
            else Text("○", style="yellow")
            if kind in expected
            else Text("✗", style="red")
            for kind in kinds
        ]
        table.add_row(model["name"], *cells)
    return table


def _table(document: Mapping[str, Any], used: list[str], dropped: tuple[str, ...]) -> Table:
    table = Table(title=f"pt2flow run {document['run_id']}", title_justify="left")
    columns = {
        "model": dict(style="bold", no_wrap=True),
        "status": dict(),
        "stages": dict(header="stages\n" + " ".join(s[:2] for s in used), no_wrap=True),
        "validation": dict(justify="right", no_wrap=True),
        "max abs err": dict(justify="right", no_wrap=True),
        "max rel err": dict(justify="right", no_wrap=True),
        "serialized": dict(no_wrap=True),
        "seconds": dict(justify="right", no_wrap=True),
    }
    shown = [name for name in columns if name not in dropped and (used or name != "stages")]
    for name in shown:
        options = dict(columns[name])
        table.add_column(options.pop("header", name), **options)
    for model in document["models"]:
        cells = _cells(model, used)
        table.add_row(*(cells[name] for name in shown))
        optional = not_required_stages(model)
        for name, component in (model.get("components") or {}).items():  # a generative model's, under it
            cells = _component_cells(name, component, used, optional)
            table.add_row(*(cells.get(column, "") for column in shown))
    return table


def _component_cells(
    name: str, component: Mapping[str, Any], used: list[str], optional: Collection[str] = ()
) -> dict[str, Any]:
    """A generative model's component as a row under its model: its stages, archive and seconds; a
    failed stage whose artifact the model does not require (`optional`) is shown as such."""
    failed = next((s for s, info in component["stages"].items() if info["status"] != "ok"), None)
    if failed is None:
        status = Text("ok", style="green")
    elif failed in optional:
        status = Text(f"{component['stages'][failed].get('error_class')} @ {failed}, not required", style="yellow")
    else:
        status = Text(f"{component['stages'][failed].get('error_class')} @ {failed}", style="red")
    return {
        "model": Text(f"└ {name}", style="dim"),
        "status": status,
        "stages": Text(" ").join(_stage_cell(component["stages"], [s], optional) for s in used),
        "serialized": ((component.get("artifacts") or {}).get("serialized") or "-")[:12],
        "seconds": f"{sum((s.get('seconds') or 0.0) for s in component['stages'].values()):.1f}",
    }


def fitted_table(document: Mapping[str, Any], console: Console, stages: Sequence[str] = ()) -> Table:
    """The summary table with as many columns as fit the console's width (OPTIONAL_COLUMNS go
    first), so that a model's name is never cut. Its stage columns: `stages` (the config's, when
    the caller has them) and every stage a model or component recorded, in pipeline order; none
    when neither names one (every model failed before its first stage)."""
    from rich.measure import Measurement

    used = [
        s
        for s in pipeline.names()
        if s in stages
        or any(
            s in m["stages"] or any(s in c["stages"] for c in (m.get("components") or {}).values())
            for m in document["models"]
        )
    ]
    for n in range(len(OPTIONAL_COLUMNS) + 1):
        table = _table(document, used, OPTIONAL_COLUMNS[:n])
        if Measurement.get(console, console.options.update_width(10_000), table).maximum <= console.width:
            break
    return table


def failures_command(document: Mapping[str, Any], config: str | None = None, store: str | None = None) -> str:
    """The `pt2flow failures` command that reads this run's groups from its store: `--store` when
    the run was given one, else `--config CONFIG` (its store resolved as the run resolved it)."""
    import shlex

    where = (
        f" --store {shlex.quote(str(document['store']))}" if store or not config else f" --config {shlex.quote(config)}"
    )
    return f"pt2flow failures {document['run_id']}{where}"


def render_run(
    document: Mapping[str, Any],
    console: Console,
    *,
    config: str | None = None,
    store: str | None = None,
    stages: Sequence[str] = (),
) -> None:
    """The summary of a run of `config` (`store`: the --store the run was given, if any; `stages`:
    the stages it ran, for the table's columns). A failure the model does not require (it is
    partial, as its `require:` allows) is shown as such (○, yellow), never as a failure to fix;
    the real failures come last."""
    table = fitted_table(document, console, stages)
    console.print(table)
    summary = document["summary"]
    matrix = verdict_matrix(document)
    if matrix is not None and (summary.get("partial") or len(matrix.columns) > 3):
        console.print(matrix)  # beside the archive and the package: the targets, or a partial model
    optional = [m for m in document["models"] if not_required(m)]
    failed_style = "red" if summary["failed"] else "default"
    console.print(
        f"[green]{summary['ok']} ok[/green], "
        + (f"[yellow]{summary['partial']} partial[/yellow], " if summary.get("partial") else "")
        + f"[{failed_style}]{summary['failed']} failed[/{failed_style}] in {summary['seconds']:.1f} s "
        f"({LEGEND}{', ' + NOT_REQUIRED if optional else ''}) — store {document['store']}"
        + (f", {counted(document['workers'], 'worker process', 'worker processes')}" if document.get("workers") else "")
        + (f" under {document['python']}" if document.get("python") else "")
    )
    static = [m["name"] for m in document["models"] if m.get("static_fallback")]
    if static:
        console.print(
            f"[yellow]static! {counted(len(static), 'model')} exported with static shapes: every dynamic-shape strategy failed, "
            f"so the program accepts only the example's sizes ({', '.join(static)}); "
            "set trace: {fallback: {static: false}} to fail instead[/yellow]"
        )
    benchmarked = [m for m in document["models"] if m.get("timings")]
    if benchmarked:
        from pt2flow.flows.report.benchmark import summary_line

        for model in benchmarked:
            console.print(Text(f"⏱ {model['name']}: {summary_line(model['timings'])}"))
    if document.get("failure_groups"):
        from pt2flow.flows.report.failure_views import render_run_groups

        render_run_groups(
            document["failure_groups"],
            console,
            failures_command(document, config, store),
            expected_failures(document),
        )
    for model in optional:  # expected: before the failures, which the summary ends on
        for kind in not_required(model):
            verdict = model["validation"]["verdicts"][kind]
            head = Text(f"○ {model['name']} {kind}", style="yellow")
            head.append(
                f" [{verdict.get('error_class')}]: not required, so {model['name']} is partial as its require: allows; "
                "`get` refuses this artifact:"
            )
            console.print(head)
            console.print(Text("    " + str(verdict.get("error")).replace("\n", "\n    "), style="dim"))
    for model in document["models"]:
        if model["status"] == "failed":
            failed = model["stages"].get(model["failed_stage"] or "") or {}
            head = Text(f"{'⊗' if failed.get('cached') else '✗'} {model['name']}", style="red")
            head.append(f" [{model['error_class']}] at {model['failed_stage'] or 'setup'}")
            head.append(
                " (cached: the same key failed before; --retry-failed runs it again):" if failed.get("cached") else ":"
            )
            console.print(head)
            console.print(Text("    " + str(model["error"]).replace("\n", "\n    ")))
            if model.get("stderr_tail"):
                tail = model["stderr_tail"].strip().splitlines()[-8:]
                console.print(Text("    worker stderr (last lines):\n      " + "\n      ".join(tail), style="dim"))
