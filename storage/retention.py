"""Retention: drop the index records of old runs and free the blobs only they name
(docs/architecture.md §5, "Retention"; `pt2flow gc --keep-runs/--keep-days`, serve's `retention:`).

The rule, per model: the records a model got in its `keep_runs` newest runs, and in every run
that ended within `keep_days`, are kept (both given: a run is kept when it satisfies either).
A model that keeps a run also keeps the newest ok record of every artifact kind (stage) it has,
whichever run made it: the newest runs of a model need not have built every kind (a run of a
config without targets after one with them), and "the last run" still means the newest `.onnx`.
A model none of whose runs the rule keeps (every run older than `keep_days`) keeps nothing.
Then everything a kept record needs is kept too: for every key on the way from a kept record to
its source (its parents' keys, transitively), the record that built it (the newest ok record
that was not a cache hit; a kept run that reused an older record keeps that record alive).
Every other record is dropped; records without a run or a model are kept. A blob is freed when
a dropped record names it (artifact, weights, validate's inputs and outputs, a failure's report)
and no kept record does.

Concurrency (storage/leases.py): nothing is dropped while another run holds a live lease; the
index is rewritten without the dropped records first, the leases are looked at again, and only
then are the blobs deleted, one by one, each after another look at the leases and only once it
is older than the grace period. A run takes its lease before it reads the index, so a run that
could reuse a dropped record or find a freed blob already stored is seen before anything of it
goes. A crash at any point leaves no record naming a deleted blob: records go before blobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, UTC
from typing import Any
from collections.abc import Iterable, Mapping

from pt2flow.storage.faults import crash_point
from pt2flow.storage.leases import LeaseInfo, live_leases

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
COLUMNS = [
    "record_id",
    "run_id",
    "model",
    "stage",
    "status",
    "cached",
    "key",
    "parent_keys",
    "sha256",
    "size",
    "weights_digest",
    "details",
    "started_at",
    "ended_at",
]


@dataclass(frozen=True)
class RetentionRule:
    """What to keep: each model's `keep_runs` newest runs and/or its runs of the last `keep_days`."""

    keep_runs: int | None = None
    keep_days: float | None = None

    def __post_init__(self) -> None:
        if self.keep_runs is None and self.keep_days is None:
            raise ValueError("a retention rule needs keep_runs or keep_days")
        if self.keep_runs is not None and self.keep_runs < 1:
            raise ValueError("keep_runs must be at least 1")
        if self.keep_days is not None and not self.keep_days >= 0:
            raise ValueError("keep_days must be 0 or more")

    def describe(self) -> str:
        parts = []
        if self.keep_runs is not None:
            parts.append(f"the {self.keep_runs} newest run(s) of each model")
        if self.keep_days is not None:
            parts.append(f"runs of the last {self.keep_days:g} day(s)")
        return " or ".join(parts)


def blobs_of(row: Mapping[str, Any]) -> list[tuple[str, int | None, str]]:
    """(digest, recorded size, role) of every blob a record names: its artifact (or a failure's
    report), the source's weights, validate's stored inputs and outputs (details.io)."""
    found: list[tuple[str, int | None, str]] = []
    try:
        details = json.loads(row.get("details") or "{}")
    except ValueError:
        details = {}
    if not isinstance(details, dict):
        details = {}
    if row.get("sha256"):
        found.append((row["sha256"], row.get("size"), "artifact"))
    if row.get("weights_digest"):
        found.append((row["weights_digest"], (details.get("weights") or {}).get("size"), "weights"))
    io = details.get("io")
    if isinstance(io, dict) and io.get("sha256"):
        found.append((io["sha256"], io.get("size"), "validation inputs and outputs"))
    report = details.get("report_sha256")
    if isinstance(report, str) and report and report != row.get("sha256"):
        found.append((report, None, "failure report"))
    return found


@dataclass
class RunSummary:
    run_id: str
    ended_at: datetime | None
    models: list[str] = field(default_factory=list)
    records: int = 0
    blobs: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "ended_at": self.ended_at.isoformat() if self.ended_at else None,
            "models": sorted(self.models),
            "records": self.records,
            "blobs": self.blobs,
            "bytes": self.bytes,
        }


