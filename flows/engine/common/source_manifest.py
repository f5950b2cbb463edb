"""What the config and the weights say about a model: the source stage records it (in a worker),
the planner keys it (flows/engine/orchestrator/planner.py) without torch.
"""

from __future__ import annotations

from typing import Any

from pt2flow.flows.config import ResolvedModel
from pt2flow.stages.vocabulary import ErrorClass


def read_weights(model: ResolvedModel) -> tuple[bytes, str]:
    from pt2flow.flows.engine.common.inputs import read_model_file

    return read_model_file(str(model.weights), model.search_path, ErrorClass.WEIGHTS, "weights file")


def source_manifest(model: ResolvedModel, weights_digest: str | None) -> tuple[dict[str, Any], str | None]:
    """What the config and the weights say about a model (the source key adds its code's
    dependency manifest): factory, kwargs, inputs (with an inputs factory's source or an inputs
    file's sha256), dynamic shapes, dims, the factory module's source and the weights' sha256.
    Returns (manifest, the factory module's file)."""
    from pt2flow.flows.engine.common.inputs import inputs_manifest, module_source_hash

    code_hash, origin = module_source_hash(model.factory, model.search_path)
    manifest: dict[str, Any] = {
        "factory": model.factory,
        "kwargs": dict(model.kwargs),
        **inputs_manifest(model),  # inputs, dynamic_shapes; inputs_factory / inputs_file where set
        "dims": {k: list(v) for k, v in model.dims.items()},
        "code_hash": code_hash,
        "weights": weights_digest,
    }
    if model.checkpoint:  # its files' digests are in the dependency manifest ("declared")
        manifest["checkpoint"] = model.checkpoint
    if model.depends_on:
        manifest["depends_on"] = list(model.depends_on)
    if getattr(model, "generate", None) is not None:  # a generative model: its components and prompts follow from it
        manifest["generate"] = model.generate.model_dump(mode="json")
    return manifest, origin
