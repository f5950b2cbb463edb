"""The metadata index: append-only Parquet files under <store>/index/, readable by any Arrow tool.

One new file per flush, so concurrent writers never touch the same file. Compaction writes
the merged file first and deletes the small ones after; readers de-duplicate by record_id, so
a crash at any point loses nothing and duplicates nothing. The schema lives in code, carries a
schema_version column and only ever gains columns.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pt2flow.storage.errors import StorageError
from pt2flow.storage.faults import crash_point
from pt2flow.storage.publish import atomic_write, remove_file
from pt2flow.storage.records import COLUMNS, JSON_COLUMNS, SCHEMA, SCHEMA_VERSION, IndexRecord
from pt2flow.storage.retry import DEFAULT_RETRY, RetryPolicy
from pt2flow.storage.urls import is_local

# The schema, its columns and its JSON columns follow from the one definition of a record.
__all__ = [
    "COLUMNS",
    "JSON_COLUMNS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "CompactResult",
    "IndexRecord",
    "MetadataIndex",
    "dedupe",
    "records_to_table",
]


class _NameTaken(StorageError):
    """Another writer's index file already has this name."""


@dataclass(frozen=True)
class CompactResult:
    merged_files: int
    records: int
    written: str | None


Record = IndexRecord | Mapping[str, Any]  # a mapping names some of IndexRecord's columns (bulk imports, tests)


def records_to_table(records: Sequence[Record]) -> pa.Table:
    mappings = [r for r in records if not isinstance(r, IndexRecord)]
    unknown = {k for r in mappings for k in r} - set(COLUMNS)
    if unknown:
        raise StorageError(f"index records have fields the schema does not know: {sorted(unknown)}")
    rows = [r.row() if isinstance(r, IndexRecord) else {"schema_version": SCHEMA_VERSION, **r} for r in records]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def filtered(table: pa.Table, expression: Any) -> pa.Table:
    """The rows of `table` that match a pyarrow compute expression, computed on this thread.
    `Table.filter(expression)` runs an Acero plan on pyarrow's CPU thread pool; a query command
    that had started those threads, on an S3 store, died with SIGABRT ("terminate called without
    an active exception") as it exited, about once in a hundred (tests/integration/test_run_cli.py
    test_queries_on_s3_exit_cleanly). The index's tables are small in memory: one
    thread costs nothing."""
    import pyarrow.dataset as ds

    return ds.dataset(table).to_table(filter=expression, use_threads=False)


def skip_pandas_probe() -> bool:
    """Answer pyarrow's look for pandas with "none" in a process that hands it no pandas object
    (pt2flow's console script); whether this process's pyarrow now holds that.

    The first time pyarrow converts a Python value (a record's fields, a filter's operand) it
    imports pandas, when installed (ExecuTorch requires it), to tell pandas objects apart: 0.19 s
    of every command, a tenth of an unchanged re-run. An object can only be a pandas one once
    pandas is imported, so when nothing imported it yet this process's pyarrow is given its
    answer without it: `import pandas` fails once, during one conversion, and pyarrow keeps "no
    pandas" for its checks; what asks for pandas itself (Table.to_pandas) still imports it then.
    Never called on import: a program that imports pt2flow's modules and hands pyarrow its own
    DataFrames keeps pyarrow's own behaviour."""
    import sys

    if "pandas" in sys.modules:
        return False
    refusal = _NoPandas()
    sys.meta_path.insert(0, refusal)
    try:
        pa.array([0])
    finally:
        sys.meta_path.remove(refusal)
    return "pandas" not in sys.modules


class _NoPandas:
    """A finder that refuses `import pandas` (skip_pandas_probe, for one conversion)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("pandas is not needed here (pt2flow.storage.index.skip_pandas_probe)")
        return None


def parquet_table(data: bytes, schema: pa.Schema | None = None) -> pa.Table:
    """An index file's bytes as a table, read on this thread from pyarrow's own buffer, so that no
    pyarrow thread calls back into Python (from an io.BytesIO, pyarrow's I/O threads call its
    read() through the GIL). A query on S3 still died now and then with SIGABRT after printing its
    answer ("terminate called without an active exception": 1 `lineage` in 24, then 1 in 100, under
    load; tests/integration/test_run_cli.py test_queries_on_s3_exit_cleanly): this takes
    away the last Python callback on a pyarrow thread in a query, a suspected cause, not a proven one.
    A `run` on S3 still died so on CI; the console script now ends the process before any C-level
    exit handler runs, which settles it whatever the cause."""
    return pq.read_table(pa.BufferReader(data), schema=schema, use_threads=False, pre_buffer=False)


def dedupe(table: pa.Table) -> pa.Table:
    """Keep the first row of each record_id (duplicates exist only around a compaction)."""
    if table.num_rows == 0 or pc.count_distinct(table["record_id"]).as_py() == table.num_rows:
        return table
    indexed = table.append_column("__row", pa.array(range(table.num_rows), pa.int64()))
    first = indexed.group_by("record_id", use_threads=False).aggregate([("__row", "min")])
    keep = pc.sort_indices(first["__row_min"])
    return table.take(pc.take(first["__row_min"], keep))


def _conform(table: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    """Cast a file's table to the current schema: columns added since it was written read as null."""
    if not columns and table.schema.equals(SCHEMA):  # written by this version (an append of this process): as it is
        return table
    names = list(columns) if columns else list(COLUMNS)
    arrays = []
    for name in names:
        field = SCHEMA.field(name)
        if name in table.column_names:
            column = table[name]
            arrays.append(column if column.type == field.type else column.cast(field.type))
        else:
            arrays.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema([SCHEMA.field(n) for n in names]))


