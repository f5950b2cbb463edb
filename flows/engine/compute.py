"""The stage functions as a worker process runs them: load inputs, call the torch stage, publish.

One function per StageSpec.compute name, each `(model, ctx, inputs, key) -> produced`, where
`produced` names the published blob (artifact, size, uri), its fingerprint, details and
warnings. Errors propagate: `classify` turns them into a failure the orchestrator records.
Torch is imported inside the functions, so the registry stays importable without it.
"""

from __future__ import annotations

import json
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

from pt2flow.flows.engine import runtime
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.artifacts import load_artifact
from pt2flow.flows.engine.context import Outcome, RunContext
from pt2flow.flows.engine.planner import read_weights, request_key, source_manifest
from pt2flow.flows.engine.registry import PROGRAM, PROGRAM_STAGES, stage_options
from pt2flow.flows.engine.inputs import model_inputs
from pt2flow.flows.engine.keys import Environment, canonical_json
from pt2flow.stages.options import AotCompileOptions, DecomposeOptions, FunctionalizeOptions, TraceOptions, ValidateOptions

Produced = dict[str, Any]

# programs this worker built or loaded recently (saves a reload from the store for the next stage)
_PROGRAMS: "OrderedDict[str, Any]" = OrderedDict()
_MEMO_SIZE = 4


def _remember(digest: str, program: Any) -> None:
    _PROGRAMS[digest] = program
    _PROGRAMS.move_to_end(digest)
    while len(_PROGRAMS) > _MEMO_SIZE:
        _PROGRAMS.popitem(last=False)


def forget_programs() -> None:
    _PROGRAMS.clear()
    _BUILT.clear()


def _load_program(store: Any, outcome: Outcome, model: ResolvedModel) -> Any:
    from pt2flow.stages.serialize import load_archive
    from pt2flow.stages.source import import_factory

    digest = outcome.artifact
    if digest in _PROGRAMS:
        _PROGRAMS.move_to_end(digest)
        return _PROGRAMS[digest]
    # the pytree types a program's inputs and outputs use (a transformers ModelOutput, a user
    # dataclass) are registered by the modules that define them: import the model's module and
    # the modules the program recorded when it was stored, as the cold run had them imported
    import_factory(model.factory, model.search_path)
    data = load_artifact(store, digest, outcome.size, PROGRAM_STAGES, "program")
    program, _meta = load_archive(data, import_pytree_modules=True)
    _remember(digest, program)
    return program


def _publish(store: Any, data: bytes, *, fingerprint: str | None, details: Mapping[str, Any], warnings: tuple[str, ...] | list[str] = ()) -> Produced:
    ref = store.put_blob(data)
    return {
        "artifact": ref.digest,
        "size": ref.size,
        "uri": ref.uri,
        "blob_stat": store.blob_signature(ref.digest),  # just written and verified: later hits trust it
        "fingerprint": fingerprint or ref.digest,
        "details": dict(details),
        "warnings": list(warnings),
    }


def model_builder(model: ResolvedModel, store: Any, weights: Mapping[str, Any] | None) -> Callable[[], Any]:
    """A function returning a fresh eager model (a TrainingStep in training mode), with the
    weights the source stage recorded (its details' `weights`: sha256, size, filename) loaded."""
    from pt2flow.stages.source import build_model, import_factory, load_state_dict, training_step

    factory = import_factory(model.factory, model.search_path)
    state = None
    if weights:
        state = load_state_dict(store.get_blob(weights["sha256"], weights["size"]), weights["filename"])

    def build() -> Any:
        module = build_model(factory, model.kwargs, state, training=model.training)
        if model.training:
            module = training_step(module, stage_options(model, "functionalize", FunctionalizeOptions).loss_output)
        return module

    return build


# ---------------------------------------------------------------------------------------------
# one function per stage


