"""validate: every candidate artifact the model has against eager (stages/validate.py), on the
same samples at the edges of every dynamic dim; the report is its artifact. The archive and the
package it loads itself, with the signature checks they allow; every other candidate (a target,
a plugin's) through its stage's loader (Stage.candidate)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from pt2flow.flows.pipeline.stage import LOADED_BY_VALIDATE as LOADED_HERE, Input, Stage
from pt2flow.stages.options import ValidateOptions

if TYPE_CHECKING:
    from pt2flow.flows.config.models import GenerateConfig, ResolvedModel
    from pt2flow.flows.engine.stage_api import Outcome, Produced, StageCall

# the generative verdicts' version, in a generative model's key alone: 2, every candidate kind
# generates through its step function (an OpenVINO model was skipped with a warning before)
GENERATION_STEPS = 2
# 2: the candidates' signatures are checked against the configured inputs
STAGE = Stage(
    "validate",
    2,
    compute=f"{__name__}:compute",
    inputs=(Input.of("source"), Input.of("trace")),
    options=ValidateOptions,
    publishes="report",
    artifact="report",
    suffix=".json",
    key=f"{__name__}:key",
    device=f"{__name__}:device",
    checks_candidates=True,
    default=True,
    position=100,
    description="validation report (JSON)",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.flows import pipeline
    from pt2flow.flows.engine.stage_api import validation_summary
    from pt2flow.stages.validate import validate

    model, store = call.model, call.store
    if (generate := model.generate) is not None:
        return _compute_generation(call, generate)
    publishers = {kind: name for kind in LOADED_HERE if (name := pipeline.publisher_name(kind)) and name in call.inputs}
    archive = call.artifact(publishers["archive"], "archive") if "archive" in publishers else None
    package = call.artifact(publishers["package"], "package") if "package" in publishers else None
    result = validate(
        call.eager(),
        call.example_inputs(),
        call.inputs["trace"].details.get("dims", {}),
        call.options(ValidateOptions),
        archive=archive,
        package=package,
        training=model.training,
        device=call.inputs[publishers["package"]].details.get("device", "cpu")
        if package is not None
        else "cpu",  # where the package was compiled for
        targets=target_artifacts(call),
        required=required_candidates(model),
        kinds={name: kind for kind, name in candidate_names().items()},
        evaluation=evaluation_batches(model),
    )
    report = json.dumps(result.output, indent=1, default=str).encode()
    details: dict[str, Any] = {"validation": validation_summary(result.output)}
    if "io" in result.side:  # the inputs and eager outputs, for check-compat after a torch upgrade
        io_ref = store.put_blob(result.side["io"])
        details["io"] = {"sha256": io_ref.digest, "size": io_ref.size}
    elif result.output.get("io_skipped"):  # why not (training mode, an output safetensors cannot hold)
        details["io_skipped"] = result.output["io_skipped"]
    return call.publish(report, details=details, warnings=result.warnings)


def _compute_generation(call: StageCall, generate: GenerateConfig) -> Produced:
    """A generative model: its components' artifacts of every kind generate greedily against eager
    `generate()` (stages.generation.validate_generation), one verdict per artifact kind, each run
    by its kind's step function (Stage.step, else a flat runner's over Stage.candidate)."""
    import functools
    import tempfile

    from pt2flow.flows import pipeline
    from pt2flow.flows.config.models import components_of
    from pt2flow.flows.engine.stage_api import validation_summary
    from pt2flow.stages import generation as G

    G.register_cache_pytrees()
    candidates = candidate_names()
    order = components_of(call.inputs["source"].details)  # in call order; an encoder-decoder's encoder included
    specs: dict[str, Any] = {}

    def call_specs(component: str) -> Any:  # how a flat runtime calls it: the traced program's call spec
        if component not in specs:
            specs[component] = G.CallSpecs.of(call.program(f"{component}/{pipeline.entry().name}"))
        return specs[component]

    def blob(component: str, stage: str, what: str, zipped: bool | None) -> bytes:
        return call.artifact(f"{component}/{stage}", what, zipped=zipped, stage=stage)

    with tempfile.TemporaryDirectory(prefix="pt2flow-generate-") as workdir:

        def steps_of(stage: Stage) -> Callable[[], dict[str, G.StepFn]]:
            # the kind's step function (Stage.step), else any flat runner's over its candidate loader
            make: Callable[[bytes, G.StepContext], G.StepFn] = (
                pipeline.resolve(stage.step)
                if stage.step
                else functools.partial(_candidate_steps, pipeline.resolve(str(stage.candidate)))
            )
            zipped = True if stage.publishes in LOADED_HERE else None

            def load() -> dict[str, G.StepFn]:
                steps = {}
                for c in order:
                    data = blob(c, stage.name, stage.publishes, zipped)
                    steps[c] = make(
                        data, G.StepContext(functools.partial(call_specs, c), tempfile.mkdtemp(dir=workdir))
                    )
                return steps

            return load

        loaders = {}
        for name in pipeline.candidates():
            stage = pipeline.get(name)
            if all(f"{c}/{name}" in call.inputs for c in order):
                loaders[candidates.get(stage.artifact or name, name)] = steps_of(stage)
        result = G.validate_generation(
            call.eager()(),
            call.generate_spec(),
            generate.prompt_lens,
            loaders,
            required=required_candidates(call.model),
            kinds={name: kind for kind, name in candidates.items()},
        )
    output = dict(result.output)
    report = json.dumps(output, indent=1, default=str).encode()
    return call.publish(report, details={"validation": validation_summary(output)}, warnings=output["warnings"])


def _candidate_steps(runner: Callable[[bytes], Any], data: bytes, context: Any) -> Any:
    """The step function of a kind without one of its own: its flat runner's, over `data`."""
    from pt2flow.stages.generation_steps import candidate_step

    return candidate_step(runner(data), context)


