"""Plain-text pieces of a comparison that every view shows the same way (terminal, Markdown,
HTML): values with units, `before → after`, percentages, a model's status, its signature,
range constraints, op changes, latency, and the torch line."""

from __future__ import annotations

import json
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable, Mapping, Sequence


def decoded(value: Any) -> Any:
    """An index field stored as JSON text, decoded (anything else, or text that is not JSON, as it is)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 model`, `2 models` (`plural` for a noun not made plural by an s: `process` -> `processes`)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def clipped(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a word boundary, with `…` where it was cut."""
    if len(text) <= limit:
        return text
    cut = text[: max(1, limit - 1)]
    space = cut.rfind(" ")
    if space > limit // 2:  # a word boundary not too far back; else the word is cut
        cut = cut[: space + 1]
    return cut + "…"


def secs(value: Any) -> str:
    return "-" if value is None else f"{value:.2f} s"


def err(value: Any) -> str:
    return "-" if value is None else f"{value:.2e}"


def arrow(pair: Mapping[str, Any], fmt: Callable[[Any], str]) -> str:
    """`a → b`, or one value when both runs agree; '-' for a side that has none."""
    a, b = pair.get("a"), pair.get("b")

    def show(value: Any) -> str:
        return "-" if value is None else fmt(value)

    if a == b:
        return show(a)
    return f"{show(a)} → {show(b)}"


def when(iso: Any) -> str:
    """An ISO timestamp as `YYYY-MM-DD HH:MM:SS UTC`; '?' when unknown."""
    if not iso:
        return "?"
    try:
        return datetime.fromisoformat(str(iso)).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return str(iso)


def pct(pair: Mapping[str, Any]) -> str:
    """` (+12 %)` for a changed measurement, else ''."""
    ratio = pair.get("ratio")
    if ratio is None or not pair.get("changed"):
        return ""
    return f" ({(ratio - 1) * 100:+.0f} %)"


def _side(state: Mapping[str, Any] | None) -> str:
    if state is None:
        return "absent"
    if state["status"] == "ok":
        text = "ok (cached)" if state.get("cached") else "ok"
        return text + (" static!" if state.get("static_fallback") else "")
    if state["status"] == "partial":
        return f"partial ({', '.join(f'{kind} ✗' for kind in state.get('failed_artifacts') or [])})"
    return f"failed at {state['failed_stage']} ({state['error_class']})"


def status_text(entry: Mapping[str, Any]) -> str:
    status = entry["status"]
    change = status["change"]
    if change == "ok":
        return _side(status["b"])
    if change == "only_in_a":
        return f"only before ({_side(status['a'])})"
    if change == "only_in_b":
        return f"only after ({_side(status['b'])})"
    label = change.replace("_", " ")
    return f"{label}: {_side(status['a'])} → {_side(status['b'])}"


def signature_text(signature: Any) -> str:
    if not isinstance(signature, Mapping):
        return "-"

    def tensor(item: Mapping[str, Any]) -> str:
        shape = ",".join(str(d) for d in item.get("shape") or [])
        return f"{item.get('dtype', '?')}[{shape}]"

    ins = ", ".join(f"{i.get('name', '?')}: {tensor(i)}" for i in signature.get("inputs") or [])
    outs = ", ".join(tensor(o) for o in signature.get("outputs") or [])
    return f"({ins}) -> ({outs})"


def ranges_text(ranges: Any) -> str:
    if not isinstance(ranges, Mapping) or not ranges:
        return "static" if isinstance(ranges, Mapping) else "-"
    return ", ".join(f"{sym}∈[{lo},{hi}]" for sym, (lo, hi) in sorted(ranges.items()))


