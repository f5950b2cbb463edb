"""A generative model's components (prefill, decode; an encoder-decoder's encoder) found by
transformers' own decomposition and exported one by one: stages/generation.py's first part.

The decomposition is transformers' own (`transformers.exporters.utils.decompose_for_generation`: it
runs a real `generate()` and captures the forward kwargs of the prefill call and of a decode call,
with the cache `generate()` builds, dynamic or static); the export is transformers' `DynamoExporter`
(`torch.export.export(strict=False)` under its per-model patches and cache pytree registrations).
What this module adds: explicit dynamic shapes per component (only the axes that vary) and the
encoder's kwargs (captured from the same `generate()`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.export import Dim, ExportedProgram

# The components transformers' decomposition returns for a text-only generative model, in call order.
PREFILL = "prefill"
DECODE = "decode"
COMPONENTS = (PREFILL, DECODE)
# An encoder-decoder's encoder (model.get_encoder()), called by generate() before the decoder's steps.
ENCODER = "encoder"
ENCODER_DECODER_COMPONENTS = (ENCODER, PREFILL, DECODE)

# Forward kwargs that `generate()` passes but no exported program takes as an input: output flags
# (DynamoExporter applies them to the config for the trace) and generation-time hints.
NOT_PROGRAM_INPUTS = ("use_cache", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep")


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """What `generate:` says for a model: the prompt and how many tokens, and the cache kind.

    `cache` is `dynamic` (a growing `DynamicCache`) or `static` (a `StaticCache` of `max_cache_len`
    positions). `multi_token_decode` captures `decode` with a symbolic query length (transformers
    merges two decode steps), so it also takes several tokens at once.
    """

    prompt_len: int = 8
    max_new_tokens: int = 32
    cache: str = "dynamic"
    max_cache_len: int = 128
    multi_token_decode: bool = False

    def __post_init__(self) -> None:
        if self.cache not in ("dynamic", "static"):
            raise ValueError(f"generate.cache: {self.cache!r} is neither 'dynamic' nor 'static'")
        if self.cache == "static" and self.max_cache_len < self.prompt_len + self.max_new_tokens:
            raise ValueError(
                f"generate.max_cache_len: {self.max_cache_len} < prompt_len + max_new_tokens "
                f"({self.prompt_len} + {self.max_new_tokens})"
            )

    def generation_config(self, model: torch.nn.Module) -> Any:
        """The model's own GenerationConfig with this cache kind; greedy, `max_new_tokens` set."""
        config = copy.deepcopy(model.generation_config)
        config.do_sample = False
        config.num_beams = 1
        config.max_new_tokens = self.max_new_tokens
        if self.cache == "static":
            config.cache_implementation = "static"
            config.max_cache_len = self.max_cache_len
        else:
            config.cache_implementation = None
        return config


@dataclasses.dataclass(frozen=True)
class Component:
    """One independently exportable program of a generative model.

    `inputs` are the forward kwargs captured from a real `generate()` (`past_key_values` a
    transformers Cache); `dynamic_shapes` has the same structure, marking only the axes that vary.
    """

    name: str
    module: torch.nn.Module
    inputs: dict[str, Any]
    dynamic_shapes: dict[str, Any]


def prompt_inputs(model: torch.nn.Module, prompt_ids: torch.Tensor) -> dict[str, Any]:
    """The generate kwargs for a prompt of token ids `[batch, length]` (no padding)."""
    return {"input_ids": prompt_ids, "attention_mask": torch.ones_like(prompt_ids)}


def encoder_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """An encoder-decoder's encoder as generate() finds it (`model.get_encoder()`), else None."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False) or not hasattr(model, "get_encoder"):
        return None
    encoder = model.get_encoder()
    return encoder if encoder is not None and encoder is not model else None


def component_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The components of `model`, in call order: `(encoder, prefill, decode)` for an
    encoder-decoder, `(prefill, decode)` for a decoder-only model."""
    return ENCODER_DECODER_COMPONENTS if encoder_of(model) is not None else COMPONENTS