def evaluation_batches(model: ResolvedModel) -> list[Any]:
    """The model's evaluation batches (`data.evaluation` of them, after its calibration ones), or
    none. Their source and the files they read are in the source's key, and so in this stage's."""
    if model.data is None or not model.data.evaluation or model.training:
        return []
    from pt2flow.flows.engine.stage_api import data_batches

    return data_batches(model, "evaluation")


def target_artifacts(call: StageCall) -> dict[str, Any]:
    """The other candidates this model has (the targets; a plugin's), each its bytes and its
    stage's loader (Stage.candidate: bytes -> a runner of flat tensor lists)."""
    from pt2flow.flows import pipeline
    from pt2flow.stages.targets import TargetArtifact

    found = {}
    for name in pipeline.candidates():
        stage = pipeline.get(name)
        if stage.publishes in LOADED_HERE or name not in call.inputs:
            continue
        found[name] = TargetArtifact(
            call.artifact(name, stage.publishes, zipped=None), pipeline.resolve(str(stage.candidate)), stage.exact
        )
    return found


def candidate_names() -> dict[str, str]:
    """Artifact kind (what `get --artifact` and `require:` name) -> its name among validate's
    candidates: the archive and the package under the names the report has always used, any
    other candidate under its stage's name."""
    from pt2flow.flows import pipeline

    named = {"archive": "archive", "package": "compiled"}
    return {
        stage.artifact: named.get(stage.publishes, stage.name)
        for stage in map(pipeline.get, pipeline.candidates())
        if stage.artifact
    }


def required_candidates(model: ResolvedModel) -> list[str] | None:
    """The candidates a model's `require:` names (None: every candidate it has must pass)."""
    if model.require is None:
        return None
    names = candidate_names()
    return sorted(names[kind] for kind in model.require if kind in names)


def device(model: ResolvedModel) -> str:
    """Where the package it checks runs: the package's device (the CPU without a package stage)."""
    from pt2flow.flows import pipeline

    package = pipeline.publisher("package")
    return pipeline.resolve(package.device)(model) if package is not None and package.device else "cpu"


def key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """The source's key and every candidate's artifact, under the libraries of every candidate."""
    from pt2flow.flows import pipeline
    from pt2flow.flows.engine.stage_api import current_interpreter, derivation_key, environment_part, options_json

    if (generate := model.generate) is not None:  # a generative model: every component's candidates
        from pt2flow.flows.config.models import components_of

        order = components_of(inputs["source"].details)  # in call order; an encoder-decoder's encoder first
        names = [f"{c}/{name}" for name in pipeline.candidates() for c in order]
        candidates = [inputs[name].artifact for name in names if name in inputs]
        libraries = [
            lib
            for name in pipeline.candidates()
            if f"{order[0]}/{name}" in inputs
            for lib in pipeline.get(name).libraries
        ]
        options = {
            **_keyed_options(options_json(model, stage.name)),
            "generate": generate.model_dump(mode="json"),
            "steps": GENERATION_STEPS,
        }
        if (required := required_candidates(model)) is not None:
            options = {**options, "require": required}
        env = {
            **environment_part(device(model)),
            **{lib: current_interpreter().version(lib, "absent") for lib in libraries},
        }
        return derivation_key(stage.name, [inputs["source"].key, *candidates], options, env)
    candidates = [inputs[name].artifact for name in pipeline.candidates() if name in inputs]
    libraries = [lib for name in pipeline.candidates() if name in inputs for lib in pipeline.get(name).libraries]
    env = {
        **environment_part(device(model)),
        **{lib: current_interpreter().version(lib, "absent") for lib in libraries},
    }
    options = _keyed_options(options_json(model, stage.name))
    if (
        required := required_candidates(model)
    ) is not None:  # it decides the stage's status; absent, the key is as before require existed
        options = {**options, "require": required}
    return derivation_key(stage.name, [inputs["source"].key, *candidates], options, env)


def _keyed_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options that change the verdict: with the fixed tolerance, noise_multiple does not, and
    leaving both out keeps the key of a config written before tolerance: auto existed; so does
    leaving out accuracy budgets the model does not set (the defaults are this stage's version's)."""
    if options.get("accuracy") is None:
        options = {k: v for k, v in options.items() if k != "accuracy"}
    if options.get("tolerance", "fixed") == "fixed":
        return {k: v for k, v in options.items() if k not in ("tolerance", "noise_multiple")}
    return options
