"""Figures the reliability tests collect for the session summary (printed by tests/session.py,
gathered from every pytest-xdist worker)."""

from __future__ import annotations

from typing import Any

crash_points_tested: set[str] = set()
faults_injected: int = 0
records_checked: int = 0
records_lost: int = 0


def add_faults(count: int) -> None:
    global faults_injected
    faults_injected += count


def add_records(checked: int, lost: int) -> None:
    global records_checked, records_lost
    records_checked += checked
    records_lost += lost


def as_json() -> dict[str, Any]:
    return {
        "crash_points": sorted(crash_points_tested),
        "faults": faults_injected,
        "checked": records_checked,
        "lost": records_lost,
    }


def merge(figures: dict[str, Any]) -> None:
    """Add another process' figures (an xdist worker's as_json) to these."""
    crash_points_tested.update(figures["crash_points"])
    add_faults(figures["faults"])
    add_records(figures["checked"], figures["lost"])
