"""Reliability tests: crash points, disk full, S3 faults, concurrent writers, task retries.

At the end of the session, tests/session.py prints how many crash points were tested, how many
faults were injected and how many index records were lost (the tests fail unless that is 0).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_env(prefect_server: str) -> dict[str, str]:
    """Environment for `pt2flow` subprocesses: the session's Prefect server, so a SIGKILLed
    run leaves no private server behind (and none is started per run)."""
    return {"PREFECT_API_URL": prefect_server}
