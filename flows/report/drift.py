"""The drift report (`pt2flow report --json`, compare_runs()), defined once: every view renders
its `model_dump(mode="json")`, key for key and in the order below."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Number = int | float | None  # a measurement as the index has it (an int stays an int)


class Fact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pair(Fact):
    """Two values of one fact; `changed` only when both runs know it."""

    a: Any
    b: Any
    changed: bool

    @classmethod
    def of(cls, a: Any, b: Any) -> Pair:
        return cls(a=a, b=b, changed=a is not None and b is not None and a != b)


class Numbers(Fact):
    """Two measurements with their difference and ratio (b / a)."""

    a: Number
    b: Number
    delta: Number
    ratio: float | None
    changed: bool

    @classmethod
    def of(cls, a: Number, b: Number) -> Numbers:
        if a is None or b is None:
            return cls(a=a, b=b, delta=None, ratio=None, changed=False)
        ratio = (b / a) if a else (None if b else 1.0)
        return cls(a=a, b=b, delta=b - a, ratio=ratio, changed=a != b)


class CompileSeconds(Numbers):
    """Compile times; a cached compile reports the original's, and the run that compiled."""

    a_cached: bool
    b_cached: bool
    a_compiled_in: str | None
    b_compiled_in: str | None


class ModelState(Fact):
    """A model's outcome in one run: ok, partial (validate failed an artifact the model does not
    require: `failed_artifacts`), or failed at its first failed stage with the error class."""

    status: str
    failed_stage: str | None
    error_class: str | None
    error: str | None
    stages: list[str]
    cached: bool
    trace_strategy: str | None
    static_fallback: bool
    verdicts: dict[str, bool] = {}  # artifact kind -> its own validation verdict passed (none: not judged)
    failed_artifacts: list[str] = []


class StatusChange(Fact):
    a: ModelState | None
    b: ModelState | None
    change: str  # ok | newly_failing | newly_passing | still_failing | only_in_a | only_in_b


class SourceFacts(Fact):
    factory: Pair
    kwargs: Pair
    code_hash: Pair
    weights: Pair


class OpHistogramDiff(Fact):
    added: dict[str, int]
    removed: dict[str, int]
    changed: dict[str, list[int]]
    changed_ops: int


class GraphFacts(Fact):
    stage: Pair
    fingerprint: Pair
    node_count: Numbers
    op_histogram: OpHistogramDiff
    signature: Pair
    range_constraints: Pair


class ValidationFacts(Fact):
    passed: Pair
    max_abs_err: Numbers
    max_rel_err: Numbers
    a_cached: bool
    b_cached: bool


class ArtifactFacts(Fact):
    """One artifact kind of a model (the archive, the package, a deployment target's, a plugin's),
    before and after: its size (None where that run has no such artifact) and its own verdict
    (`passed` and `error_class`; None where that run's validate did not judge it)."""

    size: Numbers
    passed: Pair
    error_class: Pair


class ModelDrift(Fact):
    """One model, before (a) and after (b)."""

    model: str
    presence: str  # both | a | b
    status: StatusChange
    torch_version: Pair
    source: SourceFacts
    static_fallback: Pair
    keys_changed: list[str]
    graph: GraphFacts
    archive_size: Numbers
    package_size: Numbers
    compile_seconds: CompileSeconds
    validation: ValidationFacts
    latency_ms: dict[str, Numbers] | None
    changes: list[str]
    # added compatibly: the after run's benchmark summary (the benchmark stage's, when it ran)
    timings: dict[str, Any] | None = None
    # added compatibly: every artifact kind either run built or judged, by kind (`get --artifact`'s
    # names), in pipeline order (None: neither run has one)
    artifacts: dict[str, ArtifactFacts] | None = None


class RunInfo(Fact):
    run_id: str
    started_at: str | None
    ended_at: str | None
    torch_versions: list[str]
    models: int
    ok: int
    failed: int
    records: int
    partial: int = 0


class Runs(Fact):
    a: RunInfo
    b: RunInfo


class TorchChange(Fact):
    a: str | None
    b: str | None
    change: str  # same | changed | upgrade | downgrade
    changed: bool


class DriftSummary(Fact):
    models: int
    in_both: int
    only_in_a: int
    only_in_b: int
    newly_failing: int
    newly_passing: int
    still_failing: int
    changed: int
    unchanged: int
    all_keys_changed: int
    regressions: int = 0


class Regression(Fact):
    """A change that needs a person (flows/report/rules.py)."""

    model: str
    rule: str
    a: Any
    b: Any
    ratio: float | None
    message: str


class Selection(Fact):
    """Which runs were compared and why (flows/report/runs.py RunSelection): `rule` given |
    newest | covering | most_shared; `models` the models compared (model -> run b), when the
    runs were chosen for the caller; `not_compared` run a's models left out."""

    rule: str
    runs: list[str]
    reason: str
    models: dict[str, str] = Field(default_factory=dict)
    not_compared: list[str] = Field(default_factory=list)


class DriftReport(Fact):
    report_version: int
    runs: Runs
    torch: TorchChange
    summary: DriftSummary
    models: list[ModelDrift]
    only_in_a: list[str]
    only_in_b: list[str]
    regressions: list[Regression] = Field(default_factory=list)
    selection: Selection | None = None  # added compatibly, last: which runs and why
    # added compatibly, last: run b's failures grouped by root cause against run a (flows/report/failures.py)
    failure_groups: list[dict[str, Any]] | None = None
