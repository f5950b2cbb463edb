"""Index records (docs/architecture.md §5) built from stage outcomes, through IndexRecord."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.documents import Outcome
from pt2flow.flows.engine.common.keys import Environment
from pt2flow.flows.engine.orchestrator.stage_keys import stage_device
from pt2flow.storage.records import IndexRecord

# Facts about an artifact that a cached record copies from the record that made it.
ARTIFACT_FACTS = (
    "op_histogram",
    "node_count",
    "signature",
    "range_constraints",
    "validation",
    "passed",
    "max_abs_err",
    "max_rel_err",
    "strategy",
    "details",
    "blob_stat",
    "archive_version",
)


def _json(value: Any) -> str | None:
    if value is None:
        return None
    return json.dumps(value, sort_keys=True, default=str)


def stage_record(
    *,
    run_id: str,
    model: ResolvedModel,
    stage: str,
    outcome: Outcome,
    parents: Sequence[str],
    options: Mapping[str, Any],
    env: Environment,
    started: datetime,
    ended: datetime,
    source_row: Mapping[str, Any] | None = None,
) -> IndexRecord:
    """The record of one stage run; a cached one (`source_row`: the record that made the
    artifact) copies that record's artifact facts, a new one takes them from its details."""
    facts = (
        {column: source_row.get(column) for column in ARTIFACT_FACTS}
        if source_row is not None
        else artifact_facts(outcome)
    )
    if stage == "source":
        manifest = outcome.details.get("manifest") or {}
        facts.update(
            factory=model.factory,
            kwargs=_json(dict(model.kwargs)),
            code_hash=manifest.get("code_hash"),
            weights_digest=manifest.get("weights"),
        )
    return IndexRecord(
        record_id=uuid.uuid4().hex,
        run_id=run_id,
        model=model.name,
        stage=stage,
        status=outcome.status,
        cached=outcome.cached,
        key=outcome.key or None,
        parent_keys=tuple(p for p in parents if p),
        sha256=outcome.artifact,
        size=outcome.size,
        uri=outcome.uri,
        fingerprint=outcome.fingerprint,
        error_class=outcome.error_class,
        error_message=outcome.error,
        options=_json(dict(options)),
        warnings=tuple(outcome.warnings),
        seconds=outcome.seconds,
        started_at=started,
        ended_at=ended,
        torch_version=env.torch_version,
        python_version=env.python_version,
        pt2flow_version=env.pt2flow_version,
        host=env.host,
        device=stage_device(stage, model),
        **facts,
    )


def artifact_facts(outcome: Outcome) -> dict[str, Any]:
    """The record's artifact facts from a stage's details: the program's graph facts, the trace
    strategy, the validation summary; the rest of the details as JSON."""
    details = dict(outcome.details)
    facts: dict[str, Any] = {
        column: _json(details.pop(column))
        for column in ("op_histogram", "signature", "range_constraints")
        if column in details
    }
    if "node_count" in details:
        facts["node_count"] = details.pop("node_count")
    if "strategy" in details:
        facts["strategy"] = details["strategy"]
    if "archive_version" in details:
        facts["archive_version"] = details.pop("archive_version")
    validation = details.get("validation")
    if validation:
        facts.update(
            validation=_json(validation),
            passed=bool(validation.get("passed")),
            max_abs_err=validation.get("max_abs_err"),
            max_rel_err=validation.get("max_rel_err"),
        )
    facts["details"] = _json(details)
    facts["blob_stat"] = outcome.blob_stat
    return facts