def components(
    model: torch.nn.Module, generate: GenerateSpec, prompt_ids: torch.Tensor | None = None
) -> dict[str, Component]:
    """The components of `model` in call order (component_names): `{prefill, decode}` from
    transformers' `decompose_for_generation` under `generate`, and an encoder-decoder's `encoder`
    (transformers decomposes only the decoder's steps): `model.get_encoder()` with the kwargs
    generate() called it with during that same decomposition, its sequence axis dynamic.

    `prompt_ids` default to a fixed pseudo-random prompt of `generate.prompt_len` tokens.
    """
    from transformers.exporters.utils import decompose_for_generation

    if prompt_ids is None:
        prompt_ids = example_prompt(model, generate.prompt_len)
    encoder = encoder_of(model)
    with torch.no_grad(), _calls_of(encoder) as encoder_calls:
        decomposed = decompose_for_generation(
            model,
            prompt_inputs(model, prompt_ids),
            generation_config=generate.generation_config(model),
            multi_token_decode=generate.multi_token_decode,
        )
    if set(decomposed) != set(COMPONENTS):
        raise NotImplementedError(
            f"{type(model).__name__} decomposes into {sorted(decomposed)}: only prefill/decode models are supported"
        )
    if encoder is not None:
        if len(encoder_calls) != 1:
            raise RuntimeError(
                f"generate() called {type(model).__name__}'s encoder {len(encoder_calls)} times, not once"
            )
        # a shallow copy, as transformers' decomposition returns the model: greedy_tokens swaps the
        # encoder's own forward, which must not reach the eager reference's module
        decomposed = {ENCODER: (copy.copy(encoder), encoder_calls[0]), **decomposed}
    found = {}
    for name in component_names(model):
        module, inputs = decomposed[name]
        inputs = {key: value for key, value in inputs.items() if key not in NOT_PROGRAM_INPUTS}
        found[name] = Component(name, module, inputs, dynamic_shapes(name, inputs, generate))
    return found


@contextmanager
def _calls_of(module: torch.nn.Module | None) -> Iterator[list[dict[str, Any]]]:
    """The kwargs of every call of `module.forward` while the block runs (None: no module, no calls)."""
    calls: list[dict[str, Any]] = []
    if module is None:
        yield calls
        return

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if args:
                raise TypeError(f"generate() called {type(module).__name__}.forward with positional arguments")
            calls.append(dict(kwargs))
            return original(**kwargs)

        return forward

    with forward_replaced(module, recording):
        yield calls


