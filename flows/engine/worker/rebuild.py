"""The worker's side of `pt2flow audit` (flows/engine/maintenance/audit.py): one program record checked.

For a source record: the eager digest of the model built again now (the caller compares it with
the recorded one). For a program record, two fingerprints of the record's program, compared by
the caller with the one the record holds:
`stored`, of the program in the record's blob as it loads now, and `rebuilt`, of the stage run
again on its recorded inputs (the parent program from the store, the recorded options; for
trace the model from the config). Imports torch; runs only in a worker process.
"""

from __future__ import annotations

from typing import Any, Mapping

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common import stores
from pt2flow.flows.engine.worker.compute import classify, model_builder
from pt2flow.flows.engine.common.inputs import model_inputs
from pt2flow.flows.engine.common.stage_options import stage_options


def _program(data: bytes) -> Any:
    from pt2flow.stages.serialize import load_archive

    return load_archive(data, import_pytree_modules=True)[0]


def _rerun(stage: str, options: Mapping[str, Any], parent: Any) -> str:
    """The fingerprint of `stage` run again on `parent` with the recorded options."""
    from pt2flow.stages import decompose, functionalize
    from pt2flow.stages.options import DecomposeOptions, FunctionalizeOptions
    from pt2flow.stages.program import fingerprint
    from pt2flow.stages.serialize import stored_program

    # a program stage's record holds the identity of its program as stored (compute._program_result)
    if stage == "functionalize":
        return stored_program(functionalize.functionalize(parent, FunctionalizeOptions(**options)).output).fingerprint
    if stage == "decompose":
        return stored_program(decompose.decompose(parent, DecomposeOptions(**options)).output).fingerprint
    return fingerprint(parent)  # serialize stores its parent program as it is


def _retrace(model: ResolvedModel, store_url: str, weights: Mapping[str, Any] | None) -> str:
    from pt2flow.stages.options import TraceOptions
    from pt2flow.stages.serialize import stored_program
    from pt2flow.stages.trace import trace

    built = model_builder(model, stores.open_store(store_url), weights)()
    return stored_program(trace(built, model_inputs(model), stage_options(model, "trace", TraceOptions)).output).fingerprint


def _rebuild_source(model: ResolvedModel, store_url: str, weights: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model built again as the source stage builds it: {"rebuilt": its eager digest (None:
    it did not build), "problem": why it did not}."""
    from pt2flow.flows.engine.worker.compute import build_recorded

    built = build_recorded(model, stores.open_store(store_url), weights)
    return {"rebuilt": built.deps.get("eager"), "problem": built.problem}


def rebuild(
    stage: str,
    stored: bytes,
    options: Mapping[str, Any],
    parent: bytes | None,
    model: ResolvedModel | None,
    store_url: str,
    weights: Mapping[str, Any] | None,
) -> tuple[str, dict[str, Any]]:
    """("ok", {"stored": fingerprint, "rebuilt": fingerprint or None}) or ("failed", failure)."""
    from pt2flow.stages.program import fingerprint
    from pt2flow.stages.source import import_factory

    try:
        if stage == "source":
            found = _rebuild_source(model, store_url, weights) if model is not None else {"rebuilt": None, "problem": None}
            return "ok", {"stored": None, **found}
        if model is not None:  # the pytree types the program uses, as the run had them
            import_factory(model.factory, model.search_path)
        found: dict[str, Any] = {"stored": fingerprint(_program(stored)), "rebuilt": None}
        if stage == "trace":
            if model is not None:
                found["rebuilt"] = _retrace(model, store_url, weights)
        elif parent is not None:
            found["rebuilt"] = _rerun(stage, options, _program(parent))
        return "ok", found
    except Exception as exc:  # noqa: BLE001 - reported as the record's failure to rebuild
        failure = classify(stage, exc)
        return "failed", {"error_class": str(failure.error_class), "error": failure.error}
