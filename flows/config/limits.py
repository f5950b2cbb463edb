"""A model's limits (config `limits`, in `defaults` and per model): how long it may run and how
much memory its worker processes may hold before the supervisor stops them (docs/architecture.md §8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pt2flow.flows import pipeline

DEFAULT_TIMEOUT_S = 3600.0  # a model's default time limit: far above any healthy export here
DEFAULT_NO_WORKER_TIMEOUT_S = 60.0  # a Dask cluster with no worker this long fails what is left


class LimitsConfig(BaseModel):
    """What one model may take (a worker over it is stopped): wall-clock seconds for the whole
    model, seconds per stage, and GiB of resident memory of its worker process tree."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(
        default=None, gt=0, description=f"seconds for the whole model (default {DEFAULT_TIMEOUT_S:g})"
    )
    stage_timeout_s: dict[str, float] = Field(
        default_factory=dict, description="seconds per stage, e.g. {aot_compile: 600}"
    )
    memory_gb: float | None = Field(
        default=None, gt=0, description="GiB for the worker and its compilers (default: 90% of the machine's memory)"
    )

    @field_validator("stage_timeout_s")
    @classmethod
    def _known_stages(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(pipeline.names()) - {"source"})
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are {list(pipeline.names())}")
        if any(not (v > 0) for v in value.values()):
            raise ValueError("stage time limits must be > 0 seconds")
        return value


@dataclass(frozen=True)
class Limits:
    """A model's resolved limits (None: no limit of that kind)."""

    timeout_s: float | None = None
    stage_timeout_s: Mapping[str, float] = field(default_factory=dict)
    memory_gb: float | None = None

    def stage_budget(self, stage: str) -> float | None:
        return self.stage_timeout_s.get(stage)


def resolve_limits(defaults: Mapping[str, Any], model: LimitsConfig | None) -> Limits:
    """Model limits over the config's defaults, field by field; stage limits merged."""
    own = model.model_dump(exclude_unset=True) if model is not None else {}
    timeout = own.get("timeout_s", defaults.get("timeout_s"))
    return Limits(
        timeout_s=DEFAULT_TIMEOUT_S if timeout is None else float(timeout),
        stage_timeout_s={**(defaults.get("stage_timeout_s") or {}), **own.get("stage_timeout_s", {})},
        memory_gb=own.get("memory_gb", defaults.get("memory_gb")),
    )


class DaskConfig(BaseModel):
    """The run's Dask cluster (`--runner dask`): how long it may have no worker at all (every
    Dask worker lost, or none ever joined) before the models not yet done fail with `timeout`."""

    model_config = ConfigDict(extra="forbid")

    no_worker_timeout_s: float = Field(
        default=DEFAULT_NO_WORKER_TIMEOUT_S,
        gt=0,
        description=f"seconds the cluster may have no worker before the models not done fail (default {DEFAULT_NO_WORKER_TIMEOUT_S:g})",
    )