@contextmanager
def forward_replaced(
    module: torch.nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """`module.forward` replaced by `make(original)` (functools.wraps: generate() reads the
    signature), then restored as it was (an instance attribute removed again)."""
    had = "forward" in vars(module)
    original = module.forward
    module.forward = functools.wraps(original)(make(original))
    try:
        yield
    finally:
        if had:
            module.forward = original
        else:
            del module.forward


def example_prompt(model: torch.nn.Module, length: int, seed: int = 0) -> torch.Tensor:
    """A fixed prompt of `length` ids, avoiding the model's special tokens (ids below 3 and its
    bos/eos/pad), so a random model does not stop at once."""
    vocab = model.config.get_text_config().vocab_size
    special = {0, 1, 2} | {
        token
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        for token in _as_list(getattr(model.generation_config, name, None))
    }
    allowed = torch.tensor([token for token in range(vocab) if token not in special])
    generator = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(0, len(allowed), (1, length), generator=generator)]


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def dynamic_shapes(name: str, inputs: Mapping[str, Any], generate: GenerateSpec) -> dict[str, Any]:
    """Only the axes that vary between calls are dynamic, as DynamoExporter recommends over
    `Dim.AUTO` everywhere: the prompt (query) axis of `prefill` (and of a multi-token `decode`), the
    key/value length of a dynamic cache and of the masks that span it. A static cache, batch, heads
    and head size stay fixed. Every dim is `Dim.AUTO`, so torch.export names and relates them."""
    query_varies = name in (PREFILL, ENCODER) or generate.multi_token_decode
    cache_varies = generate.cache == "dynamic"
    # a static cache bounds the query axis (ExecuTorch plans memory for the largest input, so it
    # refuses an unbounded dim); a dynamic cache leaves it open
    query = Dim.AUTO if cache_varies else Dim.AUTO(max=generate.max_cache_len)

    def spec(key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            axes: dict[int, Any] = {}
            if name == ENCODER and key in ("input_ids", "attention_mask") and value.dim() == 2:
                axes[1] = query  # the encoder reads the whole prompt: 2..max tokens
            elif key in ("input_ids", "position_ids", "cache_position", "decoder_input_ids", "inputs_embeds"):
                if query_varies:
                    axes[value.dim() - 1 if key != "inputs_embeds" else 1] = query
            elif key in ("attention_mask", "decoder_attention_mask") and value.dim() == 2 and cache_varies:
                axes[1] = Dim.AUTO  # padding mask over prompt + generated tokens
            elif key in ("attention_mask", "decoder_attention_mask") and value.dim() == 4:
                if query_varies:
                    axes[2] = query
                if cache_varies:
                    axes[3] = Dim.AUTO
            return axes or None
        if value is None or isinstance(value, (bool, int, float, str)):
            return None
        if isinstance(value, dict) and type(value) is dict:
            return {k: spec(key, v) for k, v in value.items()}
        if key == "past_key_values":
            return _cache_shapes(value, cache_varies)
        if key == "encoder_outputs":
            leaves = torch.utils._pytree.tree_leaves(value)
            return _like_registered(value, [{1: Dim.AUTO} if leaf.dim() >= 2 else None for leaf in leaves])
        raise NotImplementedError(f"{name}: no dynamic-shape rule for input {key!r} ({type(value).__name__})")

    return {key: spec(key, value) for key, value in inputs.items()}


def _cache_shapes(cache: Any, varies: bool) -> list[Any]:
    """One spec per tensor of the cache as DynamoExporter flattens it (`[batch, heads, length, head]`):
    the length axis when the cache grows."""
    register_cache_pytrees()
    leaves, _ = torch.utils._pytree.tree_flatten(cache)
    return [{2: Dim.AUTO} if varies and leaf.dim() == 4 else None for leaf in leaves]


def register_cache_pytrees() -> None:
    """Register every transformers Cache class as a pytree node, as DynamoExporter does before an
    export (`transformers.exporters.exporter_dynamo.register_cache_pytrees_for_model`): a process
    must do it before it loads a component's archive, AOTInductor package or call specs, whose
    tree specs name the cache classes (`transformers.cache_utils:StaticCache`). Idempotent."""
    from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model

    register_cache_pytrees_for_model(torch.nn.Module())


def _like_registered(value: Any, leaf_specs: list[Any]) -> Any:
    """A spec for a registered pytree node (a ModelOutput): one entry per child, as torch.export compares."""
    node = torch.utils._pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        return leaf_specs
    children, _ = node.flatten_fn(value)
    it = iter(leaf_specs)
    return [next(it) if isinstance(child, torch.Tensor) else None for child in children]


@dataclasses.dataclass(frozen=True)
class ExportedComponent:
    """A component's program and how long its export took."""

    name: str
    program: ExportedProgram
    seconds: float


class ComponentExportError(RuntimeError):
    """A component failed to export: `component` names it, the cause is chained."""

    def __init__(self, component: str, cause: BaseException) -> None:
        super().__init__(f"{component}: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        self.component = component


def size_oblivious(component: Component) -> bool:
    """Whether the component is exported with size-oblivious sizes: an encoder-decoder's decode is
    captured after one decoder token, and its self-attention cache of length 1 would otherwise be
    specialized by torch.export (0/1 specialization)."""
    return any(
        leaf.dim() == 4 and leaf.shape[2] == 1
        for leaf in torch.utils._pytree.tree_leaves(component.inputs.get("past_key_values"))
        if isinstance(leaf, torch.Tensor)
    )


def export_component(component: Component) -> ExportedProgram:
    """torch.export (strict=False) of one component through transformers' DynamoExporter, which
    applies its per-model patches, registers the cache classes as pytrees and gives the program
    the flat signature of the captured kwargs."""
    from transformers.exporters import DynamoConfig, DynamoExporter

    with quiet_warnings(), torch.fx.experimental._config.patch(backed_size_oblivious=size_oblivious(component)):
        program, _ = DynamoExporter().export_program(
            component.module,
            dict(component.inputs),
            DynamoConfig(dynamic_shapes=component.dynamic_shapes, strict=False),
        )
    if component.name == ENCODER:
        _contiguous_as_clone(program)
    return program


def _contiguous_as_clone(program: ExportedProgram) -> None:
    """Every `aten.contiguous` of the program as `aten.clone(memory_format=contiguous_format)`
    (the same values), in place. With the encoder's symbolic sequence axis, torch.onnx's
    decomposition turns T5's `attn.transpose(1, 2).contiguous()` into no copy at all (its
    contiguity test does not hold for every size), and the `reshape` after it then fails as a
    `view` ("Cannot view a tensor with shape [1, s, 4, 8] and strides (32*s, 8, 8*s, 1)"); an
    explicit clone survives it."""
    changed = False
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.contiguous.default and len(node.args) == 1:
            node.target = torch.ops.aten.clone.default
            node.kwargs = {"memory_format": node.kwargs.get("memory_format", torch.contiguous_format)}
            changed = True
    if changed:
        program.graph_module.recompile()


def export_components(found: Mapping[str, Component]) -> dict[str, ExportedComponent]:
    """Every component exported; a failure names the component (`decode: ...`)."""
    exported = {}
    for name, component in found.items():
        start = time.perf_counter()
        try:
            program = export_component(component)
        except Exception as exc:
            raise ComponentExportError(name, exc) from exc
        exported[name] = ExportedComponent(name, program, time.perf_counter() - start)
    return exported


@contextmanager
def quiet_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
