"""Where the trace ladder gave up dynamic shapes, said where the user looks: the run document's
model entries get `trace_strategy` (the ladder rung that exported: configured,
other_strictness, suggested_fixes, static) and `static_fallback` (true when the program was
exported with static shapes although the config asked for dynamic dims)."""

from __future__ import annotations

from typing import Any


def annotate_trace_strategy(document: dict[str, Any], store: Any) -> dict[str, Any]:
    """Add trace_strategy / static_fallback to every model entry of a run document that lacks
    them, from this run's trace records in the index. Adds fields only (a compatible extension
    of the run document); a model whose trace did not succeed gets null / false."""
    import pyarrow.compute as pc

    pending = [m for m in document.get("models", []) if "trace_strategy" not in m]
    if not pending:
        return document
    condition = (pc.field("run_id") == document["run_id"]) & (pc.field("stage") == "trace") & (pc.field("status") == "ok")
    rows = store.index.read(["model", "strategy", "ended_at"], filter=condition).to_pylist()
    strategy: dict[str, str | None] = {}
    for row in sorted(rows, key=lambda r: str(r["ended_at"])):
        strategy[row["model"]] = row["strategy"]
    for model in pending:
        trace = (model.get("stages") or {}).get("trace") or {}
        found = strategy.get(model["name"]) if trace.get("status") == "ok" else None
        model["trace_strategy"] = found
        model["static_fallback"] = found == "static"
    return document
