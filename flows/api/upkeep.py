"""Store upkeep as values: verify (re-hash every blob, naming the records that use a bad one) and
collect_garbage (delete blobs no record names, past a grace period; with a retention rule, first
drop the records of runs it does not keep and free the blobs only they named). Used by `pt2flow verify`,
`pt2flow gc` and the Python API. Storage only: no torch, no Prefect."""

from __future__ import annotations

from datetime import datetime, timedelta, UTC
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

from pt2flow.flows.api.documents import CorruptBlob, MissingBlob, VerifyReport

from pt2flow.storage.leases import live_leases
from pt2flow.storage.retention import RetentionRule, apply_retention, blobs_of

if TYPE_CHECKING:
    from pt2flow.storage import ArtifactStore

DEFAULT_GRACE_SECONDS = 3600


def referenced(store: ArtifactStore) -> dict[str, dict[str, Any]]:
    """digest -> {"size": recorded size, "records": [...]} for every blob a record points to: its
    artifact, the source's weights, validate's stored inputs and outputs (details.io), a
    failure's report (storage.retention.blobs_of)."""
    table = store.index.scan(["record_id", "run_id", "model", "stage", "sha256", "size", "weights_digest", "details"])
    refs: dict[str, dict[str, Any]] = {}
    for row in table.to_pylist():
        who = {"record_id": row["record_id"], "model": row["model"], "stage": row["stage"], "run_id": row["run_id"]}
        for digest, size, role in blobs_of(row):
            entry = refs.setdefault(digest, {"size": size, "records": []})
            if entry["size"] is None:
                entry["size"] = size
            entry["records"].append(who if role == "artifact" else {**who, "as": role})
    return refs


def verify_store(store: ArtifactStore) -> VerifyReport:
    """Re-hash every blob in the store and every blob the index references."""
    refs = referenced(store)
    present = {b.digest: b for b in store.list_blobs()}
    missing: list[MissingBlob] = []
    corrupt: list[CorruptBlob] = []
    for digest in sorted(set(refs) | set(present)):
        ref = refs.get(digest, {"size": None, "records": []})
        if digest not in present:
            missing.append({"sha256": digest, "records": ref["records"]})
            continue
        status = store.blob_status(digest, ref["size"])
        if status != "ok":
            corrupt.append({"sha256": digest, "status": status, "records": ref["records"]})
    return {"checked": len(set(refs) | set(present)), "missing": missing, "corrupt": corrupt}


def collect_garbage(
    store: ArtifactStore,
    *,
    dry_run: bool,
    grace_seconds: float,
    keep_runs: int | None = None,
    keep_days: float | None = None,
    exclude_runs: Iterable[str] = (),
) -> dict[str, Any]:
    """Delete blobs no record references and older than the grace period (a running export may
    have published a blob whose record is not written yet). With keep_runs and/or keep_days,
    first apply that retention rule (storage/retention.py: the records of runs it does not keep
    and the blobs only they name go; `retention` in the result); `exclude_runs`: runs whose
    leases do not stop it (serve's own, just finished). Raises ValueError for a bad rule."""
    retention = None
    if keep_runs is not None or keep_days is not None:
        rule = RetentionRule(keep_runs=keep_runs, keep_days=keep_days)
        retention = apply_retention(
            store, rule, dry_run=dry_run, grace_seconds=grace_seconds, exclude_runs=exclude_runs
        )
    refs = referenced(store)
    cutoff = datetime.now(UTC) - timedelta(seconds=grace_seconds)
    unreferenced, kept_young = [], 0
    for blob in store.list_blobs():
        if blob.digest in refs:
            continue
        if blob.modified is None or blob.modified > cutoff:
            kept_young += 1
            continue
        unreferenced.append(blob)
    # temp files of writers killed mid-write (local stores without O_TMPFILE), past the grace period
    stale = [t for t in store.temp_files() if t.modified is not None and t.modified <= cutoff]
    # a run in progress may have found one of these blobs already stored (put_blob does not
    # rewrite it) and not recorded it yet: while any run holds a live lease, no blob is deleted
    deferred = [lease.run_id for lease in live_leases(store, exclude=frozenset(exclude_runs))]
    if not dry_run and deferred:
        unreferenced = []
    freed = sum(blob.size for blob in unreferenced)
    if not dry_run:
        store.delete_blobs(b.digest for b in unreferenced)
        for temp in stale:
            store.delete_temp_file(temp.path)
    result: dict[str, Any] = {
        "deleted" if not dry_run else "would_delete": [b.digest for b in unreferenced],
        "bytes": freed,
        "kept_within_grace": kept_young,
        "temp_files_deleted" if not dry_run else "temp_files_would_delete": len(stale),
        "deferred": deferred,
    }
    if retention is not None:
        result["retention"] = retention
    return result
