"""One model through the stages: a Prefect flow that runs one Prefect task per stage.

Tasks pass digests and keys, never nn.Modules: each task loads what it needs from the store
(verified) or from this process's small memo of programs it just built. Before a stage runs,
its derivation key is looked up in the index; an ok record whose blob verifies is reused.
Every stage run, cached or not, failed or not, appends one index record.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import traceback
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from flows import runtime
from flows.config import ResolvedModel
from flows.keys import Environment, canonical_json, derivation_key
from flows.records import stage_record
from storage import StorageError
from storage.fs import is_transient

PROGRAM_STAGES = ("trace", "functionalize", "decompose")


@dataclass(frozen=True)
class RunContext:
    """What every task of a run shares. Holds no secrets (storage options stay in the process env)."""

    run_id: str
    store_url: str
    stages: tuple[str, ...]
    force: bool = False


class StageFailed(Exception):
    """A stage ended in failure; `outcome` is what the run reports for it."""

    def __init__(self, outcome: dict[str, Any]) -> None:
        super().__init__(outcome.get("error") or "stage failed")
        self.outcome = outcome


# ---------------------------------------------------------------------------------------------
# per-process memo of programs built by earlier tasks (saves a reload from the store)

_PROGRAMS: "OrderedDict[str, Any]" = OrderedDict()
_MEMO_SIZE = 4


def _remember(digest: str, program: Any) -> None:
    _PROGRAMS[digest] = program
    _PROGRAMS.move_to_end(digest)
    while len(_PROGRAMS) > _MEMO_SIZE:
        _PROGRAMS.popitem(last=False)


def _load_program(store: Any, outcome: Mapping[str, Any]) -> Any:
    from stages.serialize import load_archive

    digest = outcome["artifact"]
    if digest in _PROGRAMS:
        _PROGRAMS.move_to_end(digest)
        return _PROGRAMS[digest]
    program, _meta = load_archive(load_artifact(store, digest, outcome.get("size"), PROGRAM_STAGES, "program"))
    _remember(digest, program)
    return program


def load_artifact(store: Any, digest: str, size: int | None, stages: tuple[str, ...], what: str) -> bytes:
    """The bytes of a zip artifact (program, .pt2 archive, AOTInductor package) about to go to a
    torch loader: only a digest the index records as an ok output of one of `stages`, read with
    its size and sha256 verified, and passed through the zip safety check (storage.safety)."""
    import pyarrow.compute as pc

    from storage.errors import RecordNotFound
    from storage.safety import check_archive

    condition = (pc.field("sha256") == digest) & (pc.field("status") == "ok") & pc.field("stage").isin(list(stages))
    rows = store.index.read(["size"], filter=condition).to_pylist()
    if not rows:
        raise RecordNotFound(f"{what} {digest} has no ok {'/'.join(stages)} record in the index of {store.url}: not loading it")
    data = store.get_blob(digest, size if size is not None else rows[0]["size"])
    check_archive(data, what=f"{what} {digest}")
    return data


# ---------------------------------------------------------------------------------------------
# building the model and its inputs from the source record


def model_inputs(model: ResolvedModel) -> Any:
    from flows.inputs import model_inputs as build_inputs

    return build_inputs(model)


def model_builder(model: ResolvedModel, store: Any, source: Mapping[str, Any]) -> Callable[[], Any]:
    """A function returning a fresh eager model (a TrainingStep in training mode), weights loaded."""
    from stages.source import build_model, import_factory, load_state_dict, training_step

    factory = import_factory(model.factory, model.search_path)
    weights = source["details"].get("weights")
    state = None
    if weights:
        state = load_state_dict(store.get_blob(weights["sha256"], weights["size"]), weights["filename"])

    def build() -> Any:
        module = build_model(factory, model.kwargs, state, training=model.training)
        if model.training:
            module = training_step(module, model.options["functionalize"].loss_output)  # type: ignore[attr-defined]
        return module

    return build


# ---------------------------------------------------------------------------------------------
# running one stage: key, cache lookup, compute, publish, record


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _options_json(model: ResolvedModel, stage: str) -> dict[str, Any]:
    return model.options[stage].model_dump(mode="json")


class StageRun:
    """The bookkeeping around one stage of one model: timing, caching, publishing, recording."""

    def __init__(self, stage: str, model: ResolvedModel, ctx: RunContext, key: str, parents: list[str]) -> None:
        self.stage = stage
        self.model = model
        self.ctx = ctx
        self.key = key
        self.parents = parents
        self.store = runtime.open_store(ctx.store_url)
        self.env = Environment.current()
        self.started = _now()
        self.clock = time.perf_counter()

    def cached(self) -> dict[str, Any] | None:
        """The outcome of an earlier ok run of this exact key whose blob still verifies."""
        # with --force, only this run's own record counts: an earlier attempt of this task
        # (retried by Prefect) that did the work and recorded it
        hit = find_cached(self.store, self.key, run_id=self.ctx.run_id if self.ctx.force else None)
        if hit is None:
            return None
        own = hit["run_id"] == self.ctx.run_id and hit["model"] == self.model.name and hit["stage"] == self.stage
        if self.ctx.force and not own:
            return None
        outcome = {
            "status": "ok",
            "cached": bool(hit["cached"]) if own else True,
            "seconds": round(time.perf_counter() - self.clock, 6),
            "artifact": hit["sha256"],
            "size": hit["size"],
            "uri": hit["uri"],
            "key": self.key,
            "fingerprint": hit["fingerprint"],
            "details": json.loads(hit["details"] or "{}"),
            "warnings": [],
        }
        if not own:  # a retried attempt does not record its stage a second time
            self._record(outcome, source_row=hit)
        return outcome

    def publish(self, data: bytes, *, fingerprint: str | None, details: Mapping[str, Any], warnings: tuple[str, ...] = ()) -> dict[str, Any]:
        """Store `data` (verifying a copy already there) and record the stage."""
        ref = self.store.put_blob(data)
        outcome = {
            "status": "ok",
            "cached": False,
            "seconds": round(time.perf_counter() - self.clock, 6),
            "artifact": ref.digest,
            "size": ref.size,
            "uri": ref.uri,
            "key": self.key,
            "fingerprint": fingerprint or ref.digest,
            "details": dict(details),
            "warnings": list(warnings),
        }
        self._record(outcome)
        return outcome

    def fail(self, error_class: str, message: str, *, details: Mapping[str, Any] | None = None, report: bytes | None = None) -> StageFailed:
        outcome: dict[str, Any] = {
            "status": "failed",
            "cached": False,
            "seconds": round(time.perf_counter() - self.clock, 6),
            "artifact": None,
            "size": None,
            "uri": None,
            "key": self.key,
            "fingerprint": None,
            "details": dict(details or {}),
            "warnings": [],
            "error_class": error_class,
            "error": message,
        }
        if report is not None:
            try:
                ref = self.store.put_blob(report)
                outcome.update(artifact=ref.digest, size=ref.size, uri=ref.uri)
                outcome["details"]["report_sha256"] = ref.digest
            except StorageError:
                pass  # the failure itself is what matters; the report is a bonus
        try:
            self._record(outcome)
        except StorageError as exc:
            outcome["error"] += f" (and its index record could not be written: {exc})"
        return StageFailed(outcome)

    def _record(self, outcome: Mapping[str, Any], source_row: Mapping[str, Any] | None = None) -> None:
        record = stage_record(
            run_id=self.ctx.run_id,
            model=self.model,
            stage=self.stage,
            outcome=outcome,
            parents=self.parents,
            options=_options_json(self.model, self.stage) if self.stage in self.model.options else {},
            env=self.env,
            started=self.started,
            ended=_now(),
            source_row=source_row,
        )
        self.store.index.append([record])


def find_cached(store: Any, key: str, run_id: str | None = None) -> dict[str, Any] | None:
    """The newest ok record for `key` (of run `run_id`, if given) whose blob exists and verifies, else None."""
    import pyarrow.compute as pc

    condition = (pc.field("key") == key) & (pc.field("status") == "ok")
    if run_id is not None:
        condition = condition & (pc.field("run_id") == run_id)
    table = store.index.read(None, filter=condition)
    if table.num_rows == 0:
        return None
    rows = sorted(table.to_pylist(), key=lambda r: r["ended_at"] or datetime.min.replace(tzinfo=timezone.utc), reverse=True)
    for row in rows:
        if row["sha256"] and store.blob_status(row["sha256"], row["size"]) == "ok":
            return row
    return None


def _guard(run: StageRun, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a stage body; turn every failure into a recorded, classified StageFailed."""
    from stages.errors import StageError

    try:
        return body()
    except StageFailed:
        raise
    except StageError as exc:
        report = exc.report.encode() if exc.report else None
        if exc.details and run.stage == "validate":
            report = json.dumps(exc.details, indent=1, default=str).encode()
        details = {"attempts": list(exc.attempts)} if exc.attempts else {}
        if run.stage == "validate" and exc.details:
            details["validation"] = _validation_summary(exc.details)
        raise run.fail(exc.error_class, exc.message, details=details, report=report) from None
    except StorageError as exc:
        if is_transient(exc) and _retries_left():
            raise TransientStageError(str(exc)) from exc  # not recorded: the retry records the outcome
        raise run.fail("storage", str(exc)) from None
    except MemoryError as exc:
        raise run.fail("runtime", f"out of memory: {exc}") from None
    except Exception as exc:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
        raise run.fail("internal", f"pt2flow bug: {type(exc).__name__}: {exc}", details={"traceback": tb}) from None


