"""The worker's side of `pt2flow audit` (flows/engine/maintenance/audit.py): one program record checked.

For a source record: the eager digest of the model built again now (the caller compares it with
the recorded one). For a program record, two fingerprints of the record's program, compared by
the caller with the one the record holds:
`stored`, of the program in the record's blob as it loads now (of a deployment artifact, the int8
.pte, the sha256 of its bytes), and `rebuilt`, of the stage run
again on its recorded inputs by its declaration's rebuild function (Stage.rebuild: the parent
program from the store and the recorded options; for the stage that starts from the source, the
model from the config). Imports torch; runs only in a worker process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from pt2flow.flows import pipeline
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common import stores
from pt2flow.flows.engine.common.messages import RebuildRecord
from pt2flow.flows.engine.worker.compute import classify, model_builder
from pt2flow.flows.engine.common.inputs import model_inputs


# the programs this worker loaded, by the sha256 of their bytes, with their fingerprints: a
# record's stored program is the next record's parent (trace's blob is functionalize's input), so
# each blob would be loaded and fingerprinted twice. A worker audits one model (its components
# included) and is then stopped (flows/engine/maintenance/audit.py), so nothing outlives the model.
_LOADED: dict[str, tuple[Any, str]] = {}


def _loaded(data: bytes) -> tuple[Any, str]:
    """The program in an archive's bytes and its fingerprint, loaded once per worker."""
    import hashlib

    from pt2flow.stages.program import fingerprint
    from pt2flow.stages.serialize import load_archive

    digest = hashlib.sha256(data).hexdigest()
    if digest not in _LOADED:
        program = load_archive(data, import_pytree_modules=True)[0]
        _LOADED[digest] = (program, fingerprint(program))
    return _LOADED[digest]


def _register_cache_pytrees() -> None:
    """transformers' cache classes as pytrees (a generative model's component programs name them),
    where transformers is installed."""
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        from pt2flow.stages.generation_export import register_cache_pytrees

        register_cache_pytrees()


def _stored_identity(identity: str, stored: bytes) -> str:
    """What the record's fingerprint is of its blob (RebuildRecord.identity): the program's
    fingerprint as it loads now, or the sha256 of its bytes (a deployment artifact's, the int8 .pte's)."""
    import hashlib

    return hashlib.sha256(stored).hexdigest() if identity == "bytes" else _loaded(stored)[1]


@dataclass
class RebuildCall:
    """What a stage's rebuild function (Stage.rebuild) gets: the record's options, its parent's
    program as stored (None for the stage that starts from the source), and the model as the
    config resolves it (None without --config), with the weights its source recorded."""

    options: Mapping[str, Any]
    parent: Any
    model: ResolvedModel | None
    store_url: str
    weights: Mapping[str, Any] | None
    parent_fingerprint: str | None = None  # the parent program's, as it loaded (None: no parent)

    def eager(self) -> Any:
        assert self.model is not None
        return model_builder(self.model, stores.open_store(self.store_url), self.weights)()

    def example_inputs(self) -> Any:
        assert self.model is not None
        return model_inputs(self.model)


def _rebuild_source(model: ResolvedModel, store_url: str, weights: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model built again as the source stage builds it: {"rebuilt": its eager digest (None:
    it did not build), "problem": why it did not}."""
    from pt2flow.flows.engine.worker.compute import build_recorded

    built = build_recorded(model, stores.open_store(store_url), weights)
    return {"rebuilt": built.deps.get("eager"), "problem": built.problem}


def rebuild(request: RebuildRecord) -> tuple[str, dict[str, Any]]:
    """("ok", {"stored": fingerprint, "rebuilt": fingerprint or None}) or ("failed", failure)."""
    from pt2flow.stages.source import import_factory

    stage, stored, parent, model, store_url, weights = (
        request.stage,
        request.stored,
        request.parent,
        request.model,
        request.store_url,
        request.weights,
    )
    try:
        if stage == pipeline.SOURCE_NAME:
            found = (
                _rebuild_source(model, store_url, weights) if model is not None else {"rebuilt": None, "problem": None}
            )
            return "ok", {"stored": None, **found}
        if model is not None:  # the pytree types the program uses, as the run had them
            import_factory(model.factory, model.search_path)
        if (
            model is None or getattr(model, "generate", None) is not None
        ):  # a component's program names transformers' cache classes
            _register_cache_pytrees()
        found: dict[str, Any] = {"stored": _stored_identity(request.identity, stored), "rebuilt": None}
        parent_program, parent_fingerprint = _loaded(parent) if parent is not None else (None, None)
        again = RebuildCall(request.options, parent_program, model, store_url, weights, parent_fingerprint)
        found["rebuilt"] = pipeline.resolve(str(pipeline.get(stage).rebuild))(again)
        return "ok", found
    except Exception as exc:  # noqa: BLE001 - reported as the record's failure to rebuild
        failure = classify(stage, exc)
        return "failed", {"error_class": str(failure.error_class), "error": failure.error}
