"""check-compat's document as a terminal table and as one self-contained HTML page
(templates/compat.html.j2). No torch, no Prefect."""

from __future__ import annotations

import functools
from typing import Any
from collections.abc import Mapping

from pt2flow.flows.report.templating import environment


@functools.lru_cache(maxsize=1)
def _template() -> Any:
    return environment().get_template("compat.html.j2")


def checked_artifacts(model: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(kind, check) of every artifact check-compat checked for a model, in the document's order:
    the archive, the package and each deployment target's (`onnx`, `pte`, `openvino`, and any
    kind a stage module adds): an artifact's check is the entry with `loads`."""
    return [(kind, value) for kind, value in model.items() if isinstance(value, Mapping) and "loads" in value]


def compat_html(doc: Mapping[str, Any]) -> str:
    return str(_template().render(doc=doc, checked_artifacts=checked_artifacts))


def _flag(value: Any) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def render_compat(doc: Mapping[str, Any], console: Any) -> None:
    """A rich table: per model and artifact, loads / runs / matches and the class."""
    from rich.table import Table

    table = Table(
        title=f"run {doc['run_id']}: built with torch {', '.join(doc['built_with']) or '?'}, checked with {doc['torch_version']}",
        title_justify="left",
    )
    for column in ("model", "artifact", "loads", "runs", "matches", "max abs err", "class"):
        table.add_column(column)
    for model in doc["models"]:
        for kind, artifact in checked_artifacts(model):
            err = artifact["max_abs_err"]
            table.add_row(
                model["name"] if len(doc.get("runs") or []) < 2 else f"{model['name']} ({model['run_id']})",
                f"{kind} {artifact['sha256'][:12]}",
                _flag(artifact["loads"]),
                _flag(artifact["runs"]),
                _flag(artifact["matches"]),
                "-" if err is None else f"{err:.3g}",
                artifact["error_class"] or ("not checked" if artifact.get("skipped") else "ok"),
            )
    console.print(table)
    if doc.get("selection"):
        console.print(f"runs: {doc['selection']['reason']}", markup=False, highlight=False)
    for model in doc["models"]:
        for kind, artifact in checked_artifacts(model):
            if artifact.get("error"):
                console.print(
                    f"[bold]{model['name']}[/bold] {kind}: {artifact['error_class']}: {artifact['error']}",
                    markup=True,
                    highlight=False,
                )
            elif artifact.get("skipped"):
                console.print(f"{model['name']} {kind}: {artifact['skipped']}", markup=False, highlight=False)
        if model.get("note"):
            console.print(f"{model['name']}: {model['note']}", markup=False, highlight=False)
    summary = doc["summary"]
    unchecked = f", {summary['unchecked']} not checked here" if summary.get("unchecked") else ""
    console.print(f"{summary['ok']} compatible, {summary['failed']} not{unchecked}", markup=False, highlight=False)
