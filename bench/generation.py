"""Generative models, measured: per tiny random-config model and cache kind, the decomposition time,
the export time of each component (prefill, decode), and decode tokens/s of eager `generate()` vs
the exported programs (`ExportedProgram.module()`) driven through the same generate() loop.

    .venv/bin/python bench/generation.py [--models llama,qwen2,phi3,gemma,t5] [--caches default]
        [--tokens 64] [--repeats 3] [--artifacts archive,pte,onnx,aoti,openvino] [--json FILE] [--markdown FILE]

--caches: `default` is each model's own (static for the decoders, as configs/generative.yaml;
dynamic for T5, whose static cache does not export), or a comma-separated list (dynamic,static)
run for every model.

With --artifacts, each component is also built into each artifact kind by pt2flow's own stage
(serialize, executorch with the portable kernels, onnx, aot_compile): build seconds per component,
whether the artifact generates eager's tokens (and where it first differs, the logits' max error),
and its decode tokens/s. A kind that refuses a component (the .pte of a dynamic cache: no maximum
on its axes) is reported as refused with its reason and the step (`build prefill`, `build decode`,
`generate`), never dropped; a kind whose tokens differ from eager's keeps its tokens/s, marked.

Decode tokens/s: every kind of a model built first, then one warm-up generation each, then
--repeats rounds of timed generations going round-robin over the kinds (eager, the exported
program, each artifact), so load on a shared machine hits every kind alike; the best time of a
generation with 1 new token (the prefill alone, and generate()'s set-up) is subtracted from the
best with N, so the rate is (N - 1) decode steps over their own time. One thread
(torch.set_num_threads(1)). --markdown writes the report (machine, versions, threads, date, load).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pt2flow.stages import generation as G  # noqa: E402

DECODER = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# each model's own cache kind (`--caches default`): static for the decoders (configs/generative.yaml);
# an encoder-decoder's static cache does not export (architecture.md, "What works")
DEFAULT_CACHE = {"t5": "dynamic"}
KINDS = ("archive", "pte", "onnx", "aoti", "openvino")
KIND_NAMES = {
    "eager": "eager `generate()`",
    "program": "`ExportedProgram.module()`",
    "archive": "archive (`.pt2`, serialize)",
    "pte": "`.pte` (ExecuTorch, portable kernels)",
    "onnx": "ONNX (dynamo, ONNX Runtime CPU)",
    "aoti": "AOTInductor package",
    "openvino": "OpenVINO IR (CPU plugin)",
}
# what --check expects to be refused (kind, model, cache), as configs/generative.yaml does: a .pte
# of a dynamic cache (ExecuTorch needs a maximum on every axis), OpenVINO's frontend on Qwen2's
# grouped-query attention (its SDPA shape check) and on T5's prefill (SequenceMark, aten.cat)
EXPECTED_REFUSALS = {("pte", None, "dynamic"), ("openvino", "qwen2", None), ("openvino", "t5", None)}
PROMPT_LEN = 16


def builders() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as T

    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(pad_token_id=0, **DECODER)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **DECODER)),
        "t5": lambda: T.T5ForConditionalGeneration(
            T.T5Config(
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


def decode_rates(
    model: torch.nn.Module,
    spec: G.GenerateSpec,
    prompt: torch.Tensor,
    runners: dict[str, dict[str, G.StepFn] | None],
    repeats: int = 3,
) -> dict[str, float]:
    """Decode tokens/s per runner (None: eager `generate()`): (N - 1) decode steps over (best time of
    N tokens - best time of 1 token). Every runner is warmed up once, then the timed generations go
    round-robin over the runners, `repeats` rounds, so that a burst of load on a shared machine
    falls on every kind alike instead of on whichever one was being timed then."""

    def generation(steps: dict[str, G.StepFn] | None, tokens: int) -> Callable[[], Any]:
        short = dataclasses.replace(spec, max_new_tokens=tokens)
        if steps is None:
            return lambda: G.eager_generation(model, short, prompt)
        return lambda: G.greedy_tokens(model, steps, prompt, short)

    runs = {name: (generation(steps, spec.max_new_tokens), generation(steps, 1)) for name, steps in runners.items()}
    best = {name: [float("inf"), float("inf")] for name in runs}
    for whole, first in runs.values():  # warm-up
        whole(), first()
    for _ in range(repeats):
        for name, pair in runs.items():
            for i, run in enumerate(pair):
                start = time.perf_counter()
                run()
                best[name][i] = min(best[name][i], time.perf_counter() - start)
    return {name: (spec.max_new_tokens - 1) / max(whole - first, 1e-9) for name, (whole, first) in best.items()}


def _reason(exc: BaseException) -> str:
    """The exception's class and first line, whole (a refusal's reason is the result)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:600]


