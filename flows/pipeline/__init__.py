"""The stage model: a stage is one object (Stage), and the pipeline is the set of registered
stages (flows/pipeline/registry.py). The lowest layer of flows: torch-free, no Prefect, no store."""

from __future__ import annotations

from pt2flow.flows.pipeline.registry import (
    ENTRY_POINT_GROUP,
    SOURCE_NAME,
    StageRegistrationError,
    artifact_kinds,
    candidates,
    check_stage_list,
    choose_inputs,
    configured_by,
    entry,
    libraries,
    lineage_order,
    publisher,
    publisher_name,
    default_stages,
    document_slots,
    get,
    inputs_of,
    missing_libraries,
    names,
    parents,
    plugin_problems,
    program_stages,
    register,
    stages,
    unregister,
    versions,
)
from pt2flow.flows.pipeline.stage import Input, NoOptions, Stage, resolve

__all__ = [
    "ENTRY_POINT_GROUP", "SOURCE_NAME", "Input", "NoOptions", "Stage", "StageRegistrationError", "artifact_kinds", "candidates",
    "check_stage_list", "choose_inputs", "configured_by", "entry", "libraries", "lineage_order", "publisher", "publisher_name", "default_stages", "document_slots", "get", "inputs_of", "missing_libraries",
    "names", "parents", "plugin_problems", "program_stages", "register", "resolve", "stages", "unregister", "versions",
]
