"""MetadataIndex: append-only Parquet files, de-duplicating reads, compaction, schema evolution."""

from __future__ import annotations

import io
import uuid
from datetime import datetime, timedelta, UTC

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pt2flow.storage import ArtifactStore, StorageError
from pt2flow.storage.index import COLUMNS, PLAIN_FILE_ROWS, SCHEMA, SCHEMA_VERSION, sidecar_of

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def record(model: str = "m", stage: str = "trace", **fields) -> dict:
    base = {
        "record_id": uuid.uuid4().hex,
        "run_id": "run-1",
        "model": model,
        "stage": stage,
        "status": "ok",
        "cached": False,
        "key": uuid.uuid4().hex,
        "parent_keys": [],
        "sha256": uuid.uuid4().hex + uuid.uuid4().hex,
        "size": 10,
        "ended_at": T0,
    }
    base.update(fields)
    return base


def test_append_then_read_round_trips_every_column_type(store: ArtifactStore) -> None:
    rec = record(
        parent_keys=["a", "b"],
        warnings=["w1"],
        seconds=1.5,
        node_count=42,
        passed=True,
        max_abs_err=1e-7,
        op_histogram='{"aten.addmm.default": 2}',
        started_at=T0 - timedelta(seconds=2),
    )
    path = store.index.append([rec])
    assert path is not None and path.endswith(".parquet")
    table = store.index.read()
    assert table.num_rows == 1
    row = table.to_pylist()[0]
    for key, value in rec.items():
        assert row[key] == value, key
    assert row["schema_version"] == SCHEMA_VERSION
    assert table.schema.names == list(COLUMNS)


def test_a_few_records_are_written_plain_and_many_compressed_and_both_read_back(store: ArtifactStore) -> None:
    """A stage's record is written without compression, dictionaries or statistics (cheaper on
    the path between two stages, and smaller at one row); more than PLAIN_FILE_ROWS keep zstd.
    Another process's store reads both back as written, every column type included."""
    one = record(parent_keys=["a"], warnings=["w"], seconds=0.5, passed=False, started_at=T0)
    many = [record(model=f"m{i}", seconds=float(i)) for i in range(PLAIN_FILE_ROWS + 1)]
    small, large = store.index.append([one]), store.index.append(many)
    assert small is not None and large is not None

    def codecs(path: str) -> set[str]:
        meta = pq.ParquetFile(io.BytesIO(store.fs.cat_file(path))).metadata
        return {meta.row_group(0).column(c).compression for c in range(meta.num_columns)}

    assert codecs(small) == {"UNCOMPRESSED"} and codecs(large) == {"ZSTD"}
    elsewhere = ArtifactStore(store.url)  # nothing cached: the files as another process reads them
    rows = {r["record_id"]: r for r in elsewhere.index.read().to_pylist()}
    assert len(rows) == 1 + len(many)
    for rec in [one, *many]:
        assert all(rows[rec["record_id"]][k] == v for k, v in rec.items()), rec["record_id"]


def test_each_append_is_a_new_file(store: ArtifactStore) -> None:
    for i in range(3):
        store.index.append([record(model=f"m{i}")])
    assert len(store.index.files()) == 3
    assert sorted(store.index.read(["model"])["model"].to_pylist()) == ["m0", "m1", "m2"]


def test_read_filters_and_columns(store: ArtifactStore) -> None:
    store.index.append([record(model="a", stage="trace"), record(model="a", stage="validate"), record(model="b")])
    table = store.index.read(["model", "stage"], filter=pc.field("model") == "a")
    assert sorted(table["stage"].to_pylist()) == ["trace", "validate"]
    assert table.column_names == ["record_id", "model", "stage"]
    scanned = store.index.scan(["model"], filter=pc.field("stage") == "validate")
    assert scanned["model"].to_pylist() == ["a"]


def test_unknown_fields_are_rejected(store: ArtifactStore) -> None:
    with pytest.raises(StorageError, match="not_a_column"):
        store.index.append([record(not_a_column=1)])
    assert store.index.files() == []


def test_compaction_merges_and_keeps_every_record(store: ArtifactStore) -> None:
    records = [record(model=f"m{i % 3}", stage="trace") for i in range(20)]
    for rec in records:
        store.index.append([rec])
    before = sorted(store.index.read(["record_id"])["record_id"].to_pylist())
    result = store.index.compact()
    assert result.merged_files == 20
    assert result.records == 20
    files = store.index.files()
    assert len(files) == 1 and files[0] == result.written
    after = sorted(store.index.read(["record_id"])["record_id"].to_pylist())
    assert after == before == sorted(r["record_id"] for r in records)
    # sorted by model within the merged file
    models = pq.read_table(io.BytesIO(store.fs.cat_file(files[0])), columns=["model"])["model"].to_pylist()
    assert models == sorted(models)


def test_crash_between_merge_and_delete_duplicates_nothing(store: ArtifactStore) -> None:
    """The state a crash mid-compaction leaves: the merged file AND the small files."""
    records = [record() for _ in range(5)]
    for rec in records:
        store.index.append([rec])
    merged = store.index.read()
    store.index._write_table(merged, f"{store.index.root}/compact-crashed.parquet")
    assert len(store.index.files()) == 6
    table = store.index.read()
    assert table.num_rows == 5
    assert sorted(table["record_id"].to_pylist()) == sorted(r["record_id"] for r in records)
    assert store.index.scan(["record_id"]).num_rows == 5
    # the next compaction converges to one file with each record once
    store.index.compact()
    assert store.index.read().num_rows == 5
    assert len(store.index.files()) == 1


