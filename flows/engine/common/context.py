"""What every stage of a run shares, and the failure that ends a model."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, UTC

from pt2flow.flows.config.limits import Limits  # noqa: F401  (re-exported: the engine's view of a model's limits)
from pt2flow.flows.engine.common.documents import Outcome  # noqa: F401  (re-exported: what every stage returns)


@dataclass(frozen=True)
class RunContext:
    """What every task of a run shares. Holds no secrets (storage options stay in the process env)."""

    run_id: str
    store_url: str
    stages: tuple[str, ...]
    force: bool = False
    retry_failed: bool = False  # re-run stages whose cached outcome is a deterministic failure
    python: str | None = (
        None  # the interpreter the workers run in (flows/engine/environment/interpreter.py); None: this one
    )
    verify_sources: bool = False  # build every model again (its source stage) instead of trusting its recorded manifest


class StageFailed(Exception):
    """A stage ended in failure; `outcome` is what the run reports for it."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error or "stage failed")
        self.outcome = outcome


class TransientStageError(Exception):
    """A stage attempt hit a transient storage error and will be retried (never recorded)."""


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]
