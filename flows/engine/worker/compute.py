"""The stage functions as a worker process runs them: load inputs, call the torch stage, publish.

Each Stage (flows/pipeline) names its compute function by dotted path; the worker resolves it
and calls it with a StageCall: the model, the run, the stage's inputs and key, and what a stage
needs of the store (its input programs and blobs, loaded and verified; `publish` for its output).
It returns a Produced. Errors propagate: `classify` turns them into a Failure the orchestrator
records. Torch is imported inside the functions, so planning never needs it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from pt2flow.flows import pipeline
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common import stores
from pt2flow.flows.engine.worker.artifacts import load_artifact, vouch
from pt2flow.flows.engine.worker.turns import machine_turn
from pt2flow.flows.engine.common.context import Outcome, RunContext
from pt2flow.flows.engine.common.inputs import (
    checkpoint_folder,
    data_batches,
    declared_paths,
    declared_problems,
    model_inputs,
)
from pt2flow.flows.engine.common.keys import canonical_json
from pt2flow.flows.engine.common.messages import CheckArtifact, Failure, Produced, StageRequest
from pt2flow.flows.engine.common.source_manifest import read_weights, source_manifest
from pt2flow.flows.engine.common.keys import request_key
from pt2flow.flows.engine.common.stage_options import OptionsT, stage_options
from pt2flow.flows.pipeline.stage import LOADED_BY_VALIDATE
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import FunctionalizeOptions
from pt2flow.stages.vocabulary import ErrorClass


# programs this worker built or loaded recently (saves a reload from the store for the next stage)
_PROGRAMS: OrderedDict[str, Any] = OrderedDict()
_MEMO_SIZE = 4


def _remember(digest: str, program: Any) -> None:
    _PROGRAMS[digest] = program
    _PROGRAMS.move_to_end(digest)
    while len(_PROGRAMS) > _MEMO_SIZE:
        _PROGRAMS.popitem(last=False)


def forget_programs() -> None:
    """A new model starts on this worker (messages.NewModel): nothing made for the last one is reused."""
    _PROGRAMS.clear()
    _BUILT.clear()
    _INPUTS.clear()


# the current model's example inputs, made once in this worker (its inputs factory called, its
# inputs file read, at the source stage inside the read recording, or at the first stage that
# needs them), not once per stage; every consumer materializes tensors from them as copies
# (stages/example_inputs.py materialize)
_INPUTS: dict[str, Any] = {}


def _load_program(store: Any, outcome: Outcome, model: ResolvedModel) -> Any:
    from pt2flow.stages.serialize import load_archive
    from pt2flow.stages.source import import_factory

    digest = outcome.artifact
    if digest in _PROGRAMS:
        _PROGRAMS.move_to_end(digest)
        return _PROGRAMS[digest]
    if getattr(model, "generate", None) is not None:  # a component's program names transformers' cache classes
        from pt2flow.stages.generation_export import register_cache_pytrees

        register_cache_pytrees()
    # the pytree types a program's inputs and outputs use (a transformers ModelOutput, a user
    # dataclass) are registered by the modules that define them: import the model's module and
    # the modules the program recorded when it was stored, as the cold run had them imported
    import_factory(model.factory, model.search_path)
    data = load_artifact(store, digest, outcome.size, pipeline.program_stages(), "program")
    program, _meta = load_archive(data, import_pytree_modules=True)
    _remember(digest, program)
    return program


def _publish(
    store: Any,
    data: bytes,
    *,
    fingerprint: str | None,
    details: Mapping[str, Any],
    warnings: tuple[str, ...] | list[str] = (),
) -> Produced:
    ref = store.put_blob(data)
    return Produced(
        artifact=ref.digest,
        size=ref.size,
        uri=ref.uri,
        blob_stat=store.blob_signature(ref.digest),  # just written and verified: later hits trust it
        fingerprint=fingerprint or ref.digest,
        details=dict(details),
        warnings=list(warnings),
    )


@dataclass
class StageCall:
    """One stage of one model, as its compute function sees it (the API a stage outside
    pt2flow is written against: docs/architecture.md, "Adding a stage")."""

    stage: str
    model: ResolvedModel
    ctx: RunContext
    inputs: Mapping[str, Outcome]
    key: str

    @cached_property
    def store(self) -> Any:
        return stores.open_store(self.ctx.store_url)

    def options(self, kind: type[OptionsT]) -> OptionsT:
        """This stage's options for the model, as the stage's options model."""
        return stage_options(self.model, self.stage, kind)

    def program(self, name: str = "program") -> Any:
        """Input `name` as an ExportedProgram (loaded from the store, verified; memoized)."""
        return _load_program(self.store, self.inputs[name], self.model)

    def blob(self, name: str) -> bytes:
        """The bytes of input `name`'s artifact, verified against its index record."""
        outcome = self.inputs[name]
        stages = [s.name for s in pipeline.stages() if s.publishes == pipeline.get(self._provider(name)).publishes]
        return load_artifact(self.store, outcome.artifact, outcome.size, tuple(stages), name, zipped=False)

    def example_inputs(self) -> Any:
        """The model's example inputs and dynamic dims (stages.example_inputs.ModelInputs); for a
        component, its captured kwargs (self.component().inputs)."""
        if getattr(self.model, "component", None):
            return self.component().inputs
        if self.model.name not in _INPUTS:
            _INPUTS[self.model.name] = model_inputs(self.model)
        return _INPUTS[self.model.name]

    def eager(self) -> Callable[[], Any]:
        """A function returning a fresh eager model with the weights the source recorded."""
        return model_builder(
            self.model, self.store, self.inputs["source"].details.get("weights") if "source" in self.inputs else None
        )

    def publish(
        self,
        data: bytes,
        *,
        fingerprint: str | None = None,
        details: Mapping[str, Any] | None = None,
        warnings: tuple[str, ...] | list[str] = (),
    ) -> Produced:
        """Store `data` as this stage's artifact (by digest) and describe it for the index."""
        produced = _publish(self.store, data, fingerprint=fingerprint, details=details or {}, warnings=warnings)
        vouch(self.store, produced.artifact, self.stage)
        return produced

    def publish_result(self, result: Any, *, fingerprint: str | None = None) -> Produced:
        """Publish a StageResult whose output is bytes, with its metadata as details."""
        return self.publish(result.output, fingerprint=fingerprint, details=result.metadata, warnings=result.warnings)

    def publish_program(self, result: Any) -> Produced:
        """Publish a program stage's StageResult (its output an ExportedProgram), after checking
        that it loads back (a program that does not must never become a cache entry: the stage
        fails with `serialization`, cold or warm). The record's identity and what the next stage
        is given are the program as it loads back, as a later run or `pt2flow audit` reads it
        from the store (stages.serialize.stored_program)."""
        from pt2flow.stages.serialize import stored_program

        stored = stored_program(result.output)
        details = {**result.metadata, "fingerprint": stored.fingerprint}
        produced = self.publish(stored.data, fingerprint=stored.fingerprint, details=details, warnings=result.warnings)
        _remember(produced.artifact, stored.program)
        return produced

    def eager_model(self) -> Any:
        """The eager model: the one the source stage built in this worker, else a fresh one."""
        built = _BUILT.pop(self.model.name, None)
        return built if built is not None else self.eager()()

    def generate_spec(self) -> Any:
        """A generative model's `generate:` as stages.generation.GenerateSpec (components are
        captured at CAPTURE_PROMPT_LEN; the prompt axis is dynamic)."""
        return generate_spec(self.model)

    def component(self) -> Any:
        """For a component-scoped model (`M/decode`): the parent model built and decomposed
        (stages.generation.components), this component's module, captured kwargs and dynamic
        shapes (stages.generation.Component)."""
        return model_component(self.model, self.eager())

    def artifact(self, name: str, what: str, *, zipped: bool | None = True, stage: str | None = None) -> bytes:
        """The bytes of input `name`'s artifact (a blob of kind `what`), verified against an ok
        record of the stage that made it (`stage`: a component's input, `COMPONENT/STAGE`)."""
        outcome = self.inputs[name]
        if not outcome.artifact:
            raise KeyError(f"input {name!r} of {self.stage} has no artifact")
        return load_artifact(
            self.store, outcome.artifact, outcome.size, (stage or self._provider(name),), what, zipped=zipped
        )

    def _provider(self, name: str) -> str:
        item = next(i for i in pipeline.inputs_of(pipeline.get(self.stage)) if i.name == name)
        return next((s for s in item.stages if s in self.ctx.stages or s == pipeline.SOURCE_NAME), item.stages[0])


