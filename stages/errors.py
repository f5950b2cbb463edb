"""Errors raised by stages, each carrying one of the contract's error classes (docs/architecture.md §7)."""

from __future__ import annotations

from typing import Any

from pt2flow.stages.vocabulary import ERROR_CLASSES, ErrorClass  # noqa: F401  (ERROR_CLASSES re-exported)


class StageError(Exception):
    """A stage failed for a reason the user can act on.

    `error_class` is an ErrorClass (its value, one of ERROR_CLASSES, is accepted too). `attempts` lists what was tried (the trace fallback
    ladder); `report` is a diagnostic text worth keeping (a draft_export report, a validation
    report) and `details` any structured data for the index record.
    """

    def __init__(
        self,
        error_class: ErrorClass,
        message: str,
        *,
        attempts: tuple[dict[str, Any], ...] = (),
        report: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        if error_class not in ERROR_CLASSES:
            raise ValueError(f"unknown error class {error_class!r}")
        super().__init__(message)
        self.error_class = ErrorClass(error_class)
        self.message = message
        self.attempts = attempts
        self.report = report
        self.details = details or {}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # keep keyword-only state across process boundaries (pickle)
        return (_rebuild_stage_error, (self.error_class, self.message, self.attempts, self.report, self.details))


def _rebuild_stage_error(
    error_class: ErrorClass, message: str, attempts: Any, report: Any, details: dict[str, Any] | None
) -> StageError:
    return StageError(error_class, message, attempts=attempts, report=report, details=details)
