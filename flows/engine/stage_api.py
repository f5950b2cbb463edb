"""The engine as a stage module sees it (flows/builtin/*.py, a plugin's stage): the one module it
imports from the engine, typed (mypy checks flows/builtin against it in `make test`).

- a compute function: `compute(call: StageCall) -> Produced` (`call.publish`, `call.publish_result`,
  `call.publish_program`, `call.artifact`, `call.program`, `call.eager`, ...);
  `validation_summary` condenses a validation report, `model_component` builds a component;
- a key function: `key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str` from `derivation_key(stage, parents, options,
  env)`, with `options_json` (the model's options of a stage, as keyed), `environment_part` (the
  versions a target's key names) and `stage_options`; `Environment`, `current_environment`, `current_interpreter`,
  `toolchain_identity`, `toolchain_facts`, `cache_dir` for what the environment adds;
- `data_batches`: a model's own calibration data (`data:`), as (args, kwargs) per batch;
- a repro function: `repro(job: ReproJob) -> str` (the body of a torch-only script), with
  `build_model_code`, `dims_code`, `recorded_weights`, `model_inputs`, `repro_component`;
- a rebuild function (audit): `rebuild(call: RebuildCall) -> ...`.

Each name is imported where it lives on first use (PEP 562): a worker that imports a stage's
declaration loads only what that stage's functions call, and the worker side never imports the
orchestrator's modules (stage_keys, repro) unless a key or repro function runs there."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, attribute; "" for the module itself)
_WHERE: dict[str, tuple[str, str]] = {
    "StageCall": ("pt2flow.flows.engine.worker.compute", "StageCall"),
    "Produced": ("pt2flow.flows.engine.worker.compute", "Produced"),
    "validation_summary": ("pt2flow.flows.engine.worker.compute", "validation_summary"),
    "model_component": ("pt2flow.flows.engine.worker.compute", "model_component"),
    "Outcome": ("pt2flow.flows.engine.common.documents", "Outcome"),
    "RebuildCall": ("pt2flow.flows.engine.worker.rebuild", "RebuildCall"),
    "ReproJob": ("pt2flow.flows.engine.maintenance.repro", "ReproJob"),
    "build_model_code": ("pt2flow.flows.engine.maintenance.repro", "build_model_code"),
    "dims_code": ("pt2flow.flows.engine.maintenance.repro", "dims_code"),
    "recorded_weights": ("pt2flow.flows.engine.maintenance.repro", "recorded_weights"),
    "repro_component": ("pt2flow.flows.engine.maintenance.repro_component", ""),  # the module
    "derivation_key": ("pt2flow.flows.engine.common.keys", "derivation_key"),
    "Environment": ("pt2flow.flows.engine.common.keys", "Environment"),
    "stage_options": ("pt2flow.flows.engine.common.stage_options", "stage_options"),
    "model_inputs": ("pt2flow.flows.engine.common.inputs", "model_inputs"),
    "data_batches": ("pt2flow.flows.engine.common.inputs", "data_batches"),
    "environment_part": ("pt2flow.flows.engine.orchestrator.stage_keys", "environment_part"),
    "options_json": ("pt2flow.flows.engine.orchestrator.stage_keys", "options_json"),
    "current_interpreter": ("pt2flow.flows.engine.environment.interpreter", "current"),
    "current_environment": ("pt2flow.flows.engine.environment.interpreter", "current_environment"),
    "cache_dir": ("pt2flow.flows.engine.environment.interpreter", "cache_dir"),
    "toolchain_identity": ("pt2flow.flows.engine.environment.toolchain", "toolchain_identity"),
    "toolchain_facts": ("pt2flow.flows.engine.environment.toolchain", "toolchain_facts"),
}
__all__ = [  # _WHERE's names
    "Environment",
    "Outcome",
    "Produced",
    "RebuildCall",
    "ReproJob",
    "StageCall",
    "build_model_code",
    "cache_dir",
    "current_environment",
    "current_interpreter",
    "data_batches",
    "derivation_key",
    "dims_code",
    "environment_part",
    "model_component",
    "model_inputs",
    "options_json",
    "recorded_weights",
    "repro_component",
    "stage_options",
    "toolchain_facts",
    "toolchain_identity",
    "validation_summary",
]

if TYPE_CHECKING:
    from pt2flow.flows.engine.common.documents import Outcome
    from pt2flow.flows.engine.common.inputs import data_batches, model_inputs
    from pt2flow.flows.engine.common.keys import Environment, derivation_key
    from pt2flow.flows.engine.common.stage_options import stage_options
    from pt2flow.flows.engine.environment.interpreter import cache_dir
    from pt2flow.flows.engine.environment.interpreter import current as current_interpreter
    from pt2flow.flows.engine.environment.interpreter import current_environment
    from pt2flow.flows.engine.environment.toolchain import toolchain_facts, toolchain_identity
    from pt2flow.flows.engine.maintenance import repro_component
    from pt2flow.flows.engine.maintenance.repro import ReproJob, build_model_code, dims_code, recorded_weights
    from pt2flow.flows.engine.orchestrator.stage_keys import environment_part, options_json
    from pt2flow.flows.engine.worker.compute import Produced, StageCall, model_component, validation_summary
    from pt2flow.flows.engine.worker.rebuild import RebuildCall


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    imported = importlib.import_module(module)
    value = getattr(imported, attribute) if attribute else imported
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*globals(), *__all__]