def _compared(prefix: str, eager: G.Generation, got: G.Generation) -> dict[str, Any]:
    """Same tokens as eager, the first new-token position that differs (None: none), the logits' max error."""
    comparison = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits)
    return {
        f"{prefix}same_tokens": comparison.ok,
        f"{prefix}first_divergence": comparison.first_divergence,
        f"{prefix}max_logit_err": float(f"{max(comparison.max_error, default=0.0):.3g}"),
    }


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
    if kind == "openvino":  # the stage's conversion, run as validate runs any flat runner
        from pt2flow.stages.openvino_target import convert, load_openvino as load_runner
        from pt2flow.stages.target_options import OpenvinoOptions

        data = convert(program, OpenvinoOptions()).output
        specs = G.CallSpecs.of(program)
        return time.perf_counter() - start, G.candidate_step(load_runner(data), G.StepContext(lambda: specs, workdir))
    raise ValueError(f"unknown artifact kind {kind!r} ({', '.join(KINDS)})")


def build_artifacts(
    model: torch.nn.Module,
    spec: G.GenerateSpec,
    prompt: torch.Tensor,
    eager: G.Generation,
    exported: dict[str, G.ExportedComponent],
    kinds: list[str],
    workdir: str,
) -> tuple[dict[str, Any], dict[str, dict[str, G.StepFn]]]:
    """Per artifact kind: build seconds per component and same tokens as eager; the step functions
    of the kinds that generated (timed later, with the others), loaded under `workdir`."""
    row: dict[str, Any] = {}
    runners: dict[str, dict[str, G.StepFn]] = {}
    for kind in kinds:
        step = "build"
        try:
            steps = {}
            for name, e in exported.items():
                step = f"build {name}"
                Path(workdir, kind, name).mkdir(parents=True)
                seconds, steps[name] = artifact_steps(kind, e.program, str(Path(workdir, kind, name)))
                row[f"{kind}_{name}_s"] = round(seconds, 2)
            step = "generate"
            got = G.greedy_tokens(model, steps, prompt, spec)
            row.update(_compared(f"{kind}_", eager, got))
            runners[kind] = steps
        except Exception as exc:  # noqa: BLE001 - a kind that refuses the components is a result
            row[f"{kind}_error"] = f"{step}: {_reason(exc)}"
    return row, runners


def measure(name: str, cache: str, tokens: int, kinds: list[str] | None = None, repeats: int = 3) -> dict[str, Any]:
    torch.manual_seed(0)
    model = builders()[name]().eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    row: dict[str, Any] = {"model": name, "cache": cache, "tokens": tokens, "prompt_len": PROMPT_LEN}
    step = "decompose"
    try:
        spec = G.GenerateSpec(prompt_len=8, max_new_tokens=tokens, cache=cache, max_cache_len=PROMPT_LEN + tokens)
        start = time.perf_counter()
        found = G.components(model, spec)
        row["decompose_s"] = round(time.perf_counter() - start, 3)
        step = "export"
        exported = G.export_components(found)
        row.update({f"export_{n}_s": round(e.seconds, 2) for n, e in exported.items()})
        prompt = G.example_prompt(model, PROMPT_LEN, seed=PROMPT_LEN)
        step = "eager"
        eager = G.eager_generation(model, spec, prompt)
        step = "program generate"
        program = {n: G.program_step(e.program) for n, e in exported.items()}
        row.update(_compared("program_", eager, G.greedy_tokens(model, program, prompt, spec)))
    except Exception as exc:  # noqa: BLE001 - a model that does not decompose, export or run is a result
        return {**row, "error": f"{step}: {_reason(exc)}"}
    with tempfile.TemporaryDirectory(prefix="pt2flow-bench-") as workdir:
        built, artifacts = build_artifacts(model, spec, prompt, eager, exported, kinds or [], workdir)
        row.update(built)
        runners: dict[str, dict[str, G.StepFn] | None] = {"eager": None, "program": program, **artifacts}
        row["loadavg_timing"] = [round(x, 2) for x in os.getloadavg()]
        try:
            rates = decode_rates(model, spec, prompt, runners, repeats)
        except Exception as exc:  # noqa: BLE001
            return {**row, "error": f"timing: {_reason(exc)}"}
    row.update({f"{kind}_tok_s": round(rate, 1) for kind, rate in rates.items()})
    return row


# ── Report ────────────────────────────────────────────────────────────────────


