"""Run leases on every backend, and the retention rule on hand-made index records (the real runs
are in tests/integration/test_retention.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from pt2flow.storage.leases import RunLease, lease_root, live_leases, read_leases
from pt2flow.storage.retention import RetentionRule, plan_retention

NOW = datetime(2026, 6, 1, tzinfo=timezone.utc)


def test_a_lease_is_live_while_held_renewed_and_gone_after(store: Any) -> None:
    with RunLease(store, "run-a", ttl_seconds=1.0, renew_seconds=0.1):
        time.sleep(1.5)  # past one ttl: only the renewals keep it live
        assert [lease.run_id for lease in live_leases(store)] == ["run-a"]
        assert live_leases(store, exclude={"run-a"}) == []
    assert read_leases(store) == []


def test_leases_of_dead_runs_stop_nothing(store: Any) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    old = (NOW - timedelta(hours=1)).isoformat()
    store.fs.makedirs(lease_root(store), exist_ok=True)
    for run_id, body in {
        "killed-here": {"host": socket.gethostname(), "pid": int(dead.stdout), "renewed_at": datetime.now(timezone.utc).isoformat()},
        "lapsed-elsewhere": {"host": "another-host", "pid": 1, "renewed_at": old},
        "live-elsewhere": {"host": "another-host", "pid": 1, "renewed_at": datetime.now(timezone.utc).isoformat()},
    }.items():
        store.fs.pipe_file(f"{lease_root(store)}/{run_id}.json", json.dumps({"run_id": run_id, "ttl_seconds": 600, **body}).encode())
    assert [lease.run_id for lease in live_leases(store)] == ["live-elsewhere"]


def _row(run: str, model: str, stage: str, key: str, parents: list[str], digest: str, days_ago: float, cached: bool = False) -> dict[str, Any]:
    return {"record_id": f"{run}/{model}/{stage}", "run_id": run, "model": model, "stage": stage, "status": "ok", "cached": cached,
            "key": key, "parent_keys": parents, "sha256": digest, "size": 10, "weights_digest": None, "details": None,
            "started_at": NOW - timedelta(days=days_ago), "ended_at": NOW - timedelta(days=days_ago)}


def _fleet() -> list[dict[str, Any]]:
    """m: run r1 (40 days ago) built k1; r2 (20 days ago) built k2; r3 (today) reused k2.
    n: only in r1 (a model dropped from the config since)."""
    return [
        _row("r1", "m", "source", "s1", [], "a" * 64, 40), _row("r1", "m", "trace", "k1", ["s1"], "b" * 64, 40),
        _row("r1", "n", "trace", "n1", [], "e" * 64, 40),
        _row("r2", "m", "source", "s2", [], "c" * 64, 20), _row("r2", "m", "trace", "k2", ["s2"], "d" * 64, 20),
        _row("r3", "m", "source", "s2", [], "c" * 64, 0, cached=True), _row("r3", "m", "trace", "k2", ["s2"], "d" * 64, 0, cached=True),
    ]


@pytest.mark.parametrize(("rule", "kept_runs_of_m", "dropped", "freed"), [
    # r3's cached records keep their builders in r2; r1 goes, n keeps its only run
    (RetentionRule(keep_runs=1), ["r3"], {"r1/m/source", "r1/m/trace"}, {"a" * 64, "b" * 64}),
    (RetentionRule(keep_days=30), ["r3", "r2"], {"r1/m/source", "r1/m/trace", "r1/n/trace"}, {"a" * 64, "b" * 64, "e" * 64}),
    # either rule keeps a run: r1 is within neither 1 day nor the newest 2 of m, but n's newest
    (RetentionRule(keep_runs=2, keep_days=1), ["r3", "r2"], {"r1/m/source", "r1/m/trace"}, {"a" * 64, "b" * 64}),
    (RetentionRule(keep_runs=1, keep_days=50), ["r3", "r2", "r1"], set(), set()),
])
def test_the_rule(rule: RetentionRule, kept_runs_of_m: list[str], dropped: set[str], freed: set[str]) -> None:
    plan = plan_retention(_fleet(), rule, now=NOW)
    assert plan.kept_runs["m"] == kept_runs_of_m
    assert plan.drop == dropped
    assert set(plan.free) == freed


def test_a_rule_must_keep_something() -> None:
    for bad in ({}, {"keep_runs": 0}, {"keep_days": -1}):
        with pytest.raises(ValueError):
            RetentionRule(**bad)
