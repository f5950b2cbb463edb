"""Figures the reliability tests collect for the session summary (printed by conftest.py)."""

from __future__ import annotations

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
