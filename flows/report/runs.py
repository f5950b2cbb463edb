"""The runs of the metadata index: listed by time, the last two, the one before a run, and a run
ID from a unique prefix."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pt2flow.storage.errors import AmbiguousId, RecordNotFound


class NotEnoughRuns(RecordNotFound):
    """The index holds fewer than two runs, so there is nothing to compare."""


def iso(value: Any) -> str | None:
    """A timestamp as an ISO string in UTC (None stays None)."""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat()
    return None if value is None else str(value)


def list_runs(index: Any) -> list[dict[str, Any]]:
    """Every run in the index, oldest first: run_id, started_at, ended_at (ISO strings), records."""
    import pyarrow.compute as pc

    table = index.scan(["run_id", "started_at", "ended_at"], filter=pc.field("run_id").is_valid())
    if table.num_rows == 0:
        return []
    grouped = table.group_by("run_id", use_threads=False).aggregate(
        [("started_at", "min"), ("ended_at", "min"), ("ended_at", "max"), ([], "count_all")]
    )
    runs = []
    for row in grouped.to_pylist():
        start = row["started_at_min"] or row["ended_at_min"]
        runs.append({"run_id": row["run_id"], "started_at": start, "ended_at": row["ended_at_max"], "records": row["count_all"]})
    floor = datetime.min.replace(tzinfo=timezone.utc)
    runs.sort(key=lambda r: (r["started_at"] or floor, r["ended_at"] or floor, r["run_id"]))
    return [{**r, "started_at": iso(r["started_at"]), "ended_at": iso(r["ended_at"])} for r in runs]


def last_two_runs(index: Any) -> tuple[str, str]:
    """(previous, latest) run IDs by time; NotEnoughRuns if the index holds fewer than two runs."""
    runs = list_runs(index)
    if len(runs) < 2:
        raise NotEnoughRuns(
            f"the index holds {len(runs)} run(s) and a report compares two: run the fleet again, or name RUN_A RUN_B"
        )
    return runs[-2]["run_id"], runs[-1]["run_id"]


def previous_run(index: Any, run_id: str) -> str | None:
    """The run that started just before `run_id` (None for the first run); RecordNotFound if unknown."""
    ids = [r["run_id"] for r in list_runs(index)]
    if run_id not in ids:
        raise RecordNotFound(f"no records of run {run_id!r} in the index")
    position = ids.index(run_id)
    return ids[position - 1] if position > 0 else None


def resolve_run(index: Any, text: str) -> str:
    """A run ID from its full text or a unique prefix (like artifact IDs)."""
    ids = [r["run_id"] for r in list_runs(index)]
    if text in ids:
        return text
    matches = [i for i in ids if i.startswith(text)] if text else []
    if not matches:
        raise RecordNotFound(f"no run {text!r} in the index (pt2flow ls shows run IDs)")
    if len(matches) > 1:
        raise AmbiguousId(f"run prefix {text!r} matches {len(matches)} runs: {', '.join(matches[:5])}; give more characters")
    return matches[0]