def _validation_summary(report: Mapping[str, Any]) -> dict[str, Any]:
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
# the stage tasks

# A stage task is retried, by Prefect, only after a transient storage error (the store's own
# RetryPolicy gave up: an outage longer than its backoff). The retry looks the stage up in the
# index and the store again, so what the failed attempt already published is reused, not redone.
STAGE_RETRIES = 2
STAGE_RETRY_DELAY_SECONDS = 1.0


class TransientStageError(Exception):
    """A stage attempt hit a transient storage error and will be retried (never recorded)."""


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    return isinstance(state.data, TransientStageError)


def _retries_left() -> bool:
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context is not None and context.task_run.run_count <= context.task.retries


_TASK_KW = dict(
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=STAGE_RETRIES,
    retry_delay_seconds=STAGE_RETRY_DELAY_SECONDS,
    retry_condition_fn=_retry_transient,
)


def _resolve_weights_url(model: ResolvedModel) -> str:
    url = str(model.weights)
    if "://" in url or Path(url).is_absolute():
        return url
    return str(Path(model.search_path) / url)


def _module_source_hash(model: ResolvedModel) -> tuple[str, str | None]:
    import importlib.util

    from stages.errors import StageError
    from stages.importing import search_path_first

    module_name = model.factory.split(":", 1)[0]
    try:
        with search_path_first(model.search_path):
            spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise StageError("import", f"module {module_name!r} cannot be found: {exc}") from exc
    if spec is None:
        raise StageError("import", f"module {module_name!r} not found")
    origin = spec.origin if spec.origin and Path(spec.origin).is_file() else None
    data = Path(origin).read_bytes() if origin else module_name.encode()
    return hashlib.sha256(data).hexdigest(), origin