def source(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    """Pin down what the model is made of: config, weights (copied into the store, so every
    artifact can be rebuilt from it) and the dependency manifest of its code (the model is built
    here to see what it imports; trace reuses the built model). Stored as canonical JSON."""
    store = runtime.open_store(ctx.store_url)
    weights = None
    if model.weights:
        data, url = read_weights(model)
        ref = store.put_blob(data)
        weights = {"sha256": ref.digest, "size": ref.size, "filename": Path(url.split("?")[0]).name}
    static, origin = source_manifest(model, weights["sha256"] if weights else None)
    deps, problem = _dependencies(model, store, weights)
    manifest = {**static, "deps": deps}
    details = {"manifest": manifest, "request": request_key(static), "module_file": origin, "weights": weights, "weights_url": model.weights}
    if problem:  # trace meets the same problem and reports it with its class
        details["deps_problem"] = problem
    return _publish(store, canonical_json(manifest).encode(), fingerprint=None, details=details)


# the model the source stage built, for the trace stage that follows it in this worker
_BUILT: dict[str, Any] = {}


def _dependencies(model: ResolvedModel, store: Any, weights: Mapping[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """The dependency manifest of the model's code (stages/deps.py), from building it once.

    Seeds: the factory's module, the inputs factory's module and the modules of the built
    model's classes; the walk from them reads source files only, so the manifest does not depend
    on what this worker ran before (docs/architecture.md §5)."""
    from pt2flow.stages.deps import manifest
    from pt2flow.stages.source import import_factory

    _BUILT.clear()
    built = None
    try:
        if model.inputs_factory:  # its code makes the inputs: a dependency too
            import_factory(model.inputs_factory, model.search_path)
        built = model_builder(model, store, weights)()
    except Exception as exc:  # noqa: BLE001 - an unimportable or unbuildable model fails at trace, classified
        problem = f"{type(exc).__name__}: {exc}"
    else:
        problem = None
        _BUILT[model.name] = built
    seeds: list[Any] = [model.factory.split(":", 1)[0]]
    if model.inputs_factory:
        seeds.append(model.inputs_factory.split(":", 1)[0])
    if built is not None:
        seeds += sorted({type(m) for m in built.modules()}, key=lambda t: f"{t.__module__}.{t.__qualname__}")
    try:
        return manifest(seeds, model.search_path), problem
    except Exception as exc:  # noqa: BLE001 - no manifest: the key still covers the factory module's source
        return {"files": {}, "distributions": {}, "error": f"{type(exc).__name__}: {exc}"}, problem


def _program_result(store: Any, result: Any) -> Produced:
    """Publish a program stage's output, after checking that it loads back (a program that does
    not must never become a cache entry: the stage fails with `serialization`, cold or warm)."""
    from pt2flow.stages.serialize import program_bytes_checked

    produced = _publish(store, program_bytes_checked(result.output), fingerprint=result.metadata["fingerprint"], details=result.metadata, warnings=result.warnings)
    _remember(produced["artifact"], result.output)
    return produced


def trace(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    from pt2flow.stages.trace import trace as trace_stage

    store = runtime.open_store(ctx.store_url)
    built = _BUILT.pop(model.name, None)
    if built is None:
        built = model_builder(model, store, inputs["source"].details.get("weights"))()
    return _program_result(store, trace_stage(built, model_inputs(model), stage_options(model, "trace", TraceOptions)))


def functionalize(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    from pt2flow.stages.functionalize import functionalize as functionalize_stage

    store = runtime.open_store(ctx.store_url)
    return _program_result(store, functionalize_stage(_load_program(store, inputs[PROGRAM], model), stage_options(model, "functionalize", FunctionalizeOptions)))


def decompose(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    from pt2flow.stages.decompose import decompose as decompose_stage

    store = runtime.open_store(ctx.store_url)
    return _program_result(store, decompose_stage(_load_program(store, inputs[PROGRAM], model), stage_options(model, "decompose", DecomposeOptions)))


def serialize(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    from pt2flow.stages.serialize import serialize as serialize_stage

    store = runtime.open_store(ctx.store_url)
    env = Environment.current()
    parent = inputs[PROGRAM]
    metadata = {
        "pt2flow_version": env.pt2flow_version,
        "torch_version": env.torch_version,
        "program_fingerprint": parent.fingerprint,
        "derivation_key": key,
        "parent_key": parent.key,
    }
    result = serialize_stage(_load_program(store, parent, model), metadata)
    return _publish(store, result.output, fingerprint=result.metadata["fingerprint"], details=result.metadata, warnings=result.warnings)


def aot_compile(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    from pt2flow.stages.aot_compile import aot_compile as compile_stage

    store = runtime.open_store(ctx.store_url)
    result = compile_stage(_load_program(store, inputs[PROGRAM], model), stage_options(model, "aot_compile", AotCompileOptions))
    return _publish(store, result.output, fingerprint=None, details=result.metadata, warnings=result.warnings)


def validate(model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> Produced:
    from pt2flow.stages.validate import validate as validate_stage

    store = runtime.open_store(ctx.store_url)
    serialized, compiled = inputs.get("serialize"), inputs.get("aot_compile")
    archive = load_artifact(store, serialized.artifact, serialized.size, ("serialize",), "archive") if serialized else None
    package = load_artifact(store, compiled.artifact, compiled.size, ("aot_compile",), "package") if compiled else None
    result = validate_stage(
        model_builder(model, store, inputs["source"].details.get("weights")),
        model_inputs(model),
        inputs["trace"].details.get("dims", {}),
        stage_options(model, "validate", ValidateOptions),
        archive=archive,
        package=package,
        training=model.training,
        device=compiled.details.get("device", "cpu") if compiled else "cpu",  # where the package was compiled for
    )
    report = json.dumps(result.output, indent=1, default=str).encode()
    details: dict[str, Any] = {"validation": validation_summary(result.output)}
    if "io" in result.side:  # the inputs and eager outputs, for check-compat after a torch upgrade
        io_ref = store.put_blob(result.side["io"])
        details["io"] = {"sha256": io_ref.digest, "size": io_ref.size}
    elif result.output.get("io_skipped"):  # why not (training mode, an output safetensors cannot hold)
        details["io_skipped"] = result.output["io_skipped"]
    return _publish(store, report, fingerprint=None, details=details, warnings=result.warnings)


COMPUTE: dict[str, Callable[[ResolvedModel, RunContext, Mapping[str, Outcome], str], Produced]] = {
    "source": source,
    "trace": trace,
    "functionalize": functionalize,
    "decompose": decompose,
    "serialize": serialize,
    "aot_compile": aot_compile,
    "validate": validate,
}


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
        **({"latency_ms": report["latency_ms"]} if "latency_ms" in report else {}),
    }


# ---------------------------------------------------------------------------------------------
# failures


def classify(stage: str, exc: BaseException) -> dict[str, Any]:
    """A failure the orchestrator can record: error class, message, details, report bytes, and
    whether it is a transient storage error worth a retry."""
    from pt2flow.stages.errors import StageError
    from pt2flow.storage import StorageError
    from pt2flow.storage.retry import is_transient

    if isinstance(exc, StageError):
        report = exc.report.encode() if exc.report else None
        details: dict[str, Any] = {"attempts": list(exc.attempts)} if exc.attempts else {}
        if stage == "validate" and exc.details:
            report = json.dumps(exc.details, indent=1, default=str).encode()
            details["validation"] = validation_summary(exc.details)
        return {"error_class": exc.error_class, "error": exc.message, "details": details, "report": report}
    if isinstance(exc, StorageError):
        return {"error_class": "storage", "error": str(exc), "details": {}, "report": None, "transient": is_transient(exc)}
    if isinstance(exc, MemoryError):
        return {"error_class": "out_of_memory", "error": f"out of memory: {exc or 'MemoryError'}", "details": {}, "report": None}
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return {"error_class": "internal", "error": f"pt2flow bug: {type(exc).__name__}: {exc}", "details": {"traceback": tb}, "report": None}


def check_artifact(kind: str, data: bytes, io: bytes | None, atol: float, rtol: float, device: str) -> tuple[str, Any]:
    """check-compat's check of one artifact (stages/compat.py) on the stored samples `io`:
    ("ok", result with `checked_with`, this torch's version) or ("failed", failure)."""
    import torch

    from pt2flow.stages.compat import check_artifact as check
    from pt2flow.stages.validation_io import unpack

    try:
        result = check(kind, data, unpack(io) if io is not None else None, atol, rtol, device)
    except Exception as exc:
        return "failed", classify("check-compat", exc)
    return "ok", {**result, "checked_with": torch.__version__}


def run_stage(stage: str, model: ResolvedModel, ctx: RunContext, inputs: Mapping[str, Outcome], key: str) -> tuple[str, dict[str, Any]]:
    """("ok", produced) or ("failed", failure): never raises for the stage's own errors."""
    try:
        return "ok", COMPUTE[stage](model, ctx, inputs, key)
    except Exception as exc:
        return "failed", classify(stage, exc)
