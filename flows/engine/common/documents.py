"""The documents a run produces, each defined once (docs/architecture.md §4).

Outcome      one stage's outcome: what the engine passes between stages (worker pipes, Dask),
             records in the index (flows/engine/orchestrator/records.py) and summarizes in a model result
StageView    a stage as the run document shows it
ModelResult  one model's entry in the run document
RunDocument  what `pt2flow run --json` prints and the fleet flow returns

`model_dump()` of a RunDocument is the contract's JSON, key for key and in order. Keys that the
contract adds only in some cases (a failed stage's `error`, a model's `stderr_tail`) are fields
in `optional`: dumped when they were given, left out when not, and a dump validated back gives
the same document.
"""

from __future__ import annotations

from typing import Any, ClassVar
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from pt2flow.stages.vocabulary import ErrorClass


class Document(BaseModel):
    """A JSON document: its fields in contract order; the ones in `optional` dumped only when given."""

    model_config = ConfigDict(extra="forbid")

    optional: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_ungiven(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        dumped = handler(self)
        for name in self.optional - self.model_fields_set:
            dumped.pop(name, None)
        return dumped


class Outcome(BaseModel):
    """A stage's outcome: status, cached, seconds, the artifact's sha256, size and uri, the
    derivation key, the program fingerprint, stage details and warnings; failures also carry
    error_class and error (and, when the worker wrote one, a report blob as their artifact)."""

    model_config = ConfigDict(extra="forbid")

    status: str = "ok"
    cached: bool = False
    seconds: float | None = None
    artifact: str | None = None
    size: int | None = None
    uri: str | None = None
    key: str | None = None
    fingerprint: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
    blob_stat: str | None = None
    error_class: ErrorClass | None = None
    error: str | None = None

    @classmethod
    def failure(
        cls,
        key: str,
        error_class: ErrorClass,
        message: str,
        *,
        seconds: float,
        details: Mapping[str, Any] | None = None,
    ) -> Outcome:
        return cls(
            status="failed",
            seconds=round(seconds, 6),
            key=key,
            details=dict(details or {}),
            error_class=error_class,
            error=message,
        )

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class StageView(Document):
    """A stage in the run document: `warnings` when there were some, `error_class` and `error`
    when it failed, `report` when a failure left a report blob."""

    optional: ClassVar[frozenset[str]] = frozenset({"warnings", "error_class", "error", "report"})

    status: str
    cached: bool
    seconds: float | None
    artifact: str | None
    warnings: list[str] | None = None
    error_class: ErrorClass | None = None
    error: str | None = None
    report: str | None = None

    @classmethod
    def of(cls, outcome: Outcome) -> StageView:
        view = cls(
            status=outcome.status,
            cached=outcome.cached,
            seconds=outcome.seconds,
            artifact=outcome.artifact if outcome.ok else None,
        )
        if outcome.warnings:
            view.warnings = list(outcome.warnings)
        if not outcome.ok:
            view.error_class, view.error = outcome.error_class, outcome.error
            if outcome.artifact:
                view.report = outcome.artifact
        return view


class Artifacts(Document):
    """The model's deliverables by slot (flows/pipeline: a candidate stage's `artifact`):
    `serialized` and `compiled` always, a target's (`onnx`, `pte`, a registered stage's) when
    its stage ran."""

    model_config = ConfigDict(extra="allow")

    serialized: str | None = None
    compiled: str | None = None

    def put(self, slot: str, digest: str | None) -> None:
        setattr(self, slot, digest)

    def get(self, slot: str) -> str | None:
        return getattr(self, slot, None)


class Verdict(Document):
    """One artifact's own verdict: passed, or the class and message of its failure."""

    passed: bool
    error_class: ErrorClass | None = None
    error: str | None = None


class ValidationSummary(Document):
    """tolerance and max_noise_ratio only where the model's validate ran with tolerance: auto:
    the tolerance applied (auto, or fixed after a fallback) and the worst ratio of a candidate's
    error against the float64 reference to eager's own (docs/architecture.md §6). verdicts: each
    artifact's own verdict by artifact kind (absent in a report written before verdicts existed);
    `passed` is true when every one passed."""

    optional: ClassVar[frozenset[str]] = frozenset({"tolerance", "max_noise_ratio", "verdicts"})

    passed: bool | None
    max_abs_err: float | int | None
    max_rel_err: float | int | None
    samples: int | None
    tolerance: str | None = None
    max_noise_ratio: float | int | None = None
    verdicts: dict[str, Verdict] | None = None

    def failed_artifacts(self) -> list[str]:
        return [kind for kind, verdict in (self.verdicts or {}).items() if not verdict.passed]


class ComponentResult(Document):
    """One component of a generative model (`prefill`, `decode`): its stages and artifacts, as a
    model's are (its records are the model `M/component`'s)."""

    stages: dict[str, StageView] = Field(default_factory=dict)
    artifacts: Artifacts = Field(default_factory=Artifacts)


class BenchmarkSummary(Document):
    """The benchmark stage's summary (stages/benchmark.summary): the recommended artifact (fastest
    at the most sizes), the sizes timed (labels such as "batch=1 seq=2"), the fastest artifact and
    its speedup over eager at each, and every artifact's p50 in ms at each (None: it failed there);
    `accuracy`, where an artifact timed is judged by accuracy budgets (int8), its metrics as
    validate measured them (stages/accuracy.py), so the recommendation can say what it costs;
    `noisy`, the sizes whose timings could not be trusted and why (no recommendation drawn there);
    `load`, the cores other processes kept busy while the artifacts were timed."""

    optional: ClassVar[frozenset[str]] = frozenset({"accuracy", "noisy", "load"})

    recommended: str | None
    points: list[str]
    best: dict[str, str | None]
    speedup_vs_eager: dict[str, float | None]
    p50_ms: dict[str, dict[str, float | None]]
    threads: int | None = None
    accuracy: dict[str, dict[str, float | None]] | None = None
    noisy: dict[str, str] | None = None
    load: float | None = None


class ModelResult(Document):
    """One model of the run document. status: ok, failed, or partial (validate passed every
    artifact the model requires and failed another: `validation.verdicts` says which). `source` is there once the source stage succeeded,
    `stderr_tail` when a failed worker printed something; a result the model flow never
    reported (a crash of the flow itself) has no trace facts."""

    optional: ClassVar[frozenset[str]] = frozenset(
        {"source", "stderr_tail", "trace_strategy", "static_fallback", "timings", "components"}
    )

    name: str
    status: str = "ok"
    failed_stage: str | None = None
    error_class: ErrorClass | None = None
    error: str | None = None
    stages: dict[str, StageView] = Field(default_factory=dict)
    artifacts: Artifacts = Field(default_factory=Artifacts)
    validation: ValidationSummary | None = None
    worker: str | None = None
    source: str | None = None
    stderr_tail: str | None = None
    trace_strategy: str | None = None
    static_fallback: bool | None = None
    timings: BenchmarkSummary | None = None  # the benchmark stage's summary, when it ran
    components: dict[str, ComponentResult] | None = None  # a generative model's, by component

    @classmethod
    def crashed(cls, name: str, message: str) -> ModelResult:
        """A model whose flow ended without a result."""
        return cls(name=name, status="failed", error_class=ErrorClass.INTERNAL, error=message)

    def fail(self, stage: str, outcome: Outcome) -> None:
        """The model ended at `stage` with this failed outcome."""
        self.status, self.failed_stage, self.error_class, self.error = (
            "failed",
            stage,
            outcome.error_class,
            outcome.error,
        )
        tail = outcome.details.get("stderr_tail")
        if tail:
            self.stderr_tail = tail


class RunSummary(Document):
    """Models by status (partial: added compatibly, after the contract's keys)."""

    ok: int
    failed: int
    seconds: float
    partial: int = 0


class RunDocument(Document):
    """The run document of docs/architecture.md §4; `failure_groups` (added compatibly) only when
    the run's failures were grouped by root cause (flows/report/failures.py run_groups)."""

    optional: ClassVar[frozenset[str]] = frozenset({"failure_groups"})

    run_id: str
    store: str
    summary: RunSummary
    models: list[ModelResult]
    workers: int
    python: str | None = None  # the interpreter the workers ran in (`run --python`); None: pt2flow's own
    failure_groups: list[dict[str, Any]] | None = None