def machine() -> dict[str, Any]:
    """What the timings were taken on: CPU, cores, threads, niceness, versions, date, load."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib import metadata

    versions = {}
    for package in ("torch", "transformers", "executorch", "onnxruntime", "onnx"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:  # an absent runtime is reported as such
            versions[package] = None
    return {
        "cpu": cpu,
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0),
        "python": platform.python_version(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def _build(row: dict[str, Any], prefix: str) -> str:
    parts = [row.get(f"{prefix}{n}_s") for n in G.COMPONENTS]
    return " / ".join(f"{p:.2f}" if p is not None else "–" for p in parts)


def _same(row: dict[str, Any], prefix: str) -> str:
    same = row.get(f"{prefix}same_tokens")
    if same is None:
        return ""
    err = row.get(f"{prefix}max_logit_err")
    text = "yes" if same else f"**no** (first differs at new token {row.get(f'{prefix}first_divergence')})"
    return f"{text}, max logits err {err:.1e}" if err is not None else text


def kind_rows(row: dict[str, Any], kinds: list[str]) -> list[dict[str, Any]]:
    """One entry per kind of a model's row: name, build, same tokens, tok/s, ratio to eager, error."""
    eager = row.get("eager_tok_s")
    out = [{"kind": "eager", "build": "–", "same": "reference", "tok_s": eager, "ratio": 1.0 if eager else None}]
    for kind, prefix, build_prefix in [("program", "program_", "export_")] + [(k, f"{k}_", f"{k}_") for k in kinds]:
        tok_s = row.get(f"{prefix}tok_s")
        out.append(
            {
                "kind": kind,
                "build": _build(row, build_prefix),
                "same": _same(row, prefix),
                "tok_s": tok_s,
                "ratio": round(tok_s / eager, 2) if tok_s and eager else None,
                "error": row.get(f"{prefix}error"),
                "same_tokens": row.get(f"{prefix}same_tokens"),
            }
        )
    return out


