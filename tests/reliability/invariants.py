"""Store invariants checked after every injected crash or fault (docs/architecture.md §5)."""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pt2flow.storage import ArtifactStore
from pt2flow.storage.publish import is_temp_name, unnamed_temp_files_supported
from pt2flow.storage.index import COLUMNS

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def temp_files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and is_temp_name(p.name))


def raw_index_rows(root: Path) -> pa.Table:
    """Every row of every published index file, NOT de-duplicated (each file must parse whole)."""
    tables = []
    folder = root / "index"
    for path in sorted(folder.glob("*.parquet")) if folder.exists() else []:
        if path.name.startswith((".", "_")):
            continue
        tables.append(
            pq.read_table(
                io.BytesIO(path.read_bytes()),
                columns=["record_id", "model", "stage", "status", "cached", "key", "sha256", "size", "run_id"],
            )
        )
    if not tables:
        return pa.table({"record_id": pa.array([], pa.string())})
    return pa.concat_tables(tables)


def check_local_store(root: Path, *, allow_named_temps: bool = False) -> dict[str, Any]:
    """The crash invariant on a local store:

    - every file under blobs/ is named by a sha256, sits in its 2-hex folder and hashes to its name
      (no half-written blob under a real name);
    - no temp file is visible (unless this filesystem cannot do unnamed temp files);
    - every published index file parses completely;
    - every index record points to a blob that exists with that digest and size (re-hashed).
    Returns {"records": [...], "blobs": {digest: size}}.
    """
    blobs: dict[str, int] = {}
    base = root / "blobs" / "sha256"
    for path in sorted(base.rglob("*")) if base.exists() else []:
        if not path.is_file():
            continue
        if is_temp_name(path.name):
            continue
        assert HEX64.match(path.name), f"unexpected file under blobs/: {path}"
        assert path.parent.name == path.name[:2], f"blob in the wrong folder: {path}"
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == path.name, (
            f"partial or corrupt blob visible: {path} ({len(data)} bytes)"
        )
        blobs[path.name] = len(data)
    temps = temp_files(root)
    if temps:
        strict = not allow_named_temps and unnamed_temp_files_supported(str(root))
        assert not strict, f"temp files visible after the crash: {temps}"
    raw_index_rows(root)  # raises if a published index file is partial
    store = ArtifactStore(str(root))
    records = store.index.read(list(COLUMNS)).to_pylist() if (root / "index").exists() else []
    ids = Counter(r["record_id"] for r in records)
    assert all(n == 1 for n in ids.values()), "the index reader returned a record twice"
    for record in records:
        if record["sha256"]:
            assert record["sha256"] in blobs, (
                f"record {record['record_id']} ({record['model']}/{record['stage']}) points to a missing blob {record['sha256']}"
            )
            assert blobs[record["sha256"]] == record["size"], (
                f"record {record['record_id']} size {record['size']} != blob size {blobs[record['sha256']]}"
            )
            assert store.blob_status(record["sha256"], record["size"]) == "ok"
    return {"records": records, "blobs": blobs}


def files_under(root: Path) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in root.rglob("*") if p.is_file())
