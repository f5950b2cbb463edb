"""Drift between two runs (`pt2flow report`): what changed for each model, by name, and which
changes are regressions.

Pure functions over the metadata index: no torch, no Prefect. compare_runs() builds one
JSON-ready dict; the terminal table, `--json`, `--html` and the fleet flow's markdown artifact
all render that same dict.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping, Sequence

from flows.cli_support import format_size as _size
from storage.errors import AmbiguousId, RecordNotFound

STAGES = ("source", "trace", "functionalize", "decompose", "serialize", "aot_compile", "validate")
# The graph is read after decompose; a run that stopped earlier (or skipped it) is read at the
# last program stage it has.
GRAPH_STAGES = ("decompose", "functionalize", "trace")

# regression rules (issue 5)
VALIDATION_GROWTH = 10.0  # max abs error grew more than 10x
COST_GROWTH = 1.25  # compile time or artifact size up more than 25 %
# Errors below this are float32 rounding noise: 0 -> 1e-7 is not a 10x regression.
VALIDATION_FLOOR = 1e-6
PLOT_MODELS = 40  # bars per plot; a fleet shows the models that changed most

REPORT_VERSION = 1


class NotEnoughRuns(RecordNotFound):
    """The index holds fewer than two runs, so there is nothing to compare."""


# ---------------------------------------------------------------------------------------------
# runs


def _iso(value: Any) -> str | None:
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
    return [{**r, "started_at": _iso(r["started_at"]), "ended_at": _iso(r["ended_at"])} for r in runs]


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


def compare_with_previous(index: Any, run_id: str) -> dict[str, Any] | None:
    """compare_runs(previous run, run_id), or None when run_id is the first run of the index."""
    before = previous_run(index, run_id)
    return None if before is None else compare_runs(index, before, run_id)


# ---------------------------------------------------------------------------------------------
# comparing


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _pair(a: Any, b: Any) -> dict[str, Any]:
    """Two values of one fact; `changed` only when both runs know it."""
    return {"a": a, "b": b, "changed": a is not None and b is not None and a != b}


def _numbers(a: Any, b: Any) -> dict[str, Any]:
    """Two measurements with their difference and ratio (b / a)."""
    both = a is not None and b is not None
    ratio = None
    if both:
        ratio = (b / a) if a else (None if b else 1.0)
    return {"a": a, "b": b, "delta": (b - a) if both else None, "ratio": ratio, "changed": both and a != b}


def _histogram_diff(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, Any]:
    added = {op: b[op] for op in sorted(set(b) - set(a))}
    removed = {op: a[op] for op in sorted(set(a) - set(b))}
    changed = {op: [a[op], b[op]] for op in sorted(set(a) & set(b)) if a[op] != b[op]}
    return {"added": added, "removed": removed, "changed": changed}


def _newest_per_stage(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """model -> stage -> the newest record of that stage in the run."""
    floor = datetime.min.replace(tzinfo=timezone.utc)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r.get("ended_at") or floor):
        out.setdefault(row["model"], {})[row["stage"]] = dict(row)
    return out


def _original_compile_records(index: Any, cached: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """For cached aot_compile records: the record that really compiled the package (same key,
    else same sha256), newest first. Maps record_id of the cached record -> original record."""
    import pyarrow.compute as pc

    if not cached:
        return {}
    keys = sorted({r["key"] for r in cached if r.get("key")})
    digests = sorted({r["sha256"] for r in cached if r.get("sha256")})
    condition = pc.field("stage") == "aot_compile"
    condition = condition & (pc.field("key").isin(keys) | pc.field("sha256").isin(digests))
    table = index.scan(["record_id", "run_id", "key", "sha256", "status", "cached", "seconds", "ended_at"], filter=condition)
    floor = datetime.min.replace(tzinfo=timezone.utc)
    originals = [r for r in table.to_pylist() if r["status"] == "ok" and not r["cached"] and r["seconds"] is not None]
    originals.sort(key=lambda r: r["ended_at"] or floor, reverse=True)
    found: dict[str, dict[str, Any]] = {}
    for record in cached:
        match = next((o for o in originals if o["key"] and o["key"] == record.get("key")), None)
        match = match or next((o for o in originals if o["sha256"] and o["sha256"] == record.get("sha256")), None)
        if match is not None:
            found[record["record_id"]] = match
    return found


def _state(stages: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any] | None:
    """A model's outcome in one run: ok, or failed at its first failed stage with the error class."""
    if stages is None:
        return None
    failed = [s for s in STAGES if s in stages and stages[s].get("status") != "ok"]
    first = stages[failed[0]] if failed else None
    ran = [s for s in STAGES if s in stages and s != "source"]
    message = (first or {}).get("error_message")
    strategy = (stages.get("trace") or {}).get("strategy")
    return {
        "status": "failed" if failed else "ok",
        "failed_stage": failed[0] if failed else None,
        "error_class": first.get("error_class") if first else None,
        "error": (message[:300] + " …") if message and len(message) > 300 else message,
        "stages": ran,
        "cached": bool(ran) and all(stages[s].get("cached") for s in ran),
        # the trace ladder gave up the dynamic dims: the program takes only the example's shapes
        "trace_strategy": strategy,
        "static_fallback": strategy == "static",
    }


