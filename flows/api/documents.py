"""The shapes of what the Python API returns as dicts (Store's records and reports, verify, gc):
TypedDicts, so a type checker knows their keys while callers keep indexing them
(`record["sha256"]`) and `--json` keeps dumping them as they are. Documents with a model of
their own (RunDocument, UpgradeReport, DriftReport) are returned as those."""

from __future__ import annotations

from typing import Any, TypedDict


class Record(TypedDict, total=False):
    """An index record as the queries give it (storage/records.py IndexRecord, decoded by
    storage.lineage.decode: JSON columns parsed, timestamps as ISO strings). Every key is
    optional: `ls(columns=...)` gives only those asked for. `show` adds `recorded_in_runs` and,
    for a validate record, `report`; `get` adds `path`."""

    schema_version: int
    record_id: str
    run_id: str | None
    model: str | None
    stage: str | None
    status: str | None
    cached: bool | None
    key: str | None
    parent_keys: list[str] | None
    sha256: str | None
    size: int | None
    uri: str | None
    fingerprint: str | None
    op_histogram: dict[str, int] | None
    node_count: int | None
    signature: Any
    range_constraints: dict[str, Any] | None
    validation: dict[str, Any] | None
    passed: bool | None
    max_abs_err: float | None
    max_rel_err: float | None
    error_class: str | None  # as stored: a class of stages/vocabulary.py ErrorClass, by value
    error_message: str | None
    strategy: str | None
    options: dict[str, Any] | None
    warnings: list[str] | None
    seconds: float | None
    started_at: str | None
    ended_at: str | None
    torch_version: str | None
    python_version: str | None
    host: str | None
    device: str | None
    factory: str | None
    kwargs: dict[str, Any] | None
    code_hash: str | None
    weights_digest: str | None
    details: dict[str, Any] | None
    blob_stat: str | None
    archive_version: str | None
    recorded_in_runs: list[str]
    report: dict[str, Any]
    path: str


class Lineage(TypedDict):
    """Store.lineage: where an artifact came from (ancestors, source first) and what it made."""

    id: str
    ancestors: list[Record]
    record: Record
    descendants: list[Record]


class BuiltFromWeights(TypedDict):
    """Store.built_from_weights: the sources built from a checkpoint and everything after them."""

    weights: str
    sources: list[Record]
    descendants: list[Record]


class RunEntry(TypedDict):
    """Store.runs: one run of the index."""

    run_id: str
    started_at: str | None  # ISO
    ended_at: str | None
    records: int


class MissingBlob(TypedDict):
    sha256: str
    records: list[dict[str, Any]]  # who names it: record_id, model, stage, run_id (and `as` when not its artifact)


class CorruptBlob(TypedDict):
    sha256: str
    status: str
    records: list[dict[str, Any]]


class VerifyReport(TypedDict):
    """Store.verify, `pt2flow verify --json`: every blob re-hashed."""

    checked: int
    missing: list[MissingBlob]
    corrupt: list[CorruptBlob]


class RecordDiff(TypedDict):
    """Store.diff, `pt2flow diff --json`: the fields two records differ in."""

    a: dict[str, Any]
    b: dict[str, Any]
    signature: dict[str, Any]
    op_histogram: dict[str, Any]
    node_count: dict[str, Any]
    range_constraints: dict[str, Any]
    size: dict[str, Any]
    fingerprint: dict[str, Any]
    validation: dict[str, Any]
    seconds: dict[str, Any]
