"""The upgrade-check report (`pt2flow upgrade-check --json`): what a candidate environment (another
torch, transformers, ...) does to a fleet, per model, baseline run against candidate run, built
from the drift report of the two runs (flows/report/compare.py) and the check-compat document of
the baseline's artifacts under the candidate. Every view renders `model_dump(mode="json")`.

Verdicts, per model: unchanged (same program, same numbers), changed (the program or its op
histogram, node count or validation error moved, within tolerance), newly_failing, fixed,
still_failing, regressed (it still builds, but a regression rule fired: validation error grew,
compile time, latency or size up, static fallback, or the baseline's artifact no longer loads or
matches under the candidate), only_in_baseline, only_in_candidate.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Collection, Mapping, Sequence

from pydantic import Field

from pt2flow.flows.report.drift import DriftReport, Fact, ModelDrift, Numbers, OpHistogramDiff
from pt2flow.flows.report.rules import COST_GROWTH
from pt2flow.flows.report.text import counted

UPGRADE_REPORT_VERSION = 1
LATENCY_GROWTH = 1.25  # a latency up more than 25 % is a regression
REGRESSING = ("newly_failing", "regressed")
TIMING_RULES = ("compile_time_up", "latency_up")  # measured, so re-timed before they are believed
_ORDER = {
    v: i
    for i, v in enumerate(
        (
            "newly_failing",
            "regressed",
            "changed",
            "fixed",
            "still_failing",
            "only_in_candidate",
            "only_in_baseline",
            "unchanged",
        )
    )
}


class Side(Fact):
    run_id: str
    python: str
    torch: str | None
    chosen: str | None = None  # why this run (the baseline: given, or how it was found)


class VersionChange(Fact):
    """One distribution whose version differs between the environments (None: not installed)."""

    name: str
    baseline: str | None
    candidate: str | None
    used_by: list[str]  # the models whose dependency manifest names it (torch: every model)
    # torch only: the changed distributions torch's own Requires-Dist brought (its CUDA and
    # runtime wheels, triton...), folded under it instead of listed beside it (added compatibly)
    came_with: list[VersionChange] = Field(default_factory=list)


class Failure(Fact):
    stage: str | None
    error_class: str | None
    error: str | None


class Finding(Fact):
    rule: str
    message: str
    # what a person re-runs or reads to confirm it (added compatibly): the baseline and candidate
    # numbers, the load command of an artifact that fails, the repro script of a new failure
    evidence: str | None = None


class Attribution(Fact):
    """Which single candidate distribution, put into the baseline alone, reproduces the regression."""

    distributions: list[str]
    tried: dict[str, str]  # distribution -> the attribution run's verdict for this model
    note: str


class ModelUpgrade(Fact):
    model: str
    verdict: str
    regressions: list[Finding]
    changes: list[str]
    program_changed: bool
    node_count: Numbers
    op_histogram: OpHistogramDiff
    failure: Failure | None  # the candidate's failure
    baseline_failure: Failure | None
    repro: str | None = None  # the folder `pt2flow repro`, run in the candidate, wrote
    repro_error: str | None = None
    compat: dict[str, Any] | None = None  # the baseline's artifacts under the candidate
    attribution: Attribution | None = None
    # added compatibly: the numbers beside their baseline values (a: baseline, b: candidate)
    validation_error: dict[str, Numbers] | None = None  # max_abs_err, max_rel_err against eager
    compile_seconds: Numbers | None = None
    latency_ms: dict[str, Numbers] | None = None
    # a timing regression re-measured back to back (baseline then candidate, fresh processes and
    # compiler caches): what the re-timing found; a finding it did not confirm is dropped
    retimed: str | None = None


class UpgradeSummary(Fact):
    models: int
    unchanged: int = 0
    changed: int = 0
    newly_failing: int = 0
    fixed: int = 0
    still_failing: int = 0
    regressed: int = 0
    only_in_baseline: int = 0
    only_in_candidate: int = 0


class UpgradeReport(Fact):
    upgrade_report_version: int = UPGRADE_REPORT_VERSION
    store: str
    baseline: Side
    candidate: Side
    versions: list[VersionChange]
    other_version_changes: list[VersionChange]  # distributions no model's code imports
    summary: UpgradeSummary
    regressed: bool
    models: list[ModelUpgrade]
    attribution_runs: dict[str, str] = Field(default_factory=dict)  # distribution -> run id
    drift: DriftReport
    compat: dict[str, Any]


def version_changes(
    baseline: Mapping[str, str],
    candidate: Mapping[str, str],
    used: Mapping[str, Sequence[str]],
    with_torch: Collection[str] = (),
) -> tuple[list[VersionChange], list[VersionChange]]:
    """(changes of distributions some model uses, the other changes). The first list is ranked
    by how many models import each (torch first), then by name. `with_torch`: the distributions
    torch's own requirements bring (its CUDA/runtime wheels); when torch changed, their changes
    are folded under torch's entry (`came_with`) instead of listed beside it."""
    relevant, other, folded = [], [], []
    torch_changed = baseline.get("torch") != candidate.get("torch")
    for name in sorted(set(baseline) | set(candidate)):
        a, b = baseline.get(name), candidate.get(name)
        if a == b:
            continue
        change = VersionChange(name=name, baseline=a, candidate=b, used_by=sorted(used.get(name, ())))
        if torch_changed and name != "torch" and name in with_torch:
            folded.append(change)
        else:
            (relevant if change.used_by or name == "torch" else other).append(change)
    for change in relevant + other:
        if change.name == "torch":
            change.came_with = folded
    relevant.sort(key=lambda c: (c.name != "torch", -len(c.used_by), c.name))
    return relevant, other


