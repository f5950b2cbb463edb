"""Run leases on every backend, and the retention rule on hand-made index records (the real runs
are in tests/integration/test_retention.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, UTC
from typing import Any

import pytest

from pt2flow.storage.leases import RunLease, lease_root, live_leases, read_leases
from pt2flow.storage.retention import RetentionRule, plan_retention

NOW = datetime(2026, 6, 1, tzinfo=UTC)


def test_a_lease_is_live_while_held_renewed_and_gone_after(store: Any) -> None:
    with RunLease(store, "run-a", ttl_seconds=1.0, renew_seconds=0.1):
        time.sleep(1.5)  # past one ttl: only the renewals keep it live
        assert [lease.run_id for lease in live_leases(store)] == ["run-a"]
        assert live_leases(store, exclude={"run-a"}) == []
    assert read_leases(store) == []


def test_leases_of_dead_runs_stop_nothing(store: Any) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    old = (NOW - timedelta(hours=1)).isoformat()
    store.fs.makedirs(lease_root(store), exist_ok=True)
    for run_id, body in {
        "killed-here": {
            "host": socket.gethostname(),
            "pid": int(dead.stdout),
            "renewed_at": datetime.now(UTC).isoformat(),
        },
        "lapsed-elsewhere": {"host": "another-host", "pid": 1, "renewed_at": old},
        "live-elsewhere": {"host": "another-host", "pid": 1, "renewed_at": datetime.now(UTC).isoformat()},
    }.items():
        store.fs.pipe_file(
            f"{lease_root(store)}/{run_id}.json", json.dumps({"run_id": run_id, "ttl_seconds": 600, **body}).encode()
        )
    assert [lease.run_id for lease in live_leases(store)] == ["live-elsewhere"]


def _row(
    run: str, model: str, stage: str, key: str, parents: list[str], digest: str, days_ago: float, cached: bool = False
) -> dict[str, Any]:
    return {
        "record_id": f"{run}/{model}/{stage}",
        "run_id": run,
        "model": model,
        "stage": stage,
        "status": "ok",
        "cached": cached,
        "key": key,
        "parent_keys": parents,
        "sha256": digest,
        "size": 10,
        "weights_digest": None,
        "details": None,
        "started_at": NOW - timedelta(days=days_ago),
        "ended_at": NOW - timedelta(days=days_ago),
    }


def _fleet() -> list[dict[str, Any]]:
    """m: run r1 (40 days ago) built k1; r2 (20 days ago) built k2; r3 (today) reused k2.
    n: only in r1 (a model dropped from the config since)."""
    return [
        _row("r1", "m", "source", "s1", [], "a" * 64, 40),
        _row("r1", "m", "trace", "k1", ["s1"], "b" * 64, 40),
        _row("r1", "n", "trace", "n1", [], "e" * 64, 40),
        _row("r2", "m", "source", "s2", [], "c" * 64, 20),
        _row("r2", "m", "trace", "k2", ["s2"], "d" * 64, 20),
        _row("r3", "m", "source", "s2", [], "c" * 64, 0, cached=True),
        _row("r3", "m", "trace", "k2", ["s2"], "d" * 64, 0, cached=True),
    ]


@pytest.mark.parametrize(
    ("rule", "kept_runs_of_m", "dropped", "freed"),
    [
        # r3's cached records keep their builders in r2; r1 goes, n keeps its only run
        (RetentionRule(keep_runs=1), ["r3"], {"r1/m/source", "r1/m/trace"}, {"a" * 64, "b" * 64}),
        (
            RetentionRule(keep_days=30),
            ["r3", "r2"],
            {"r1/m/source", "r1/m/trace", "r1/n/trace"},
            {"a" * 64, "b" * 64, "e" * 64},
        ),
        # either rule keeps a run: r1 is within neither 1 day nor the newest 2 of m, but n's newest
        (RetentionRule(keep_runs=2, keep_days=1), ["r3", "r2"], {"r1/m/source", "r1/m/trace"}, {"a" * 64, "b" * 64}),
        (RetentionRule(keep_runs=1, keep_days=50), ["r3", "r2", "r1"], set(), set()),
    ],
)
def test_the_rule(rule: RetentionRule, kept_runs_of_m: list[str], dropped: set[str], freed: set[str]) -> None:
    plan = plan_retention(_fleet(), rule, now=NOW)
    assert plan.kept_runs["m"] == kept_runs_of_m
    assert plan.drop == dropped
    assert set(plan.free) == freed


def test_a_rule_must_keep_something() -> None:
    for bad in ({}, {"keep_runs": 0}, {"keep_days": -1}):
        with pytest.raises(ValueError):
            RetentionRule(**bad)


def _targets_then_plain_runs() -> list[dict[str, Any]]:
    """m as `make demo` then the README leaves it: r1 builds (source s1, trace k1, serialize k2);
    r2, a targets run, reuses them and builds onnx (k3 on k1); r3 and r4 run without targets (all
    cached). n was built by r1 alone, 40 days ago, and never run since."""
    return [
        _row("r1", "m", "source", "s1", [], "a" * 64, 40),
        _row("r1", "m", "trace", "k1", ["s1"], "b" * 64, 40),
        _row("r1", "m", "serialize", "k2", ["k1"], "c" * 64, 40),
        _row("r1", "n", "source", "n0", [], "7" * 64, 40),
        _row("r1", "n", "onnx", "n1", ["n0"], "8" * 64, 40),
        _row("r2", "m", "source", "s1", [], "a" * 64, 30, cached=True),
        _row("r2", "m", "trace", "k1", ["s1"], "b" * 64, 30, cached=True),
        _row("r2", "m", "onnx", "k3", ["k1"], "d" * 64, 30),
        *(
            _row(run, "m", stage, key, parents, digest, days, cached=True)
            for run, days in (("r3", 2), ("r4", 1))
            for stage, key, parents, digest in (
                ("source", "s1", [], "a" * 64),
                ("trace", "k1", ["s1"], "b" * 64),
                ("serialize", "k2", ["k1"], "c" * 64),
            )
        ),
    ]


def test_the_newest_artifact_of_every_kind_stays_with_its_lineage() -> None:
    """keep_runs 1 keeps r4 (all cached: r1's builders stay) and also r2's onnx, the only one m
    has, with what its lineage needs; r2's and r3's cached records go, and nothing is freed.
    With keep_days alone, n (no run within the days) keeps nothing, its onnx included."""
    plan = plan_retention(_targets_then_plain_runs(), RetentionRule(keep_runs=1), now=NOW)
    assert plan.kept_runs["m"] == ["r4"]
    assert plan.drop == {"r2/m/source", "r2/m/trace", "r3/m/source", "r3/m/trace", "r3/m/serialize"}
    assert plan.free == {}
    assert plan.kept_newest["m"] == {"source": "r4", "trace": "r4", "serialize": "r4", "onnx": "r2"}
    by_kind = {(k.model, k.stage): (k.records, sorted(k.runs)) for k in plan.dropped_kinds}
    assert by_kind == {
        ("m", "source"): (2, ["r2", "r3"]),
        ("m", "trace"): (2, ["r2", "r3"]),
        ("m", "serialize"): (1, ["r3"]),
    }

    plan = plan_retention(_targets_then_plain_runs(), RetentionRule(keep_days=10), now=NOW)
    assert "r1/m/trace" not in plan.drop and "r2/m/onnx" not in plan.drop  # m keeps r3, r4 and its newest onnx
    assert {"r1/n/source", "r1/n/onnx"} <= plan.drop and set(plan.free) == {"7" * 64, "8" * 64}
    assert [(k.model, k.stage, k.blobs, k.bytes) for k in plan.dropped_kinds if k.model == "n"] == [
        ("n", "onnx", 1, 10),
        ("n", "source", 1, 10),
    ]
