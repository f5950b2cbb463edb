"""A generative model's components as artifacts, through stages/generation.py's own functions: a
tiny random Llama with a static cache, 32 new tokens at prompts of 2 and 16 — the `.pte` on the
ExecuTorch runtime (its call specs through their JSON form), the `.pt2` archive and the `.pte` in a
fresh process, a dynamic cache to ONNX but not to ExecuTorch, and the AOTInductor package of a
dynamic cache (marked `compile`). The same Llama's archive, AOTInductor package, ONNX model and
.pte generating eager's tokens in this process is the shared generative fleet's check
(tests/integration/test_generative.py, tiny-llama: the same step functions, from the pipeline's
artifacts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pt2flow.stages import generation as G
from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import ErrorClass

pytestmark = pytest.mark.integration  # exports transformers models and lowers them to every kind

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPT_LENGTHS = (2, 16)
MAX_CACHE_LEN = 64
DECODER = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)


def _llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))
    model.generation_config.eos_token_id = None  # a random model may emit eos at once
    model.config.eos_token_id = None
    return model.eval()


@dataclass(frozen=True)
class Case:
    model: torch.nn.Module
    spec: G.GenerateSpec
    programs: dict[str, torch.export.ExportedProgram]
    eager: dict[int, G.Generation]  # by prompt length


@pytest.fixture(scope="module")
def llama() -> Case:
    torch.set_num_threads(1)
    model = _llama()
    spec = G.GenerateSpec(prompt_len=8, max_new_tokens=NEW_TOKENS, cache="static", max_cache_len=MAX_CACHE_LEN)
    exported = G.export_components(G.components(model, spec))
    eager = {length: G.eager_generation(model, spec, _prompt(model, length)) for length in PROMPT_LENGTHS}
    return Case(model, spec, {name: e.program for name, e in exported.items()}, eager)


@pytest.fixture(scope="module")
def ptes(llama: Case) -> dict[str, bytes]:
    return {name: G.pte_bytes(program) for name, program in llama.programs.items()}


@pytest.fixture(scope="module")
def archives(llama: Case) -> dict[str, bytes]:
    return {name: G.archive_bytes(program) for name, program in llama.programs.items()}


def _prompt(model: torch.nn.Module, length: int) -> torch.Tensor:
    return G.example_prompt(model, length, seed=length)


def _assert_generates_eagers_tokens(case: Case, steps: dict[str, G.StepFn], atol: float) -> None:
    for length, eager in case.eager.items():
        got = G.greedy_tokens(case.model, steps, _prompt(case.model, length), case.spec)
        assert len(eager.tokens) == NEW_TOKENS and len(set(eager.tokens)) > 3
        result = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits)
        assert got.tokens == eager.tokens, (length, result)
        assert result.ok and len(result.max_error) == NEW_TOKENS and max(result.max_error) < atol, (length, result.max_error)


def test_the_static_cache_bounds_the_prompt_axis(llama: Case) -> None:
    (prompt_range,) = llama.programs["prefill"].range_constraints.values()
    assert (prompt_range.lower, prompt_range.upper) == (2, MAX_CACHE_LEN)  # ExecuTorch needs the maximum


def test_ptes_on_the_executorch_runtime_generate_eagers_tokens(llama: Case, ptes: dict[str, bytes]) -> None:
    # the call specs go through their JSON form, as a manifest beside the .pte holds them
    specs = {name: G.CallSpecs.from_json(json.loads(json.dumps(G.CallSpecs.of(p).to_json()))) for name, p in llama.programs.items()}
    assert specs["decode"].kwargs == ["input_ids", "attention_mask", "position_ids", "past_key_values"]
    steps = {name: G.pte_step(data, specs[name]) for name, data in ptes.items()}
    _assert_generates_eagers_tokens(llama, steps, atol=1e-4)


def test_a_dynamic_cache_goes_to_onnx_but_not_to_executorch() -> None:
    torch.set_num_threads(1)
    model = _llama()
    spec = G.GenerateSpec(prompt_len=8, max_new_tokens=NEW_TOKENS, cache="dynamic")
    programs = {name: e.program for name, e in G.export_components(G.components(model, spec)).items()}
    eager = {length: G.eager_generation(model, spec, _prompt(model, length)) for length in PROMPT_LENGTHS}
    case = Case(model, spec, programs, eager)
    steps = {name: G.onnx_step(G.onnx_bytes(p), G.CallSpecs.of(p)) for name, p in programs.items()}
    _assert_generates_eagers_tokens(case, steps, atol=1e-4)
    # ExecuTorch plans memory for the largest input: a cache that grows without a maximum is refused, named
    with pytest.raises(StageError, match=r"unbounded: input 'past_key_values_0' dim 2") as refused:
        G.pte_bytes(programs["decode"])
    assert refused.value.error_class is ErrorClass.DYNAMIC_SHAPE


FRESH_PROCESS = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch, transformers
    from pt2flow.stages import generation as G

    here = Path(sys.argv[1])
    case = json.loads((here / "case.json").read_text())
    # a model of the same config with other weights: only the components compute the tokens
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**case["config"])).eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    spec = G.GenerateSpec(**case["spec"])
    kinds = {
        "archive": {name: G.archive_step((here / f"{name}.pt2").read_bytes()) for name in G.COMPONENTS},
        "pte": {name: G.pte_step((here / f"{name}.pte").read_bytes(), G.CallSpecs.from_json(case["specs"][name]))
                for name in G.COMPONENTS},
    }
    out = {kind: {length: G.greedy_tokens(model, steps, torch.tensor([prompt]), spec).tokens
                  for length, prompt in case["prompts"].items()} for kind, steps in kinds.items()}
    print(json.dumps(out))
''')


def test_archives_and_ptes_generate_eagers_tokens_in_a_fresh_process(
    llama: Case, archives: dict[str, bytes], ptes: dict[str, bytes], tmp_path: Path
) -> None:
    for name in G.COMPONENTS:
        (tmp_path / f"{name}.pt2").write_bytes(archives[name])
        (tmp_path / f"{name}.pte").write_bytes(ptes[name])
    spec = llama.spec
    case = {
        "config": DECODER,
        "spec": {"prompt_len": spec.prompt_len, "max_new_tokens": spec.max_new_tokens, "cache": spec.cache, "max_cache_len": spec.max_cache_len},
        "specs": {name: G.CallSpecs.of(program).to_json() for name, program in llama.programs.items()},
        "prompts": {str(length): _prompt(llama.model, length)[0].tolist() for length in PROMPT_LENGTHS},
    }
    (tmp_path / "case.json").write_text(json.dumps(case))
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {str(length): llama.eager[length].tokens for length in PROMPT_LENGTHS}
    assert got == {"archive": expected, "pte": expected}


@pytest.mark.compile
def test_aoti_packages_with_a_dynamic_cache_generate_eagers_tokens(tmp_path: Path) -> None:
    """The prefill package returns the cache's tensors non-contiguous; aoti_step makes them contiguous."""
    torch.set_num_threads(1)
    model = _llama()
    spec = G.GenerateSpec(prompt_len=8, max_new_tokens=NEW_TOKENS, cache="dynamic")
    programs = {name: e.program for name, e in G.export_components(G.components(model, spec)).items()}
    eager = {length: G.eager_generation(model, spec, _prompt(model, length)) for length in PROMPT_LENGTHS}
    steps = {}
    for name, program in programs.items():
        (tmp_path / name).mkdir()
        steps[name] = G.aoti_step(G.aoti_bytes(program), str(tmp_path / name))
    _assert_generates_eagers_tokens(Case(model, spec, programs, eager), steps, atol=1e-4)