def _failure(state: Any) -> Failure | None:
    if state is None or state.status == "ok":
        return None
    return Failure(stage=state.failed_stage, error_class=state.error_class, error=state.error)


def _compat_problem(entry: Mapping[str, Any] | None) -> Finding | None:
    """The first artifact of the baseline's that fails under the candidate, with the evidence: the
    numbers it computed, or the command that loads it outside pt2flow. A module the archive names
    that does not import in the candidate is `artifact_module_missing` (the candidate lacks the
    model's library), not an incompatibility of the artifact."""
    if not entry or entry.get("status") != "failed":
        return None
    for kind, value in entry.items():
        if isinstance(value, dict) and value.get("error_class"):
            first = (value.get("error") or "").strip().splitlines()
            if value["error_class"] == "import":
                rule, what = "artifact_module_missing", "needs a module the candidate cannot import"
            else:
                rule = "artifact_incompatible"
                what = "no longer loads" if value.get("loads") is False else "no longer runs or matches"
            evidence = value.get("load_command")
            if value.get("matches") is False:
                evidence = (
                    f"max_abs_err {value.get('max_abs_err')}, max_rel_err {value.get('max_rel_err')} over {value.get('samples')} stored samples"
                    + (f"; {evidence}" if evidence else "")
                )
            return Finding(
                rule=rule,
                message=f"the baseline's {kind} {what} under the candidate: {value['error_class']}: {first[0] if first else ''}".rstrip(
                    ": "
                ),
                evidence=evidence,
            )
    return Finding(
        rule="artifact_incompatible",
        message=f"the baseline's artifacts fail under the candidate ({entry.get('error_class')})",
    )


def _numbers_evidence(a: Any, b: Any, ratio: float | None) -> str | None:
    if a is None and b is None:
        return None
    return f"baseline {a}, candidate {b}" + (f" (×{ratio:.3g})" if ratio is not None else "")


def _latency_findings(entry: ModelDrift, growth: float) -> list[Finding]:
    found = []
    for name, numbers in (entry.latency_ms or {}).items():
        if numbers.a and numbers.b is not None and numbers.b > growth * numbers.a:
            found.append(
                Finding(
                    rule="latency_up",
                    message=f"{name} latency {numbers.a:.3g} ms → {numbers.b:.3g} ms (limit +{(growth - 1) * 100:.0f} %)",
                    evidence=_numbers_evidence(numbers.a, numbers.b, numbers.ratio),
                )
            )
    return found