def test_old_files_without_new_columns_read_as_null(store: ArtifactStore) -> None:
    """Schema evolution: a file written before a column existed still reads, the column null."""
    old_schema = pa.schema([SCHEMA.field(n) for n in ("schema_version", "record_id", "model", "stage", "status")])
    old = pa.Table.from_pylist(
        [{"schema_version": 0, "record_id": "r-old", "model": "legacy", "stage": "trace", "status": "ok"}],
        schema=old_schema,
    )
    sink = io.BytesIO()
    pq.write_table(old, sink)
    store.fs.makedirs(store.index.root, exist_ok=True)
    store.fs.pipe_file(f"{store.index.root}/part-00000000T000000000000-old.parquet", sink.getvalue())
    store.index.append([record(model="new")])
    table = store.index.read()
    rows = {r["model"]: r for r in table.to_pylist()}
    assert set(rows) == {"legacy", "new"}
    assert rows["legacy"]["sha256"] is None and rows["legacy"]["schema_version"] == 0
    assert rows["new"]["sha256"] is not None
    scanned = store.index.scan(["model", "sha256"], filter=pc.field("model") == "legacy")
    assert scanned.to_pylist()[0]["sha256"] is None


def test_id_lookup_uses_the_sidecar_after_compaction(store: ArtifactStore) -> None:
    recs = [record(model=f"m{i}", sha256=f"{i:02x}" * 32) for i in range(40)]
    store.index.append(recs[:20])
    store.index.compact(min_files=1)
    store.index.append(recs[20:])  # a plain file beside the compacted one
    compacted = [p for p in store.index.files() if "compact-" in p][0]
    assert store.fs.exists(sidecar_of(compacted))
    assert store.index.models_for_digest("05" * 4) == {"m5"}  # found through the sidecar
    assert store.index.models_for_digest("1e" * 4) == {"m30"}  # found in the plain file
    assert store.index.models_for_digest("ff" * 4) == set()


def test_reads_see_files_appended_by_another_writer(store_url: str) -> None:
    reader = ArtifactStore(store_url)
    writer = ArtifactStore(store_url)
    writer.index.append([record(model="first")])
    assert reader.index.read(["model"])["model"].to_pylist() == ["first"]
    writer.index.append([record(model="second")])
    assert sorted(reader.index.read(["model"])["model"].to_pylist()) == ["first", "second"]


def test_with_key_gives_what_a_filter_on_the_key_gives_across_appends_compaction_and_other_writers(
    store_url: str,
) -> None:
    reader = ArtifactStore(store_url)
    writer = ArtifactStore(store_url)
    shared = "k-shared"
    first = [record(model="a", key=shared), record(model="b"), record(model="c", key=shared, run_id="run-2")]
    reader.index.append(first[:2])
    writer.index.append(first[2:])  # another process: the reader sees it at its next lookup

    def by_filter(key: str) -> list[str]:
        return sorted(reader.index.read(None, filter=pc.field("key") == key)["record_id"].to_pylist())

    def by_key(key: str) -> list[str]:
        table = reader.index.with_key(key)
        assert table.column_names == list(COLUMNS)
        return sorted(table["record_id"].to_pylist())

    assert by_key(shared) == by_filter(shared) == sorted([first[0]["record_id"], first[2]["record_id"]])
    assert by_key(first[1]["key"]) == [first[1]["record_id"]]
    assert by_key("no-such-key") == by_filter("no-such-key") == []
    # the reader's own append is seen without reading its file back, and it is the same row
    own = record(model="d", key=shared, stage="validate", size=77)
    reader.index.append([own])
    (row,) = [r for r in reader.index.with_key(shared).to_pylist() if r["record_id"] == own["record_id"]]
    assert (row["model"], row["stage"], row["size"], row["ended_at"]) == ("d", "validate", 77, T0)
    # a compaction by another process: the small files are gone, their rows are in the merged one
    writer.index.compact()
    assert (
        by_key(shared) == by_filter(shared) == sorted([first[0]["record_id"], first[2]["record_id"], own["record_id"]])
    )


def test_a_scan_of_files_this_process_holds_answers_from_memory_with_the_same_rows(tmp_path) -> None:
    """scan() reads through pyarrow.dataset, without caching; once every current file is in this
    process's memory (a run planned on them, or wrote them) it answers from there: the same rows,
    columns and de-duplication as a scan from disk, for every filter, and no file read again
    (shown by overwriting one on disk afterwards: the cached answer still has its rows)."""
    url = str(tmp_path / "store")
    holder = ArtifactStore(url)
    dup = record(model="a", stage="source", run_id="run-1")
    holder.index.append([dup, record(model="a", stage="trace", run_id="run-1")])
    holder.index.append([dup, record(model="b", stage="trace", run_id="run-2", status="failed")])
    holder.index.append([record(model="c", stage="trace", run_id="run-2")])
    filters = [
        None,
        pc.field("run_id") == "run-2",
        (pc.field("model") == "a") & (pc.field("stage") == "source"),
        pc.field("run_id").is_valid(),
    ]
    for columns in (None, ["run_id", "model", "stage", "status"], ["model"]):
        for condition in filters:
            from_disk = ArtifactStore(url).index.scan(columns, filter=condition)
            held = holder.index.scan(columns, filter=condition)
            assert held.schema == from_disk.schema
            assert sorted(held.to_pylist(), key=str) == sorted(from_disk.to_pylist(), key=str)
    assert holder.index.scan(["record_id"]).num_rows == 4  # the record in two files, once
    victim = holder.index.files()[-1]
    with open(victim, "wb") as handle:  # files are immutable: a changed one shows which way a scan read
        pq.write_table(pa.table({"record_id": ["x"]}), handle)
    assert sorted(holder.index.scan(["model"])["model"].to_pylist()) == ["a", "a", "b", "c"]
    assert "c" not in ArtifactStore(url).index.scan(["model"])["model"].to_pylist()  # a fresh process reads the disk