def markdown(rows: list[dict[str, Any]], kinds: list[str], env: dict[str, Any], command: str) -> str:
    v = env["versions"]
    lines = [
        "# Benchmark of generative models: export time and decode tokens/s",
        "",
        f"`{command}` on {env['cpu']} ({env['arch']}), {env['cores']} cores, {env['torch_threads']} torch thread(s), "
        f"niceness {env['nice']}, {env['date']}; Python {env['python']}, torch {v['torch']}, transformers "
        f"{v['transformers']}, executorch {v['executorch']}, onnxruntime {v['onnxruntime']}, onnx {v['onnx']}. "
        f"Load average (1/5/15 min) {env['loadavg_start']} at the start, {env.get('loadavg_end')} at the end.",
        "",
        "Tiny random-config models (2 layers, hidden 32, vocabulary 128), a prompt of "
        f"{rows[0].get('prompt_len', PROMPT_LEN) if rows else PROMPT_LEN} tokens, {rows[0].get('tokens') if rows else ''} new "
        "greedy tokens, each model's own cache kind (static for the decoders, as configs/generative.yaml; dynamic "
        "for T5). *build s*: the `torch.export` of each component (prefill / decode) for the exported program, "
        "then, per artifact kind, the time pt2flow's own stage takes to build it from that program. *same tokens*: "
        "the kind's greedy tokens are eager `generate()`'s, position by position (and the logits' max error). "
        "*decode tok/s*: the kind driven through generate()'s own loop; all of a model's kinds are built first, "
        f"warmed up once each, then timed in {env.get('repeats', 3)} round-robin rounds (eager, program, each "
        "artifact in turn), the best kept, and the 1-token generation's best time subtracted from the N-token one's, "
        "so (N - 1) decode steps over their own time; *× eager*: over eager's decode tok/s in the same rounds.",
        "",
        "**Read the ratios, not the absolute numbers.** The machine is shared (other engineers run test suites "
        "on its cores) and the bench ran at a lower priority (`nice -n 10`): absolute tokens/s move between "
        "runs by tens of percent or more; the ratios within one model's rounds (every kind timed side by side) are "
        "what to compare, and a ratio within ~20 % of 1 is not a difference. "
        "Each step here is a ~1 ms call on a tiny model, so the numbers measure per-step overhead (Python, "
        "copying the cache in and out, the runtime's call), not arithmetic.",
        "",
    ]
    summary_kinds = ["program", *kinds]
    lines += [
        "## Summary: decode tok/s relative to eager",
        "",
        "| model | cache | eager tok/s | " + " | ".join(KIND_NAMES[k].split(" (")[0] for k in summary_kinds) + " |",
        "|---|---|---:|" + "---:|" * len(summary_kinds),
    ]
    for row in rows:
        entries = {e["kind"]: e for e in kind_rows(row, kinds)}
        cells = []
        for k in summary_kinds:
            e = entries[k]
            if e.get("error") or row.get("error"):
                cells.append("refused" if (e.get("error") or "").startswith("build") else "failed")
            elif e["ratio"] is None:
                cells.append("–")
            else:
                cells.append(f"{e['ratio']:.2f}x" + ("" if e.get("same_tokens") else " (tokens differ)"))
        lines.append(f"| {row['model']} | {row['cache']} | {row.get('eager_tok_s', '–')} | " + " | ".join(cells) + " |")
    lines += [""]
    for row in rows:
        lines += [
            f"## {row['model']}",
            "",
            f"{row['cache']} cache; decomposition (finding the components) {row.get('decompose_s', '–')} s; "
            f"load average when timed {row.get('loadavg_timing', '–')}.",
        ]
        if row.get("error"):
            lines += ["", f"Failed at {row['error']}", ""]
            continue
        lines += [
            "",
            "| kind | build s (prefill / decode) | same tokens as eager | decode tok/s | × eager |",
            "|---|---|---|---:|---:|",
        ]
        for e in kind_rows(row, kinds):
            if e.get("error"):
                verb = "refused" if e["error"].startswith("build") else "failed"
                reason = e["error"].replace("|", "\\|")
                lines.append(
                    f"| {KIND_NAMES[e['kind']]} | {e['build'] if e['build'] != '– / –' else '–'} | {verb} at {reason} | – | – |"
                )
                continue
            ratio = f"{e['ratio']:.2f}" if e["ratio"] is not None else "–"
            lines.append(f"| {KIND_NAMES[e['kind']]} | {e['build']} | {e['same']} | {e['tok_s']} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen2,phi3,gemma,t5")
    parser.add_argument(
        "--caches",
        default="default",
        help="`default` (each model's own: static, T5 dynamic) or a comma-separated list of dynamic,static",
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations after the warm-up; the best is kept")
    parser.add_argument(
        "--artifacts",
        default="",
        help=f"comma-separated: {','.join(KINDS)} (pt2flow's stages; pte needs a static cache)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="write the report (machine, versions, tables) here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a model fails, or an artifact fails to build or generates other tokens than eager "
        "(a .pte of a dynamic cache, which ExecuTorch refuses, excepted): `make bench-generation`",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    kinds = [kind for kind in args.artifacts.split(",") if kind]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"--artifacts: unknown {sorted(unknown)} ({', '.join(KINDS)})")
    env = {**machine(), "repeats": args.repeats}
    models = args.models.split(",")
    plan = [
        (name, cache)
        for name in models
        for cache in ([DEFAULT_CACHE.get(name, "static")] if args.caches == "default" else args.caches.split(","))
    ]
    rows = [measure(name, cache, args.tokens, kinds, args.repeats) for name, cache in plan]
    env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    columns = [
        "model",
        "cache",
        "decompose_s",
        "export_prefill_s",
        "export_decode_s",
        "eager_tok_s",
        "program_same_tokens",
        "program_tok_s",
        "error",
    ]
    columns += [
        f"{kind}_{suffix}" for kind in kinds for suffix in ("prefill_s", "decode_s", "same_tokens", "tok_s", "error")
    ]
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row.get(column, "")) for column in columns))
    command = "python bench/generation.py " + " ".join(sys.argv[1:])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": env, "command": command, "rows": rows}, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(rows, kinds, env, command))
    if args.check:
        problems = [problem for row in rows for problem in check(row, kinds)]
        for problem in problems:
            print(f"FAILED {problem}", file=sys.stderr)
        print(
            f"{len(rows)} model/cache pairs, {len(kinds)} artifact kinds: {len(problems) or 'no'} problems",
            file=sys.stderr,
        )
        if problems:
            sys.exit(1)


def check(row: dict[str, Any], kinds: list[str]) -> list[str]:
    """What --check fails on in one row: the model's own error, the exported program's or an
    artifact's tokens differing from eager's, an artifact that did not build (but the refusals
    configs/generative.yaml expects: EXPECTED_REFUSALS)."""
    where = f"{row['model']} ({row['cache']} cache)"
    if row.get("error"):
        return [f"{where}: {row['error']}"]
    problems = [] if row.get("program_same_tokens") else [f"{where}: the exported program's tokens differ from eager's"]
    for kind in kinds:
        if row.get(f"{kind}_error"):
            expected = any(
                k == kind and m in (None, row["model"]) and c in (None, row["cache"]) for k, m, c in EXPECTED_REFUSALS
            )
            if not expected:
                problems.append(f"{where} {kind}: {row[f'{kind}_error']}")
        elif not row.get(f"{kind}_same_tokens"):
            problems.append(
                f"{where} {kind}: tokens differ from eager's (first at {row.get(f'{kind}_first_divergence')})"
            )
    return problems


if __name__ == "__main__":
    main()