def model_verdicts(
    drift: DriftReport, compat: Mapping[str, Any], latency_growth: float = LATENCY_GROWTH
) -> list[ModelUpgrade]:
    """One entry per model of either run, regressions first."""
    rules: dict[str, list[Finding]] = {}
    for regression in drift.regressions:
        rules.setdefault(regression.model, []).append(
            Finding(
                rule=regression.rule,
                message=regression.message,
                evidence=_numbers_evidence(regression.a, regression.b, regression.ratio),
            )
        )
    compat_of = {m["name"]: m for m in compat.get("models", [])}
    out = []
    for entry in drift.models:
        findings = [f for f in rules.get(entry.model, []) if f.rule != "stopped_exporting"] + _latency_findings(
            entry, latency_growth
        )
        problem = _compat_problem(compat_of.get(entry.model))
        if problem is not None:
            findings.append(problem)
        change = entry.status.change
        if entry.presence != "both":
            verdict = "only_in_baseline" if entry.presence == "a" else "only_in_candidate"
        elif change == "newly_failing":
            verdict = "newly_failing"
        elif change == "newly_passing":
            verdict = "fixed"
        elif change == "still_failing":
            verdict = "regressed" if problem is not None else "still_failing"
        elif findings:
            verdict = "regressed"
        elif entry.changes:
            verdict = "changed"
        else:
            verdict = "unchanged"
        if verdict == "newly_failing":
            after = entry.status.b
            findings.insert(
                0, Finding(rule="stopped_exporting", message=f"fails at {after.failed_stage} ({after.error_class})")
            )
        out.append(
            ModelUpgrade(
                model=entry.model,
                verdict=verdict,
                regressions=findings if verdict in REGRESSING or problem is not None else [],
                changes=[c for c in entry.changes if c != "torch_version"],
                program_changed=entry.graph.fingerprint.changed,
                node_count=entry.graph.node_count,
                op_histogram=entry.graph.op_histogram,
                failure=_failure(entry.status.b),
                baseline_failure=_failure(entry.status.a),
                compat=compat_of.get(entry.model),
                validation_error={
                    "max_abs_err": entry.validation.max_abs_err,
                    "max_rel_err": entry.validation.max_rel_err,
                },
                compile_seconds=entry.compile_seconds,
                latency_ms=entry.latency_ms,
            )
        )
    return ordered(out)


def timing_only(m: ModelUpgrade) -> bool:
    """A regressed model whose every finding is a measured time (compile, latency)."""
    return m.verdict == "regressed" and bool(m.regressions) and all(f.rule in TIMING_RULES for f in m.regressions)


def apply_retiming(m: ModelUpgrade, again: ModelDrift | None, latency_growth: float = LATENCY_GROWTH) -> None:
    """Keep each timing finding of `m` that the back-to-back re-timing `again` (its drift entry in
    the re-timing runs) fires too, with the re-timed numbers as evidence; drop the others, and a
    model left with none is `changed` (the numbers moved between the runs, not when re-timed)."""
    if (
        again is None
        or again.status.a is None
        or again.status.b is None
        or again.status.a.status != "ok"
        or again.status.b.status != "ok"
    ):
        m.retimed = "could not re-time it (the re-timing runs did not both build it): the findings stand unconfirmed"
        return
    fired = {f.rule for f in _latency_findings(again, latency_growth)}
    secs = again.compile_seconds
    if secs.a and secs.b is not None and secs.b > COST_GROWTH * secs.a:
        fired.add("compile_time_up")
    parts = [("compile", _pair(secs, " s"))] + [
        (f"{k} latency", _pair(v, " ms")) for k, v in sorted((again.latency_ms or {}).items())
    ]
    measured = "; ".join(f"{name} {text}" for name, text in parts if text is not None) or "no numbers"
    kept = [f for f in m.regressions if f.rule in fired]
    for f in kept:
        f.evidence = (f"{f.evidence}; " if f.evidence else "") + f"re-timed back to back: {measured}"
    if not kept:
        m.retimed, m.verdict = (
            f"re-timed back to back: {measured}: not confirmed, so not reported as a regression",
            "changed",
        )
    else:
        m.retimed = f"re-timed back to back: {measured}: " + (
            "confirmed" if len(kept) == len(m.regressions) else "partly confirmed"
        )
    m.regressions = kept


def ordered(models: Sequence[ModelUpgrade]) -> list[ModelUpgrade]:
    """Regressions first, then what changed, then the rest; by name within a verdict."""
    return sorted(models, key=lambda m: (_ORDER[m.verdict], m.model))


def summarize(models: Sequence[ModelUpgrade]) -> UpgradeSummary:
    summary = UpgradeSummary(models=len(models))
    for m in models:
        setattr(summary, m.verdict, getattr(summary, m.verdict) + 1)
    return summary


