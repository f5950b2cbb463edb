"""Regression rules: which changes between two runs need a person, and the order views list
models in (regressed first)."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows.report.text import err, format_size, secs

VALIDATION_GROWTH = 10.0  # max abs error grew more than 10x
COST_GROWTH = 1.25  # compile time or artifact size up more than 25 %
# Errors below this are float32 rounding noise: 0 -> 1e-7 is not a 10x regression.
VALIDATION_FLOOR = 1e-6

# rule -> the per-model field a view marks for it
FLAGGED_FIELD = {
    "stopped_exporting": "status",
    "validation_error_grew": "max_abs_err",
    "compile_time_up": "compile_seconds",
    "archive_size_up": "archive_size",
    "package_size_up": "package_size",
    "static_fallback": "status",  # the status cell says "static!"
}

_COST_RULES = (
    ("compile_seconds", "compile_time_up", "compile time", secs),
    ("archive_size", "archive_size_up", "archive size", format_size),
    ("package_size", "package_size_up", "package size", format_size),
)


def regressions(
    comparison: Mapping[str, Any],
    *,
    validation_growth: float = VALIDATION_GROWTH,
    cost_growth: float = COST_GROWTH,
    validation_floor: float = VALIDATION_FLOOR,
) -> list[dict[str, Any]]:
    """The changes that need a person: a model that stopped exporting, a validation error that
    grew more than `validation_growth` times (from at least `validation_floor`), compile time or
    archive/package size up more than `cost_growth` - 1, a model that exported with dynamic dims
    and now falls back to static shapes. Each: {model, rule, a, b, ratio, message}; rule is
    stopped_exporting | validation_error_grew | compile_time_up | archive_size_up |
    package_size_up | static_fallback; message says what happened, without the model's name."""
    found: list[dict[str, Any]] = []

    def flag(model: str, rule: str, a: Any, b: Any, message: str) -> None:
        ratio = (b / a) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
        found.append({"model": model, "rule": rule, "a": a, "b": b, "ratio": ratio, "message": message})

    for entry in comparison.get("models", []):
        name = entry["model"]
        status = entry["status"]
        if status["change"] == "newly_failing":
            after = status["b"]
            flag(
                name,
                "stopped_exporting",
                "ok",
                after["status"],
                f"stopped exporting: fails at {after['failed_stage']} ({after['error_class']})",
            )
        if (
            entry.get("static_fallback", {}).get("changed")
            and entry["static_fallback"]["b"]
            and status["change"] == "ok"
        ):
            flag(
                name,
                "static_fallback",
                "dynamic",
                "static",
                "exported with static shapes: every dynamic strategy failed, so the program takes only the example's sizes",
            )
        error = entry.get("validation", {}).get("max_abs_err", {})
        a, b = error.get("a"), error.get("b")
        if a is not None and b is not None and b > validation_growth * max(a, validation_floor):
            flag(
                name,
                "validation_error_grew",
                a,
                b,
                f"validation max abs error {err(a)} → {err(b)} (more than {validation_growth:g}×)",
            )
        for field, rule, label, fmt in _COST_RULES:
            pair = entry.get(field) or {}
            a, b = pair.get("a"), pair.get("b")
            if a and b is not None and b > cost_growth * a:
                flag(
                    name,
                    rule,
                    a,
                    b,
                    f"{label} {fmt(a)} → {fmt(b)} (+{(b / a - 1) * 100:.0f} %, limit +{(cost_growth - 1) * 100:.0f} %)",
                )
    return found


def row_order(comparison: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Regressed models first, then changed, then the rest; by name within each group."""
    flagged = {r["model"] for r in regressions(comparison)}
    return sorted(comparison["models"], key=lambda m: (m["model"] not in flagged, not m["changes"], m["model"]))


def flagged_fields(found: Sequence[Mapping[str, Any]]) -> dict[str, set[str]]:
    """model -> the fields its regressions concern (views mark those cells)."""
    out: dict[str, set[str]] = {}
    for r in found:
        out.setdefault(r["model"], set()).add(FLAGGED_FIELD[r["rule"]])
    return out
