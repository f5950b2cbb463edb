"""Disk full mid-write: a child process with RLIMIT_FSIZE (SIGXFSZ ignored, so write() fails with
EFBIG the way it fails with ENOSPC on a full disk) publishes a blob and an index file larger than
the limit: a clear StorageFull naming the path, nothing partial, no temp file, and the store keeps
working for what fits (and for everything once there is room again)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from pt2flow.storage import ArtifactStore
from tests.reliability import stats
from tests.reliability.invariants import check_local_store, files_under, temp_files
from tests.reliability.test_crash_points import _worker

LIMIT = 256 * 1024


def test_disk_full_mid_write_is_a_clear_storage_error_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    proc = _worker("disk_full", {"url": str(root), "limit": LIMIT})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    big = random.Random(1).randbytes(LIMIT * 3)
    digest = hashlib.sha256(big).hexdigest()
    store = ArtifactStore(str(root))

    blob = out["blob"]
    assert blob["raised"] == "StorageFull" and blob["is_storage_error"], blob
    assert "disk full" in blob["message"] and "File too large" in blob["message"]
    assert store.blob_path(digest) in blob["message"]  # names the path it could not write
    index = out["index"]
    assert index["raised"] == "StorageFull" and index["is_storage_error"], index
    assert "disk full" in index["message"] and "/index/part-" in index["message"]

    # nothing partial, no temp file: the only files are the small blob and, later, the big one
    assert temp_files(root) == []
    assert files_under(root / "blobs") == sorted(f"sha256/{d[:2]}/{d}" for d in (out["small"], out["big_after"]))
    assert not (root / "index").exists() or list((root / "index").iterdir()) == []
    assert out["big_after"] == digest  # published once there was room
    state = check_local_store(root)
    assert state["records"] == []  # the index file that did not fit left no record behind
    assert store.blob_status(digest, len(big)) == "ok"
    stats.add_faults(2)