def source_manifest(model: ResolvedModel, weights_digest: str | None) -> tuple[dict[str, Any], str | None]:
    """What the source key covers: factory, kwargs, inputs, dynamic shapes, dims, the factory
    module's source (hashed) and the weights' sha256. Returns (manifest, module file)."""
    from flows.inputs import inputs_manifest

    code_hash, origin = _module_source_hash(model)
    manifest: dict[str, Any] = {
        "factory": model.factory,
        "kwargs": dict(model.kwargs),
        **inputs_manifest(model),  # inputs, dynamic_shapes; inputs_factory / inputs_file where set
        "dims": {k: list(v) for k, v in model.dims.items()},
        "code_hash": code_hash,
        "weights": weights_digest,
    }
    return manifest, origin


def _read_weights(model: ResolvedModel) -> tuple[bytes, str]:
    from stages.errors import StageError
    from storage.fs import read_url

    url = _resolve_weights_url(model)
    try:
        return read_url(url, runtime.storage_options(url) if "://" in url else {}), url
    except FileNotFoundError as exc:
        raise StageError("weights", f"weights file not found: {model.weights}") from exc


def trace_key(model: ResolvedModel, source: Mapping[str, Any]) -> str:
    options = {**_options_json(model, "trace"), "mode": model.options["functionalize"].mode}  # type: ignore[attr-defined]
    if model.training:
        options["loss_output"] = model.options["functionalize"].loss_output  # type: ignore[attr-defined]
    return derivation_key("trace", [source["key"]], options, Environment.current().key_part("cpu"))


