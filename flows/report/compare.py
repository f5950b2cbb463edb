"""Comparing two runs model by model (by name): status, source, graph, sizes, compile time,
validation and latency. build_report() makes the one DriftReport (flows/report/drift.py) every
view renders, as the dict compare_runs() returns."""

from __future__ import annotations

import re
from datetime import datetime, UTC
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from pt2flow.flows import pipeline
from pt2flow.flows.report.drift import (
    ArtifactFacts,
    CompileSeconds,
    DriftReport,
    DriftSummary,
    GraphFacts,
    ModelDrift,
    ModelState,
    Numbers,
    OpHistogramDiff,
    Pair,
    Regression,
    RunInfo,
    Runs,
    Selection,
    SourceFacts,
    StatusChange,
    TorchChange,
    ValidationFacts,
)
from pt2flow.flows.pipeline.stage import TIMINGS
from pt2flow.flows.report.failures import run_groups
from pt2flow.flows.report.rules import regressions
from pt2flow.flows.report.runs import NotEnoughRuns, RunSelection, given, iso, report_pair
from pt2flow.flows.report.text import decoded, op_changes
from pt2flow.storage.errors import RecordNotFound


def stage_columns() -> tuple[str, ...]:
    """The stages a report walks, the source first, in pipeline order (flows/pipeline)."""
    return ("source", *pipeline.names())


def graph_stages() -> tuple[str, ...]:
    """Where the graph is read: the newest program stage a run has (decompose, else
    functionalize, else trace)."""
    return tuple(reversed(pipeline.program_stages()))


REPORT_VERSION = 1

Stages = Mapping[str, Mapping[str, Any]]  # stage -> the newest record of that stage


def compare_with_previous(index: Any, run_id: str) -> dict[str, Any] | None:
    """run_id against the run `report` would pair it with (runs.report_pair: the newest earlier
    run that covered its models), or None when run_id is the first run of the index."""
    try:
        selection = report_pair(index, run_id)
    except NotEnoughRuns:
        return None
    return build_report(index, *selection.runs, selection=selection).model_dump(mode="json")


def compare_default(index: Any) -> dict[str, Any]:
    """The report of `pt2flow report` without runs: the newest run against its partner
    (runs.report_pair), its models only, with the selection saying which runs and why."""
    selection = report_pair(index)
    return build_report(index, *selection.runs, selection=selection).model_dump(mode="json")


def compare_runs(index: Any, run_a: str, run_b: str) -> dict[str, Any]:
    """Compare every model (by name) of run_a (before) with run_b (after): build_report() as
    its JSON dict {"report_version", "runs": {"a", "b"}, "torch", "summary", "models": [per-model
    entries], "only_in_a", "only_in_b", "regressions", "selection"}. Raises RecordNotFound for an
    unknown run."""
    return build_report(index, run_a, run_b, selection=given((run_a, run_b))).model_dump(mode="json")


def build_report(index: Any, run_a: str, run_b: str, *, selection: RunSelection | None = None) -> DriftReport:
    """The drift report of run_a (before) against run_b (after); with a selection that names its
    models, of those models only (the others are its `not_compared`)."""
    import pyarrow.compute as pc

    table = index.scan(None, filter=pc.field("run_id").isin([run_a, run_b]))
    rows = table.to_pylist()
    rows_a = [r for r in rows if r["run_id"] == run_a]
    rows_b = [r for r in rows if r["run_id"] == run_b]
    for run, found in ((run_a, rows_a), (run_b, rows_b)):
        if not found:
            raise RecordNotFound(f"no records of run {run!r} in the index")
    whole_a, per_b = _newest_per_stage(rows_a), _newest_per_stage(rows_b)
    per_a = whole_a
    if selection is not None and selection.models:
        per_a = {name: stages for name, stages in whole_a.items() if name in selection.models}
    package = _kind("package")
    cached = [s[package] for per in (per_a, per_b) for s in per.values() if s.get(package, {}).get("cached")]
    originals = _original_compile_records(index, cached)

    models = [
        _compare_model(name, per_a.get(name), per_b.get(name), originals, whole_a, per_b)
        for name in sorted(set(per_a) | set(per_b))
    ]
    runs = Runs(a=_run_summary(run_a, whole_a, rows_a), b=_run_summary(run_b, per_b, rows_b))  # the runs whole
    report = DriftReport(
        report_version=REPORT_VERSION,
        selection=Selection(**selection.as_json()) if selection is not None else None,
        runs=runs,
        torch=_torch_change(runs.a.torch_versions, runs.b.torch_versions),
        summary=_summary(models),
        models=models,
        only_in_a=[m.model for m in models if m.presence == "a"],
        only_in_b=[m.model for m in models if m.presence == "b"],
    )
    report.failure_groups = run_groups(index, run_b, run_a)
    report.regressions = [Regression(**found) for found in regressions(report.model_dump(mode="json"))]
    report.summary.regressions = len(report.regressions)
    return report


