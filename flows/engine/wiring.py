"""How the engine wires a stage (flows/pipeline): its options for a model, its inputs from the
outcomes a model has so far, its derivation key and its parents' keys.

Torch-free: keys are computed by the orchestrator and by the fully-cached check without torch.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

from pydantic import BaseModel

from pt2flow.flows import pipeline
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.context import Outcome
from pt2flow.flows.pipeline import Stage
from pt2flow.stages.options import AotCompileOptions


def options_json(model: ResolvedModel, stage: str) -> dict[str, Any]:
    return model.options[stage].model_dump(mode="json") if stage in model.options else {}


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def stage_options(model: ResolvedModel, stage: str, kind: type[OptionsT]) -> OptionsT:
    """A stage's options as their own type (the config validated them with it)."""
    options = model.options[stage]
    if not isinstance(options, kind):
        raise TypeError(f"{model.name}: the {stage} options are a {type(options).__name__}, not a {kind.__name__}")
    return options


def compile_device(model: ResolvedModel) -> str:
    return stage_options(model, "aot_compile", AotCompileOptions).device


def gather(stage: Stage, outcomes: Mapping[str, Outcome]) -> dict[str, Outcome]:
    """`stage`'s inputs, by input name, from the outcomes a model has so far (each input from
    the first of its stages the model has: the newest program, for a program consumer)."""
    gathered: dict[str, Outcome] = {}
    for item in pipeline.inputs_of(stage):
        provider = next((s for s in item.stages if s in outcomes), None)
        if provider is not None:
            gathered[item.name] = outcomes[provider]
        elif not item.optional:
            raise KeyError(f"{stage.name} needs {' or '.join(item.stages)} before it")
    return gathered


def parent_keys(stage: Stage, inputs: Mapping[str, Outcome]) -> list[str]:
    return list(dict.fromkeys(key for item in pipeline.inputs_of(stage) if item.name in inputs and (key := inputs[item.name].key)))


def stage_key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """The stage's derivation key: its own key function, or keys.default_key."""
    from pt2flow.flows.engine.keys import default_key

    function = pipeline.resolve(stage.key) if stage.key else default_key
    return function(stage, model, inputs)