def ops_text(entry: Mapping[str, Any], limit: int = 6) -> str:
    hist = entry["graph"]["op_histogram"]
    parts = [f"+{op} ×{n}" for op, n in hist["added"].items()]
    parts += [f"-{op} ×{n}" for op, n in hist["removed"].items()]
    parts += [f"~{op} {x}→{y}" for op, (x, y) in hist["changed"].items()]
    if not parts:
        return "same" if entry["presence"] == "both" and entry["graph"]["stage"]["a"] else "-"
    more = f" (+{len(parts) - limit} more)" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def latency_text(entry: Mapping[str, Any]) -> str:
    """Median latency per runner (benchmark: true), before → after."""
    latency = entry.get("latency_ms") or {}
    parts = [
        f"{name} {arrow(latency[name], lambda v: f'{v:.3f}')}"
        for name in ("eager", "archive", "compiled")
        if name in latency
    ]
    return ", ".join(parts) + " ms" if parts else "-"


def compile_text(entry: Mapping[str, Any]) -> str:
    pair = entry["compile_seconds"]
    text = arrow(pair, secs) + pct(pair)
    if (pair.get("a_cached") and pair.get("a") is None) or (pair.get("b_cached") and pair.get("b") is None):
        text += " (cached, original unknown)"
    elif pair.get("b_cached"):
        text += " (cached)"
    return text


def signature_cell(entry: Mapping[str, Any]) -> str:
    """The signature column: 'changed (below)', 'same', or the one signature known."""
    signature = entry["graph"]["signature"]
    if signature["changed"]:
        return "changed (below)"
    if entry["presence"] == "both" and signature["a"] is not None:
        return "same"
    return signature_text(signature["b"] or signature["a"])


def verdict_text(facts: Mapping[str, Any]) -> str:
    """An artifact's own verdict before and after: `pass`, `FAIL (class)`, `-` where not judged."""

    def show(passed: Any, error_class: Any) -> str:
        if passed is None:
            return "-"
        return "pass" if passed else f"FAIL ({error_class})" if error_class else "FAIL"

    before = show(facts["passed"]["a"], facts["error_class"]["a"])
    after = show(facts["passed"]["b"], facts["error_class"]["b"])
    return after if before == after else f"{before} → {after}"


def artifact_rows(
    comparison: Mapping[str, Any], order: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str, str, str, bool]]:
    """(model, kind, size, verdict, lost) of every artifact kind of every model in `order`: the
    targets' beside the archive and the package; `lost` when the kind passed before and fails now."""
    rows = []
    for entry in order:
        for kind, facts in (entry.get("artifacts") or {}).items():
            lost = facts["passed"]["a"] is True and facts["passed"]["b"] is False
            rows.append(
                (
                    entry["model"],
                    kind,
                    arrow(facts["size"], format_size) + pct(facts["size"]),
                    verdict_text(facts),
                    lost,
                )
            )
    return rows


def torch_line(comparison: Mapping[str, Any]) -> str:
    torch = comparison["torch"]
    if not torch["changed"]:
        return f"torch {torch['b'] or '?'} in both runs"
    verb = {"upgrade": "upgraded", "downgrade": "downgraded"}.get(torch["change"], "changed")
    keyed = comparison["summary"].get("all_keys_changed", 0)
    return (
        f"torch {verb}: {torch['a']} → {torch['b']} — every stage key of {keyed} of "
        f"{comparison['summary']['in_both']} model(s) changed, so every artifact was rebuilt"
    )


def format_size(value: Any) -> str:
    """Bytes as B, KB, MB or GB (powers of 1024); '-' for None."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def op_changes(
    a: Mapping[str, int], b: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, int], dict[str, list[int]]]:
    """Between two op histograms: ops added (count after), removed (count before), and those
    whose count changed ([before, after]), each sorted by op name."""
    added = {op: b[op] for op in sorted(set(b) - set(a))}
    removed = {op: a[op] for op in sorted(set(a) - set(b))}
    changed = {op: [a[op], b[op]] for op in sorted(set(a) & set(b)) if a[op] != b[op]}
    return added, removed, changed