def generate_spec(model: ResolvedModel) -> Any:
    """A generative model's `generate:` as stages.generation.GenerateSpec (components are captured
    at CAPTURE_PROMPT_LEN; the prompt axis is dynamic)."""
    from pt2flow.flows.config.models import CAPTURE_PROMPT_LEN
    from pt2flow.stages.generation_export import GenerateSpec

    generate = model.generate
    if generate is None:
        raise ValueError(f"{model.name} has no generate:")
    return GenerateSpec(
        prompt_len=CAPTURE_PROMPT_LEN,
        max_new_tokens=generate.max_new_tokens,
        cache=generate.cache,
        max_cache_len=generate.max_cache_len,
        multi_token_decode=generate.multi_token_decode,
    )


def model_component(model: ResolvedModel, build: Callable[[], Any]) -> Any:
    """The component a component-scoped model (`M/decode`) names, from the parent model `build()`
    makes, decomposed (stages.generation.components)."""
    from pt2flow.stages.generation_export import components

    if not model.component:
        raise ValueError(f"{model.name} is not a component of a generative model")
    return components(build(), generate_spec(model))[model.component]


def model_builder(model: ResolvedModel, store: Any, weights: Mapping[str, Any] | None) -> Callable[[], Any]:
    """A function returning a fresh eager model (a TrainingStep in training mode), with the
    weights the source stage recorded (its details' `weights`: sha256, size, filename) loaded."""
    from pt2flow.stages.source import build_model, import_factory, load_state_dict, training_step

    factory = import_factory(model.factory, model.search_path)
    checkpoint = checkpoint_folder(model)
    state = None
    if weights:
        state = load_state_dict(store.get_blob(weights["sha256"], weights["size"]), weights["filename"])

    def build() -> Any:
        module = build_model(factory, model.kwargs, state, training=model.training, checkpoint=checkpoint)
        if model.training:
            module = training_step(
                module,
                stage_options(model, pipeline.configured_by(FunctionalizeOptions), FunctionalizeOptions).loss_output,
            )
        return module

    return build


