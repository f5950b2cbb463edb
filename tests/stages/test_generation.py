"""Generative models as prefill + decode programs (stages/generation.py): transformers' decomposition,
export per component, greedy generation with the exported programs against eager `generate()`, token
for token over 32 new tokens at two prompt lengths; a decode program with one weight perturbed is
caught at its first diverging position; ExecuTorch refuses a dynamic cache's decode (the cache axis has
no maximum), while a static cache bounds the prompt axis; the AOTInductor packages of a dynamic cache
generate eager's tokens (marked `compile`). Tiny random-config models from transformers' own classes.
(Every artifact kind generating eager's tokens through the pipeline's step functions — archive,
AOTInductor package, ONNX and .pte of a static cache, in a fresh process too — is the shared
generative fleet's check, tests/integration/test_generative.py; a dynamic cache's archive and ONNX
model, test_generative_t5.py's fleet.)"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pt2flow.stages import generation as G
from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import ErrorClass

pytestmark = pytest.mark.integration  # exports tiny transformers models

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPT_LENGTHS = (2, 16)  # the prefill's prompt axis starts at 2 (Dim.AUTO); traced at 8
DECODER = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _no_eos(model: torch.nn.Module) -> torch.nn.Module:
    """A random model may emit its eos token at once: without one, every run makes NEW_TOKENS tokens."""
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model.eval()


BUILDERS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, **DECODER)),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=128,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
    ),
}


@dataclass(frozen=True)
class Exported:
    model: torch.nn.Module
    spec: G.GenerateSpec
    components: dict[str, G.Component]
    programs: dict[str, G.ExportedComponent]


def _export(name: str, cache: str) -> Exported:
    torch.manual_seed(0)
    model = _no_eos(BUILDERS[name]())
    spec = G.GenerateSpec(prompt_len=8, max_new_tokens=NEW_TOKENS, cache=cache, max_cache_len=64)
    found = G.components(model, spec)
    return Exported(model, spec, found, G.export_components(found))


@pytest.fixture(scope="module")
def llama() -> Exported:
    torch.set_num_threads(1)
    return _export("llama", "dynamic")


def _generate_both(case: Exported, length: int, steps: dict[str, G.StepFn]) -> tuple[G.Generation, G.Generation]:
    prompt = G.example_prompt(case.model, length, seed=length)
    return G.eager_generation(case.model, case.spec, prompt), G.greedy_tokens(case.model, steps, prompt, case.spec)


def _program_steps(case: Exported) -> dict[str, G.StepFn]:
    return {name: G.program_step(exported.program) for name, exported in case.programs.items()}


def test_llama_decomposes_into_prefill_and_decode_against_a_growing_cache(llama: Exported) -> None:
    prefill, decode = llama.components["prefill"], llama.components["decode"]
    assert list(llama.components) == ["prefill", "decode"]
    assert prefill.inputs["input_ids"].shape == (1, 8) and decode.inputs["input_ids"].shape == (1, 1)
    assert type(decode.inputs["past_key_values"]).__name__ == "DynamicCache"
    assert [layer.keys.shape[2] for layer in decode.inputs["past_key_values"].layers] == [8, 8]  # after the prompt
    assert "use_cache" not in prefill.inputs  # an output flag, not a program input
    assert G.traced_kwargs(llama.programs["prefill"].program) == ["input_ids", "position_ids", "past_key_values"]
    # only the axes that vary are dynamic: the prompt axis in prefill, the cache length in decode
    assert prefill.dynamic_shapes["input_ids"] == {1: torch.export.Dim.AUTO}
    assert decode.dynamic_shapes["input_ids"] is None
    assert decode.dynamic_shapes["past_key_values"] == [{2: torch.export.Dim.AUTO}] * 4
    (prefill_range,) = llama.programs["prefill"].program.range_constraints.values()
    assert prefill_range.lower == 2


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_exported_llama_generates_eagers_tokens(llama: Exported, length: int) -> None:
    eager, got = _generate_both(llama, length, _program_steps(llama))
    assert len(eager.tokens) == NEW_TOKENS and len(set(eager.tokens)) > 3  # a real sequence, not one token repeated
    assert got.tokens == eager.tokens
    result = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits)
    assert result.first_divergence is None and result.ok
    assert len(result.max_error) == NEW_TOKENS and max(result.max_error) < 1e-4


def test_eager_components_through_the_same_loop_reproduce_generate(llama: Exported) -> None:
    steps = {name: G.eager_step(component) for name, component in llama.components.items()}
    eager, got = _generate_both(llama, 5, steps)
    # the components compute every position's logits (logits_to_keep is not a program input): equal to rounding
    assert got.tokens == eager.tokens and torch.allclose(got.logits, eager.logits, rtol=0, atol=1e-6)


def test_a_perturbed_decode_program_is_caught_at_its_first_diverging_token(llama: Exported) -> None:
    decode = copy.deepcopy(llama.programs["decode"].program)
    weight = decode.state_dict["model.layers.1.mlp.down_proj.weight"]
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    steps = {"prefill": G.program_step(llama.programs["prefill"].program), "decode": G.program_step(decode)}
    eager, got = _generate_both(llama, 16, steps)
    result = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits)
    first = result.first_divergence
    assert first is not None and first >= 1  # the prefill program, untouched, makes token 0
    assert got.tokens[:first] == eager.tokens[:first] and got.tokens[first] != eager.tokens[first]
    assert result.max_error[0] < 1e-4 and min(result.max_error[1:]) > 1e-3  # every decode step is off
    # the original decode program is untouched by the perturbed copy
    assert not torch.equal(llama.programs["decode"].program.state_dict["model.layers.1.mlp.down_proj.weight"], weight)


@pytest.mark.parametrize(
    ("name", "cache"), [("qwen2", "dynamic"), ("phi3", "dynamic"), ("llama", "static"), ("t5", "dynamic")]
)
def test_other_decoders_caches_and_an_encoder_decoder_generate_eagers_tokens(name: str, cache: str) -> None:
    torch.set_num_threads(1)
    case = _export(name, cache)
    if cache == "static":
        decode_cache = case.components["decode"].inputs["past_key_values"]
        assert type(decode_cache).__name__ == "StaticCache" and decode_cache.layers[0].keys.shape[2] == 64
        # the static cache bounds the prompt axis by max_cache_len: ExecuTorch needs the maximum
        (prompt_range,) = case.programs["prefill"].program.range_constraints.values()
        assert (prompt_range.lower, prompt_range.upper) == (2, 64)
    for length in PROMPT_LENGTHS:
        eager, got = _generate_both(case, length, _program_steps(case))
        assert len(eager.tokens) == NEW_TOKENS
        assert got.tokens == eager.tokens, (name, cache, length)


def test_executorch_refuses_a_dynamic_caches_decode_naming_the_unbounded_cache_axis(llama: Exported) -> None:
    # ExecuTorch plans memory for the largest input: a cache that grows without a maximum is refused,
    # named, before any lowering (the pipeline stops at the first component, prefill: test_generative_t5.py)
    with pytest.raises(StageError, match=r"unbounded: input 'past_key_values_0' dim 2") as refused:
        G.pte_bytes(llama.programs["decode"].program)
    assert refused.value.error_class is ErrorClass.DYNAMIC_SHAPE


@pytest.mark.compile
def test_aoti_packages_with_a_dynamic_cache_generate_eagers_tokens(llama: Exported, tmp_path: Path) -> None:
    """The prefill package returns the cache's tensors non-contiguous; aoti_step makes them
    contiguous (without it the decode package misreads them: tokens diverge from the second. Only
    a decoder's dynamic cache shows it: tiny T5's packages generate eager's tokens either way, so
    the fleet's T5 does not cover this)."""
    steps = {}
    for name, exported in llama.programs.items():
        (tmp_path / name).mkdir()
        steps[name] = G.aoti_step(G.aoti_bytes(exported.program), str(tmp_path / name))
    for length in PROMPT_LENGTHS:
        eager, got = _generate_both(llama, length, steps)
        assert len(eager.tokens) == NEW_TOKENS and len(set(eager.tokens)) > 3
        result = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits)
        assert got.tokens == eager.tokens, (length, result)
        assert result.ok and len(result.max_error) == NEW_TOKENS and max(result.max_error) < 1e-4, (
            length,
            result.max_error,
        )