def program_key(stage: str, model: ResolvedModel, parent: Mapping[str, Any]) -> str:
    """functionalize, decompose, serialize, aot_compile: keyed by the parent program's fingerprint."""
    device = model.options["aot_compile"].device if stage == "aot_compile" else "cpu"  # type: ignore[attr-defined]
    return derivation_key(stage, [parent["fingerprint"]], _options_json(model, stage), Environment.current().key_part(device))


def validate_key(model: ResolvedModel, source: Mapping[str, Any], candidates: list[str]) -> str:
    device = model.options["aot_compile"].device  # type: ignore[attr-defined]
    return derivation_key("validate", [source["key"], *candidates], _options_json(model, "validate"), Environment.current().key_part(device))


def fully_cached(model: ResolvedModel, ctx: RunContext) -> bool:
    """Whether every stage of `model` has an ok record whose blob verifies: the same key chain
    the tasks compute, read from the index without torch. Such a model needs no worker."""
    if ctx.force:
        return False
    try:
        store = runtime.open_store(ctx.store_url)
        digest = None
        if model.weights:
            digest = hashlib.sha256(_read_weights(model)[0]).hexdigest()
        manifest, _ = source_manifest(model, digest)
        source = {"key": derivation_key("source", [], manifest, {})}
        if find_cached(store, source["key"]) is None:
            return False
        program: Mapping[str, Any] = source
        artifacts: dict[str, str] = {}
        for stage in ctx.stages:
            if stage == "trace":
                key = trace_key(model, source)
            elif stage == "validate":
                key = validate_key(model, source, [artifacts[s] for s in ("serialize", "aot_compile") if s in artifacts])
            else:
                key = program_key(stage, model, program)
            hit = find_cached(store, key)
            if hit is None:
                return False
            if stage in PROGRAM_STAGES:
                program = hit
            artifacts[stage] = hit["sha256"]
        return True
    except Exception:  # anything odd: let the real tasks find out and report it
        return False


@task(name="source", **_TASK_KW)
def source_task(model: ResolvedModel, ctx: RunContext) -> dict[str, Any]:
    """Pin down what the model is made of: factory, kwargs, module source, weights, inputs.

    The weights are copied into the store (so every artifact can be rebuilt from the store) and
    the description is stored as a canonical JSON blob whose key is the source key.
    """
    run = StageRun("source", model, ctx, key="", parents=[])

    def body() -> dict[str, Any]:
        weights = None
        if model.weights:
            data, url = _read_weights(model)
            ref = run.store.put_blob(data)
            weights = {"sha256": ref.digest, "size": ref.size, "filename": Path(url.split("?")[0]).name}
        manifest, origin = source_manifest(model, weights["sha256"] if weights else None)
        run.key = derivation_key("source", [], manifest, {})
        details = {"manifest": manifest, "module_file": origin, "weights": weights, "weights_url": model.weights}
        blob = canonical_json(manifest).encode()
        # the same source seen before (or by an earlier attempt of this task): reuse its record
        return run.cached() or run.publish(blob, fingerprint=None, details=details)

    return _guard(run, body)


def _program_stage(
    stage: str,
    model: ResolvedModel,
    ctx: RunContext,
    parent: Mapping[str, Any],
    compute: Callable[[Any], Any],
) -> dict[str, Any]:
    """functionalize / decompose: program in, program out, keyed by the parent's fingerprint."""
    run = StageRun(stage, model, ctx, program_key(stage, model, parent), [parent["key"]])

    def body() -> dict[str, Any]:
        hit = run.cached()
        if hit is not None:
            return hit
        from stages.serialize import program_bytes

        result = compute(_load_program(run.store, parent))
        data = program_bytes(result.output)
        outcome = run.publish(data, fingerprint=result.metadata["fingerprint"], details=result.metadata, warnings=result.warnings)
        _remember(outcome["artifact"], result.output)
        return outcome

    return _guard(run, body)