def _summary(models: Sequence[ModelDrift]) -> DriftSummary:
    both = [m for m in models if m.presence == "both"]
    changes = [m.status.change for m in models]
    return DriftSummary(
        models=len(models),
        in_both=len(both),
        only_in_a=changes.count("only_in_a"),
        only_in_b=changes.count("only_in_b"),
        newly_failing=changes.count("newly_failing"),
        newly_passing=changes.count("newly_passing"),
        still_failing=changes.count("still_failing"),
        changed=sum(1 for m in both if m.changes),
        unchanged=sum(1 for m in both if not m.changes),
        # a torch upgrade changes every stage key (the source key does not depend on torch)
        all_keys_changed=sum(
            1 for m in both if m.keys_changed and set(m.keys_changed) >= _stages_of(m.status.a) & _stages_of(m.status.b)
        ),
    )


def _stages_of(state: ModelState | None) -> set[str]:
    return set(state.stages) if state is not None else set()


# ---------------------------------------------------------------------------------------------
# reading one run's records


def _newest_per_stage(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """model -> stage -> the newest record of that stage in the run."""
    floor = datetime.min.replace(tzinfo=UTC)
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
    condition = pc.field("stage") == _kind("package")
    condition = condition & (pc.field("key").isin(keys) | pc.field("sha256").isin(digests))
    table = index.scan(
        ["record_id", "run_id", "key", "sha256", "status", "cached", "seconds", "ended_at"], filter=condition
    )
    floor = datetime.min.replace(tzinfo=UTC)
    originals = [r for r in table.to_pylist() if r["status"] == "ok" and not r["cached"] and r["seconds"] is not None]
    originals.sort(key=lambda r: r["ended_at"] or floor, reverse=True)
    found: dict[str, dict[str, Any]] = {}
    for record in cached:
        match = next((o for o in originals if o["key"] and o["key"] == record.get("key")), None)
        match = match or next((o for o in originals if o["sha256"] and o["sha256"] == record.get("sha256")), None)
        if match is not None:
            found[record["record_id"]] = match
    return found


def _state(stages: Stages | None, name: str = "", run: Mapping[str, Stages] | None = None) -> ModelState | None:
    """A model's outcome in one run: ok, or failed at its first failed stage with the error class.

    `run` (every model's stages in that run) relates a generative model `M` and its components
    `M/prefill`, `M/decode`, as the run document does: a component's stage that failed fails `M`
    (the error naming the component) unless `M`'s validate ran after it (`require:` let the model
    do without that artifact kind: its verdict is failed, the model partial); a component is
    judged by its model's validate."""
    if stages is None:
        return None
    run = run or {}
    parent, _, own = name.partition("/")
    failed = [s for s in stage_columns() if s in stages and stages[s].get("status") != "ok"]
    judged = stages.get(_kind("report")) or ((run.get(parent) or {}).get(_kind("report")) if own else None) or {}
    verdicts = {
        kind: bool(v.get("passed"))
        for kind, v in ((decoded(judged.get("validation")) or {}).get("verdicts") or {}).items()
    }
    if (
        failed and judged.get("status") == "ok"
    ):  # validate ran after them: the model did without those stages (`require:`)
        verdicts.update({pipeline.get(s).artifact or s: False for s in failed if s in pipeline.names()})
        failed = []
    first = stages[failed[0]] if failed else None
    message = (first or {}).get("error_message")
    if name and not own:  # a generative model's components' failures are its own
        for component in sorted(n for n in run if n.startswith(f"{name}/")):
            theirs = run[component]
            for s in (s for s in stage_columns() if s in theirs and theirs[s].get("status") != "ok"):
                if judged.get("status") == "ok":
                    verdicts[pipeline.get(s).artifact or s] = False
                elif not failed:
                    failed, first = [s], theirs[s]
                    message = f"{component.partition('/')[2]}: {first.get('error_class')}: {first.get('error_message')}"
    ran = [s for s in stage_columns() if s in stages and s != "source"]
    strategy = (stages.get(pipeline.entry().name) or {}).get("strategy")
    bad = [kind for kind, passed in verdicts.items() if not passed]
    return ModelState(
        status="failed" if failed else ("partial" if bad else "ok"),
        failed_stage=failed[0] if failed else None,
        error_class=first.get("error_class") if first else None,
        error=(message[:300] + " …") if message and len(message) > 300 else message,
        stages=ran,
        cached=bool(ran) and all(stages[s].get("cached") for s in ran),
        # the trace ladder gave up the dynamic dims: the program takes only the example's shapes
        trace_strategy=strategy,
        static_fallback=strategy == "static",
        verdicts=verdicts,
        failed_artifacts=bad,
    )


def _graph(stages: Stages) -> dict[str, Any]:
    for stage in graph_stages():
        record = stages.get(stage)
        if record is not None and record.get("status") == "ok":
            return {
                "stage": stage,
                "fingerprint": record.get("fingerprint"),
                "node_count": record.get("node_count"),
                "op_histogram": decoded(record.get("op_histogram")) or {},
                "signature": decoded(record.get("signature")),
                "range_constraints": decoded(record.get("range_constraints")),
            }
    return {}


def _kind(publishes: str) -> str:
    """The stage that makes a `publishes` kind of blob (the archive, the package, the report)."""
    return pipeline.publisher_name(publishes) or ""


def _ok(stages: Stages, stage: str) -> Mapping[str, Any] | None:
    record = stages.get(stage)
    return record if record is not None and record.get("status") == "ok" else None


def _compile_time(record: Mapping[str, Any] | None, originals: Stages) -> tuple[float | None, bool, str | None]:
    """(seconds, cached, run that compiled): a cached record's own seconds are a cache lookup,
    so its compile time is the original record's, or unknown."""
    if record is None:
        return None, False, None
    if not record.get("cached"):
        return record.get("seconds"), False, record.get("run_id")
    original = originals.get(record["record_id"])
    return (original["seconds"], True, original["run_id"]) if original else (None, True, None)


def _validation(stages: Stages) -> dict[str, Any]:
    record = stages.get(_kind("report"))
    if record is None:
        return {}
    summary = decoded(record.get("validation")) or {}
    return {
        "passed": record.get("passed") if record.get("passed") is not None else summary.get("passed"),
        "max_abs_err": record.get("max_abs_err")
        if record.get("max_abs_err") is not None
        else summary.get("max_abs_err"),
        "max_rel_err": record.get("max_rel_err")
        if record.get("max_rel_err") is not None
        else summary.get("max_rel_err"),
        "latency_ms": summary.get("latency_ms") or {},
        "cached": bool(record.get("cached")),
    }


def _timings(stages: Stages) -> dict[str, Any] | None:
    """The benchmark stage's summary of a model in one run (its record's details), or None."""
    record = _ok(stages, _kind(TIMINGS))
    return (decoded(record.get("details")) or {}).get(TIMINGS) if record is not None else None


def _latency_facts(timed_a: Mapping[str, Any] | None, timed_b: Mapping[str, Any] | None) -> dict[str, Numbers] | None:
    """The benchmark's p50 of each artifact at each size ("onnx batch=8"), before and after. Two
    runs timed on different thread counts (the benchmark's `threads`) are not compared: each p50
    is named with its count ("onnx batch=8, 2 threads"), one run's each, so no ratio is drawn."""
    threads = [(timed or {}).get("threads") for timed in (timed_a, timed_b)]
    differ = None not in threads and threads[0] != threads[1]

    def flat(timed: Mapping[str, Any] | None) -> dict[str, float]:
        count = (timed or {}).get("threads")
        suffix = f", {count} thread{'s' if count != 1 else ''}" if differ else ""
        return {
            f"{name} {label}{suffix}": v
            for name, per in ((timed or {}).get("p50_ms") or {}).items()
            for label, v in per.items()
            if v is not None
        }

    lat_a, lat_b = flat(timed_a), flat(timed_b)
    return {k: Numbers.of(lat_a.get(k), lat_b.get(k)) for k in sorted(set(lat_a) | set(lat_b))} or None


def _torch_of(stages: Stages | None) -> str | None:
    if not stages:
        return None
    versions = sorted({r["torch_version"] for r in stages.values() if r.get("torch_version")})
    return ", ".join(versions) or None


def _run_summary(run_id: str, per_model: Mapping[str, Stages], rows: Sequence[Mapping[str, Any]]) -> RunInfo:
    starts = [r.get("started_at") or r.get("ended_at") for r in rows if r.get("started_at") or r.get("ended_at")]
    ends = [r["ended_at"] for r in rows if r.get("ended_at")]
    states = [_state(stages, name, per_model) for name, stages in per_model.items()]
    return RunInfo(
        run_id=run_id,
        started_at=iso(min(starts) if starts else None),
        ended_at=iso(max(ends) if ends else None),
        torch_versions=sorted({r["torch_version"] for r in rows if r.get("torch_version")}),
        models=len(per_model),
        ok=sum(1 for s in states if s and s.status == "ok"),
        failed=sum(1 for s in states if s and s.status == "failed"),
        records=len(rows),
        partial=sum(1 for s in states if s and s.status == "partial"),
    )


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _torch_change(a: Sequence[str], b: Sequence[str]) -> TorchChange:
    shown_a, shown_b = ", ".join(a) or None, ", ".join(b) or None
    change = "same"
    if shown_a != shown_b:
        change = "changed"
        if len(a) == 1 and len(b) == 1:
            ta, tb = _version_tuple(a[0]), _version_tuple(b[0])
            change = "upgrade" if tb > ta else ("downgrade" if tb < ta else "changed")
    return TorchChange(a=shown_a, b=shown_b, change=change, changed=change != "same")


# ---------------------------------------------------------------------------------------------
# one model, before and after


def _histogram_diff(a: Mapping[str, int], b: Mapping[str, int]) -> OpHistogramDiff:
    added, removed, changed = op_changes(a, b)
    return OpHistogramDiff(
        added=added, removed=removed, changed=changed, changed_ops=len(added) + len(removed) + len(changed)
    )


def _status_change(a: ModelState | None, b: ModelState | None) -> str:
    if a is None:
        return "only_in_b"
    if b is None:
        return "only_in_a"
    if a.status == "ok" and b.status != "ok":
        return "newly_failing"
    if a.status != "ok" and b.status == "ok":
        return "newly_passing"
    if a.status != "ok":
        return "still_failing"
    return "ok"


def _compare_model(
    name: str,
    a: Stages | None,
    b: Stages | None,
    originals: Stages,
    run_a: Mapping[str, Stages] | None = None,
    run_b: Mapping[str, Stages] | None = None,
) -> ModelDrift:
    state_a, state_b = _state(a, name, run_a), _state(b, name, run_b)
    presence = "both" if a is not None and b is not None else ("a" if a is not None else "b")
    torch_version = Pair.of(_torch_of(a), _torch_of(b))
    a, b = a or {}, b or {}
    static_a, static_b = bool(state_a and state_a.static_fallback), bool(state_b and state_b.static_fallback)
    validation, latency = _validation_facts(_validation(a), _validation(b))
    if _timings(a) or _timings(b):  # the benchmark's p50s replace validate's medians
        latency = _latency_facts(_timings(a), _timings(b))
    entry = ModelDrift(
        model=name,
        presence=presence,
        status=StatusChange(a=state_a, b=state_b, change=_status_change(state_a, state_b)),
        torch_version=torch_version,
        source=_source_facts(a.get("source") or {}, b.get("source") or {}),
        static_fallback=Pair(
            a=static_a, b=static_b, changed=state_a is not None and state_b is not None and static_a != static_b
        ),
        keys_changed=[
            s
            for s in stage_columns()
            if s in a and s in b and a[s].get("key") and b[s].get("key") and a[s]["key"] != b[s]["key"]
        ],
        graph=_graph_facts(_graph(a), _graph(b)),
        **_cost_facts(a, b, originals),
        validation=validation,
        latency_ms=latency,
        changes=[],
        timings=_timings(b),
        artifacts=_artifact_facts(name, a, b, state_a, state_b, run_a, run_b),
    )
    entry.changes = _changes(entry)
    return entry


def _source_facts(src_a: Mapping[str, Any], src_b: Mapping[str, Any]) -> SourceFacts:
    return SourceFacts(
        factory=Pair.of(src_a.get("factory"), src_b.get("factory")),
        kwargs=Pair.of(decoded(src_a.get("kwargs")), decoded(src_b.get("kwargs"))),
        code_hash=Pair.of(src_a.get("code_hash"), src_b.get("code_hash")),
        # no weights (factory init) is a value too: None -> digest is a change
        weights=Pair(
            a=src_a.get("weights_digest"),
            b=src_b.get("weights_digest"),
            changed=bool(src_a) and bool(src_b) and src_a.get("weights_digest") != src_b.get("weights_digest"),
        ),
    )


def _graph_facts(graph_a: Mapping[str, Any], graph_b: Mapping[str, Any]) -> GraphFacts:
    hist = (
        _histogram_diff(graph_a.get("op_histogram") or {}, graph_b.get("op_histogram") or {})
        if graph_a and graph_b
        else _histogram_diff({}, {})
    )
    return GraphFacts(
        stage=Pair.of(graph_a.get("stage"), graph_b.get("stage")),
        fingerprint=Pair.of(graph_a.get("fingerprint"), graph_b.get("fingerprint")),
        node_count=Numbers.of(graph_a.get("node_count"), graph_b.get("node_count")),
        op_histogram=hist,
        signature=Pair.of(graph_a.get("signature"), graph_b.get("signature")),
        range_constraints=Pair.of(graph_a.get("range_constraints"), graph_b.get("range_constraints")),
    )


def _cost_facts(a: Stages, b: Stages, originals: Stages) -> dict[str, Any]:
    """archive_size, package_size and compile_seconds (a cached compile reports the original's)."""
    archive_a, archive_b = _ok(a, _kind("archive")), _ok(b, _kind("archive"))
    package_a, package_b = _ok(a, _kind("package")), _ok(b, _kind("package"))
    secs_a, cached_a, by_a = _compile_time(package_a, originals)
    secs_b, cached_b, by_b = _compile_time(package_b, originals)
    seconds = Numbers.of(secs_a, secs_b)
    return {
        "archive_size": Numbers.of((archive_a or {}).get("size"), (archive_b or {}).get("size")),
        "package_size": Numbers.of((package_a or {}).get("size"), (package_b or {}).get("size")),
        "compile_seconds": CompileSeconds(
            **dict(seconds), a_cached=cached_a, b_cached=cached_b, a_compiled_in=by_a, b_compiled_in=by_b
        ),
    }


def _artifact_facts(
    name: str,
    a: Stages,
    b: Stages,
    state_a: ModelState | None,
    state_b: ModelState | None,
    run_a: Mapping[str, Stages] | None,
    run_b: Mapping[str, Stages] | None,
) -> dict[str, ArtifactFacts] | None:
    """Each deliverable kind (pipeline.document_slots: the archive, the package, every target's)
    that either run built, tried to build or judged: its size and its own verdict, before and
    after. The verdict is the model state's (validate's, or a stage that failed before a validate
    that ran: a generative model's components' too), its class validate's or the failed stage's."""
    found = {}
    for kind, stage in pipeline.document_slots().items():
        judged = [kind in (state.verdicts if state else {}) for state in (state_a, state_b)]
        if stage not in a and stage not in b and not any(judged):
            continue
        built_a, built_b = _ok(a, stage) or {}, _ok(b, stage) or {}
        passed_a = state_a.verdicts.get(kind) if state_a else None
        passed_b = state_b.verdicts.get(kind) if state_b else None
        found[kind] = ArtifactFacts(
            size=Numbers.of(built_a.get("size"), built_b.get("size")),
            passed=Pair.of(passed_a, passed_b),
            error_class=Pair.of(
                _verdict_class(name, a, run_a, kind, stage) if passed_a is False else None,
                _verdict_class(name, b, run_b, kind, stage) if passed_b is False else None,
            ),
        )
    return found or None


def _verdict_class(name: str, stages: Stages, run: Mapping[str, Stages] | None, kind: str, stage: str) -> str | None:
    """The class of a failed kind's verdict: validate's, else its stage's failure (a component's, for a generative model)."""
    record = stages.get(_kind("report"))
    verdict = (
        ((decoded(record.get("validation")) or {}).get("verdicts") or {}).get(kind) if record is not None else None
    )
    if verdict and verdict.get("error_class"):
        return str(verdict["error_class"])
    own = [stages] + [theirs for component, theirs in sorted((run or {}).items()) if component.startswith(f"{name}/")]
    return next((s[stage].get("error_class") for s in own if stage in s and s[stage].get("status") != "ok"), None)


def _validation_facts(
    val_a: Mapping[str, Any], val_b: Mapping[str, Any]
) -> tuple[ValidationFacts, dict[str, Numbers] | None]:
    """The validation facts, and the latency per measurement (None: neither run measured it)."""
    lat_a, lat_b = val_a.get("latency_ms") or {}, val_b.get("latency_ms") or {}
    facts = ValidationFacts(
        passed=Pair.of(val_a.get("passed"), val_b.get("passed")),
        max_abs_err=Numbers.of(val_a.get("max_abs_err"), val_b.get("max_abs_err")),
        max_rel_err=Numbers.of(val_a.get("max_rel_err"), val_b.get("max_rel_err")),
        a_cached=val_a.get("cached", False),
        b_cached=val_b.get("cached", False),
    )
    return facts, {k: Numbers.of(lat_a.get(k), lat_b.get(k)) for k in sorted(set(lat_a) | set(lat_b))} or None


def _changes(entry: ModelDrift) -> list[str]:
    """Names of the facts that differ between the runs (timings are measurements, not listed)."""
    if entry.presence != "both":
        return ["only_in_" + entry.presence]
    out = []
    status = entry.status
    if status.change not in ("ok", "still_failing"):
        out.append("status")
    elif (
        status.change == "still_failing"
        and status.a
        and status.b
        and ((status.a.failed_stage, status.a.error_class) != (status.b.failed_stage, status.b.error_class))
    ):
        out.append("failure")
    out += [field for field in ("factory", "kwargs", "code_hash", "weights") if getattr(entry.source, field).changed]
    if entry.static_fallback.changed:
        out.append("static_fallback")
    if entry.torch_version.changed:
        out.append("torch_version")
    graph = entry.graph
    out += [
        field
        for field in ("fingerprint", "node_count", "signature", "range_constraints")
        if getattr(graph, field).changed
    ]
    if graph.op_histogram.changed_ops:
        out.append("op_histogram")
    out += [
        field
        for field, facts in (("archive_size", entry.archive_size), ("package_size", entry.package_size))
        if facts.changed
    ]
    if entry.validation.max_abs_err.changed:
        out.append("max_abs_err")
    return out
