"""Store upkeep as values: verify (re-hash every blob, naming the records that use a bad one) and
collect_garbage (delete blobs no record names, past a grace period). Used by `pt2flow verify`,
`pt2flow gc` and the Python API. Storage only: no torch, no Prefect."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

DEFAULT_GRACE_SECONDS = 3600


def referenced(store: Any) -> dict[str, dict[str, Any]]:
    """digest -> {"size": recorded size, "records": [...]} for every blob a record points to: its
    artifact, the source's weights, validate's stored inputs and outputs (details.io)."""
    table = store.index.scan(["record_id", "run_id", "model", "stage", "sha256", "size", "weights_digest", "details"])
    refs: dict[str, dict[str, Any]] = {}

    def add(digest: str, size: Any, who: dict[str, Any]) -> None:
        refs.setdefault(digest, {"size": size, "records": []})["records"].append(who)

    for row in table.to_pylist():
        who = {"record_id": row["record_id"], "model": row["model"], "stage": row["stage"], "run_id": row["run_id"]}
        if row["sha256"]:
            add(row["sha256"], row["size"], who)
        try:
            details = json.loads(row["details"] or "{}")
        except ValueError:
            details = {}
        if row["weights_digest"]:
            add(row["weights_digest"], (details.get("weights") or {}).get("size"), {**who, "as": "weights"})
        io = details.get("io") if isinstance(details, dict) else None
        if isinstance(io, dict) and io.get("sha256"):
            add(io["sha256"], io.get("size"), {**who, "as": "validation inputs and outputs"})
    return refs


def verify_store(store: Any) -> dict[str, Any]:
    """Re-hash every blob in the store and every blob the index references."""
    refs = referenced(store)
    present = {b.digest: b for b in store.list_blobs()}
    missing, corrupt = [], []
    for digest in sorted(set(refs) | set(present)):
        ref = refs.get(digest, {"size": None, "records": []})
        if digest not in present:
            missing.append({"sha256": digest, "records": ref["records"]})
            continue
        status = store.blob_status(digest, ref["size"])
        if status != "ok":
            corrupt.append({"sha256": digest, "status": status, "records": ref["records"]})
    return {"checked": len(set(refs) | set(present)), "missing": missing, "corrupt": corrupt}


def collect_garbage(store: Any, *, dry_run: bool, grace_seconds: float) -> dict[str, Any]:
    """Delete blobs no record references and older than the grace period (a running export may
    have published a blob whose record is not written yet)."""
    refs = referenced(store)
    cutoff = datetime.now(timezone.utc) - timedelta(seconds=grace_seconds)
    unreferenced, kept_young = [], 0
    for blob in store.list_blobs():
        if blob.digest in refs:
            continue
        if blob.modified is None or blob.modified > cutoff:
            kept_young += 1
            continue
        unreferenced.append(blob)
    freed = sum(blob.size for blob in unreferenced)
    # temp files of writers killed mid-write (local stores without O_TMPFILE), past the grace period
    stale = [t for t in store.temp_files() if t.modified is not None and t.modified <= cutoff]
    if not dry_run:
        store.delete_blobs(b.digest for b in unreferenced)
        for temp in stale:
            store.delete_temp_file(temp.path)
    return {
        "deleted" if not dry_run else "would_delete": [b.digest for b in unreferenced],
        "bytes": freed,
        "kept_within_grace": kept_young,
        "temp_files_deleted" if not dry_run else "temp_files_would_delete": len(stale),
    }
