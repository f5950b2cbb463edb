"""Validation by generation (stages.generation.validate_generation, what validate runs for a model
with `generate:`): every artifact kind gets its own verdict; a decode component whose weight was
perturbed after export is caught as `numeric_mismatch` at the first diverging position, while the
unperturbed archive pair passes. Tiny random Llama, static cache, 8 tokens at prompts 2 and 16."""

from __future__ import annotations

import copy

import pytest
import torch

from pt2flow.stages import generation as G
from pt2flow.stages.errors import StageError

pytestmark = pytest.mark.integration  # exports a tiny transformers model

transformers = pytest.importorskip("transformers")

DECODER = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
PROMPTS = (2, 16)


@pytest.fixture(scope="module")
def case() -> tuple[torch.nn.Module, G.GenerateSpec, dict[str, bytes], dict[str, bytes]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    spec = G.GenerateSpec(prompt_len=8, max_new_tokens=8, cache="static", max_cache_len=32)
    programs = {name: e.program for name, e in G.export_components(G.components(model, spec)).items()}
    good = {name: G.archive_bytes(program) for name, program in programs.items()}
    decode = copy.deepcopy(programs[G.DECODE])
    (weight,) = [t for name, t in decode.state_dict.items() if name.endswith("lm_head.weight")]
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    bad = {**good, G.DECODE: G.archive_bytes(decode)}
    return model, spec, good, bad


def _loader(archives: dict[str, bytes]):
    return lambda: {name: G.archive_step(data) for name, data in archives.items()}


def test_a_perturbed_decode_is_caught_at_its_first_diverging_position(case) -> None:
    model, spec, good, bad = case
    loaders = {"archive": _loader(good), "perturbed": _loader(bad)}
    kinds = {"archive": "serialized", "perturbed": "perturbed"}
    result = G.validate_generation(model, spec, PROMPTS, loaders, required=["archive"], kinds=kinds)
    report = result.output
    assert report["candidates"]["archive"]["verdict"]["passed"]
    for length in PROMPTS:
        assert report["candidates"]["archive"]["prompts"][str(length)]["tokens"] == report["eager"][str(length)]
    verdict = report["candidates"]["perturbed"]["verdict"]
    assert not verdict["passed"] and verdict["error_class"] == "numeric_mismatch", verdict
    first = report["candidates"]["perturbed"]["prompts"][str(PROMPTS[0])]["first_divergence"]
    assert first is not None and first >= 1  # prefill's token is right: decode makes the later ones
    assert (
        f"perturbed: generated tokens diverge from eager at position {first} (prompt {PROMPTS[0]})" == verdict["error"]
    )
    assert not report["passed"] and any("perturbed (not required) failed" in w for w in report["warnings"])

    with pytest.raises(StageError) as info:  # required (the default: every candidate), it fails the stage
        G.validate_generation(model, spec, PROMPTS, loaders, kinds=kinds)
    assert info.value.error_class == "numeric_mismatch" and "perturbed: generated tokens diverge" in info.value.message
    assert info.value.details["candidates"]["archive"]["verdict"]["passed"]


def test_a_candidate_that_does_not_load_is_a_serialization_verdict(case) -> None:
    model, spec, good, _ = case
    broken = {name: b"not an archive" for name in good}
    with pytest.raises(StageError) as info:
        G.validate_generation(model, spec, PROMPTS[:1], {"archive": _loader(broken)})
    assert info.value.error_class == "serialization"
    assert info.value.details["candidates"]["archive"]["verdict"]["error"].startswith("archive: does not load")
