"""Reliability tests: crash points, disk full, S3 faults, concurrent writers, task retries.

Prints, at the end of the session, how many crash points were tested, how many faults were
injected and how many index records were lost (the tests fail unless that is 0).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.reliability import stats


@pytest.fixture(scope="session")
def prefect_env(prefect_server: str) -> dict[str, str]:
    """Environment for `pt2flow` subprocesses: the session's Prefect server, so a SIGKILLed
    run leaves no private server behind (and none is started per run)."""
    return {"PREFECT_API_URL": prefect_server}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not (stats.crash_points_tested or stats.faults_injected or stats.records_checked):
        return
    from pt2flow.storage.faults import CRASH_POINTS

    terminalreporter.write_sep("-", "reliability")
    terminalreporter.write_line(
        f"crash points tested: {len(stats.crash_points_tested)} of {len(CRASH_POINTS)} "
        f"({', '.join(p for p in CRASH_POINTS if p in stats.crash_points_tested)})"
    )
    terminalreporter.write_line(f"faults injected: {stats.faults_injected}")
    terminalreporter.write_line(f"index records checked: {stats.records_checked}; records lost: {stats.records_lost}")
