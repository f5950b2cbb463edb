"""The config's `retention:` block: what `pt2flow serve` keeps of the store after each scheduled
run (storage/retention.py applies it; `pt2flow gc --keep-runs/--keep-days` is the same rule)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_GRACE_SECONDS = 3600.0  # as `pt2flow gc --grace`


class RetentionConfig(BaseModel):
    """Keep each model's `keep_runs` newest runs and/or its runs of the last `keep_days` days (a run
    either keeps is kept), with everything their artifacts' lineage needs; the rest of the index
    and the blobs only it names are freed after each scheduled run of `pt2flow serve`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keep_runs: int | None = Field(default=None, ge=1, description="keep each model's N newest runs")
    keep_days: float | None = Field(default=None, ge=0, description="keep every run that ended within this many days")
    grace_seconds: float = Field(
        default=DEFAULT_GRACE_SECONDS, ge=0, description="never delete a blob younger than this"
    )

    @model_validator(mode="after")
    def _keeps_something(self) -> RetentionConfig:
        if self.keep_runs is None and self.keep_days is None:
            raise ValueError("retention needs keep_runs, keep_days or both")
        return self
