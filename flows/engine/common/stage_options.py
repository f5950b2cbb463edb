"""A stage's options for a model, as the stage's own options model (the config validated them
with it): what the orchestrator keys and a worker's stage reads."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from pt2flow.flows.config import ResolvedModel

OptionsT = TypeVar("OptionsT", bound=BaseModel)


def stage_options(model: ResolvedModel, stage: str, kind: type[OptionsT]) -> OptionsT:
    """A stage's options as their own type (the config validated them with it)."""
    options = model.options[stage]
    if not isinstance(options, kind):
        raise TypeError(f"{model.name}: the {stage} options are a {type(options).__name__}, not a {kind.__name__}")
    return options