@dataclass
class KindSummary:
    """The records of one model and one stage (artifact kind) that go, and the blobs only they name."""

    model: str
    stage: str
    records: int = 0
    blobs: int = 0
    bytes: int = 0
    runs: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "stage": self.stage,
            "records": self.records,
            "blobs": self.blobs,
            "bytes": self.bytes,
            "runs": self.runs,
        }


@dataclass
class RetentionPlan:
    """What a rule keeps and drops in one reading of the index."""

    rule: RetentionRule
    kept_runs: dict[str, list[str]]  # model -> its kept run ids, newest first
    kept_records: int
    drop: set[str]  # record ids
    dropped_runs: list[RunSummary]  # runs some of whose records go, newest first
    free: dict[str, int]  # digest -> size, the blobs only dropped records name
    kept_newest: dict[str, dict[str, str]] = field(
        default_factory=dict
    )  # model -> stage -> run of its newest artifact of that kind
    dropped_kinds: list[KindSummary] = field(default_factory=list)  # what goes, by model and kind


def _when(row: Mapping[str, Any]) -> datetime:
    value = row.get("ended_at") or row.get("started_at")
    return value if isinstance(value, datetime) else _EPOCH


def plan_retention(
    rows: Iterable[Mapping[str, Any]], rule: RetentionRule, *, now: datetime | None = None
) -> RetentionPlan:
    """Which records and blobs `rule` drops among `rows` (index records with COLUMNS)."""
    rows = list(rows)
    now = now or datetime.now(UTC)
    run_time: dict[str, datetime] = {}
    runs_of: dict[str, set[str]] = {}
    for row in rows:
        run, model = row.get("run_id"), row.get("model")
        if run is None or model is None:
            continue
        run_time[run] = max(run_time.get(run, _EPOCH), _when(row))
        runs_of.setdefault(model, set()).add(run)
    cutoff = now - timedelta(days=rule.keep_days) if rule.keep_days is not None else None
    kept_runs: dict[str, list[str]] = {}
    for model, runs in runs_of.items():
        ordered = sorted(runs, key=lambda r: (run_time[r], r), reverse=True)
        keep = set(ordered[: rule.keep_runs]) if rule.keep_runs is not None else set()
        if cutoff is not None:
            keep |= {r for r in ordered if run_time[r] >= cutoff}
        kept_runs[model] = [r for r in ordered if r in keep]

    def kept_by_rule(row: Mapping[str, Any]) -> bool:
        run, model = row.get("run_id"), row.get("model")
        return run is None or model is None or run in kept_runs.get(model, ())

    kept = {row["record_id"]: row for row in rows if kept_by_rule(row)}
    newest = _newest_of_each_kind(rows, {model for model, runs in kept_runs.items() if runs})
    kept.update({row["record_id"]: row for row in newest.values()})
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("key"):
            by_key.setdefault(row["key"], []).append(row)
    # every key a kept record's lineage passes through, and the record that built each
    pending = [k for row in kept.values() for k in [row.get("key"), *(row.get("parent_keys") or [])] if k]
    needed: set[str] = set()
    while pending:
        key = pending.pop()
        if key in needed:
            continue
        needed.add(key)
        candidates = by_key.get(key, [])
        if not any(r["record_id"] in kept and r.get("status") == "ok" and not r.get("cached") for r in candidates):
            builders = sorted(
                candidates, key=lambda r: (r.get("status") == "ok", not r.get("cached"), _when(r)), reverse=True
            )
            if builders:
                kept[builders[0]["record_id"]] = builders[0]
        for row in candidates:
            if row["record_id"] in kept:
                pending.extend(row.get("parent_keys") or [])

    kept_blobs = {digest for row in kept.values() for digest, _, _ in blobs_of(row)}
    dropped = [row for row in rows if row["record_id"] not in kept]
    free: dict[str, int] = {}
    summaries: dict[str, RunSummary] = {}
    kinds: dict[tuple[str, str], KindSummary] = {}
    for row in dropped:
        summary = summaries.setdefault(row["run_id"], RunSummary(row["run_id"], run_time.get(row["run_id"])))
        kind = kinds.setdefault((row["model"], row["stage"]), KindSummary(row["model"], row["stage"]))
        summary.records += 1
        kind.records += 1
        if row["model"] not in summary.models:
            summary.models.append(row["model"])
        if row["run_id"] not in kind.runs:
            kind.runs.append(row["run_id"])
        for digest, size, _role in blobs_of(row):
            if digest in kept_blobs or digest in free:
                continue
            free[digest] = int(size or 0)
            for counted in (summary, kind):
                counted.blobs += 1
                counted.bytes += int(size or 0)
    ordered_runs = sorted(summaries.values(), key=lambda s: (s.ended_at or _EPOCH, s.run_id), reverse=True)
    return RetentionPlan(
        rule,
        kept_runs,
        len(kept),
        {row["record_id"] for row in dropped},
        ordered_runs,
        free,
        kept_newest=_by_model(newest),
        dropped_kinds=[kinds[k] for k in sorted(kinds)],
    )


