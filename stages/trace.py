"""trace: torch.export.export with the fallback ladder of docs/architecture.md §2."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch

from pt2flow.stages import program
from pt2flow.stages.binding import bind_inputs, export_dynamic_shapes
from pt2flow.stages.classify import classify_trace_error, failure_origin, short_message, strip_ansi
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import BoundInputs, ModelInputs
from pt2flow.stages.options import TraceOptions
from pt2flow.stages.quiet import WarningSink, quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.vocabulary import ErrorClass


def _suggested_fixes(exc: BaseException, dynamic: Any) -> Any | None:
    """torch's own suggested fixes for a dynamic-shape error, applied to our dynamic_shapes."""
    text = str(exc)
    if "Suggested fixes:" not in text:
        return None
    block = text.split("Suggested fixes:", 1)[1].strip().split("\n\n", 1)[0]
    lines = [line for line in block.splitlines() if " = " in line]
    if not lines:
        return None
    try:
        return torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(
            "Suggested fixes:\n" + "\n".join(lines), dynamic
        )
    except Exception:
        return None


def _describe_dynamic(dynamic: Any) -> Any:
    """dynamic_shapes as JSON: Dim objects by name, containers as lists and string-keyed dicts."""
    if dynamic is None or isinstance(dynamic, (int, str)):
        return dynamic
    if isinstance(dynamic, (list, tuple)):
        return [_describe_dynamic(d) for d in dynamic]
    if isinstance(dynamic, dict):
        return {str(k): _describe_dynamic(v) for k, v in dynamic.items()}
    return getattr(dynamic, "__name__", str(dynamic))


def _export(model: torch.nn.Module, bound: BoundInputs, dynamic: Any, strict: bool) -> torch.export.ExportedProgram:
    # on failure torch.export print()s the partial FX graph to sys.stderr; stages never print
    with contextlib.redirect_stderr(io.StringIO()):
        return torch.export.export(model, bound.args, bound.kwargs, dynamic_shapes=dynamic, strict=strict)


def draft_report(model: torch.nn.Module, bound: BoundInputs, dynamic: Any) -> str:
    """torch.export.draft_export's diagnostic report, for a model no strategy could export."""
    try:
        with quiet_torch(structured_trace=True), contextlib.redirect_stderr(io.StringIO()):
            draft = torch.export.draft_export(model, bound.args, bound.kwargs, dynamic_shapes=dynamic)
        report = getattr(draft, "_report", None)
        return strip_ansi(str(report)) if report is not None else "draft_export produced no report"
    except Exception as exc:
        return f"draft_export itself failed: {short_message(exc)}"


def trace(model: torch.nn.Module, model_inputs: ModelInputs, options: TraceOptions) -> StageResult:
    """Export `model` on its example inputs. Output: the ExportedProgram (training IR).

    Ladder: configured strictness; the other strictness; torch's suggested dynamic-shape fixes
    (once); static shapes. The strategy that worked and every failed attempt go in metadata.
    """
    bound = bind_inputs(model, model_inputs, seed=0)
    dynamic = export_dynamic_shapes(model_inputs, bound)
    ladder: list[tuple[str, bool, Any]] = [("configured", options.strict, dynamic)]
    if options.allows("other_strictness"):
        ladder.append(("other_strictness", not options.strict, dynamic))
    attempts: list[dict[str, Any]] = []
    errors: list[BaseException] = []  # each failed rung's exception, in the order of `attempts`
    sink = WarningSink()
    fixes_tried = False
    index = 0
    while index < len(ladder):
        strategy, strict, dyn = ladder[index]
        index += 1
        try:
            with quiet_torch(sink):
                ep = _export(model, bound, dyn, strict)
        except Exception as exc:
            error_class = _rung_class(exc)
            errors.append(exc)
            attempts.append(
                _attempt_record(strategy, strict, dyn, error_class, short_message(exc, 1000), failure_origin(exc))
            )
            if (
                error_class == ErrorClass.DYNAMIC_SHAPE
                and not fixes_tried
                and dyn is not None
                and options.allows("suggested_fixes")
            ):
                fixes_tried = True
                refined = _suggested_fixes(exc, dyn)
                if refined is not None:
                    ladder.insert(index, ("suggested_fixes", strict, refined))
            if index == len(ladder) and dynamic is not None and ladder[-1][0] != "static" and options.allows("static"):
                ladder.append(("static", options.strict, None))
            continue
        attempts.append(_attempt_record(strategy, strict, dyn, None, None))
        return _exported(model, ep, bound, strategy, strict, attempts, list(sink.items))
    raise _failure(model, bound, dynamic, options, attempts, errors)


_OBSERVED = "Observed exception"  # Dynamo's words for a `raise` in the traced code that nothing caught


def _rung_class(exc: BaseException) -> ErrorClass:
    """The error class of a failed rung. Dynamo's "Observed exception" is strict tracing meeting a
    `raise` in the model's code that nothing caught: the model's own exception (runtime), not an
    operator torch cannot trace."""
    if _OBSERVED in str(exc):
        return ErrorClass.RUNTIME
    return classify_trace_error(exc)


def _raised_by_model(exc: BaseException) -> bool:
    """Whether a rung's exception is one the model's own code raised: raised in a frame of the
    model's code (non-strict tracing runs that code as Python), or seen raised by strict tracing
    (Dynamo's "Observed exception")."""
    return _OBSERVED in str(exc) or _model_location(exc, raised_there=True) is not None


