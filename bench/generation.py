"""Generative models, measured: per tiny random-config model and cache kind, the decomposition time,
the export time of each component (prefill, decode), and decode tokens/s of eager `generate()` vs
the exported programs (`ExportedProgram.module()`) driven through the same generate() loop.

    .venv/bin/python bench/generation.py [--models llama,qwen2,phi3,gemma,t5] [--tokens 64] [--json FILE]
        [--artifacts archive,pte,onnx,aoti]

With --artifacts, each component is also built into each artifact kind by pt2flow's own stage
(serialize, executorch with the portable kernels, onnx, aot_compile): build seconds per component,
whether the artifact generates eager's tokens, and its decode tokens/s.

Decode tokens/s: one warm-up generation, then the best of 3 timed ones; the time of a generation
with 1 new token (the prefill alone, and generate()'s set-up) is subtracted from one with N, so
the rate is (N - 1) decode steps over their own time. One thread (torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pt2flow.stages import generation as G  # noqa: E402

DECODER = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)


def builders() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as T

    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(pad_token_id=0, **DECODER)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **DECODER)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        )),
    }


def _best_of(run: Callable[[], Any], repeats: int = 3) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_rate(model: torch.nn.Module, spec: G.GenerateSpec, prompt: torch.Tensor, steps: dict[str, Any] | None) -> float:
    """Decode tokens/s: (N - 1) decode steps over (time of N tokens - time of 1 token)."""
    import dataclasses

    def generation(tokens: int) -> Callable[[], Any]:
        short = dataclasses.replace(spec, max_new_tokens=tokens)
        if steps is None:
            return lambda: G.eager_generation(model, short, prompt)
        return lambda: G.greedy_tokens(model, steps, prompt, short)

    whole, prefill = _best_of(generation(spec.max_new_tokens)), _best_of(generation(1))
    return (spec.max_new_tokens - 1) / max(whole - prefill, 1e-9)


def artifact_steps(kind: str, program: torch.export.ExportedProgram, workdir: str) -> tuple[float, G.StepFn]:
    """One component built into an artifact kind (pt2flow's own stage) and its step function: (build seconds, step)."""
    start = time.perf_counter()
    if kind == "archive":
        data = G.archive_bytes(program)
        return time.perf_counter() - start, G.archive_step(data)
    if kind == "pte":
        data = G.pte_bytes(program)
        return time.perf_counter() - start, G.pte_step(data, G.CallSpecs.of(program))
    if kind == "onnx":
        data = G.onnx_bytes(program)
        return time.perf_counter() - start, G.onnx_step(data, G.CallSpecs.of(program))
    if kind == "aoti":
        data = G.aoti_bytes(program)
        return time.perf_counter() - start, G.aoti_step(data, workdir)
    raise ValueError(f"unknown artifact kind {kind!r} (archive, pte, onnx, aoti)")


def measure_artifacts(model: torch.nn.Module, spec: G.GenerateSpec, prompt: torch.Tensor, eager: G.Generation,
                      exported: dict[str, G.ExportedComponent], kinds: list[str]) -> dict[str, Any]:
    """Per artifact kind: build seconds per component, same tokens as eager, decode tokens/s."""
    import tempfile

    row: dict[str, Any] = {}
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix=f"pt2flow-bench-{kind}-") as tmp:
            try:
                steps = {}
                for name, e in exported.items():
                    Path(tmp, name).mkdir()
                    seconds, steps[name] = artifact_steps(kind, e.program, str(Path(tmp, name)))
                    row[f"{kind}_{name}_s"] = round(seconds, 2)
                got = G.greedy_tokens(model, steps, prompt, spec)
            except Exception as exc:  # noqa: BLE001 - a kind that refuses the components is a result
                row[f"{kind}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                continue
            row[f"{kind}_same_tokens"] = got.tokens == eager.tokens
            row[f"{kind}_tok_s"] = round(decode_rate(model, spec, prompt, steps), 1)
    return row


def measure(name: str, cache: str, tokens: int, kinds: list[str] = []) -> dict[str, Any]:
    torch.manual_seed(0)
    model = builders()[name]().eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    spec = G.GenerateSpec(prompt_len=8, max_new_tokens=tokens, cache=cache, max_cache_len=16 + tokens)
    start = time.perf_counter()
    found = G.components(model, spec)
    decompose_s = time.perf_counter() - start
    row: dict[str, Any] = {"model": name, "cache": cache, "decompose_s": round(decompose_s, 3)}
    try:
        exported = G.export_components(found)
    except G.ComponentExportError as exc:
        return {**row, "error": str(exc)}
    row.update({f"export_{n}_s": round(e.seconds, 2) for n, e in exported.items()})
    prompt = G.example_prompt(model, 16, seed=16)
    steps = {n: G.program_step(e.program) for n, e in exported.items()}
    eager = G.eager_generation(model, spec, prompt)
    try:
        got = G.greedy_tokens(model, steps, prompt, spec)
    except (ValueError, RuntimeError, AssertionError) as exc:  # a program refusing the cache it is handed
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    row["same_tokens"] = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits).ok
    row["eager_tok_s"] = round(decode_rate(model, spec, prompt, None), 1)
    row["program_tok_s"] = round(decode_rate(model, spec, prompt, steps), 1)
    row.update(measure_artifacts(model, spec, prompt, eager, exported, kinds))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen2,phi3,gemma,t5")
    parser.add_argument("--caches", default="dynamic,static")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--artifacts", default="", help="comma-separated: archive,pte,onnx,aoti (pt2flow's stages; pte needs a static cache)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    kinds = [kind for kind in args.artifacts.split(",") if kind]
    rows = [measure(name, cache, args.tokens, kinds) for name in args.models.split(",") for cache in args.caches.split(",")]
    columns = ["model", "cache", "decompose_s", "export_prefill_s", "export_decode_s", "same_tokens", "eager_tok_s", "program_tok_s", "error"]
    columns += [f"{kind}_{suffix}" for kind in kinds for suffix in ("prefill_s", "decode_s", "same_tokens", "tok_s", "error")]
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row.get(column, "")) for column in columns))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