@task(name="trace", **_TASK_KW)
def trace_task(model: ResolvedModel, ctx: RunContext, source: dict[str, Any]) -> dict[str, Any]:
    run = StageRun("trace", model, ctx, trace_key(model, source), [source["key"]])

    def body() -> dict[str, Any]:
        hit = run.cached()
        if hit is not None:
            return hit
        from stages.serialize import program_bytes
        from stages.trace import trace

        build = model_builder(model, run.store, source)
        result = trace(build(), model_inputs(model), model.options["trace"])
        data = program_bytes(result.output)
        outcome = run.publish(data, fingerprint=result.metadata["fingerprint"], details=result.metadata, warnings=result.warnings)
        _remember(outcome["artifact"], result.output)
        return outcome

    return _guard(run, body)


@task(name="functionalize", **_TASK_KW)
def functionalize_task(model: ResolvedModel, ctx: RunContext, parent: dict[str, Any]) -> dict[str, Any]:
    def compute(ep: Any) -> Any:
        from stages.functionalize import functionalize

        return functionalize(ep, model.options["functionalize"])

    return _program_stage("functionalize", model, ctx, parent, compute)


@task(name="decompose", **_TASK_KW)
def decompose_task(model: ResolvedModel, ctx: RunContext, parent: dict[str, Any]) -> dict[str, Any]:
    def compute(ep: Any) -> Any:
        from stages.decompose import decompose

        return decompose(ep, model.options["decompose"])

    return _program_stage("decompose", model, ctx, parent, compute)


@task(name="serialize", **_TASK_KW)
def serialize_task(model: ResolvedModel, ctx: RunContext, parent: dict[str, Any]) -> dict[str, Any]:
    env = Environment.current()
    key = program_key("serialize", model, parent)
    run = StageRun("serialize", model, ctx, key, [parent["key"]])

    def body() -> dict[str, Any]:
        hit = run.cached()
        if hit is not None:
            return hit
        from stages.serialize import serialize

        metadata = {
            "pt2flow_version": env.pt2flow_version,
            "torch_version": env.torch_version,
            "program_fingerprint": parent["fingerprint"],
            "derivation_key": key,
            "parent_key": parent["key"],
        }
        result = serialize(_load_program(run.store, parent), metadata)
        return run.publish(result.output, fingerprint=result.metadata["fingerprint"], details=result.metadata, warnings=result.warnings)

    return _guard(run, body)


@task(name="aot_compile", **_TASK_KW)
def aot_compile_task(model: ResolvedModel, ctx: RunContext, parent: dict[str, Any]) -> dict[str, Any]:
    options = model.options["aot_compile"]
    run = StageRun("aot_compile", model, ctx, program_key("aot_compile", model, parent), [parent["key"]])

    def body() -> dict[str, Any]:
        hit = run.cached()
        if hit is not None:
            return hit
        from stages.aot_compile import aot_compile

        result = aot_compile(_load_program(run.store, parent), options)
        return run.publish(result.output, fingerprint=None, details=result.metadata, warnings=result.warnings)

    return _guard(run, body)


@task(name="validate", **_TASK_KW)
def validate_task(
    model: ResolvedModel,
    ctx: RunContext,
    source: dict[str, Any],
    trace_outcome: dict[str, Any],
    serialized: dict[str, Any] | None,
    compiled: dict[str, Any] | None,
) -> dict[str, Any]:
    candidates = [c["artifact"] for c in (serialized, compiled) if c is not None]
    parents = [source["key"]] + [c["key"] for c in (serialized, compiled) if c is not None]
    run = StageRun("validate", model, ctx, validate_key(model, source, candidates), parents)

    def body() -> dict[str, Any]:
        hit = run.cached()
        if hit is not None:
            return hit
        from stages.validate import validate

        archive = load_artifact(run.store, serialized["artifact"], serialized["size"], ("serialize",), "archive") if serialized else None
        package = load_artifact(run.store, compiled["artifact"], compiled["size"], ("aot_compile",), "package") if compiled else None
        result = validate(
            model_builder(model, run.store, source),
            model_inputs(model),
            trace_outcome["details"].get("dims", {}),
            model.options["validate"],
            archive=archive,
            package=package,
            training=model.training,
        )
        report = json.dumps(result.output, indent=1, default=str).encode()
        details = {"validation": _validation_summary(result.output)}
        return run.publish(report, fingerprint=None, details=details, warnings=result.warnings)

    return _guard(run, body)