# ---------------------------------------------------------------------------------------------
# one function per stage


def source(call: StageCall) -> Produced:
    """Pin down what the model is made of: config, weights (copied into the store, so every
    artifact can be rebuilt from it), the dependency manifest of its code, the data files its
    construction read or declares (a checkpoint folder, `depends_on`) and the eager model's
    digest (the model is built here; trace reuses it). Stored as canonical JSON; the files'
    stat signatures go in the details, outside the key, for a cheap re-check."""
    model, store = call.model, call.store
    weights = None
    if model.weights:
        data, url = read_weights(model)
        ref = store.put_blob(data)
        weights = {"sha256": ref.digest, "size": ref.size, "filename": Path(url.split("?")[0]).name}
    static, origin = source_manifest(model, weights["sha256"] if weights else None)
    built = build_recorded(model, store, weights)
    manifest = {**static, "deps": built.deps}
    details = {
        "manifest": manifest,
        "request": request_key(static),
        "module_file": origin,
        "search_path": model.search_path,  # the config's folder: where its data factory is found (repro)
        "weights": weights,
        "weights_url": model.weights,
        "stats": built.stats,
        "stats_at": built.stats_at,
    }
    if built.problem:  # trace meets the same problem and reports it with its class
        details["deps_problem"] = built.problem
    if model.generate is not None:  # its components, in call order, from the model (outside the key)
        from pt2flow.stages.generation_export import component_names

        details["components"] = list(component_names(built.module)) if built.module is not None else None
    return call.publish(canonical_json(manifest).encode(), details=details)


# the model the source stage built, for the trace stage that follows it in this worker
_BUILT: dict[str, Any] = {}


@dataclass
class Built:
    """A model built as the source stage builds it: the dependency manifest (code, data files,
    eager digest), the files' stat signatures and when they were taken, and what went wrong."""

    deps: dict[str, Any]
    stats: dict[str, str]
    stats_at: int
    problem: str | None
    module: Any = None


def _not_model_inputs(store: Any) -> list[str]:
    """Folders whose files a build may read that are not the model's: the store (a local one) and
    pt2flow's cache."""
    from pt2flow.flows.engine.environment.interpreter import cache_dir

    folders = [str(cache_dir())]
    url = str(store.url)
    if url.startswith("file://") or "://" not in url:
        folders.append(url.removeprefix("file://"))
    return folders