# an index file of at most this many records is written without compression, dictionaries or
# statistics (MetadataIndex._write_table)
PLAIN_FILE_ROWS = 64


class MetadataIndex:
    """Append records, read them back (filtered, de-duplicated), compact."""

    def __init__(self, fs: Any, root: str, *, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.retry = retry
        self._file_cache: dict[str, pa.Table] = {}
        self._key_rows: dict[str, dict[str, list[int]]] = {}  # per file: key -> its rows (with_key)
        self._combined: tuple[tuple[str, ...], pa.Table] | None = None
        self._pinned: list[str] | None = None  # the listing a snapshot() reuses

    # -- writing -------------------------------------------------------------------------
    def append(self, records: Sequence[Record]) -> str | None:
        """Write `records` as one new Parquet file; returns its path."""
        if not records:
            return None
        return self._write_new(records_to_table(records), "part")

    def _write_new(self, table: pa.Table, prefix: str, **kwargs: Any) -> str:
        """Write `table` under a fresh name: never over another writer's file."""
        for _attempt in range(5):
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
            path = f"{self.root}/{prefix}-{stamp}-{uuid.uuid4().hex[:12]}.parquet"
            try:
                self._write_table(table, path, **kwargs)
                # files are immutable: the next read need not fetch and parse what was just written
                self._file_cache[path] = _conform(table, None)
                if self._pinned:  # a snapshot sees what this process itself appended
                    self._pinned.append(path)
                    self._pinned.sort()
                return path
            except _NameTaken:
                continue
        raise StorageError(f"cannot find a free index file name under {self.root}")

    def _write_table(self, table: pa.Table, path: str, row_group_size: int = 65536) -> None:
        """Create `path` (never replace it). A file already there with the same bytes is this
        writer's own (a retried PUT whose first response was lost); other bytes raise _NameTaken.

        A file of a few records (a stage's record, a model's) is written plain: no compression, no
        dictionaries, no statistics. On one record of 41 columns, zstd made the file larger
        (15.2 KB against 14.7 KB plain, 8.5 KB without dictionaries and statistics) and took 2.6 ms
        against 0.8 ms, on the orchestrator's path between two stages; no reader filters on
        statistics (reads take whole files). A larger file (a compaction's, a settled fleet's
        records) keeps zstd, dictionaries and statistics: there they pay."""
        sink = io.BytesIO()
        encoding = (
            {"compression": "none", "use_dictionary": False, "write_statistics": False}
            if table.num_rows <= PLAIN_FILE_ROWS
            else {"compression": "zstd"}
        )
        pq.write_table(table, sink, row_group_size=row_group_size, **encoding)
        data = sink.getvalue()
        crash_point("before_index_append")
        try:
            written = self.retry.call(
                "index append", lambda: atomic_write(self.fs, path, data, exclusive=True, kind="index")
            )
            if not written:
                existing = self.retry.call("index read", lambda: self.fs.cat_file(path))
                if existing != data:
                    raise _NameTaken(path)
        except StorageError:
            raise  # _NameTaken, StorageFull: already say what and where
        except Exception as exc:
            raise StorageError(f"cannot write index file {path}: {type(exc).__name__}: {exc}") from exc
        crash_point("after_index_append")

    # -- reading -------------------------------------------------------------------------
    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Within the block, reads use one listing of the index files, taken at its first read
        (planning a fleet reads the index hundreds of times; records appended meanwhile by this
        process are still seen). Outside it, every read lists the files afresh."""
        outer = self._pinned is not None
        if not outer:
            self._pinned = []
        try:
            yield
        finally:
            if not outer:
                self._pinned = None

    def files(self) -> list[str]:
        if self._pinned:
            return list(self._pinned)
        listed = self._list_files()
        if self._pinned is not None:
            self._pinned.extend(listed)
        return listed

    def _list_files(self) -> list[str]:
        try:
            self.fs.invalidate_cache(self.root)  # other processes append too: never trust a cached listing
            if not self.fs.exists(self.root):
                return []
            names = self.retry.call("index list", lambda: self.fs.ls(self.root, detail=False))
        except Exception as exc:
            raise StorageError(f"cannot list index {self.root}: {exc}") from exc
        out = []
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".parquet") and not base.startswith((".", "_")):
                out.append(name)
        return sorted(out)

    def _read_file(self, path: str, columns: Sequence[str] | None) -> pa.Table | None:
        try:
            data = self.retry.call("index read", lambda: self.fs.cat_file(path))
            table = parquet_table(data)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise StorageError(f"cannot read index file {path}: {type(exc).__name__}: {exc}") from exc
        return _conform(table, columns)

    def read(self, columns: Sequence[str] | None = None, filter: Any = None) -> pa.Table:
        """Every record (or `columns` of it), de-duplicated; `filter` is a pyarrow compute expression.

        Files are immutable, so each is read once per MetadataIndex and cached in memory.
        """
        cols = list(columns) if columns else list(COLUMNS)
        if "record_id" not in cols:
            cols = ["record_id", *cols]
        return self._rows(self.files(), cols, filter)

    def _rows(self, current: list[str], cols: list[str], filter: Any) -> pa.Table:
        """`cols` of the de-duplicated rows of files `current` that match `filter`, from memory
        (each file read once)."""
        combined = self._combined_table(current)
        if combined is None:
            return _conform(pa.table({}), cols)
        if filter is not None:
            combined = filtered(combined, filter)
        return dedupe(combined.select(cols))

    def _combined_table(self, current: list[str]) -> pa.Table | None:
        """Every file's rows in one table (files are immutable: each is read once). When files
        were only added since the last read (the common case while a run appends), the new ones
        are appended to the previous table instead of concatenating everything again."""
        key = tuple(current)
        if self._combined is not None and self._combined[0] == key:
            return self._combined[1]
        previous = self._combined
        if previous is not None and set(previous[0]) <= set(current):
            added = [t for t in (self._cached_file(p) for p in current if p not in set(previous[0])) if t is not None]
            combined = pa.concat_tables([previous[1], *added]) if added else previous[1]
            if combined.column(0).num_chunks > 64:
                combined = combined.combine_chunks()
        else:
            tables = [t for t in (self._cached_file(p) for p in current) if t is not None]
            for stale in set(self._file_cache) - set(current):
                del self._file_cache[stale]
                self._key_rows.pop(stale, None)
            combined = pa.concat_tables(tables).combine_chunks() if tables else None
        self._combined = (key, combined) if combined is not None else None
        return combined

    def with_key(self, key: str) -> pa.Table:
        """Every record of stage key `key` (all columns, de-duplicated): what read() with the
        filter `key == key` gives, through a map of each file's keys to its rows, made once per
        file (a run looks a key up before every stage: filtering the whole index each time
        grew with it)."""
        parts = []
        for path in self.files():
            table = self._cached_file(path)
            if table is None:
                continue
            rows = self._key_rows.get(path)
            if rows is None:
                rows = {}
                for row, value in enumerate(table["key"].to_pylist()):
                    rows.setdefault(value, []).append(row)
                self._key_rows[path] = rows
            if key in rows:
                parts.append(table.take(pa.array(rows[key], pa.int64())))
        if not parts:
            return _conform(pa.table({}), None)
        return dedupe(pa.concat_tables(parts))

    def _cached_file(self, path: str) -> pa.Table | None:
        """A file's table, read once; None if a compaction deleted it since the listing (its rows
        are in the merged file)."""
        table = self._file_cache.get(path)
        if table is None:
            table = self._read_file(path, None)
            if table is not None:
                self._file_cache[path] = table
        return table

    def scan(self, columns: Sequence[str] | None = None, filter: Any = None) -> pa.Table:
        """Like read(), but through pyarrow.dataset with predicate pushdown and no caching.

        For one-shot queries on a large index (the CLI's ls, show, lineage).
        """

        cols = list(columns) if columns else list(COLUMNS)
        if "record_id" not in cols:
            cols = ["record_id", *cols]
        paths = self.files()
        if not paths:
            return _conform(pa.table({}), cols)
        if all(path in self._file_cache for path in paths):
            # every file is in memory already (this process planned a run on them, or wrote
            # them): the same rows without reading them again (a warm run's failure groups
            # scanned its index files four times, 0.48 s of a 40-model re-run's 2.5 under cProfile)
            return self._rows(paths, cols, filter)
        try:
            table = self._scan(paths, cols, filter, SCHEMA)
        except FileNotFoundError:
            return self.read(cols, filter)  # a compaction removed a file mid-scan: fall back
        except Exception as exc:
            raise StorageError(f"cannot read index {self.root}: {type(exc).__name__}: {exc}") from exc
        return dedupe(table)

    def _scan(self, paths: list[str], columns: list[str], filter: Any, schema: pa.Schema | None) -> pa.Table:
        """`columns` of the rows of parquet `paths` that match `filter`. On local disk pyarrow's own
        filesystem scans with predicate pushdown; elsewhere each file is fetched through fsspec and
        filtered here. pyarrow never gets the fsspec filesystem itself: its scanner threads would
        call back into Python and can outlive the interpreter (the process then dies with SIGABRT,
        "terminate called without an active exception", after its work is done)."""
        import pyarrow.dataset as ds

        if is_local(self.fs):
            import pyarrow.fs as pafs

            dataset = ds.dataset(paths, schema=schema, format="parquet", filesystem=pafs.LocalFileSystem())
            return dataset.to_table(columns=columns, filter=filter)
        tables = []
        for path in paths:
            data = self.retry.call("index read", lambda path=path: self.fs.cat_file(path))
            table = parquet_table(data, schema)
            tables.append(filtered(table, filter) if filter is not None else table)
        if not tables:
            return _conform(pa.table({}), columns)
        return pa.concat_tables(tables).select(columns)

    # -- compaction ----------------------------------------------------------------------
    def compact(self, min_files: int = 2, *, drop: frozenset[str] | set[str] = frozenset()) -> CompactResult:
        """Merge all current files into one (sorted by model, stage, time), then delete them.
        `drop`: record IDs left out of the merged file (retention; any number of files is then
        rewritten). Files appended meanwhile by others are not touched."""
        paths = self.files()
        if len(paths) < min_files and not (drop and paths):
            return CompactResult(0, 0, None)
        tables = []
        for path in paths:
            # files are immutable: one this process wrote or read is not fetched and parsed again
            # (a run's end compacts the files its own records went to: 1.6 s of 100 small models)
            table = self._file_cache.get(path)
            if table is None:
                table = self._read_file(path, None)
            if table is not None:
                tables.append(table)
        merged = dedupe(pa.concat_tables(tables)) if tables else _conform(pa.table({}), None)
        if drop:
            merged = merged.filter(pc.invert(pc.is_in(merged["record_id"], pa.array(sorted(drop), pa.string()))))
        merged = merged.sort_by([("model", "ascending"), ("stage", "ascending"), ("ended_at", "ascending")])
        target = self._write_new(merged, "compact")
        self._write_id_sidecar(merged, target)
        crash_point("mid_compaction")
        for number, path in enumerate(paths):
            if number:
                crash_point("mid_compaction_delete")
            for victim in (path, sidecar_of(path)):
                try:
                    remove_file(self.fs, victim)
                except Exception as exc:
                    raise StorageError(f"compaction wrote {target} but could not delete {victim}: {exc}") from exc
            self._file_cache.pop(path, None)
            self._key_rows.pop(path, None)
        return CompactResult(len(paths), merged.num_rows, target)

    # -- artifact ID lookups -------------------------------------------------------------
    def _write_id_sidecar(self, merged: pa.Table, target: str) -> None:
        """(sha256, model) sorted by sha256 beside a compacted file: an ID lookup then reads one
        small row group instead of scanning the sha256 column of every record."""
        ids = merged.select(["sha256", "model"]).filter(pc.is_valid(merged["sha256"]))
        ids = ids.sort_by([("sha256", "ascending")])
        self._write_table(ids, sidecar_of(target), row_group_size=8192)

    def models_for_digest(self, prefix: str) -> set[str]:
        """Models having a record whose sha256 starts with `prefix` (to narrow a full scan)."""

        upper = prefix + "g"  # every hex digest with this prefix sorts below prefix + 'g'
        condition = (pc.field("sha256") >= prefix) & (pc.field("sha256") < upper)
        models: set[str] = set()
        plain: list[str] = []
        try:
            self.fs.invalidate_cache(self.root)
            names = set(self.fs.ls(self.root, detail=False)) if self.fs.exists(self.root) else set()
        except Exception as exc:
            raise StorageError(f"cannot list index {self.root}: {exc}") from exc
        sidecars = {n.rstrip("/").rsplit("/", 1)[-1] for n in names}
        for path in self.files():
            if sidecar_of(path).rsplit("/", 1)[-1] in sidecars:
                try:
                    table = self._scan([sidecar_of(path)], ["model"], condition, None)
                except FileNotFoundError:
                    continue
                models.update(table["model"].to_pylist())
            else:
                plain.append(path)
        if plain:
            table = self._scan(plain, ["model"], condition, SCHEMA)
            models.update(table["model"].to_pylist())
        return {m for m in models if m is not None}


def sidecar_of(path: str) -> str:
    head, _, name = path.rpartition("/")
    return f"{head}/_ids-{name}"
