"""Lineage queries over the index: resolve an ID, walk to the source, find what was derived.

Records form a graph through their derivation keys: each record names its parents' keys
(source -> trace -> functionalize -> decompose -> serialize / aot_compile -> validate). Several
records can share a key (a cached re-run records the same artifact again); a walk takes the
newest ok record per key, preferring the run it started from.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, UTC
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from pt2flow.storage.errors import AmbiguousId, InvalidId, RecordNotFound
from pt2flow.storage.index import JSON_COLUMNS, MetadataIndex

MIN_PREFIX = 8
_HEX = re.compile(r"^[0-9a-f]+$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def check_prefix(prefix: str, what: str = "ID") -> str:
    value = (prefix or "").strip().lower()
    if not _HEX.match(value):
        raise InvalidId(f"{what} {prefix!r} is not a hex sha256 digest or prefix")
    if len(value) < MIN_PREFIX:
        raise InvalidId(f"{what} prefix {prefix!r} is too short: give at least {MIN_PREFIX} hex characters")
    if len(value) > 64:
        raise InvalidId(f"{what} {prefix!r} is longer than a sha256 digest")
    return value


def newest_first(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records as dicts, the newest (by ended_at) first."""
    return sorted((dict(r) for r in rows), key=lambda r: r.get("ended_at") or _EPOCH, reverse=True)


def _prefix_filter(column: str, prefix: str) -> Any:
    if len(prefix) == 64:
        return pc.field(column) == prefix
    return pc.starts_with(pc.field(column), prefix)


def records_for_id(index: MetadataIndex, prefix: str) -> list[dict[str, Any]]:
    """Every record whose artifact sha256 starts with `prefix`, newest first.

    Raises InvalidId (not hex, shorter than 8), RecordNotFound, or AmbiguousId (the prefix
    matches more than one artifact) naming the candidates.
    """
    value = check_prefix(prefix)
    models = index.models_for_digest(value)
    if not models:
        raise RecordNotFound(f"no artifact with ID {prefix!r} in the index")
    table = index.scan(None, filter=pc.field("model").isin(sorted(models)) & _prefix_filter("sha256", value))
    if table.num_rows == 0:
        raise RecordNotFound(f"no artifact with ID {prefix!r} in the index")
    rows = newest_first(table.to_pylist())
    digests = sorted({r["sha256"] for r in rows})
    if len(digests) > 1:
        shown = ", ".join(
            f"{d[:16]}… ({next(r['model'] for r in rows if r['sha256'] == d)}/{next(r['stage'] for r in rows if r['sha256'] == d)})"
            for d in digests[:5]
        )
        more = f" and {len(digests) - 5} more" if len(digests) > 5 else ""
        raise AmbiguousId(f"ID prefix {prefix!r} matches {len(digests)} artifacts: {shown}{more}; give more characters")
    return rows


def resolve(index: MetadataIndex, prefix: str) -> dict[str, Any]:
    """The newest record of the artifact an ID (prefix) names."""
    return records_for_id(index, prefix)[0]


class _Graph:
    """Records of some models, indexed by key and by parent key, newest record per key."""

    def __init__(self, table: pa.Table) -> None:
        self.by_key: dict[str, list[dict[str, Any]]] = {}
        self.children: dict[str, set[str]] = {}
        for row in newest_first(table.to_pylist()):
            key = row.get("key")
            if not key:
                continue
            self.by_key.setdefault(key, []).append(row)
            for parent in row.get("parent_keys") or []:
                self.children.setdefault(parent, set()).add(key)

    def pick(self, key: str, run_id: str | None = None) -> dict[str, Any] | None:
        rows = self.by_key.get(key) or []
        ok = [r for r in rows if r.get("status") == "ok"] or rows
        if run_id:
            same = [r for r in ok if r.get("run_id") == run_id]
            if same:
                return same[0]
        return ok[0] if ok else None


def _graph_for(index: MetadataIndex, models: Sequence[str]) -> _Graph:
    return _Graph(index.scan(None, filter=pc.field("model").isin(list(models))))


def _stage_rank(record: Mapping[str, Any], order: Sequence[str]) -> int:
    """Where the record's stage is in `order` (the caller's pipeline order; a stage it does not
    name goes last)."""
    stage = record.get("stage")
    return order.index(stage) if stage in order else len(order)


def ancestors(index: MetadataIndex, record: Mapping[str, Any], order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The chain from the source to `record` (inclusive), in `order` of their stages (the
    pipeline's, from the caller: storage knows no stage), then oldest first."""
    graph = _graph_for(index, [record["model"]])
    found: dict[str, dict[str, Any]] = {}
    pending = list(record.get("parent_keys") or [])
    missing: list[str] = []
    while pending:
        key = pending.pop()
        if key in found:
            continue
        row = graph.pick(key, record.get("run_id"))
        if row is None:
            missing.append(key)
            continue
        found[key] = row
        pending.extend(row.get("parent_keys") or [])
    if missing:  # a parent recorded under another model name (identical definitions share keys)
        extra = _Graph(index.scan(None, filter=pc.field("key").isin(missing)))
        for key in missing:
            row = extra.pick(key)
            if row is not None:
                found[key] = row
    chain = sorted(found.values(), key=lambda r: (_stage_rank(r, order), r.get("ended_at") or _EPOCH))
    return [*chain, dict(record)]


def descendants(index: MetadataIndex, record: Mapping[str, Any], order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Everything derived from `record` (newest record per derived key), in `order` of their stages."""
    graph = _graph_for(index, [record["model"]])
    return _walk_down(graph, [record["key"]] if record.get("key") else [], order)


def _walk_down(graph: _Graph, roots: Sequence[str], order: Sequence[str]) -> list[dict[str, Any]]:
    seen: set[str] = set(roots)
    out = []
    pending = list(roots)
    while pending:
        key = pending.pop()
        for child in sorted(graph.children.get(key, ())):
            if child in seen:
                continue
            seen.add(child)
            row = graph.pick(child)
            if row is not None:
                out.append(row)
                pending.append(child)
    return sorted(out, key=lambda r: (r.get("model") or "", _stage_rank(r, order), r.get("ended_at") or _EPOCH))


def by_weights(index: MetadataIndex, prefix: str, order: Sequence[str] = ()) -> dict[str, Any]:
    """Every source record built from a checkpoint and everything derived from those sources."""
    value = check_prefix(prefix, "weights digest")
    sources = newest_first(index.scan(None, filter=_prefix_filter("weights_digest", value)).to_pylist())
    if not sources:
        raise RecordNotFound(f"no source record uses weights {prefix!r}")
    digests = sorted({r["weights_digest"] for r in sources})
    if len(digests) > 1:
        raise AmbiguousId(
            f"weights prefix {prefix!r} matches {len(digests)} checkpoints: {', '.join(d[:16] + '…' for d in digests[:5])}"
        )
    graph = _graph_for(index, sorted({r["model"] for r in sources}))
    unique_sources: dict[str, dict[str, Any]] = {}
    for row in sources:
        unique_sources.setdefault(row["key"], row)
    derived = _walk_down(graph, list(unique_sources), order)
    return {"weights": digests[0], "sources": list(unique_sources.values()), "descendants": derived}


def decode(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record with its JSON columns parsed and timestamps as ISO strings (for --json output)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in JSON_COLUMNS and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        elif isinstance(value, datetime):
            value = value.astimezone(UTC).isoformat()
        out[key] = value
    return out