def _model_location(exc: BaseException, *, raised_there: bool = False) -> str | None:
    """The frame of the model's own code nearest the raise of `exc` (classify.failure_origin), as
    `FILE:LINE (function): code`: for an exception torch raised on the model's behalf, the model's
    line that called it. `raised_there`: only when that frame raised `exc` itself (it is the
    innermost of the traceback). None without such a frame."""
    origin = failure_origin(exc)
    if origin is None or not origin["own"]:
        return None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    found = [
        tb
        for tb in frames
        if tb.tb_lineno == origin["line"] and tb.tb_frame.f_globals.get("__name__") == origin["module"]
    ]
    if not found or (raised_there and found[-1] is not frames[-1]):
        return None
    return f"{found[-1].tb_frame.f_code.co_filename}:{origin['line']} ({origin['function']}): {origin['code']}"


def _eager_error(model: torch.nn.Module, bound: BoundInputs) -> Exception | None:
    """The exception the model raises when called eagerly on its example inputs (None: it runs)."""
    try:
        with quiet_torch(), torch.no_grad():
            bound.call(model)
    except Exception as exc:
        return exc
    return None


def _attempt_record(
    strategy: str,
    strict: bool,
    dynamic: Any,
    error_class: ErrorClass | None,
    error: str | None,
    origin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One rung of the ladder as metadata records it; a failed one with where it failed (the
    frame in the model's own code, classify.failure_origin) when there is one."""
    record = {
        "strategy": strategy,
        "strict": strict,
        "dynamic_shapes": _describe_dynamic(dynamic),
        "error_class": error_class,
        "error": error,
    }
    if origin is not None:
        record["origin"] = origin
    return record


def _exported(
    model: torch.nn.Module,
    ep: torch.export.ExportedProgram,
    bound: BoundInputs,
    strategy: str,
    strict: bool,
    attempts: list[dict[str, Any]],
    warnings: list[str],
) -> StageResult:
    """The result of the strategy that worked: the program, its metadata and warnings about the
    fallback taken and the dynamic dims that export specialized."""
    if strategy != "configured":
        failed = "; ".join(f"{a['strategy']}: {a['error_class']}" for a in attempts[:-1])
        warnings.insert(0, f"exported with fallback strategy {strategy!r} after {failed}")
    dims = program.effective_dims_of_leaves(ep, [per for _, _, per in bound.tensor_leaves()])
    lost = sorted(name for name, d in dims.items() if d.get("static"))
    if lost:
        warnings.append(f"dynamic dims specialized to static sizes: {', '.join(lost)}")
    metadata = {
        **program.describe(ep),
        "strategy": strategy,
        "static_fallback": strategy == "static",
        "specialized_dims": lost,
        "strict": strict,
        "attempts": attempts,
        "dims": dims,
        "training": bool(model.training),
    }
    return StageResult(output=ep, metadata=metadata, warnings=tuple(warnings))


def _failure(
    model: torch.nn.Module,
    bound: BoundInputs,
    dynamic: Any,
    options: TraceOptions,
    attempts: list[dict[str, Any]],
    errors: list[BaseException],
) -> StageError:
    """Every strategy failed: the most specific class, with torch's draft_export report. When a
    rung saw the model's own code raise (`raise ValueError(...)` in forward), that exception is
    what is reported, whichever rung came last: class runtime, its type and message, and the
    model's file and line (the eager call's, when the model raises eagerly too)."""
    classes = [a["error_class"] for a in attempts]
    error_class = next((c for c in classes if c != "runtime"), classes[0])
    first = next(a for a in attempts if a["error_class"] == error_class)
    if dynamic is not None and not options.allows("static") and "dynamic_shape" in classes:
        # the model exports only by giving up its dynamic dims, which its config forbids
        error_class = "dynamic_shape"
        first = next(a for a in attempts if a["error_class"] == "dynamic_shape")
        first = {**first, "error": f"{first['error']} (static fallback forbidden by trace.fallback.static: false)"}
    report = draft_report(model, bound, dynamic)
    raised = [(a, e) for a, e in zip(attempts, errors) if _raised_by_model(e)]
    if error_class == ErrorClass.RUNTIME or raised:
        eager = _eager_error(model, bound)
        if eager is not None:
            error_class, first = ErrorClass.RUNTIME, _eager_attempt(eager)
        elif error_class == ErrorClass.RUNTIME:
            # raised only while traced (a model that refuses export itself): the rung whose
            # traceback runs through the model's code says it in the model's words, not Dynamo's
            own = [(a, where) for a, e in raised if (where := _model_location(e, raised_there=True))]
            if own:
                attempt, where = own[0]
                first = {
                    **attempt,
                    "error": f"{attempt['error']}\n  at {where}\n  raised by the model's code while torch.export "
                    f"traced it (strict={attempt['strict']}); it runs in eager mode",
                }
    tried = ", ".join(a["strategy"] for a in attempts)
    return StageError(
        error_class,
        f"{first['error']} (tried: {tried})",
        attempts=tuple(attempts),
        report=report,
        details={"attempts": attempts, **({"origin": first["origin"]} if first.get("origin") else {})},
    )


def _eager_attempt(exc: Exception) -> dict[str, Any]:
    """The model's eager failure as the error to report: its own exception first, where the
    model's code raised it (or called what raised it), and why no strategy can help."""
    lines = [short_message(exc, 1000)]
    location = _model_location(exc)
    if location is not None:
        lines.append(f"  at {location}")
    lines.append(
        "  the model fails in eager mode on its example inputs, so no export strategy can work: fix the model or its inputs"
    )
    origin = failure_origin(exc)
    return {"error": "\n".join(lines), **({"origin": origin} if origin else {})}