def build_recorded(model: ResolvedModel, store: Any, weights: Mapping[str, Any] | None) -> Built:
    """Build the model once, recording what it is made of (stages/deps.py, stages/reads.py).

    Seeds of the code walk: the factory's module, the inputs factory's module and the modules
    of the built model's classes; the walk reads source files only, so the manifest does not
    depend on what this worker ran before (docs/architecture.md §5). The data files come from
    the reads recorded while the model and its example inputs are made, plus the import-time
    reads of its local modules; the declared ones from the config."""
    from pt2flow.stages.datafiles import Hashed
    from pt2flow.stages.deps import manifest
    from pt2flow.stages.reads import recording
    from pt2flow.stages.source import eager_digest, import_factory

    from pt2flow.stages.errors import StageError

    pipeline.stages()  # the registry reads installed distributions' entry points: not while the model's reads are recorded
    missing = declared_problems(model)
    if missing:  # what the config declares the model is made of must be there
        raise StageError(
            ErrorClass.CONFIG, "; ".join(f"{'.'.join(map(str, path))}: {message}" for path, message in missing)
        )
    _BUILT.clear()
    _INPUTS.pop(model.name, None)  # made again here, inside the recording
    built = None
    problem = None
    with recording(exclude=_not_model_inputs(store)) as reads:
        try:
            if model.inputs_factory:  # its code makes the inputs: a dependency too
                import_factory(model.inputs_factory, model.search_path)
            built = model_builder(model, store, weights)()
            _INPUTS[model.name] = model_inputs(model)  # an inputs factory's reads are the model's too
            if model.data is not None:  # so are the calibration data's: the int8 stages' keys see them
                with contextlib.suppress(Exception):  # a failing data factory fails the int8 stages alone
                    data_batches(model)
        except Exception as exc:  # noqa: BLE001 - an unimportable or unbuildable model fails at trace, classified
            problem = f"{type(exc).__name__}: {exc}"
    if built is not None:
        _BUILT[model.name] = built
    seeds: list[Any] = [model.factory.split(":", 1)[0]]
    if model.inputs_factory:
        seeds.append(model.inputs_factory.split(":", 1)[0])
    if model.data is not None and model.data.factory is not None:
        seeds.append(model.data.factory.split(":", 1)[0])
    if built is not None:
        seeds += sorted({type(m) for m in built.modules()}, key=lambda t: f"{t.__module__}.{t.__qualname__}")
    hashed = Hashed()
    try:
        deps = manifest(seeds, model.search_path, reads=reads.files(), declared=declared_paths(model), hashed=hashed)
    except Exception as exc:  # noqa: BLE001 - no manifest: the key still covers the factory module's source
        deps = {"files": {}, "distributions": {}, "error": f"{type(exc).__name__}: {exc}"}
    if built is not None:
        deps["eager"] = eager_digest(built)
    return Built(deps, hashed.signatures, hashed.taken_ns, problem, built)


def validation_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "passed": bool(report.get("passed")),
        "max_abs_err": report.get("max_abs_err"),
        "max_rel_err": report.get("max_rel_err"),
        "samples": report.get("samples"),
        "nondeterministic": bool(report.get("nondeterministic")),
        "candidates": {
            name: {"max_abs_err": c.get("max_abs_err"), "max_rel_err": c.get("max_rel_err")}
            for name, c in (report.get("candidates") or {}).items()
        },
        # each artifact's own verdict, by artifact kind (a report written before verdicts has none)
        "verdicts": {
            c.get("artifact", name): c["verdict"]
            for name, c in (report.get("candidates") or {}).items()
            if "verdict" in c
        },
        **({"latency_ms": report["latency_ms"]} if "latency_ms" in report else {}),
        **_noise_summary(report),
    }


def _noise_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """tolerance: auto's part of the summary (nothing with the fixed tolerance): the tolerance
    applied (auto, or fixed where the model could not run in float64) and the worst ratio of a
    candidate's error against float64 to eager's."""
    tolerance = report.get("tolerance") or {}
    if tolerance.get("mode") != "auto":
        return {}
    return {"tolerance": tolerance.get("applied"), "max_noise_ratio": report.get("max_noise_ratio")}


# ---------------------------------------------------------------------------------------------
# failures


