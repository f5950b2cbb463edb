"""How the engine wires a stage (flows/pipeline): its options for a model, its inputs from the
outcomes a model has so far, its parents' keys, its device, and its derivation key (the default
one, or the key function its declaration names; the parts a key function is made of).

Torch-free: keys are computed by the orchestrator and by the fully-cached check without torch.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows import pipeline
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.context import Outcome
from pt2flow.flows.engine.common.keys import derivation_key
from pt2flow.flows.engine.environment.interpreter import current_environment
from pt2flow.flows.pipeline import Stage
from pt2flow.flows.engine.environment import interpreter


def options_json(model: ResolvedModel, stage: str) -> dict[str, Any]:
    return model.options[stage].model_dump(mode="json") if stage in model.options else {}


def stage_device(stage: str, model: ResolvedModel) -> str | None:
    """The device `stage`'s artifact is made for (Stage.device), None for a stage that does not say."""
    declared = pipeline.get(stage)
    return pipeline.resolve(declared.device)(model) if declared.device else None


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


def blocked(stage: Stage, outcomes: Mapping[str, Outcome]) -> bool:
    """Whether an input `stage` cannot do without has none of its stages among `outcomes` (one
    failed and the model went on: Resolvedmodel.tolerates_failure); the stage is then skipped."""
    return any(not item.optional and not any(s in outcomes for s in item.stages) for item in pipeline.inputs_of(stage))


def parent_keys(stage: Stage, inputs: Mapping[str, Outcome]) -> list[str]:
    return list(
        dict.fromkeys(
            key for item in pipeline.inputs_of(stage) if item.name in inputs and (key := inputs[item.name].key)
        )
    )


def stage_key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """The stage's derivation key: its own key function (Stage.key), or default_key."""
    function = pipeline.resolve(stage.key) if stage.key else default_key
    return function(stage, model, inputs)


# ---------------------------------------------------------------------------------------------
# the stages' keys (flows/pipeline: Stage.key names the ones that are not the default)


def environment_part(device: str, libraries: Sequence[str] = ()) -> dict[str, str]:
    """The environment a key covers: torch, Python and pt2flow on `device`, and `libraries`' versions."""
    env = current_environment().key_part(device)
    for name in libraries:  # a target's output depends on its library's version as much as on torch's
        env[name] = interpreter.current().version(name, "absent")
    return env


def default_key(stage: Any, model: Any, inputs: Mapping[str, Any]) -> str:
    """A stage's key by default: its name and version, the identity of each input (a program's
    fingerprint, else its blob's digest), its options, and the torch, Python and library versions
    (Stage.libraries), on the CPU."""
    parents = [
        inputs[item.name].fingerprint or inputs[item.name].artifact
        for item in pipeline.inputs_of(stage)
        if item.name in inputs
    ]
    return derivation_key(
        stage.name, parents, options_json(model, stage.name), environment_part("cpu", stage.libraries)
    )
