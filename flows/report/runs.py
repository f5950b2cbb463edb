"""The runs of the metadata index: listed by time (with the models each covered), a run ID from
a unique prefix, and which runs `report` and `check-compat` take when none is named
(docs/architecture.md §4, "Which runs"):

- report: the newest run (b) against the newest earlier run that covered every model b covered
  (a); when no earlier run did, the earlier run sharing the most models with b (the newest of
  those). The comparison is of b's models: after `run --only m`, report shows m's drift, and the
  models a covered and b did not are named as not compared instead of "only in a".
- check-compat: the fleet, not a partial run. When an earlier run covered more models than the
  newest, including all of the newest run's (the newest run looks like `--only`), the models of
  the newest such run are checked, each from the newest run since then that built it; else the
  newest run alone.

Only the index is read: a run does not record whether it was partial, so a model dropped from a
config stays in check-compat's fleet until a run covers more models again (name the RUN to
choose). Every answer says which runs it took and why (RunSelection).
"""

from __future__ import annotations

from datetime import datetime, UTC
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from pt2flow.storage.errors import AmbiguousId, RecordNotFound


class NotEnoughRuns(RecordNotFound):
    """The index holds fewer than two runs, so there is nothing to compare."""


def iso(value: Any) -> str | None:
    """A timestamp as an ISO string in UTC (None stays None)."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
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
        runs.append(
            {"run_id": row["run_id"], "started_at": start, "ended_at": row["ended_at_max"], "records": row["count_all"]}
        )
    floor = datetime.min.replace(tzinfo=UTC)
    runs.sort(key=lambda r: (r["started_at"] or floor, r["ended_at"] or floor, r["run_id"]))
    return [{**r, "started_at": iso(r["started_at"]), "ended_at": iso(r["ended_at"])} for r in runs]


def run_models(index: Any) -> dict[str, set[str]]:
    """run_id -> the models it has records of (cached records count: a run records every model it covered)."""
    import pyarrow.compute as pc

    table = index.scan(["run_id", "model"], filter=pc.field("run_id").is_valid() & pc.field("model").is_valid())
    covered: dict[str, set[str]] = {}
    if table.num_rows == 0:
        return covered
    for row in table.group_by(["run_id", "model"], use_threads=False).aggregate([]).to_pylist():
        covered.setdefault(row["run_id"], set()).add(row["model"])
    return covered


@dataclass(frozen=True)
class RunSelection:
    """Which runs a report or a check takes, and why (`reason`, one sentence for people).

    report: `runs` is [a, b]; check-compat: `runs` holds every run an artifact is taken from,
    newest first, and `models` maps each checked model to its run. `not_compared`: models of
    the runs taken that are left out (report: a's models b did not cover)."""

    rule: str  # given | newest | covering | most_shared | fleet
    runs: tuple[str, ...]
    reason: str
    models: dict[str, str] = field(default_factory=dict)  # model -> the run it is taken from
    not_compared: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "runs": list(self.runs),
            "reason": self.reason,
            "models": dict(sorted(self.models.items())),
            "not_compared": sorted(self.not_compared),
        }


def _count(n: int, what: str = "model") -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def report_pair(index: Any, newest: str | None = None) -> RunSelection:
    """The runs `report` compares when none is named: `newest` (default: the newest run) against
    its partner (module docstring); NotEnoughRuns when there is no earlier run."""
    runs = [r["run_id"] for r in list_runs(index)]
    if newest is not None and newest not in runs:
        raise RecordNotFound(f"no records of run {newest!r} in the index")
    b_at = runs.index(newest) if newest is not None else len(runs) - 1
    if b_at < 1:
        raise NotEnoughRuns(
            f"the index holds {len(runs)} run(s) and a report compares two: run the fleet again, or name RUN_A RUN_B"
        )
    covered = run_models(index)
    b = runs[b_at]
    mine = covered.get(b, set())
    earlier = runs[:b_at][::-1]  # newest first
    a = next((r for r in earlier if mine <= covered.get(r, set())), None)
    if a is not None:
        rule = "newest" if a == earlier[0] else "covering"
        skipped = earlier.index(a)
        reason = (
            f"{b} is the newest run ({_count(len(mine))}); {a} is the newest earlier run that covered all of them"
            + (f" ({_count(skipped, 'newer run')} covered fewer)" if skipped else "")
        )
    else:
        a = max(earlier, key=lambda r: (len(mine & covered.get(r, set())), -earlier.index(r)))
        rule = "most_shared"
        reason = (
            f"{b} is the newest run ({_count(len(mine))}); no earlier run covered all of them, and {a} shares the most "
            f"({len(mine & covered.get(a, set()))})"
        )
    left_out = covered.get(a, set()) - mine
    if left_out:
        reason += f"; {_count(len(left_out))} of {a} that {b} did not cover {'is' if len(left_out) == 1 else 'are'} not compared"
    return RunSelection(rule, (a, b), reason, models={m: b for m in mine}, not_compared=tuple(sorted(left_out)))


def fleet_runs(index: Any) -> RunSelection:
    """The runs `check-compat` checks when none is named (module docstring): the newest run, or
    when it looks partial, the fleet of the newest earlier run that covered more models
    (including all of its), each model from the newest run since then that built it."""
    runs = [r["run_id"] for r in list_runs(index)]
    if not runs:
        raise RecordNotFound("the index holds no run")
    covered = run_models(index)
    newest = runs[-1]
    mine = covered.get(newest, set())
    fleet_at = next((i for i in range(len(runs) - 2, -1, -1) if mine < covered.get(runs[i], set())), None)
    if fleet_at is None:
        reason = f"{newest} is the newest run ({_count(len(mine))}); no earlier run covered more models including all of them"
        return RunSelection("newest", (newest,), reason, models={m: newest for m in mine})
    fleet = runs[fleet_at]
    models = covered[fleet] | mine
    taken = {m: next(r for r in reversed(runs[fleet_at:]) if m in covered.get(r, set())) for m in models}
    used = tuple(r for r in reversed(runs[fleet_at:]) if r in set(taken.values()))
    older = sum(1 for r in taken.values() if r != newest)
    reason = (
        f"{newest}, the newest run, covered {_count(len(mine))}, fewer than {fleet} ({_count(len(covered[fleet]))}), the newest "
        f"earlier run that covered all of them: the {_count(len(models))} of that fleet are checked, each from the newest run "
        f"that built it ({older} from earlier runs)"
    )
    return RunSelection("fleet", used, reason, models=taken)


def given(runs: Sequence[str]) -> RunSelection:
    """The selection of runs named by the caller."""
    return RunSelection("given", tuple(runs), "named by the caller")


def resolve_run(index: Any, text: str) -> str:
    """A run ID from its full text or a unique prefix or suffix: the date part (`20261130T1730`)
    or the random tail (`d559a4ad`) of `20261130T173000Z-d559a4ad`."""
    ids = [r["run_id"] for r in list_runs(index)]
    if text in ids:
        return text
    prefixed = {i for i in ids if i.startswith(text)} if text else set()
    suffixed = {i for i in ids if i.endswith(text)} if text else set()
    matches = [i for i in ids if i in prefixed or i in suffixed]
    if not matches:
        raise RecordNotFound(
            f"no run {text!r} in the index: give a run ID or a unique prefix or suffix of one (pt2flow ls shows run IDs)"
        )
    if len(matches) > 1:
        part = "prefix" if not suffixed else "suffix" if not prefixed else "prefix or suffix"
        raise AmbiguousId(
            f"run {part} {text!r} matches {len(matches)} runs: {', '.join(matches[:5])}; give more characters"
        )
    return matches[0]
