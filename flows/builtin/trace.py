"""trace: torch.export.export of the eager model (stages/trace.py: the strictness and
dynamic-shape ladder), the training IR every other stage starts from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from pt2flow.flows.config.models import CAPTURE_PROMPT_LEN
from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.options import FunctionalizeOptions, TraceOptions

if TYPE_CHECKING:
    from pt2flow.flows.config.models import ResolvedModel
    from pt2flow.flows.engine.stage_api import Outcome, Produced, RebuildCall, ReproJob, StageCall

# 2: the program fingerprint covers every node's tensor metadata (stages/program.py); 3: a
# program's identity is the program's as it loads back (stages.serialize.stored_program)
STAGE = Stage(
    "trace",
    3,
    compute=f"{__name__}:compute",
    inputs=(Input.of("source"),),
    options=TraceOptions,
    key=f"{__name__}:key",
    repro=f"{__name__}:repro",
    rebuild=f"{__name__}:rebuild",
    default=True,
    position=10,
    description="the traced program (training IR)",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.trace import trace

    if call.model.component:  # a generative model's component: transformers' exporter, not the ladder
        return call.publish_program(trace_component(call.component()))
    return call.publish_program(trace(call.eager_model(), call.example_inputs(), call.options(TraceOptions)))


def trace_component(component: Any) -> Any:
    """A component exported as stages.generation.export_component does it (transformers'
    DynamoExporter: its patches, the cache pytrees registered, strict=False, the component's
    dynamic shapes); a failure is classified as a trace failure is (stages.classify)."""
    import time

    from pt2flow.stages import program as described
    from pt2flow.stages.classify import classify_trace_error, short_message
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.generation_export import export_component
    from pt2flow.stages.generation_steps import CallSpecs
    from pt2flow.stages.result import StageResult

    start = time.perf_counter()
    try:
        program = export_component(component)
    except StageError:
        raise
    except Exception as exc:
        raise StageError(classify_trace_error(exc), short_message(exc, 1000)) from exc
    metadata = {
        **described.describe(program),
        "strategy": "component",
        "component": component.name,
        "export_seconds": round(time.perf_counter() - start, 3),
        "call_specs": CallSpecs.of(program).to_json(),  # how a flat runtime calls it (get's manifest)
    }
    return StageResult(output=program, metadata=metadata)


def key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """The source's key, the trace options, and the training-mode settings trace exports for."""
    from pt2flow.flows.engine.stage_api import derivation_key, environment_part, options_json, stage_options
    from pt2flow.flows.pipeline import configured_by

    functional = stage_options(model, configured_by(FunctionalizeOptions), FunctionalizeOptions)
    options = {**options_json(model, stage.name), "mode": functional.mode}
    if model.training:
        options["loss_output"] = functional.loss_output
    if model.component:  # a generative model's component: which one, exported how
        options = {
            **options,
            "component": model.component,
            "exporter": "transformers.DynamoExporter",
            "capture_prompt_len": CAPTURE_PROMPT_LEN,
        }
    return derivation_key(stage.name, [inputs["source"].key], options, environment_part("cpu"))


def rebuild(call: RebuildCall) -> str | None:
    """The program traced again from the model the config builds now (None without --config)."""
    from pt2flow.stages.serialize import stored_program
    from pt2flow.stages.trace import trace

    if call.model is None:
        return None
    if call.model.component:  # a generative model's component, exported as the run exported it
        from pt2flow.flows.engine.stage_api import model_component

        return stored_program(trace_component(model_component(call.model, call.eager)).output).fingerprint
    return stored_program(trace(call.eager(), call.example_inputs(), TraceOptions(**call.options)).output).fingerprint


def repro(job: ReproJob) -> str:
    """torch.export.export with the first strategy of the ladder, whose error is the one recorded."""
    import torch

    from pt2flow.flows.engine.stage_api import build_model_code, dims_code, model_inputs, recorded_weights
    from pt2flow.stages.binding import bind_inputs, export_dynamic_shapes
    from pt2flow.stages.source import build_model, import_factory

    if job.model.component:  # a generative model's component: its decomposition and DynamoExporter's call
        from pt2flow.flows.engine.stage_api import repro_component

        return repro_component.trace(job)
    store, record, source, model, folder, files = job.store, job.record, job.source, job.model, job.folder, job.files
    state = recorded_weights(store, source.get("details") or {})
    eager = build_model(import_factory(model.factory, model.search_path), model.kwargs, state)
    specs = model_inputs(model)
    bound = bind_inputs(eager, specs, seed=0)
    files.append("inputs.pt")
    torch.save({"args": bound.args, "kwargs": bound.kwargs}, folder / "inputs.pt")
    if state is not None:
        files.append("weights.pt")
        torch.save(dict(state), folder / "weights.pt")
    attempts = (record.get("details") or {}).get("attempts") or [{}]
    first = attempts[0]
    dynamic = export_dynamic_shapes(specs, bound) if first.get("strategy", "configured") != "static" else None
    strict = bool(first.get("strict", (record.get("options") or {}).get("strict", False)))
    dims, expression = dims_code(dynamic)
    lines = [
        "inputs = torch.load(os.path.join(HERE, 'inputs.pt'), weights_only=True)",
        "args, kwargs = tuple(inputs['args']), dict(inputs['kwargs'])",
        *dims,
        f"dynamic_shapes = {expression}",
        f"# the strategy that failed first: strict={strict}, {first.get('strategy', 'configured')} dynamic shapes",
        f"ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict={strict})",
    ]
    return build_model_code(model, state is not None) + "\n".join(lines) + "\n"
