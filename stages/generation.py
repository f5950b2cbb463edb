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

Imports torch, transformers and, for the artifact kinds, pt2flow's own stages (serialize,
executorch_target, aot_compile) and their runtimes (layers: stages/ never import flows/ or storage/).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.export import Dim, ExportedProgram

if TYPE_CHECKING:
    from pt2flow.stages.target_options import PartitionerName

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

    with _forward_replaced(module, recording):
        yield calls


@contextmanager
def _forward_replaced(
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

    with _quiet(), torch.fx.experimental._config.patch(backed_size_oblivious=size_oblivious(component)):
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
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ── Running components ───────────────────────────────────────────────────────

StepFn = Callable[..., Any]


def program_step(program: ExportedProgram) -> StepFn:
    """A step function of an ExportedProgram: called with generate()'s forward kwargs, it passes the
    ones the program was traced with, in its order, to `program.module()`."""
    module = program.module()
    names = traced_kwargs(program)

    def step(**kwargs: Any) -> Any:
        with torch.no_grad():
            return module(**{name: kwargs.get(name) for name in names})

    return step


def traced_kwargs(program: ExportedProgram) -> list[str]:
    """The kwarg names a program takes, in the order its input spec lists them."""
    in_spec = program.call_spec.in_spec
    return list(in_spec.child(1).context)


def eager_step(component: Component) -> StepFn:
    """The component's own module, called with the kwargs it was captured with (the eager reference)."""
    names = list(component.inputs)

    def step(**kwargs: Any) -> Any:
        with torch.no_grad():
            return component.module(**{name: kwargs.get(name) for name in names if name in kwargs})

    return step


# ── Artifacts of a component: archive, .pte, ONNX, AOTInductor package ───────
#
# Each kind's step function takes generate()'s forward kwargs, like program_step. A runtime that
# knows no Python containers (ExecuTorch, ONNX Runtime) is fed the tensor leaves of the kwargs flattened by the
# program's in_spec, and its flat outputs are put back into the output structure by the out_spec
# (the cache a decode step returns is a transformers Cache again): CallSpecs carries both specs
# beside such an artifact (a .pte, an ONNX model). torch.export.load and aoti_load_package read the specs from the
# artifact itself, once the cache classes are registered (register_cache_pytrees).


@dataclasses.dataclass(frozen=True)
class CallSpecs:
    """How a component's program is called, for a runtime that takes and returns flat tensors:
    `in_spec`/`out_spec` its call spec, `out_constants` the user outputs the program holds as
    constants (by leaf index; the runtime returns only the tensor ones)."""

    in_spec: Any
    out_spec: Any
    out_constants: dict[int, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, program: ExportedProgram) -> CallSpecs:
        users = [spec for spec in program.graph_signature.output_specs if spec.kind.name == "USER_OUTPUT"]
        constants = {
            index: spec.arg.value for index, spec in enumerate(users) if type(spec.arg).__name__ == "ConstantArgument"
        }
        return cls(program.call_spec.in_spec, program.call_spec.out_spec, constants)

    @property
    def kwargs(self) -> list[str]:
        """The kwarg names the program takes, in its order."""
        return list(self.in_spec.child(1).context)

    def flatten(self, kwargs: Mapping[str, Any], *, keep_none: bool = False) -> list[Any]:
        """The program's user tensor inputs from generate()'s kwargs (the others are its constants).
        `keep_none`: a None leaf stays in its place (ExecuTorch keeps a None input in the method's
        signature, as Qwen2's prefill mask `{"full_attention": None}`; ONNX drops it)."""
        import torch.fx._pytree as fx_pytree

        leaves = fx_pytree.tree_flatten_spec(((), {name: kwargs.get(name) for name in self.kwargs}), self.in_spec)
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) or (keep_none and leaf is None)]

    def unflatten(self, outputs: list[Any]) -> Any:
        """The model's output from a runtime's flat outputs. ExecuTorch returns the inputs a program
        updates in place first (a static cache's layers), the user outputs last: the last ones are taken."""
        wanted = self.out_spec.num_leaves - len(self.out_constants)
        if len(outputs) < wanted:
            raise RuntimeError(
                f"the runtime returned {len(outputs)} outputs; the program's out_spec has {wanted} tensors"
            )
        tensors = iter(outputs[len(outputs) - wanted :])
        leaves = [
            self.out_constants[i] if i in self.out_constants else next(tensors) for i in range(self.out_spec.num_leaves)
        ]
        return torch.utils._pytree.tree_unflatten(leaves, self.out_spec)

    def to_json(self) -> dict[str, Any]:
        """For a manifest beside the artifact (treespec_dumps; the cache classes by their import path)."""
        dumps = torch.utils._pytree.treespec_dumps
        return {
            "in_spec": dumps(self.in_spec),
            "out_spec": dumps(self.out_spec),
            "out_constants": {str(i): v for i, v in self.out_constants.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallSpecs:
        register_cache_pytrees()
        loads = torch.utils._pytree.treespec_loads
        return cls(
            loads(data["in_spec"]),
            loads(data["out_spec"]),
            {int(i): v for i, v in data.get("out_constants", {}).items()},
        )


def flat_step(
    runner: Callable[[list[torch.Tensor]], list[Any]], specs: CallSpecs, *, keep_none: bool = False
) -> StepFn:
    """A step function of a runner taking and returning flat tensors (stages.targets.FlatRunner)."""

    def step(**kwargs: Any) -> Any:
        with torch.no_grad():
            return specs.unflatten(list(runner(specs.flatten(kwargs, keep_none=keep_none))))

    return step


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What an artifact kind's step function (its stage's `step`) gets besides the component's bytes:
    `specs` gives the component's call specs (its traced program's, made on first use) and
    `workdir` is a folder of its own that outlives the step function (a package unpacks there)."""

    specs: Callable[[], CallSpecs]
    workdir: str


def candidate_step(runner: Callable[[list[torch.Tensor]], list[Any]], context: StepContext) -> StepFn:
    """The step function of any flat runner (a candidate loader's: ONNX Runtime, OpenVINO, a
    plugin's): the component's tensor leaves in, its output rebuilt from the flat outputs."""
    return flat_step(runner, context.specs())


def archive_bytes(program: ExportedProgram) -> bytes:
    """The component's program as pt2flow's serialize stage writes it (torch.export.save, round trip checked)."""
    from pt2flow.stages.serialize import serialize

    return serialize(program, {}).output


def archive_step(data: bytes) -> StepFn:
    """A step function of a component's `.pt2` archive, loaded by torch.export.load (cache classes registered first)."""
    from pt2flow.stages.serialize import load_archive

    register_cache_pytrees()
    program, _ = load_archive(data)
    return program_step(program)


def pte_bytes(program: ExportedProgram, partitioners: tuple[PartitionerName, ...] = ()) -> bytes:
    """The component lowered by pt2flow's executorch stage: `()` the portable kernels only, `("xnnpack",)`.
    Every dynamic dim needs a maximum (a static cache bounds the prompt axis by `max_cache_len`)."""
    from pt2flow.stages.executorch_target import lower_executorch
    from pt2flow.stages.target_options import ExecutorchOptions

    return lower_executorch(program, ExecutorchOptions(partitioners=partitioners, portable_fallback=True)).output


def pte_step(data: bytes, specs: CallSpecs) -> StepFn:
    """A step function of a component's `.pte` on the ExecuTorch runtime's Python bindings."""
    from pt2flow.stages.executorch_target import load_pte

    return flat_step(load_pte(data), specs, keep_none=True)


def onnx_bytes(program: ExportedProgram) -> bytes:
    """The component converted by pt2flow's onnx stage (torch.onnx.export(program, dynamo=True));
    the cache's tensors are the model's inputs and outputs, a static cache's updates included."""
    from pt2flow.stages.onnx_target import export_onnx
    from pt2flow.stages.target_options import OnnxOptions

    return export_onnx(program, OnnxOptions()).output


def onnx_step(data: bytes, specs: CallSpecs) -> StepFn:
    """A step function of a component's ONNX model on ONNX Runtime (CPU)."""
    from pt2flow.stages.onnx_target import load_onnx

    return flat_step(load_onnx(data), specs)


def aoti_bytes(program: ExportedProgram) -> bytes:
    """The component compiled by pt2flow's aot_compile stage (an AOTInductor package, CPU)."""
    from pt2flow.stages.aot_compile import aot_compile
    from pt2flow.stages.options import AotCompileOptions

    return aot_compile(program, AotCompileOptions()).output


def aoti_step(data: bytes, workdir: str) -> StepFn:
    """A step function of a component's AOTInductor package, loaded under `workdir` (which must
    outlive it); the package flattens and unflattens by its own call spec."""
    from pt2flow.stages.aot_compile import load_package

    register_cache_pytrees()
    runner = load_package(data, workdir)
    names = list(torch.utils._pytree.treespec_loads(runner.loader.get_call_spec()[0]).child(1).context)

    def step(**kwargs: Any) -> Any:
        # compiled code indexes its inputs by the strides they were traced with (contiguous), and
        # the prefill package returns a dynamic cache's tensors non-contiguous: the decode package
        # read them wrongly (tokens diverged from the second one) until they were made contiguous
        contiguous = torch.utils._pytree.tree_map_only(
            torch.Tensor, torch.Tensor.contiguous, {name: kwargs.get(name) for name in names}
        )
        with torch.no_grad():
            return runner(**contiguous)

    return step


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
            stack.enter_context(_forward_replaced(encoder, replaced(lambda: ENCODER)))
        stack.enter_context(_forward_replaced(model, replaced(lambda: PREFILL if calls[PREFILL] == 0 else DECODE)))
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
    with _quiet():
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
                with _quiet():
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
