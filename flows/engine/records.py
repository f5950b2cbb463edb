"""Index records (docs/architecture.md §5) built from stage outcomes."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, Mapping, Sequence

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.keys import Environment

# Facts about an artifact that a cached record copies from the record that made it.
_ARTIFACT_FACTS = (
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
    outcome: Mapping[str, Any],
    parents: Sequence[str],
    options: Mapping[str, Any],
    env: Environment,
    started: datetime,
    ended: datetime,
    source_row: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    details = dict(outcome.get("details") or {})
    device = None
    if stage in ("aot_compile", "validate"):
        device = model.options["aot_compile"].device  # type: ignore[attr-defined]
    record: dict[str, Any] = {
        "record_id": uuid.uuid4().hex,
        "run_id": run_id,
        "model": model.name,
        "stage": stage,
        "status": outcome["status"],
        "cached": bool(outcome.get("cached")),
        "key": outcome.get("key") or None,
        "parent_keys": [p for p in parents if p],
        "sha256": outcome.get("artifact"),
        "size": outcome.get("size"),
        "uri": outcome.get("uri"),
        "fingerprint": outcome.get("fingerprint"),
        "error_class": outcome.get("error_class"),
        "error_message": outcome.get("error"),
        "options": _json(dict(options)),
        "warnings": list(outcome.get("warnings") or []),
        "seconds": outcome.get("seconds"),
        "started_at": started,
        "ended_at": ended,
        "torch_version": env.torch_version,
        "python_version": env.python_version,
        "pt2flow_version": env.pt2flow_version,
        "host": env.host,
        "device": device,
        "blob_stat": outcome.get("blob_stat"),
    }
    if source_row is not None:
        for column in _ARTIFACT_FACTS:
            record[column] = source_row.get(column)
    else:
        for column in ("op_histogram", "signature", "range_constraints"):
            if column in details:
                record[column] = _json(details.pop(column))
        if "node_count" in details:
            record["node_count"] = details.pop("node_count")
        if "strategy" in details:
            record["strategy"] = details["strategy"]
        validation = details.get("validation")
        if validation:
            record["validation"] = _json(validation)
            record["passed"] = bool(validation.get("passed"))
            record["max_abs_err"] = validation.get("max_abs_err")
            record["max_rel_err"] = validation.get("max_rel_err")
        record["details"] = _json(details)
    if stage == "source":
        manifest = details.get("manifest") or {}
        record["factory"] = model.factory
        record["kwargs"] = _json(dict(model.kwargs))
        record["code_hash"] = manifest.get("code_hash")
        record["weights_digest"] = manifest.get("weights")
    return record