def classify(stage: str, exc: BaseException) -> Failure:
    """A failure the orchestrator can record: error class, message, details, report bytes, and
    whether it is a transient storage error worth a retry."""
    from pt2flow.stages.errors import StageError
    from pt2flow.storage import StorageError
    from pt2flow.storage.retry import is_transient

    if isinstance(exc, StageError):
        report = exc.report.encode() if exc.report else None
        details: dict[str, Any] = {"attempts": list(exc.attempts)} if exc.attempts else {}
        if _publishes(stage) == "report" and exc.details:  # validate's report, attached to its failure
            report = json.dumps(exc.details, indent=1, default=str).encode()
            details["validation"] = validation_summary(exc.details)
        elif exc.details:
            details.update(exc.details)
        if "origin" not in details and (exc.__cause__ is not None or exc.__context__ is not None):
            _add_origin(details, exc)
        return Failure(ErrorClass(exc.error_class), exc.message, details, report)
    if isinstance(exc, StorageError):
        return Failure(ErrorClass.STORAGE, str(exc), transient=is_transient(exc))
    if isinstance(exc, MemoryError):
        return Failure(ErrorClass.OUT_OF_MEMORY, f"out of memory: {exc or 'MemoryError'}")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    found: dict[str, Any] = {"traceback": tb}
    _add_origin(found, exc)
    if _registered_elsewhere(stage):  # a stage from another distribution raised: not pt2flow's bug
        return Failure(ErrorClass.RUNTIME, f"{stage} raised {type(exc).__name__}: {exc}", found)
    return Failure(ErrorClass.INTERNAL, f"pt2flow bug: {type(exc).__name__}: {exc}", found)


def _add_origin(details: dict[str, Any], exc: BaseException) -> None:
    """Where the failure happened (the frame in the model's own code, else the library's), for
    its root-cause signature (flows/report/failures.py)."""
    from pt2flow.stages.classify import failure_origin

    try:
        origin = failure_origin(exc, framework=pipeline.libraries())
    except Exception:  # noqa: BLE001 - a frame that cannot be read leaves the failure without one
        origin = None
    if origin is not None:
        details["origin"] = origin


def _publishes(stage: str) -> str | None:
    try:
        return pipeline.get(stage).publishes
    except KeyError:  # not a stage: check-compat, audit
        return None


def _registered_elsewhere(stage: str) -> bool:
    try:
        return pipeline.get(stage).origin != "pt2flow"
    except KeyError:
        return False


def check_artifact(request: CheckArtifact) -> tuple[str, dict[str, Any]]:
    """check-compat's check of one artifact (stages/compat.py) on the stored samples `io`:
    ("ok", result with `checked_with`, this torch's version) or ("failed", failure). stage: the
    candidate stage that made it; one validate does not load itself is loaded by its loader.
    modules: the pytree modules to import before a package or target loads (its archive's)."""
    import torch

    from pt2flow.stages.compat import check_artifact as check
    from pt2flow.stages.validation_io import unpack

    kind, data, io, stage = request.kind, request.data, request.io, request.stage
    flat, lacking = None, None
    if stage is not None and pipeline.get(stage).publishes not in LOADED_BY_VALIDATE:
        flat = pipeline.resolve(str(pipeline.get(stage).candidate))
        lacking = missing_libraries(stage)
    try:
        result = check(
            kind,
            data,
            unpack(io) if io is not None else None,
            request.atol,
            request.rtol,
            request.device,
            flat=flat,
            target=stage,
            modules=request.modules,
            lacking=lacking,
            accuracy=request.accuracy,
        )
    except Exception as exc:
        failure = classify("check-compat", exc)
        return "failed", {"error_class": str(failure.error_class), "error": failure.error}
    return "ok", {**result, "checked_with": torch.__version__, "checked_in": sys.executable}


def missing_libraries(stage: str) -> str | None:
    """None when the libraries `stage` needs (Stage.libraries) import here, else what to tell the
    user: which are missing and the extra that installs them."""
    import importlib.util

    declared = pipeline.get(stage)
    missing = [m for m in declared.libraries if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    extra = f": pip install 'pt2flow[{declared.extra}]'" if declared.extra else ""
    return f"the {stage} stage needs {', '.join(missing)}{extra}"


def run_stage(request: StageRequest) -> tuple[str, Produced | Failure]:
    """("ok", Produced) or ("failed", Failure): never raises for the stage's own errors."""
    try:
        compute = pipeline.resolve(request.compute)
        if request.stage != pipeline.SOURCE_NAME and (lacking := missing_libraries(request.stage)) is not None:
            raise StageError(ErrorClass.CONFIG, lacking)
        with machine_turn(quiet=pipeline.get(request.stage).quiet):  # a benchmark times the machine alone
            return "ok", compute(StageCall(request.stage, request.model, request.ctx, request.inputs, request.key))
    except Exception as exc:
        return "failed", classify(request.stage, exc)