# ---------------------------------------------------------------------------------------------
# the model flow


def _stage_view(outcome: Mapping[str, Any]) -> dict[str, Any]:
    view = {
        "status": outcome["status"],
        "cached": bool(outcome.get("cached")),
        "seconds": outcome.get("seconds"),
        "artifact": outcome.get("artifact") if outcome["status"] == "ok" else None,
    }
    if outcome.get("warnings"):
        view["warnings"] = list(outcome["warnings"])
    if outcome["status"] != "ok":
        view["error_class"] = outcome.get("error_class")
        view["error"] = outcome.get("error")
        if outcome.get("artifact"):
            view["report"] = outcome["artifact"]
    return view


def _call(task_obj: Any, direct: bool) -> Callable[..., Any]:
    return task_obj.fn if direct else task_obj


def run_model(model: ResolvedModel, ctx: RunContext, *, direct: bool = False) -> dict[str, Any]:
    """Run the configured stages for one model; never raises for a model's own failure.

    direct: call the task functions without Prefect task runs (for a model `fully_cached`
    found cached: every stage is an index lookup, and Prefect's per-task cost would dominate).
    """
    logger = run_logger()
    if direct:
        logger.info("%s: every stage cached", model.name)
    result: dict[str, Any] = {
        "name": model.name,
        "status": "ok",
        "failed_stage": None,
        "error_class": None,
        "error": None,
        "stages": {},
        "artifacts": {"serialized": None, "compiled": None},
        "validation": None,
        "worker": f"{socket.gethostname()}:{os.getpid()}",  # which process exported it
    }
    outcomes: dict[str, dict[str, Any]] = {}
    current = "source"
    try:
        outcomes["source"] = _call(source_task, direct)(model, ctx)
        result["source"] = outcomes["source"]["artifact"]
        program = None
        for stage in ctx.stages:
            current = stage
            logger.info("%s: %s", model.name, stage)
            if stage == "trace":
                outcomes[stage] = program = _call(trace_task, direct)(model, ctx, outcomes["source"])
            elif stage == "functionalize":
                outcomes[stage] = program = _call(functionalize_task, direct)(model, ctx, program)
            elif stage == "decompose":
                outcomes[stage] = program = _call(decompose_task, direct)(model, ctx, program)
            elif stage == "serialize":
                outcomes[stage] = _call(serialize_task, direct)(model, ctx, program)
                result["artifacts"]["serialized"] = outcomes[stage]["artifact"]
            elif stage == "aot_compile":
                outcomes[stage] = _call(aot_compile_task, direct)(model, ctx, program)
                result["artifacts"]["compiled"] = outcomes[stage]["artifact"]
            elif stage == "validate":
                outcomes[stage] = _call(validate_task, direct)(
                    model, ctx, outcomes["source"], outcomes["trace"], outcomes.get("serialize"), outcomes.get("aot_compile")
                )
            result["stages"][stage] = _stage_view(outcomes[stage])
    except StageFailed as failure:
        outcome = failure.outcome
        if current != "source":
            result["stages"][current] = _stage_view(outcome)
        result.update(status="failed", failed_stage=current, error_class=outcome.get("error_class"), error=outcome.get("error"))
        logger.warning("%s failed at %s (%s): %s", model.name, current, outcome.get("error_class"), outcome.get("error"))
        outcomes[current] = outcome
    validation = (outcomes.get("validate") or {}).get("details", {}).get("validation")
    if validation:
        result["validation"] = {
            "passed": validation["passed"],
            "max_abs_err": validation["max_abs_err"],
            "max_rel_err": validation["max_rel_err"],
            "samples": validation["samples"],
        }
    return result


def run_logger() -> Any:
    """The Prefect run logger inside a flow or task run, else the plain `pt2flow` logger."""
    try:
        return get_run_logger()
    except Exception:
        import logging

        return logging.getLogger("pt2flow")


@flow(name="pt2flow-model", validate_parameters=False, persist_result=False)
def export_model_flow(model: ResolvedModel, ctx: RunContext) -> Any:
    """One model through the configured stages; the flow run fails when the model does."""
    result = run_model(model, ctx)
    if result["status"] != "ok":
        return Failed(message=f"{model.name}: {result['error_class']} at {result['failed_stage']}", data=result)
    return Completed(data=result)


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]