def _status_change(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> str:
    if a is None:
        return "only_in_b"
    if b is None:
        return "only_in_a"
    if a["status"] == "ok" and b["status"] != "ok":
        return "newly_failing"
    if a["status"] != "ok" and b["status"] == "ok":
        return "newly_passing"
    if a["status"] != "ok":
        return "still_failing"
    return "ok"


def _graph(stages: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    for stage in GRAPH_STAGES:
        record = stages.get(stage)
        if record is not None and record.get("status") == "ok":
            return {
                "stage": stage,
                "fingerprint": record.get("fingerprint"),
                "node_count": record.get("node_count"),
                "op_histogram": _loads(record.get("op_histogram")) or {},
                "signature": _loads(record.get("signature")),
                "range_constraints": _loads(record.get("range_constraints")),
            }
    return {}


def _ok(stages: Mapping[str, Mapping[str, Any]], stage: str) -> dict[str, Any] | None:
    record = stages.get(stage)
    return record if record is not None and record.get("status") == "ok" else None


def _compile_time(record: Mapping[str, Any] | None, originals: Mapping[str, Mapping[str, Any]]) -> tuple[float | None, bool, str | None]:
    """(seconds, cached, run that compiled): a cached record's own seconds are a cache lookup,
    so its compile time is the original record's, or unknown."""
    if record is None:
        return None, False, None
    if not record.get("cached"):
        return record.get("seconds"), False, record.get("run_id")
    original = originals.get(record["record_id"])
    return (original["seconds"], True, original["run_id"]) if original else (None, True, None)


def _validation(stages: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    record = stages.get("validate")
    if record is None:
        return {}
    summary = _loads(record.get("validation")) or {}
    return {
        "passed": record.get("passed") if record.get("passed") is not None else summary.get("passed"),
        "max_abs_err": record.get("max_abs_err") if record.get("max_abs_err") is not None else summary.get("max_abs_err"),
        "max_rel_err": record.get("max_rel_err") if record.get("max_rel_err") is not None else summary.get("max_rel_err"),
        "latency_ms": summary.get("latency_ms") or {},
        "cached": bool(record.get("cached")),
    }


def _torch_of(stages: Mapping[str, Mapping[str, Any]] | None) -> str | None:
    if not stages:
        return None
    versions = sorted({r["torch_version"] for r in stages.values() if r.get("torch_version")})
    return ", ".join(versions) or None


def _compare_model(
    name: str,
    a: Mapping[str, Mapping[str, Any]] | None,
    b: Mapping[str, Mapping[str, Any]] | None,
    originals: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    state_a, state_b = _state(a), _state(b)
    entry: dict[str, Any] = {
        "model": name,
        "presence": "both" if a is not None and b is not None else ("a" if a is not None else "b"),
        "status": {"a": state_a, "b": state_b, "change": _status_change(state_a, state_b)},
        "torch_version": _pair(_torch_of(a), _torch_of(b)),
    }
    a, b = a or {}, b or {}
    src_a, src_b = a.get("source") or {}, b.get("source") or {}
    entry["source"] = {
        "factory": _pair(src_a.get("factory"), src_b.get("factory")),
        "kwargs": _pair(_loads(src_a.get("kwargs")), _loads(src_b.get("kwargs"))),
        "code_hash": _pair(src_a.get("code_hash"), src_b.get("code_hash")),
        # no weights (factory init) is a value too: None -> digest is a change
        "weights": {"a": src_a.get("weights_digest"), "b": src_b.get("weights_digest"),
                    "changed": bool(src_a) and bool(src_b) and src_a.get("weights_digest") != src_b.get("weights_digest")},
    }
    static_a, static_b = bool(state_a and state_a["static_fallback"]), bool(state_b and state_b["static_fallback"])
    entry["static_fallback"] = {"a": static_a, "b": static_b, "changed": state_a is not None and state_b is not None and static_a != static_b}
    entry["keys_changed"] = [s for s in STAGES if s in a and s in b and a[s].get("key") and b[s].get("key") and a[s]["key"] != b[s]["key"]]

    graph_a, graph_b = _graph(a), _graph(b)
    hist = _histogram_diff(graph_a.get("op_histogram") or {}, graph_b.get("op_histogram") or {}) if graph_a and graph_b else {"added": {}, "removed": {}, "changed": {}}
    entry["graph"] = {
        "stage": _pair(graph_a.get("stage"), graph_b.get("stage")),
        "fingerprint": _pair(graph_a.get("fingerprint"), graph_b.get("fingerprint")),
        "node_count": _numbers(graph_a.get("node_count"), graph_b.get("node_count")),
        "op_histogram": {**hist, "changed_ops": len(hist["added"]) + len(hist["removed"]) + len(hist["changed"])},
        "signature": _pair(graph_a.get("signature"), graph_b.get("signature")),
        "range_constraints": _pair(graph_a.get("range_constraints"), graph_b.get("range_constraints")),
    }

    archive_a, archive_b = _ok(a, "serialize"), _ok(b, "serialize")
    package_a, package_b = _ok(a, "aot_compile"), _ok(b, "aot_compile")
    entry["archive_size"] = _numbers((archive_a or {}).get("size"), (archive_b or {}).get("size"))
    entry["package_size"] = _numbers((package_a or {}).get("size"), (package_b or {}).get("size"))
    secs_a, cached_a, by_a = _compile_time(package_a, originals)
    secs_b, cached_b, by_b = _compile_time(package_b, originals)
    entry["compile_seconds"] = {
        **_numbers(secs_a, secs_b),
        "a_cached": cached_a,
        "b_cached": cached_b,
        "a_compiled_in": by_a,
        "b_compiled_in": by_b,
    }

    val_a, val_b = _validation(a), _validation(b)
    entry["validation"] = {
        "passed": _pair(val_a.get("passed"), val_b.get("passed")),
        "max_abs_err": _numbers(val_a.get("max_abs_err"), val_b.get("max_abs_err")),
        "max_rel_err": _numbers(val_a.get("max_rel_err"), val_b.get("max_rel_err")),
        "a_cached": val_a.get("cached", False),
        "b_cached": val_b.get("cached", False),
    }
    lat_a, lat_b = val_a.get("latency_ms") or {}, val_b.get("latency_ms") or {}
    entry["latency_ms"] = {k: _numbers(lat_a.get(k), lat_b.get(k)) for k in sorted(set(lat_a) | set(lat_b))} or None

    entry["changes"] = _changes(entry)
    return entry


def _changes(entry: Mapping[str, Any]) -> list[str]:
    """Names of the facts that differ between the runs (timings are measurements, not listed)."""
    if entry["presence"] != "both":
        return ["only_in_" + entry["presence"]]
    out = []
    if entry["status"]["change"] not in ("ok", "still_failing"):
        out.append("status")
    elif entry["status"]["change"] == "still_failing" and (
        (entry["status"]["a"]["failed_stage"], entry["status"]["a"]["error_class"]) != (entry["status"]["b"]["failed_stage"], entry["status"]["b"]["error_class"])
    ):
        out.append("failure")
    for field in ("factory", "kwargs", "code_hash", "weights"):
        if entry["source"][field]["changed"]:
            out.append(field)
    if entry.get("static_fallback", {}).get("changed"):
        out.append("static_fallback")
    if entry["torch_version"]["changed"]:
        out.append("torch_version")
    graph = entry["graph"]
    for field in ("fingerprint", "node_count", "signature", "range_constraints"):
        if graph[field]["changed"]:
            out.append(field)
    if graph["op_histogram"]["changed_ops"]:
        out.append("op_histogram")
    for field in ("archive_size", "package_size"):
        if entry[field]["changed"]:
            out.append(field)
    if entry["validation"]["max_abs_err"]["changed"]:
        out.append("max_abs_err")
    return out


def _run_summary(run_id: str, per_model: Mapping[str, Mapping[str, Mapping[str, Any]]], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    starts = [r.get("started_at") or r.get("ended_at") for r in rows if r.get("started_at") or r.get("ended_at")]
    ends = [r["ended_at"] for r in rows if r.get("ended_at")]
    states = [_state(stages) for stages in per_model.values()]
    return {
        "run_id": run_id,
        "started_at": _iso(min(starts) if starts else None),
        "ended_at": _iso(max(ends) if ends else None),
        "torch_versions": sorted({r["torch_version"] for r in rows if r.get("torch_version")}),
        "models": len(per_model),
        "ok": sum(1 for s in states if s and s["status"] == "ok"),
        "failed": sum(1 for s in states if s and s["status"] != "ok"),
        "records": len(rows),
    }


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _torch_change(a: Sequence[str], b: Sequence[str]) -> dict[str, Any]:
    shown_a, shown_b = ", ".join(a) or None, ", ".join(b) or None
    change = "same"
    if shown_a != shown_b:
        change = "changed"
        if len(a) == 1 and len(b) == 1:
            ta, tb = _version_tuple(a[0]), _version_tuple(b[0])
            change = "upgrade" if tb > ta else ("downgrade" if tb < ta else "changed")
    return {"a": shown_a, "b": shown_b, "change": change, "changed": change != "same"}


def compare_runs(index: Any, run_a: str, run_b: str) -> dict[str, Any]:
    """Compare every model (by name) of run_a (before) with run_b (after).

    Returns a JSON-ready dict: {"runs": {"a", "b"}, "torch", "summary", "models": [per-model
    entries], "only_in_a", "only_in_b", "regressions"}. Raises RecordNotFound for an unknown run.
    """
    import pyarrow.compute as pc

    table = index.scan(None, filter=pc.field("run_id").isin([run_a, run_b]))
    rows = table.to_pylist()
    rows_a = [r for r in rows if r["run_id"] == run_a]
    rows_b = [r for r in rows if r["run_id"] == run_b]
    for run, found in ((run_a, rows_a), (run_b, rows_b)):
        if not found:
            raise RecordNotFound(f"no records of run {run!r} in the index")
    per_a, per_b = _newest_per_stage(rows_a), _newest_per_stage(rows_b)
    cached = [s["aot_compile"] for per in (per_a, per_b) for s in per.values() if s.get("aot_compile", {}).get("cached")]
    originals = _original_compile_records(index, cached)

    models = [_compare_model(name, per_a.get(name), per_b.get(name), originals) for name in sorted(set(per_a) | set(per_b))]
    run_info = {"a": _run_summary(run_a, per_a, rows_a), "b": _run_summary(run_b, per_b, rows_b)}
    torch = _torch_change(run_info["a"]["torch_versions"], run_info["b"]["torch_versions"])
    both = [m for m in models if m["presence"] == "both"]
    changes = [m["status"]["change"] for m in models]
    comparison: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "runs": run_info,
        "torch": torch,
        "summary": {
            "models": len(models),
            "in_both": len(both),
            "only_in_a": changes.count("only_in_a"),
            "only_in_b": changes.count("only_in_b"),
            "newly_failing": changes.count("newly_failing"),
            "newly_passing": changes.count("newly_passing"),
            "still_failing": changes.count("still_failing"),
            "changed": sum(1 for m in both if m["changes"]),
            "unchanged": sum(1 for m in both if not m["changes"]),
            # a torch upgrade changes every stage key (the source key does not depend on torch)
            "all_keys_changed": sum(
                1 for m in both
                if m["keys_changed"] and set(m["keys_changed"]) >= set(m["status"]["a"]["stages"]) & set(m["status"]["b"]["stages"])
            ),
        },
        "models": models,
        "only_in_a": [m["model"] for m in models if m["presence"] == "a"],
        "only_in_b": [m["model"] for m in models if m["presence"] == "b"],
    }
    comparison["regressions"] = regressions(comparison)
    comparison["summary"]["regressions"] = len(comparison["regressions"])
    return comparison


# ---------------------------------------------------------------------------------------------
# regressions


def regressions(
    comparison: Mapping[str, Any],
    *,
    validation_growth: float = VALIDATION_GROWTH,
    cost_growth: float = COST_GROWTH,
    validation_floor: float = VALIDATION_FLOOR,
) -> list[dict[str, Any]]:
    """The changes that need a person: a model that stopped exporting, a validation error that
    grew more than `validation_growth` times (from at least `validation_floor`), compile time or
    archive/package size up more than `cost_growth` - 1, a model that exported with dynamic dims
    and now falls back to static shapes. Each: {model, rule, a, b, ratio, message}; rule is
    stopped_exporting | validation_error_grew | compile_time_up | archive_size_up |
    package_size_up | static_fallback; message says what happened, without the model's name."""
    found: list[dict[str, Any]] = []

    def flag(model: str, rule: str, a: Any, b: Any, message: str) -> None:
        ratio = (b / a) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
        found.append({"model": model, "rule": rule, "a": a, "b": b, "ratio": ratio, "message": message})

    for entry in comparison.get("models", []):
        name = entry["model"]
        status = entry["status"]
        if status["change"] == "newly_failing":
            after = status["b"]
            flag(name, "stopped_exporting", "ok", after["status"],
                 f"stopped exporting: fails at {after['failed_stage']} ({after['error_class']})")
        if entry.get("static_fallback", {}).get("changed") and entry["static_fallback"]["b"] and status["change"] == "ok":
            flag(name, "static_fallback", "dynamic", "static",
                 "exported with static shapes: every dynamic strategy failed, so the program takes only the example's sizes")
        err = entry.get("validation", {}).get("max_abs_err", {})
        a, b = err.get("a"), err.get("b")
        if a is not None and b is not None and b > validation_growth * max(a, validation_floor):
            flag(name, "validation_error_grew", a, b, f"validation max abs error {_err(a)} → {_err(b)} (more than {validation_growth:g}×)")
        for field, rule, label, fmt in (
            ("compile_seconds", "compile_time_up", "compile time", _secs),
            ("archive_size", "archive_size_up", "archive size", _size),
            ("package_size", "package_size_up", "package size", _size),
        ):
            pair = entry.get(field) or {}
            a, b = pair.get("a"), pair.get("b")
            if a and b is not None and b > cost_growth * a:
                flag(name, rule, a, b, f"{label} {fmt(a)} → {fmt(b)} (+{(b / a - 1) * 100:.0f} %, limit +{(cost_growth - 1) * 100:.0f} %)")
    return found


# ---------------------------------------------------------------------------------------------
# formatting helpers


def _secs(value: Any) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _err(value: Any) -> str:
    return "-" if value is None else f"{value:.2e}"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _arrow(pair: Mapping[str, Any], fmt: Callable[[Any], str]) -> str:
    """`a → b`, or one value when both runs agree; '-' for a side that has none."""
    a, b = pair.get("a"), pair.get("b")

    def show(value: Any) -> str:
        return "-" if value is None else fmt(value)

    if a == b:
        return show(a)
    return f"{show(a)} → {show(b)}"


def _when(iso: Any) -> str:
    if not iso:
        return "?"
    try:
        return datetime.fromisoformat(str(iso)).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return str(iso)


def _pct(pair: Mapping[str, Any]) -> str:
    ratio = pair.get("ratio")
    if ratio is None or not pair.get("changed"):
        return ""
    return f" ({(ratio - 1) * 100:+.0f} %)"


def _status_text(entry: Mapping[str, Any]) -> str:
    status = entry["status"]
    change = status["change"]

    def side(state: Mapping[str, Any] | None) -> str:
        if state is None:
            return "absent"
        if state["status"] == "ok":
            text = "ok (cached)" if state.get("cached") else "ok"
            return text + (" static!" if state.get("static_fallback") else "")
        return f"failed at {state['failed_stage']} ({state['error_class']})"

    if change == "ok":
        return side(status["b"])
    if change == "only_in_a":
        return f"only before ({side(status['a'])})"
    if change == "only_in_b":
        return f"only after ({side(status['b'])})"
    label = change.replace("_", " ")
    return f"{label}: {side(status['a'])} → {side(status['b'])}"


def _signature_text(signature: Any) -> str:
    if not isinstance(signature, Mapping):
        return "-"

    def tensor(item: Mapping[str, Any]) -> str:
        shape = ",".join(str(d) for d in item.get("shape") or [])
        return f"{item.get('dtype', '?')}[{shape}]"

    ins = ", ".join(f"{i.get('name', '?')}: {tensor(i)}" for i in signature.get("inputs") or [])
    outs = ", ".join(tensor(o) for o in signature.get("outputs") or [])
    return f"({ins}) -> ({outs})"


def _ranges_text(ranges: Any) -> str:
    if not isinstance(ranges, Mapping) or not ranges:
        return "static" if isinstance(ranges, Mapping) else "-"
    return ", ".join(f"{sym}∈[{lo},{hi}]" for sym, (lo, hi) in sorted(ranges.items()))


def _ops_text(entry: Mapping[str, Any], limit: int = 6) -> str:
    hist = entry["graph"]["op_histogram"]
    parts = [f"+{op} ×{n}" for op, n in hist["added"].items()]
    parts += [f"-{op} ×{n}" for op, n in hist["removed"].items()]
    parts += [f"~{op} {x}→{y}" for op, (x, y) in hist["changed"].items()]
    if not parts:
        return "same" if entry["presence"] == "both" and entry["graph"]["stage"]["a"] else "-"
    more = f" (+{len(parts) - limit} more)" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def _latency_text(entry: Mapping[str, Any]) -> str:
    """Median latency per runner (benchmark: true), before → after."""
    latency = entry.get("latency_ms") or {}
    parts = [f"{name} {_arrow(latency[name], lambda v: f'{v:.3f}')}" for name in ("eager", "archive", "compiled") if name in latency]
    return ", ".join(parts) + " ms" if parts else "-"


def _torch_line(comparison: Mapping[str, Any]) -> str:
    torch = comparison["torch"]
    if not torch["changed"]:
        return f"torch {torch['b'] or '?'} in both runs"
    verb = {"upgrade": "upgraded", "downgrade": "downgraded"}.get(torch["change"], "changed")
    keyed = comparison["summary"].get("all_keys_changed", 0)
    return (
        f"torch {verb}: {torch['a']} → {torch['b']} — every stage key of {keyed} of "
        f"{comparison['summary']['in_both']} model(s) changed, so every artifact was rebuilt"
    )


def _row_order(comparison: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Regressed models first, then changed, then the rest; by name within each group."""
    flagged = {r["model"] for r in regressions(comparison)}
    return sorted(comparison["models"], key=lambda m: (m["model"] not in flagged, not m["changes"], m["model"]))


def _flagged_fields(found: Sequence[Mapping[str, Any]]) -> dict[str, set[str]]:
    fields = {"stopped_exporting": "status", "validation_error_grew": "max_abs_err", "compile_time_up": "compile_seconds",
              "archive_size_up": "archive_size", "package_size_up": "package_size"}
    out: dict[str, set[str]] = {}
    for r in found:
        out.setdefault(r["model"], set()).add(fields[r["rule"]])
    return out


# ---------------------------------------------------------------------------------------------
# markdown (the fleet flow's Prefect artifact)


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(comparison: Mapping[str, Any], *, max_rows: int = 200) -> str:
    """A Markdown summary: runs, torch versions, regressions, a per-model table (regressed and
    changed models first, at most `max_rows`), op changes, models in only one run."""
    runs, summary = comparison["runs"], comparison["summary"]
    found = regressions(comparison)
    lines = [
        f"# pt2flow drift report: `{runs['a']['run_id']}` → `{runs['b']['run_id']}`",
        "",
        f"- before: `{runs['a']['run_id']}` ({_when(runs['a']['started_at'])}, torch {', '.join(runs['a']['torch_versions']) or '?'}): "
        f"{runs['a']['ok']} ok, {runs['a']['failed']} failed",
        f"- after: `{runs['b']['run_id']}` ({_when(runs['b']['started_at'])}, torch {', '.join(runs['b']['torch_versions']) or '?'}): "
        f"{runs['b']['ok']} ok, {runs['b']['failed']} failed",
        f"- {_torch_line(comparison)}",
        f"- {summary['models']} model(s): {summary['changed']} changed, {summary['unchanged']} unchanged, "
        f"{summary['newly_failing']} newly failing, {summary['newly_passing']} newly passing, "
        f"{summary['only_in_a']} only before, {summary['only_in_b']} only after",
        "",
    ]
    if found:
        lines += [f"## ⚠️ {len(found)} regression(s)", ""]
        lines += [f"- **{_md(r['model'])}**: {_md(r['message'])} (`{r['rule']}`)" for r in found]
    else:
        lines += ["## No regressions"]
    lines += [
        "",
        "## Models",
        "",
        "| model | status | changes | nodes | ops after decompose | archive | package | compile time | max abs err | latency |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    flagged = _flagged_fields(found)
    rows = _row_order(comparison)
    for entry in rows[:max_rows]:
        marks = flagged.get(entry["model"], set())

        def cell(field: str, text: str) -> str:
            return f"**{_md(text)}** ⚠️" if field in marks else _md(text)

        lines.append(
            "| " + " | ".join([
                ("⚠️ " if marks else "") + f"`{_md(entry['model'])}`",
                cell("status", _status_text(entry)),
                _md(", ".join(entry["changes"]) or "-"),
                _md(_arrow(entry["graph"]["node_count"], str)),
                _md(_ops_text(entry)),
                cell("archive_size", _arrow(entry["archive_size"], _size) + _pct(entry["archive_size"])),
                cell("package_size", _arrow(entry["package_size"], _size) + _pct(entry["package_size"])),
                cell("compile_seconds", _compile_text(entry)),
                cell("max_abs_err", _arrow(entry["validation"]["max_abs_err"], _err)),
                _md(_latency_text(entry)),
            ]) + " |"
        )
    if len(rows) > max_rows:
        lines.append(f"\n… {len(rows) - max_rows} more model(s) not shown (`pt2flow report --html` shows all).")
    details = [m for m in rows if m["presence"] == "both" and (m["graph"]["signature"]["changed"] or m["graph"]["range_constraints"]["changed"] or m["source"]["kwargs"]["changed"])]
    if details:
        lines += ["", "## Graph and source changes", ""]
        for entry in details[:max_rows]:
            graph, source = entry["graph"], entry["source"]
            if source["kwargs"]["changed"]:
                lines.append(f"- `{entry['model']}` kwargs: `{json.dumps(source['kwargs']['a'])}` → `{json.dumps(source['kwargs']['b'])}`")
            if graph["signature"]["changed"]:
                lines.append(f"- `{entry['model']}` signature: `{_md(_signature_text(graph['signature']['a']))}` → `{_md(_signature_text(graph['signature']['b']))}`")
            if graph["range_constraints"]["changed"]:
                lines.append(f"- `{entry['model']}` range constraints: {_md(_ranges_text(graph['range_constraints']['a']))} → {_md(_ranges_text(graph['range_constraints']['b']))}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# HTML: one self-contained page (inline CSS and SVG, no scripts, nothing fetched)

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d2430;background:#fff}
h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:28px 0 8px}
.muted{color:#66707d}.runs{display:grid;grid-template-columns:auto 1fr;gap:2px 12px;margin:10px 0}
.banner{padding:8px 12px;border-radius:6px;margin:10px 0;background:#eef3fb;border:1px solid #c9d8f0}
.banner.torch{background:#fff7e0;border-color:#f0d68a}
.chips span{display:inline-block;padding:2px 10px;margin:2px 4px 2px 0;border-radius:12px;background:#eef0f3}
.chips span.bad{background:#fbe3e3;color:#a11}.chips span.good{background:#e2f5e8;color:#146c2e}
ul.regressions li{color:#a11;margin:2px 0}
.scroll{overflow-x:auto}table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border-bottom:1px solid #e3e6ea;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#f6f7f9;position:sticky;top:0}td.num{text-align:right;white-space:nowrap}
tr.regressed td{background:#fff1f1}td.bad{color:#a11;font-weight:600}
tr.changed td:first-child{border-left:3px solid #2f6fde}tr.regressed td:first-child{border-left:3px solid #d64545}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}.ok{color:#146c2e}.failed{color:#a11}
.plots{display:flex;flex-wrap:wrap;gap:24px}figure{margin:0}figcaption{font-weight:600;margin-bottom:4px}
details{margin:4px 0}summary{cursor:pointer}.add{color:#146c2e}.rem{color:#a11}.chg{color:#8a5a00}
"""

_COLOR_A, _COLOR_B, _COLOR_BAD = "#9aa5b1", "#2f6fde", "#d64545"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _anchor(name: str) -> str:
    return "model-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _ticks(top: float, binary: bool = False) -> list[float]:
    """Round axis ticks from 0 to at least `top` (in powers of 1024 for sizes: 0, 5 KB, 10 KB...)."""
    if top <= 0:
        return [0.0, 1.0]
    unit = 1.0
    while binary and top / unit >= 1024:
        unit *= 1024
    scaled = top / unit
    step = 10 ** math.floor(math.log10(scaled / 4)) if scaled >= 4 else 10 ** math.floor(math.log10(scaled)) / 2
    for mult in (1, 2, 2.5, 5, 10):
        if scaled / (step * mult) <= 5:
            step *= mult
            break
    return [i * step * unit for i in range(math.ceil(scaled / step - 1e-9) + 1)]


def _bar_chart(title: str, unit: Callable[[Any], str], rows: Sequence[tuple[str, Any, Any, bool]], *, note: str = "", binary: bool = False) -> str:
    """A horizontal grouped bar chart (before grey, after blue, a regression red) as inline SVG."""
    rows = [r for r in rows if r[1] is not None or r[2] is not None]
    if not rows:
        return (f'<figure><figcaption>{_e(title)}</figcaption><svg xmlns="http://www.w3.org/2000/svg" width="460" height="40" role="img" aria-label="{_e(title)}: no data">'
                f'<text x="8" y="24" font-size="12" fill="#66707d">no records in either run</text></svg></figure>')
    label_w, plot_w, value_w, bar_h, gap, top_pad = 170, 320, 130, 10, 10, 24
    group_h = 2 * bar_h + gap
    height = top_pad + group_h * len(rows) + 24
    width = label_w + plot_w + value_w
    top_value = max(v for r in rows for v in (r[1], r[2]) if v is not None) or 1.0
    ticks = _ticks(top_value, binary)
    scale_top = max(ticks[-1], top_value)
    x = lambda v: label_w + plot_w * (v / scale_top if scale_top else 0)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}" font-size="11">']
    parts.append(f'<rect x="{label_w + 4}" y="4" width="10" height="10" fill="{_COLOR_A}" /><text x="{label_w + 18}" y="13">before</text>')
    parts.append(f'<rect x="{label_w + 70}" y="4" width="10" height="10" fill="{_COLOR_B}" /><text x="{label_w + 84}" y="13">after</text>')
    parts.append(f'<rect x="{label_w + 126}" y="4" width="10" height="10" fill="{_COLOR_BAD}" /><text x="{label_w + 140}" y="13">regression</text>')
    axis_y = top_pad + group_h * len(rows)
    for tick in ticks:
        tx = x(tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{top_pad - 2}" x2="{tx:.1f}" y2="{axis_y}" stroke="#e3e6ea" />')
        parts.append(f'<text x="{tx:.1f}" y="{axis_y + 14}" text-anchor="middle" fill="#66707d">{_e(unit(tick))}</text>')
    for i, (name, a, b, bad) in enumerate(rows):
        y0 = top_pad + i * group_h
        shown = name if len(name) <= 26 else name[:25] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{y0 + bar_h + 4}" text-anchor="end"><title>{_e(name)}</title>{_e(shown)}</text>')
        for j, (value, color, which) in enumerate(((a, _COLOR_A, "before"), (b, _COLOR_BAD if bad else _COLOR_B, "after"))):
            y = y0 + j * bar_h
            if value is None:
                parts.append(f'<text x="{label_w + 2}" y="{y + bar_h - 1}" fill="#66707d">n/a</text>')
                continue
            w = max(x(value) - label_w, 1.0)
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 1}" fill="{color}"><title>{_e(name)} {which}: {_e(unit(value))}</title></rect>')
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 1}" fill="#1d2430">{_e(unit(value))}</text>')
    parts.append(f'<line x1="{label_w}" y1="{top_pad - 2}" x2="{label_w}" y2="{axis_y}" stroke="#66707d" />')
    parts.append("</svg>")
    caption = _e(title) + (f' <span class="muted">{_e(note)}</span>' if note else "")
    return f"<figure><figcaption>{caption}</figcaption>{''.join(parts)}</figure>"


def _plot_rows(comparison: Mapping[str, Any], field: str, rule: str, found: Sequence[Mapping[str, Any]], limit: int) -> tuple[list[tuple[str, Any, Any, bool]], str]:
    bad = {r["model"] for r in found if r["rule"] == rule}
    rows = [(m["model"], m[field]["a"], m[field]["b"], m["model"] in bad) for m in comparison["models"] if m[field]["a"] is not None or m[field]["b"] is not None]
    note = ""
    if len(rows) > limit:
        def movement(row: tuple[str, Any, Any, bool]) -> float:
            a, b = row[1], row[2]
            return float("inf") if a is None or b is None or not a else abs(b / a - 1)
        keep = {r[0] for r in sorted(rows, key=lambda r: (not r[3], -movement(r), r[0]))[:limit]}
        note = f"the {limit} of {len(rows)} models that moved most"
        rows = [r for r in rows if r[0] in keep]
    return rows, note


def _cell(text: str, *, num: bool = False, bad: bool = False, title: str | None = None) -> str:
    classes = " ".join(c for c in ("num" if num else "", "bad" if bad else "") if c)
    attrs = (f' class="{classes}"' if classes else "") + (f' title="{_e(title)}"' if title else "")
    return f"<td{attrs}>{_e(text)}</td>"


def to_html(comparison: Mapping[str, Any], *, plot_models: int = PLOT_MODELS) -> str:
    """One self-contained HTML page: runs, torch versions, regressions, a per-model table,
    SVG plots of compile time and sizes per model (before vs after), op changes per model."""
    runs, summary = comparison["runs"], comparison["summary"]
    found = regressions(comparison)
    flagged = _flagged_fields(found)
    title = f"pt2flow drift report: {runs['a']['run_id']} → {runs['b']['run_id']}"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        '<div class="runs">',
    ]
    for side, label in (("a", "before"), ("b", "after")):
        run = runs[side]
        out.append(
            f"<b>{label}</b><span><code>{_e(run['run_id'])}</code> · started {_e(_when(run['started_at']))} · "
            f"torch {_e(', '.join(run['torch_versions']) or '?')} · {run['ok']} ok, {run['failed']} failed</span>"
        )
    out.append("</div>")
    out.append(f'<div class="banner{" torch" if comparison["torch"]["changed"] else ""}">{_e(_torch_line(comparison))}</div>')
    chips = [
        (f"{summary['models']} models", ""),
        (f"{summary['changed']} changed", ""),
        (f"{summary['unchanged']} unchanged", ""),
        (f"{summary['newly_failing']} newly failing", "bad" if summary["newly_failing"] else ""),
        (f"{summary['newly_passing']} newly passing", "good" if summary["newly_passing"] else ""),
        (f"{summary['only_in_a']} only before", ""),
        (f"{summary['only_in_b']} only after", ""),
        (f"{len(found)} regressions", "bad" if found else "good"),
    ]
    out.append('<div class="chips">' + "".join(f'<span class="{c}">{_e(t)}</span>' if c else f"<span>{_e(t)}</span>" for t, c in chips) + "</div>")

    out.append("<h2>Regressions</h2>")
    if found:
        out.append('<ul class="regressions">' + "".join(f'<li><a href="#{_anchor(r["model"])}">{_e(r["model"])}</a>: {_e(r["message"])}</li>' for r in found) + "</ul>")
    else:
        out.append('<p class="ok">None: no model stopped exporting, no validation error grew 10×, no compile time or size grew more than 25 %.</p>')

    out.append("<h2>Models</h2>")
    out.append('<div class="scroll"><table><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in (
        "model", "status", "changes", "nodes", "ops after decompose", "signature", "range constraints",
        "archive", "package", "compile time", "max abs err", "latency",
    )) + "</tr></thead><tbody>")
    for entry in _row_order(comparison):
        name = entry["model"]
        marks = flagged.get(name, set())
        row_class = "regressed" if marks else ("changed" if entry["changes"] else "")
        graph = entry["graph"]
        status_class = "failed" if (entry["status"]["b"] or {}).get("status") == "failed" else "ok"
        cells = [
            f'<td><a id="{_anchor(name)}"></a><b>{_e(name)}</b></td>',
            f'<td class="{"bad" if "status" in marks else status_class}" title="{_e((entry["status"]["b"] or {}).get("error") or "")}">{_e(_status_text(entry))}</td>',
            _cell(", ".join(entry["changes"]) or "-"),
            _cell(_arrow(graph["node_count"], str), num=True),
            _cell(_ops_text(entry)),
            _cell(_signature_cell(entry)),
            _cell(_arrow(graph["range_constraints"], _ranges_text)),
            _cell(_arrow(entry["archive_size"], _size) + _pct(entry["archive_size"]), num=True, bad="archive_size" in marks),
            _cell(_arrow(entry["package_size"], _size) + _pct(entry["package_size"]), num=True, bad="package_size" in marks),
            _cell(_compile_text(entry), num=True, bad="compile_seconds" in marks),
            _cell(_arrow(entry["validation"]["max_abs_err"], _err), num=True, bad="max_abs_err" in marks),
            _cell(_latency_text(entry)),
        ]
        out.append(f'<tr class="{row_class}">' if row_class else "<tr>")
        out.append("".join(cells) + "</tr>")
    out.append("</tbody></table></div>")

    out.append("<h2>Plots</h2><div class=\"plots\">")
    for field, rule, label, unit in (
        ("compile_seconds", "compile_time_up", "AOTInductor compile time per model", _secs),
        ("archive_size", "archive_size_up", "Serialized archive (.pt2) size per model", _size),
        ("package_size", "package_size_up", "AOTInductor package size per model", _size),
    ):
        rows, note = _plot_rows(comparison, field, rule, found, plot_models)
        out.append(_bar_chart(label, unit, rows, note=note, binary=unit is _size))
    out.append("</div>")

    detailed = [m for m in _row_order(comparison) if m["presence"] == "both" and m["changes"]]
    if detailed:
        out.append("<h2>What changed, per model</h2>")
        for entry in detailed:
            out.append(_details_html(entry))
    for side, label in (("a", "before"), ("b", "after")):
        names = comparison["only_in_" + side]
        if names:
            out.append(f"<h2>Only in the {label} run</h2><p>" + ", ".join(f"<code>{_e(n)}</code>" for n in names) + "</p>")
    out.append(f'<p class="muted">pt2flow report v{comparison.get("report_version", REPORT_VERSION)} · regression rules: stopped exporting; validation max abs error ×{VALIDATION_GROWTH:g}; compile time or size +{(COST_GROWTH - 1) * 100:.0f} %.</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _signature_cell(entry: Mapping[str, Any]) -> str:
    signature = entry["graph"]["signature"]
    if signature["changed"]:
        return "changed (below)"
    if entry["presence"] == "both" and signature["a"] is not None:
        return "same"
    return _signature_text(signature["b"] or signature["a"])


def _compile_text(entry: Mapping[str, Any]) -> str:
    pair = entry["compile_seconds"]
    text = _arrow(pair, _secs) + _pct(pair)
    if (pair.get("a_cached") and pair.get("a") is None) or (pair.get("b_cached") and pair.get("b") is None):
        text += " (cached, original unknown)"
    elif pair.get("b_cached"):
        text += " (cached)"
    return text


def _details_html(entry: Mapping[str, Any]) -> str:
    graph, source = entry["graph"], entry["source"]
    items = []
    if entry["status"]["change"] != "ok":
        items.append(f"<li>status: {_e(_status_text(entry))}</li>")
        error = (entry["status"]["b"] or {}).get("error")
        if error:
            items.append(f"<li>error: <code>{_e(error)}</code></li>")
    for field in ("factory", "kwargs", "code_hash", "weights"):
        pair = source[field]
        if pair["changed"]:
            show = (lambda v: json.dumps(v, sort_keys=True)) if field == "kwargs" else (lambda v: str(v)[:16] if v else "none")
            items.append(f"<li>{_e(field)}: <code>{_e(show(pair['a']))}</code> → <code>{_e(show(pair['b']))}</code></li>")
    if entry["torch_version"]["changed"]:
        items.append(f"<li>torch: {_e(entry['torch_version']['a'])} → {_e(entry['torch_version']['b'])}</li>")
    if entry["keys_changed"]:
        items.append(f"<li>derivation keys changed for: {_e(', '.join(entry['keys_changed']))}</li>")
    if graph["signature"]["changed"]:
        items.append(f"<li>signature: <code>{_e(_signature_text(graph['signature']['a']))}</code> → <code>{_e(_signature_text(graph['signature']['b']))}</code></li>")
    if graph["range_constraints"]["changed"]:
        items.append(f"<li>range constraints: {_e(_ranges_text(graph['range_constraints']['a']))} → {_e(_ranges_text(graph['range_constraints']['b']))}</li>")
    if graph["node_count"]["changed"]:
        items.append(f"<li>node count: {graph['node_count']['a']} → {graph['node_count']['b']}</li>")
    hist = graph["op_histogram"]
    ops = [f'<li class="add">+ <code>{_e(op)}</code> ×{n}</li>' for op, n in hist["added"].items()]
    ops += [f'<li class="rem">− <code>{_e(op)}</code> ×{n}</li>' for op, n in hist["removed"].items()]
    ops += [f'<li class="chg">~ <code>{_e(op)}</code> {x} → {y}</li>' for op, (x, y) in hist["changed"].items()]
    if ops:
        items.append(f"<li>ops after {_e(graph['stage']['b'] or 'decompose')}:<ul>{''.join(ops)}</ul></li>")
    return f'<details open><summary><b>{_e(entry["model"])}</b>: {_e(", ".join(entry["changes"]))}</summary><ul>{"".join(items)}</ul></details>'


# ---------------------------------------------------------------------------------------------
# terminal


def render_terminal(comparison: Mapping[str, Any], console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    runs = comparison["runs"]
    found = regressions(comparison)
    flagged = _flagged_fields(found)
    console.print(f"[bold]drift[/bold] {runs['a']['run_id']} ({_when(runs['a']['started_at'])}) → {runs['b']['run_id']} ({_when(runs['b']['started_at'])})", highlight=False)
    console.print(Text(_torch_line(comparison), style="bold yellow" if comparison["torch"]["changed"] else ""))
    view = Table(title_justify="left")
    for column, justify in (("model", "left"), ("status", "left"), ("changes", "left"), ("nodes", "right"), ("ops after decompose", "left"),
                            ("archive", "right"), ("package", "right"), ("compile", "right"), ("max abs err", "right"), ("latency", "left")):
        view.add_column(column, justify=justify)  # type: ignore[arg-type]
    for entry in _row_order(comparison):
        marks = flagged.get(entry["model"], set())

        def cell(field: str, text: str) -> Text:
            return Text(text, style="bold red" if field in marks else "")

        change = entry["status"]["change"]
        status_style = {"newly_failing": "bold red", "still_failing": "red", "newly_passing": "green", "only_in_a": "dim", "only_in_b": "cyan"}.get(change, "")
        view.add_row(
            Text(entry["model"], style="bold red" if marks else "bold"),
            Text(_status_text(entry), style=status_style),
            Text(", ".join(entry["changes"]) or "-", style="yellow" if entry["changes"] else "dim"),
            _arrow(entry["graph"]["node_count"], str),
            Text(_ops_text(entry, limit=3)),
            cell("archive_size", _arrow(entry["archive_size"], _size) + _pct(entry["archive_size"])),
            cell("package_size", _arrow(entry["package_size"], _size) + _pct(entry["package_size"])),
            cell("compile_seconds", _compile_text(entry)),
            cell("max_abs_err", _arrow(entry["validation"]["max_abs_err"], _err)),
            _latency_text(entry),
        )
    console.print(view)
    if found:
        console.print(f"[bold red]{len(found)} regression(s):[/bold red]")
        for r in found:
            console.print(Text(f"  ✗ {r['model']}: {r['message']}", style="red"))
    else:
        console.print("[green]no regressions[/green]")


# ---------------------------------------------------------------------------------------------
# CLI


def cmd_report(args: argparse.Namespace) -> int:
    from flows.cli_support import EXIT_FAILED, EXIT_OK, CommandUsageError, dump, open_store, rich_console

    if len(args.runs) not in (0, 2):
        raise CommandUsageError("give two runs (RUN_A RUN_B), or none for the last two runs of the store")
    store = open_store(args)
    if args.runs:
        run_a, run_b = (resolve_run(store.index, r) for r in args.runs)
    else:
        run_a, run_b = last_two_runs(store.index)
    comparison = compare_runs(store.index, run_a, run_b)
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as fh:
                fh.write(to_html(comparison))
        except OSError as exc:
            raise CommandUsageError(f"cannot write {args.html}: {exc}") from exc
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        dump(comparison)
    else:
        render_terminal(comparison, rich_console())
    return EXIT_FAILED if args.fail_on_regression and comparison["regressions"] else EXIT_OK


def add_command(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    from flows.cli_support import guard

    p = sub.add_parser(
        "report",
        help="drift between two runs (default: the last two)",
        description="Compare each model, by name, between two runs: status, op histogram after decompose, node count, "
        "signature, range constraints, archive and package sizes, compile time, validation error, latency, torch version. "
        "Flags regressions (stopped exporting, validation error x10, compile time or size +25 %).",
    )
    p.add_argument("runs", metavar="RUN", nargs="*", help="RUN_A RUN_B (run IDs or unique prefixes); default: the last two runs")
    store_arg(p)
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON document")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page with plots")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a regression is flagged")
    p.set_defaults(func=guard(cmd_report))
