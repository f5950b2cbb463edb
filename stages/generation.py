"""Generative models as components: prefill and decode programs, validated by the tokens they generate.

The decomposition is transformers' own (`transformers.exporters.utils.decompose_for_generation`: it
runs a real `generate()` and captures the forward kwargs of the prefill call and of a decode call,
with the cache `generate()` builds, dynamic or static); the export is transformers' `DynamoExporter`
(`torch.export.export(strict=False)` under its per-model patches and cache pytree registrations).
What this module adds: explicit dynamic shapes per component (only the axes that vary), greedy
generation driven by *any* runner of the components, and the comparison with eager `generate()`.

Greedy generation with exported components runs transformers' own `generate()` loop with the
model's `forward` replaced by the components: the first call goes to `prefill`, every later call to
`decode`, each given the kwargs its program was traced with. `generate()` still builds each step's
inputs (positions, masks, the empty cache) and carries the cache each program returns to the next
call, so no cache plumbing is written here; every logit and every cache update comes from the
programs. An encoder-decoder's encoder is a component too (`encoder`, called first): transformers'
decomposition gives only the decoder's steps (`prefill` / `decode` take `encoder_outputs`), so the
encoder's kwargs are captured from the same `generate()` (the module `model.get_encoder()`, which
generate() calls once before the decoder's first step) and greedy generation swaps its `forward`
too: no eager module computes anything of the generated tokens.

Imports torch and transformers; the step functions, for the artifact kinds, pt2flow's own stages
(serialize, executorch_target, aot_compile) and their runtimes (layers: stages/ never import flows/
or storage/).

The module is in three parts: the components and their export (stages/generation_export.py), one
generation step through each kind of artifact (stages/generation_steps.py), and here greedy
generation through any of them, compared with eager `generate()`; the names of the first two are
re-exported here, where pt2flow's stages and tests reach them as `generation.X`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from typing import Any

import torch

from pt2flow.stages.generation_export import (
    PREFILL,
    DECODE,
    COMPONENTS,
    ENCODER,
    ENCODER_DECODER_COMPONENTS,
    NOT_PROGRAM_INPUTS,
    GenerateSpec,
    Component,
    prompt_inputs,
    encoder_of,
    component_names,
    components,
    forward_replaced,
    example_prompt,
    dynamic_shapes,
    register_cache_pytrees,
    ExportedComponent,
    ComponentExportError,
    size_oblivious,
    export_component,
    export_components,
    quiet_warnings,
)
from pt2flow.stages.generation_steps import (
    StepFn,
    program_step,
    traced_kwargs,
    eager_step,
    CallSpecs,
    flat_step,
    StepContext,
    candidate_step,
    archive_bytes,
    archive_step,
    pte_bytes,
    pte_step,
    onnx_bytes,
    onnx_step,
    aoti_bytes,
    aoti_step,
)

__all__ = [  # the three parts' names, as `generation.X`
    "COMPONENTS",
    "CallSpecs",
    "Component",
    "ComponentExportError",
    "DECODE",
    "ENCODER",
    "ENCODER_DECODER_COMPONENTS",
    "ExportedComponent",
    "GenerateSpec",
    "Generation",
    "GenerationComparison",
    "NOT_PROGRAM_INPUTS",
    "PREFILL",
    "StepContext",
    "StepFn",
    "aoti_bytes",
    "aoti_step",
    "archive_bytes",
    "archive_step",
    "candidate_step",
    "compare_generation",
    "component_names",
    "components",
    "dynamic_shapes",
    "eager_generation",
    "eager_step",
    "encoder_of",
    "example_prompt",
    "export_component",
    "export_components",
    "flat_step",
    "forward_replaced",
    "greedy_tokens",
    "onnx_bytes",
    "onnx_step",
    "program_step",
    "prompt_inputs",
    "pte_bytes",
    "pte_step",
    "quiet_warnings",
    "register_cache_pytrees",
    "size_oblivious",
    "traced_kwargs",
    "validate_generation",
]


@dataclasses.dataclass(frozen=True)
class Generation:
    """Greedy tokens (the new ones only) and the raw logits of each step (`[steps, vocab]`)."""

    tokens: list[int]
    logits: torch.Tensor


def eager_generation(model: torch.nn.Module, generate: GenerateSpec, prompt_ids: torch.Tensor) -> Generation:
    """The reference: `model.generate(..., do_sample=False, max_new_tokens=N)` with the same cache kind."""
    with torch.no_grad():
        out = model.generate(
            **prompt_inputs(model, prompt_ids),
            generation_config=generate.generation_config(model),
            return_dict_in_generate=True,
            output_logits=True,
        )
    steps = len(out.logits)  # an encoder-decoder's sequences start with the decoder start token, not the prompt
    return Generation(out.sequences[0, out.sequences.shape[1] - steps :].tolist(), torch.cat(out.logits, dim=0).float())


def greedy_tokens(
    model: torch.nn.Module,
    step_fns: Mapping[str, StepFn],
    prompt_ids: torch.Tensor,
    generate: GenerateSpec,
) -> Generation:
    """Greedy generation with the components' runners: generate()'s loop, with `model.forward`
    replaced by `prefill` for the first call and `decode` for every later one, and an
    encoder-decoder's encoder (`model.get_encoder()`, which generate() calls once, before the
    decoder, for `encoder_outputs`) replaced by `encoder`.

    A step function takes generate()'s forward kwargs and returns the model's output
    (`logits` and `past_key_values`; the encoder's: its ModelOutput): `program_step`,
    `eager_step`, `pte_step` or any runner. `step_fns` must have every component of the model
    (component_names).
    """
    names = component_names(model)
    missing = set(names) - set(step_fns)
    if missing:
        raise ValueError(f"no step function for {sorted(missing)}")
    calls = dict.fromkeys(names, 0)

    def replaced(chosen: Callable[[], str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                if args:
                    raise TypeError("generate() called forward with positional arguments")
                name = chosen()
                calls[name] += 1
                return step_fns[name](**kwargs)

            return forward

        return make

    encoder = encoder_of(model)
    with ExitStack() as stack:
        if encoder is not None:
            stack.enter_context(forward_replaced(encoder, replaced(lambda: ENCODER)))
        stack.enter_context(forward_replaced(model, replaced(lambda: PREFILL if calls[PREFILL] == 0 else DECODE)))
        result = eager_generation(model, generate, prompt_ids)
    expected = {**dict.fromkeys(names, 1), DECODE: len(result.tokens) - 1}
    if calls != expected:
        raise RuntimeError(f"generate() made {calls} component calls for {len(result.tokens)} tokens")
    return result


@dataclasses.dataclass(frozen=True)
class GenerationComparison:
    """`first_divergence`: the first new-token position whose id differs (or where one run stopped
    early), None when every id agrees; `max_error`: max |logits - eager logits| per step compared."""

    first_divergence: int | None
    max_error: list[float]

    @property
    def ok(self) -> bool:
        return self.first_divergence is None


def compare_generation(
    eager_ids: list[int], eager_logits: torch.Tensor, got_ids: list[int], got_logits: torch.Tensor
) -> GenerationComparison:
    """Token ids position by position, and the logits' max error at each step both runs made."""
    first = next((i for i, (a, b) in enumerate(zip(eager_ids, got_ids)) if a != b), None)
    if first is None and len(eager_ids) != len(got_ids):
        first = min(len(eager_ids), len(got_ids))
    steps = min(len(eager_logits), len(got_logits))
    errors = [float((got_logits[i].float() - eager_logits[i].float()).abs().max()) for i in range(steps)]
    return GenerationComparison(first, errors)


# ── Validation by generation ─────────────────────────────────────────────────


def validate_generation(
    model: torch.nn.Module,
    spec: GenerateSpec,
    prompt_lens: list[int] | tuple[int, ...],
    loaders: Mapping[str, Callable[[], Mapping[str, StepFn]]],
    *,
    required: Collection[str] | None = None,
    kinds: Mapping[str, str] | None = None,
) -> Any:
    """Every candidate (its loader gives the step functions of its components: archive_step,
    pte_step, onnx_step, aoti_step) generates greedily from the same prompts as eager
    `generate()`, one prompt of each length in `prompt_lens` (example_prompt, seeded by its
    length); the token ids must be identical. Each candidate gets its own verdict:
    `serialization` (it does not load), `runtime` (a step raised), `numeric_mismatch` (tokens
    diverge: the first position and prompt named); the report has, per candidate and prompt, the
    first diverging position, the tokens and the logits' max error per step. Raises a StageError
    (the report attached) when a required candidate (None: every one) failed; else a StageResult."""
    from pt2flow.stages.classify import short_message
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.result import StageResult
    from pt2flow.stages.vocabulary import ErrorClass

    if not loaders:
        raise StageError(
            ErrorClass.CONFIG,
            "validate needs serialize, aot_compile or a target to have produced the components' artifacts",
        )
    model = model.eval()
    prompts = {length: example_prompt(model, length, seed=length) for length in prompt_lens}
    with quiet_warnings():
        eager = {length: eager_generation(model, spec, prompt) for length, prompt in prompts.items()}
    must = set(loaders) if required is None else set(required) & set(loaders)
    report: dict[str, Any] = {
        "passed": False,
        "nondeterministic": False,
        "generation": True,
        "samples": len(prompts),
        "generate": dataclasses.asdict(spec) | {"prompt_lens": list(prompt_lens)},
        "eager": {str(length): g.tokens for length, g in eager.items()},
        "candidates": {},
        "required": sorted(must),
        "warnings": [],
    }
    failed = set()
    for name, load in loaders.items():
        entry: dict[str, Any] = {
            "artifact": (kinds or {}).get(name, name),
            "max_abs_err": 0.0,
            "max_rel_err": None,
            "prompts": {},
        }
        report["candidates"][name] = entry
        verdict: dict[str, Any] = {"passed": True, "error_class": None, "error": None}
        try:
            steps: Mapping[str, StepFn] | None = load()
        except Exception as exc:  # noqa: BLE001 - a candidate that does not load fails on its own
            verdict = {
                "passed": False,
                "error_class": ErrorClass.SERIALIZATION.value,
                "error": f"{name}: does not load: {short_message(exc, 500)}",
            }
            steps = None
        for length, prompt in prompts.items():
            if steps is None:
                break
            try:
                with quiet_warnings():
                    got = greedy_tokens(model, steps, prompt, spec)
            except Exception as exc:  # noqa: BLE001
                verdict = {
                    "passed": False,
                    "error_class": ErrorClass.RUNTIME.value,
                    "error": f"{name}: generation failed (prompt {length}): {short_message(exc, 500)}",
                }
                break
            comparison = compare_generation(eager[length].tokens, eager[length].logits, got.tokens, got.logits)
            entry["prompts"][str(length)] = {
                "first_divergence": comparison.first_divergence,
                "max_error": comparison.max_error,
                "tokens": got.tokens,
            }
            entry["max_abs_err"] = max([entry["max_abs_err"], *comparison.max_error])
            if not comparison.ok and verdict["passed"]:
                verdict = {
                    "passed": False,
                    "error_class": ErrorClass.NUMERIC_MISMATCH.value,
                    "error": f"{entry['artifact']}: generated tokens diverge from eager at position {comparison.first_divergence} (prompt {length})",
                }
        entry["verdict"] = verdict
        if not verdict["passed"]:
            failed.add(name)
    report["max_abs_err"] = max((c["max_abs_err"] for c in report["candidates"].values()), default=0.0)
    report["max_rel_err"] = None
    report["passed"] = not failed
    for name in sorted(failed - must):
        verdict = report["candidates"][name]["verdict"]
        report["warnings"].append(
            f"{name} (not required) failed validation, {verdict['error_class']}: {verdict['error']}"
        )
    blocking = [report["candidates"][name]["verdict"] for name in sorted(failed & must)]
    if blocking:
        order = [ErrorClass.SERIALIZATION.value, ErrorClass.RUNTIME.value, ErrorClass.NUMERIC_MISMATCH.value]
        worst = min(blocking, key=lambda v: order.index(v["error_class"]))
        more = f" (+{len(blocking) - 5} more)" if len(blocking) > 5 else ""
        raise StageError(
            ErrorClass(worst["error_class"]), " | ".join(v["error"] for v in blocking[:5]) + more, details=report
        )
    metadata = {"passed": True, "max_abs_err": report["max_abs_err"], "max_rel_err": None}
    return StageResult(output=report, metadata=metadata, warnings=tuple(report["warnings"]))