def render_text(report: UpgradeReport) -> str:
    """The report as a terminal reads it: versions, then one block per model that needs a look,
    then the unchanged ones in a line."""
    lines = [
        f"pt2flow upgrade-check: baseline run {report.baseline.run_id} vs candidate run {report.candidate.run_id}",
        f"  baseline  {report.baseline.python}"
        + (f"  ({report.baseline.chosen})" if report.baseline.chosen not in (None, "given") else ""),
        f"  candidate {report.candidate.python}",
        "",
    ]
    if report.versions:
        lines.append("Version changes the fleet's code depends on (most models first):")
        for v in report.versions:
            users = "every model" if v.name == "torch" else f"{len(v.used_by)}: {', '.join(v.used_by)}"
            lines.append(f"  {v.name} {v.baseline or 'absent'} → {v.candidate or 'absent'}   (used by {users})")
            if v.came_with:
                wheels = ", ".join(
                    f"{w.name} {w.baseline or 'absent'} → {w.candidate or 'absent'}" for w in v.came_with[:8]
                )
                more = len(v.came_with) - 8
                lines.append(
                    f"    with it, from torch's own requirements ({len(v.came_with)}): {wheels}{f', and {more} more' if more > 0 else ''}"
                )
    else:
        lines.append("No distribution the fleet's code depends on differs.")
    if report.other_version_changes:
        names = ", ".join(
            f"{v.name} {v.baseline or 'absent'} → {v.candidate or 'absent'}" for v in report.other_version_changes[:6]
        )
        more = len(report.other_version_changes) - 6
        lines.append(f"  (also changed, imported by no model: {names}{f', and {more} more' if more > 0 else ''})")
    lines.append("")
    s = report.summary
    lines.append(
        f"{counted(s.models, 'model')}: {s.unchanged} unchanged, {s.changed} changed, {s.newly_failing} newly failing, {s.regressed} regressed, "
        f"{s.fixed} fixed, {s.still_failing} still failing"
    )
    lines.append("")
    for m in report.models:
        if m.verdict == "unchanged":
            continue
        lines.append(f"{m.model}: {m.verdict.replace('_', ' ')}")
        for f in m.regressions:
            lines.append(f"    ✗ {f.message}")
            if f.evidence and f.evidence not in f.message:
                lines.append(f"      evidence: {f.evidence}")
        if m.failure is not None and m.verdict in ("newly_failing", "still_failing"):
            first = ((m.failure.error or "").strip().splitlines() or [""])[0]
            lines.append(f"    {m.failure.stage}: {m.failure.error_class}: {first[:300]}")
        if m.program_changed or m.op_histogram.changed_ops or m.node_count.changed:
            ops = m.op_histogram
            parts = [f"+{k}×{v}" for k, v in sorted(ops.added.items())] + [
                f"-{k}×{v}" for k, v in sorted(ops.removed.items())
            ]
            parts += [f"{k} {a}→{b}" for k, (a, b) in sorted(ops.changed.items())]
            nodes = f"nodes {m.node_count.a}→{m.node_count.b}" if m.node_count.changed else "same node count"
            lines.append(f"    program changed: {nodes}; ops {' '.join(parts) if parts else 'same histogram'}")
        if m.verdict == "changed" and m.changes:
            lines.append(f"    what changed: {', '.join(m.changes)}")
        numbers = _numbers_line(m)
        if numbers:
            lines.append(f"    {numbers}")
        if m.retimed:
            lines.append(f"    {m.retimed}")
        if m.repro:
            lines.append(f"    repro (made in the candidate): {m.repro}/repro.py")
        elif m.repro_error:
            lines.append(f"    no repro: {m.repro_error}")
        if m.attribution is not None:
            lines.append(
                f"    caused by: {', '.join(m.attribution.distributions) or 'no single distribution'} ({m.attribution.note})"
            )
    unchanged = [m.model for m in report.models if m.verdict == "unchanged"]
    if unchanged:
        lines.append(f"unchanged: {', '.join(unchanged)}")
    lines.append("")
    lines.append(
        "REGRESSED: the candidate breaks or degrades the models above"
        if report.regressed
        else "No regression: the candidate is safe for this fleet"
    )
    return "\n".join(lines)


def _pair(numbers: Numbers | None, unit: str = "", digits: str = ".3g") -> str | None:
    if numbers is None or (numbers.a is None and numbers.b is None):
        return None
    show = lambda x: "-" if x is None else f"{x:{digits}}{unit}"  # noqa: E731
    return f"{show(numbers.a)} → {show(numbers.b)}"


def _numbers_line(m: ModelUpgrade) -> str:
    """compile time, latency and validation error, baseline → candidate, for a model that changed."""
    parts = []
    if (text := _pair(m.compile_seconds, " s")) is not None:
        parts.append(f"compile {text}")
    for name, numbers in sorted((m.latency_ms or {}).items()):
        if (text := _pair(numbers, " ms")) is not None:
            parts.append(f"{name} latency {text}")
    if (text := _pair((m.validation_error or {}).get("max_abs_err"), "", ".2e")) is not None:
        parts.append(f"max abs err {text}")
    return "; ".join(parts)


def render_html(report: UpgradeReport) -> str:
    """A self-contained HTML page of the report."""
    from pt2flow.flows.report.templating import environment

    return environment().get_template("upgrade.html.j2").render(r=report)