def test_compare_generation_names_the_first_diverging_position_and_each_steps_error() -> None:
    logits = torch.zeros(4, 3)
    shifted = logits.clone()
    shifted[2, 1] = 0.5
    same = G.compare_generation([1, 2, 3, 4], logits, [1, 2, 3, 4], logits)
    assert same.first_divergence is None and same.max_error == [0.0] * 4
    differ = G.compare_generation([1, 2, 3, 4], logits, [1, 2, 0, 4], shifted)
    assert differ.first_divergence == 2 and differ.max_error == [0.0, 0.0, 0.5, 0.0] and not differ.ok
    shorter = G.compare_generation([1, 2, 3, 4], logits, [1, 2], logits[:2])
    assert shorter.first_divergence == 2 and len(shorter.max_error) == 2


def test_a_component_that_fails_to_export_names_itself() -> None:
    class DataDependent(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids[input_ids.nonzero()[0]] if input_ids.sum() > 3 else input_ids

    ids = torch.arange(5)[None]
    found = {"decode": G.Component("decode", DataDependent(), {"input_ids": ids}, {"input_ids": None})}
    with pytest.raises(G.ComponentExportError, match=r"^decode: ") as caught:
        G.export_components(found)
    assert caught.value.component == "decode" and caught.value.__cause__ is not None


def test_a_static_cache_too_short_for_the_generation_is_refused() -> None:
    with pytest.raises(ValueError, match="max_cache_len"):
        G.GenerateSpec(prompt_len=8, max_new_tokens=32, cache="static", max_cache_len=16)
    with pytest.raises(ValueError, match="neither"):
        G.GenerateSpec(cache="paged")
