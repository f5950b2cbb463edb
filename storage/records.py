"""The index record: one row of the metadata index (docs/architecture.md §5), defined once.

`IndexRecord` names every column, its Python type and its Arrow type (in the field's metadata);
storage/index.py derives the Parquet schema, the column list and the JSON columns from it, and
the engine builds every record it appends through it. The schema is a contract (the store's
layout): columns keep their names, types, order and nullability, and are only ever added.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

_TS = pa.timestamp("us", tz="UTC")


def column(arrow: pa.DataType, *, json: bool = False, required: bool = False) -> Any:
    """A record field: its Arrow type, and whether it holds a JSON document as a string;
    null unless given (`required`: always given)."""
    metadata = {"arrow": arrow, "json": json}
    return dataclasses.field(metadata=metadata) if required else dataclasses.field(default=None, metadata=metadata)


@dataclass(frozen=True)
class IndexRecord:
    """One stage run of one model, cached or not, failed or not. Every column is nullable."""

    record_id: str = column(pa.string(), required=True)
    run_id: str | None = column(pa.string())
    model: str | None = column(pa.string())
    stage: str | None = column(pa.string())
    status: str | None = column(pa.string())  # ok | failed
    cached: bool | None = column(pa.bool_())
    key: str | None = column(pa.string())  # derivation key (the cache key)
    parent_keys: tuple[str, ...] | None = column(pa.list_(pa.string()))
    sha256: str | None = column(pa.string())  # content ID of the artifact (null if none)
    size: int | None = column(pa.int64())
    uri: str | None = column(pa.string())
    fingerprint: str | None = column(pa.string())  # program fingerprint (stable across re-exports)
    op_histogram: str | None = column(pa.string(), json=True)  # {op: count}
    node_count: int | None = column(pa.int64())
    signature: str | None = column(pa.string(), json=True)
    range_constraints: str | None = column(pa.string(), json=True)  # {symbol: [min, max]}
    validation: str | None = column(pa.string(), json=True)  # summary of the validation report
    passed: bool | None = column(pa.bool_())
    max_abs_err: float | None = column(pa.float64())
    max_rel_err: float | None = column(pa.float64())
    error_class: str | None = column(pa.string())
    error_message: str | None = column(pa.string())
    strategy: str | None = column(pa.string())  # trace: the fallback strategy that worked
    options: str | None = column(pa.string(), json=True)  # canonical stage options
    warnings: tuple[str, ...] | None = column(pa.list_(pa.string()))
    seconds: float | None = column(pa.float64())
    started_at: datetime | None = column(_TS)
    ended_at: datetime | None = column(_TS)
    torch_version: str | None = column(pa.string())
    python_version: str | None = column(pa.string())
    pt2flow_version: str | None = column(pa.string())
    host: str | None = column(pa.string())
    device: str | None = column(pa.string())
    factory: str | None = column(pa.string())
    kwargs: str | None = column(pa.string(), json=True)
    code_hash: str | None = column(pa.string())
    weights_digest: str | None = column(pa.string())
    details: str | None = column(pa.string(), json=True)  # stage-specific metadata (dims, attempts, sizes...)
    blob_stat: str | None = column(
        pa.string()
    )  # the blob's stat signature when it was last verified (see ArtifactStore.blob_signature)
    archive_version: str | None = column(
        pa.string()
    )  # serialize: the torch.export serializer schema version of the archive ("8.20")

    def row(self) -> dict[str, Any]:
        """The record as one row for pyarrow, schema_version first."""
        row: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            row[f.name] = list(value) if isinstance(value, tuple) else value
        return row


_FIELDS = dataclasses.fields(IndexRecord)

# The Parquet schema of an index file: schema_version, then IndexRecord's fields in order.
SCHEMA = pa.schema([pa.field("schema_version", pa.int16()), *(pa.field(f.name, f.metadata["arrow"]) for f in _FIELDS)])
COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)
JSON_COLUMNS = frozenset(f.name for f in _FIELDS if f.metadata["json"])