def _by_model(newest: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for (model, stage), row in sorted(newest.items()):
        out.setdefault(model, {})[stage] = row["run_id"]
    return out


def _newest_of_each_kind(
    rows: Iterable[Mapping[str, Any]], models: set[str]
) -> dict[tuple[str, str], Mapping[str, Any]]:
    """(model, stage) -> the newest ok record with an artifact of that stage, for `models`."""
    newest: dict[tuple[str, str], Mapping[str, Any]] = {}
    for row in rows:
        model = row.get("model")
        if model not in models or row.get("run_id") is None or row.get("status") != "ok" or not row.get("sha256"):
            continue
        slot = (model, row["stage"])
        held = newest.get(slot)
        if held is None or (_when(row), row["record_id"]) > (_when(held), held["record_id"]):
            newest[slot] = row
    return newest


class Deferred(Exception):
    """Another run holds a live lease: retention must wait."""

    def __init__(self, leases: list[LeaseInfo]) -> None:
        super().__init__(", ".join(lease.run_id for lease in leases))
        self.leases = leases


def _check_leases(store: Any, exclude: frozenset[str]) -> None:
    live = live_leases(store, exclude=exclude)
    if live:
        raise Deferred(live)


def apply_retention(
    store: Any,
    rule: RetentionRule,
    *,
    dry_run: bool,
    grace_seconds: float,
    exclude_runs: Iterable[str] = (),
    now: datetime | None = None,
) -> dict[str, Any]:
    """Plan `rule` on the store's index and (unless dry_run) drop the records and free the blobs,
    as the module says. Returns what went or would go: per run and in total; `deferred` names
    the runs whose live leases stopped it (records dropped and blobs deleted so far stay so)."""
    exclude = frozenset(exclude_runs)
    now = now or datetime.now(UTC)
    rows = store.index.read(COLUMNS).to_pylist()
    plan = plan_retention(rows, rule, now=now)
    result: dict[str, Any] = {
        "rule": {"keep_runs": rule.keep_runs, "keep_days": rule.keep_days},
        "kept_runs": {model: runs for model, runs in sorted(plan.kept_runs.items())},
        "kept_records": plan.kept_records,
        "kept_newest": plan.kept_newest,
        "dropped_runs": [s.as_dict() for s in plan.dropped_runs],
        "dropped_kinds": [k.as_dict() for k in plan.dropped_kinds],
        "records": len(plan.drop),
        "records_dropped": 0,
        "blobs": sorted(plan.free),
        "bytes": sum(plan.free.values()),
        "deleted": [],
        "deleted_bytes": 0,
        "kept_within_grace": [],
        "deferred": [],
        "dry_run": dry_run,
    }
    if dry_run or not (plan.drop or plan.free):
        return result
    try:
        _check_leases(store, exclude)
        store.index.compact(drop=plan.drop)
        result["records_dropped"] = len(plan.drop)
        crash_point("retention_after_index")
        _check_leases(store, exclude)
        # records appended since the plan (a run of an older pt2flow that takes no lease) keep theirs
        now_named = {d for row in store.index.read(COLUMNS).to_pylist() for d, _, _ in blobs_of(row)}
        cutoff = datetime.now(UTC) - timedelta(seconds=grace_seconds)
        present = {blob.digest: blob for blob in store.list_blobs()}
        for digest in sorted(plan.free):
            blob = present.get(digest)
            if blob is None or digest in now_named:
                continue
            if blob.modified is None or blob.modified > cutoff:
                result["kept_within_grace"].append(digest)
                continue
            _check_leases(store, exclude)
            if result["deleted"]:
                crash_point("mid_retention")
            store.delete_blob(digest)
            result["deleted"].append(digest)
            result["deleted_bytes"] += blob.size
    except Deferred as stop:
        result["deferred"] = [lease.run_id for lease in stop.leases]
    return result
