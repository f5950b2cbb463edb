"""Each stage's options, one pydantic model per stage (torch-free, so configs validate fast)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# pydantic tags of the two spellings of trace.fallback; config error paths leave them out
_BOOL_TAG = "<bool>"
_RUNGS_TAG = "<rungs>"
UNION_TAGS = frozenset({_BOOL_TAG, _RUNGS_TAG})


class FallbackOptions(_Options):
    """Which rungs of the trace fallback ladder may be used (each defaults to allowed).

    static: export with static shapes when every dynamic strategy failed. Forbid it for a model
    that must keep its dynamic dims: it then fails with class dynamic_shape instead.
    """

    other_strictness: bool = True
    suggested_fixes: bool = True
    static: bool = True


class TraceOptions(_Options):
    """strict: torch.export's strict (TorchDynamo) tracing; fallback: walk the ladder on failure
    (true), never (false), or only the rungs a mapping allows (`{static: false}`)."""

    strict: bool = False
    fallback: Annotated[
        Annotated[bool, Tag(_BOOL_TAG)] | Annotated[FallbackOptions, Tag(_RUNGS_TAG)],
        Discriminator(lambda v: _RUNGS_TAG if isinstance(v, (dict, FallbackOptions)) else _BOOL_TAG),
    ] = True

    def allows(self, rung: str) -> bool:
        """Whether the fallback ladder may use `rung` (other_strictness, suggested_fixes, static)."""
        if isinstance(self.fallback, bool):
            return self.fallback
        return bool(getattr(self.fallback, rung))


class FunctionalizeOptions(_Options):
    """mode: inference (functional ATen) or training (joint forward+backward).

    loss_output: in training mode, the index of the model's output leaf that is the scalar loss;
    unset, pt2flow trains against the sum over floating outputs of mean(output**2).
    """

    mode: Literal["inference", "training"] = "inference"
    loss_output: int | None = Field(default=None, ge=0)


class DecomposeOptions(_Options):
    """table: core_aten (torch's default decompositions) or none; preserve: ops kept as they are."""

    table: Literal["core_aten", "none"] = "core_aten"
    preserve: tuple[str, ...] = ()


class SerializeOptions(_Options):
    """torch.export.save has nothing to configure; the section exists for symmetry and future use."""


class AotCompileOptions(_Options):
    """device: where the package runs (cpu here; cuda or cuda:N where there is a GPU; the device
    types AOTInductor compiles for); inductor_configs: passed through."""

    device: str = Field(default="cpu", pattern=r"^(cpu|cuda|xpu|mps)(:[0-9]+)?$")
    inductor_configs: dict[str, Any] = Field(default_factory=dict)


AccuracyMetric = Literal["sqnr_db", "cosine", "max_abs_err", "mean_abs_err", "top1_agreement", "top5_agreement"]


class Bound(_Options):
    """A goal for one accuracy metric: the least and/or the most it may be."""

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _bounded(self) -> Bound:
        if self.min is None and self.max is None:
            raise ValueError("a bound needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is more than max ({self.max})")
        return self


# what an artifact not meant to be exact (an int8 one) must meet when the model sets no budget
DEFAULT_ACCURACY: dict[str, Bound] = {"sqnr_db": Bound(min=20.0)}


class ValidateOptions(_Options):
    """Tolerances, sample count and seed, optional latency benchmark.

    tolerance: fixed judges every candidate with allclose (|a-b| <= atol + rtol*|b|) against eager;
    auto judges each floating output leaf against a float64 copy of the eager model, within
    noise_multiple times eager's own error against it (docs/architecture.md §6). atol/rtol still
    judge integer leaves, the eager model against itself, and a model that cannot run in float64.
    accuracy: the goals of the artifacts not meant to be exact (an int8 one), which are judged by
    them instead (stages/accuracy.py).
    """

    atol: float = Field(default=1.0e-5, ge=0)
    rtol: float = Field(default=1.0e-4, ge=0)
    tolerance: Literal["fixed", "auto"] = "fixed"
    noise_multiple: float = Field(default=10.0, ge=1)
    samples: int = Field(default=3, ge=1, le=1000)
    seed: int = 0
    benchmark: bool = False
    benchmark_runs: int = Field(default=20, ge=1, le=10000)
    # the budgets of the artifacts not meant to be exact (Stage.exact false: int8), judged on the
    # samples instead of atol/rtol, each metric over all samples against eager (stages/accuracy.py);
    # unset: DEFAULT_ACCURACY
    accuracy: dict[AccuracyMetric, Bound] | None = None


class BenchmarkOptions(_Options):
    """How the benchmark stage times every validated artifact (stages/benchmark.py).

    sizes: dim name -> the sizes to time it at (every combination of the dims named; a dim not
    named stays at its example size); empty: every dynamic dim at its min, at its example size and
    at its max. warmup: untimed calls first at each size, for at least warmup_s seconds (a call of
    microseconds takes thousands of calls to reach its steady speed). Timed calls: at least
    min_runs, at most max_runs and max_seconds per artifact and size, ending once the median of the
    calls made at full speed (max_slowdown, below) moves by less than stable_fraction over the
    last `window` calls and they have gone on for min_seconds (a shared VM runs slower for
    stretches of a few hundred milliseconds: a median of a few milliseconds of calls, stable as it
    is, can lie wholly inside one). threads: the intra-op
    threads of every artifact's runtime while timing (torch's, and each target's runtime where
    its loader takes `threads`: ONNX Runtime, ExecuTorch, OpenVINO); 1 unless set, null: every
    core this process may use. On a shared VM a timing with more than one thread depends on every
    core being free at once: the same file timed with 2 threads in two processes differed by up
    to 1.9x, with 1 thread by under 5 % (docs/benchmarks.md). A target's runtime is timed on
    inputs already in its own form (converted once, untimed).

    Timings that hold: the stage runs while no other pt2flow stage work runs on the machine (the
    workers' turns, flows/engine/worker/turns.py); before timing it waits up to quiet_wait_s for
    the rest of the machine (other processes) to use at most max_load cores. A measurement is
    `noisy`, and no recommendation is drawn from it, when other work used more than max_load cores
    while it was timed, when its p90 is more than max_spread times its p50, or when the medians of
    its first and second half of calls differ by more than max_drift of the median; a measurement
    noisy by its own spread or drift (or too few calls at full speed) is taken again, up to
    `retries` more times. Every artifact is timed `passes` times at every size, in passes over
    all the artifacts (every other pass in the reverse order), and each size's figures are those
    of its pass with the lowest p50 among those not noisy: a pass that ran while this VM was
    slower is not the one reported. Artifacts whose p50 is within
    tie_margin of the lowest at a size are tied: the first of them in the report's order
    (archive, compiled, the targets as configured) is recommended there.

    max_slowdown: a sample counts only when a canary (a fixed piece of work, sum(range(500)), timed
    before and after it) ran within max_slowdown of its fastest in this benchmark: a shared VM's
    host runs a process 1.5-2.4x slower for stretches of 0.1 s to seconds, unseen by the load, and a
    measurement inside one has a clean spread (stages/timing.py Canary). A measurement with fewer
    than min_runs samples at full speed within max_seconds is `noisy` (and taken again); null:
    every sample counts, the machine's speed unwatched.
    """

    sizes: dict[str, tuple[Annotated[int, Field(ge=0)], ...]] = Field(default_factory=dict)
    warmup: int = Field(default=3, ge=0, le=1000)
    warmup_s: float = Field(default=0.1, ge=0)
    min_runs: int = Field(default=5, ge=1, le=100000)
    max_runs: int = Field(default=1000, ge=1, le=100000)
    window: int = Field(default=5, ge=1, le=1000)
    stable_fraction: float = Field(default=0.02, gt=0, lt=1)
    min_seconds: float = Field(default=0.3, ge=0)
    max_seconds: float = Field(default=10.0, gt=0)
    threads: int | None = Field(default=1, ge=1)
    quiet_wait_s: float = Field(default=10.0, ge=0)
    max_load: float = Field(default=0.5, ge=0)
    max_spread: float = Field(default=10.0, gt=1)
    max_drift: float = Field(default=0.25, gt=0)
    tie_margin: float = Field(default=0.1, ge=0, lt=1)
    retries: int = Field(default=2, ge=0, le=10)
    passes: int = Field(default=3, ge=1, le=10)
    max_slowdown: float | None = Field(default=0.25, gt=0)

    @model_validator(mode="after")
    def _runs_in_order(self) -> BenchmarkOptions:
        if self.min_runs > self.max_runs:
            raise ValueError(f"min_runs ({self.min_runs}) is more than max_runs ({self.max_runs})")
        if any(not values for values in self.sizes.values()):
            raise ValueError("each dim under sizes needs at least one size")
        return self
