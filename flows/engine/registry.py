"""One declarative description per stage: what it consumes, how its key is made, what it runs
and what it publishes. Adding a stage means adding one StageSpec here and one compute function
in flows/engine/compute.py (docs/architecture.md, "Adding a stage").

Torch-free: keys are computed by the orchestrator and by the fully-cached check without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from pydantic import BaseModel

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.context import Outcome
from pt2flow.flows.engine.keys import Environment, derivation_key
from pt2flow.stages.options import AotCompileOptions, FunctionalizeOptions
from pt2flow.stages.vocabulary import PROGRAM_STAGES

PROGRAM = "program"  # in StageSpec.inputs: the newest program-stage outcome so far


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


def _env(device: str) -> dict[str, str]:
    return Environment.current().key_part(device)


def _trace_key(model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    functionalize = stage_options(model, "functionalize", FunctionalizeOptions)
    options = {**options_json(model, "trace"), "mode": functionalize.mode}
    if model.training:
        options["loss_output"] = functionalize.loss_output
    return derivation_key("trace", [inputs["source"].key], options, _env("cpu"))


def _program_key(stage: str) -> Callable[[ResolvedModel, Mapping[str, Outcome]], str]:
    """Keyed by the parent program's fingerprint: an identical re-trace reuses everything downstream."""

    def key(model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
        device = compile_device(model) if stage == "aot_compile" else "cpu"
        return derivation_key(stage, [inputs[PROGRAM].fingerprint], options_json(model, stage), _env(device))

    return key


def _compile_key(model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """A package is native code: its key also covers what that code was built for and with
    (CPU vector ISA, C++ compiler and version; for CUDA the GPU architecture and CUDA version),
    so a store shared by different machines never hands one a package built for another."""
    from pt2flow.flows.engine.toolchain import toolchain_identity

    device = compile_device(model)
    options = options_json(model, "aot_compile")
    env = {**_env(device), "toolchain": toolchain_identity(device, cache_dir(), options.get("inductor_configs"))}
    return derivation_key("aot_compile", [inputs[PROGRAM].fingerprint], options, env)


def cache_dir() -> str:
    """Where pt2flow keeps per-machine facts (the native toolchain identity): PT2FLOW_CACHE_DIR,
    else $XDG_CACHE_HOME/pt2flow, else ~/.cache/pt2flow."""
    import os

    explicit = os.environ.get("PT2FLOW_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pt2flow")


def _validate_key(model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    candidates = [inputs[s].artifact for s in ("serialize", "aot_compile") if s in inputs]
    return derivation_key("validate", [inputs["source"].key, *candidates], options_json(model, "validate"), _env(compile_device(model)))


@dataclass(frozen=True)
class StageSpec:
    """A stage as data.

    inputs: the outcomes it consumes (stage names, or PROGRAM for the newest program);
    optional: consumed when the run has them (validate checks whichever candidates exist);
    key: its derivation key from the model and those outcomes (torch-free);
    compute: the name of its function in flows/engine/compute.py (runs in a worker process);
    publishes: what its blob is; slot: where the run document names its artifact.
    """

    name: str
    inputs: tuple[str, ...]
    key: Callable[[ResolvedModel, Mapping[str, Outcome]], str]
    compute: str
    publishes: str
    optional: tuple[str, ...] = ()
    slot: str | None = None

    def parent_keys(self, inputs: Mapping[str, Outcome]) -> list[str]:
        return [key for name in (*self.inputs, *self.optional) if name in inputs and (key := inputs[name].key)]

    def gather(self, outcomes: Mapping[str, Outcome]) -> dict[str, Outcome]:
        """This stage's inputs from the outcomes a model has so far."""
        gathered: dict[str, Outcome] = {}
        for name in self.inputs:
            if name == PROGRAM:
                newest = [s for s in PROGRAM_STAGES if s in outcomes]
                if not newest:
                    raise KeyError(f"{self.name} needs a program stage before it")
                gathered[PROGRAM] = outcomes[newest[-1]]
            else:
                gathered[name] = outcomes[name]
        for name in self.optional:
            if name in outcomes:
                gathered[name] = outcomes[name]
        return gathered


def _source_key(model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    raise RuntimeError("the source key comes from the planner's manifest")  # see planner.source_manifest


SOURCE = StageSpec("source", (), _source_key, compute="source", publishes="source")

STAGE_SPECS: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec("trace", ("source",), _trace_key, compute="trace", publishes="program"),
        StageSpec("functionalize", (PROGRAM,), _program_key("functionalize"), compute="functionalize", publishes="program"),
        StageSpec("decompose", (PROGRAM,), _program_key("decompose"), compute="decompose", publishes="program"),
        StageSpec("serialize", (PROGRAM,), _program_key("serialize"), compute="serialize", publishes="archive", slot="serialized"),
        StageSpec("aot_compile", (PROGRAM,), _compile_key, compute="aot_compile", publishes="package", slot="compiled"),
        StageSpec(
            "validate", ("source", "trace"), _validate_key, compute="validate", publishes="report", optional=("serialize", "aot_compile")
        ),
    )
}
