"""tolerance: auto, measured: each model's eager float32 error against a float64 copy of itself,
each candidate artifact's error against the same float64 reference, their ratio, and what the
float64 reference adds to validate's time.

    .venv/bin/python bench/validate_noise.py [--compile] [--targets] [--hf] [--samples 3] [--json FILE]

Models: every model of configs/demo.yaml (the training-mode one as its joint program), and with
--hf the tiny transformers models of tests/hf_models.py plus deeper/wider variants of BERT.
Candidates: the .pt2 archive always; with --compile the AOTInductor package (8-30 s a model on
2 cores); with --targets the ONNX, ExecuTorch and OpenVINO artifacts of configs/targets.yaml's
models (with their options there). Each model is validated twice on the same candidates, with
tolerance fixed and auto (noise_multiple 1e9, so that nothing fails and every number is kept),
and the wall time of both is printed. Per leaf, the worst sample is kept: max err, max eager err
and the ratio err / eager_err of that sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pt2flow.flows.config import load_config  # noqa: E402
from pt2flow.flows.engine.common.inputs import model_inputs  # noqa: E402
from pt2flow.stages.decompose import decompose  # noqa: E402
from pt2flow.stages.example_inputs import InputSpec, ModelInputs  # noqa: E402
from pt2flow.stages.functionalize import functionalize  # noqa: E402
from pt2flow.stages.options import (  # noqa: E402
    AotCompileOptions,
    DecomposeOptions,
    FunctionalizeOptions,
    TraceOptions,
    ValidateOptions,
)
from pt2flow.stages.serialize import serialize  # noqa: E402
from pt2flow.stages.source import build_model, import_factory, training_step  # noqa: E402
from pt2flow.stages.targets import TargetArtifact  # noqa: E402
from pt2flow.stages.trace import trace  # noqa: E402
from pt2flow.stages.validate import validate  # noqa: E402


def _builder(
    factory: Callable[..., torch.nn.Module], kwargs: dict[str, Any], training: bool, loss_output: int | None
) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        module = build_model(factory, kwargs, training=training)
        return training_step(module, loss_output) if training else module

    return build


def _targets(program: torch.export.ExportedProgram, options: dict[str, Any]) -> dict[str, TargetArtifact]:
    from pt2flow.stages.openvino_target import convert, load_openvino as load_runner
    from pt2flow.stages.target_options import OpenvinoOptions
    from pt2flow.stages.executorch_target import load_pte, lower_executorch
    from pt2flow.stages.onnx_target import export_onnx, load_onnx
    from pt2flow.stages.target_options import ExecutorchOptions, OnnxOptions

    made = {}
    for name, make, load, opts in (
        ("onnx", export_onnx, load_onnx, options.get("onnx") or OnnxOptions()),
        ("executorch", lower_executorch, load_pte, options.get("executorch") or ExecutorchOptions()),
        ("openvino", convert, load_runner, options.get("openvino") or OpenvinoOptions()),
    ):
        try:
            made[name] = TargetArtifact(make(program, opts).output, load)
        except Exception as exc:  # a target that refuses the model is reported, not fatal
            print(f"    {name}: not made ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
    return made


def measure(
    name: str,
    build: Callable[[], torch.nn.Module],
    inputs: ModelInputs,
    fixed: ValidateOptions,
    *,
    training: bool,
    compile_: bool,
    target_options: dict[str, Any] | None,
) -> dict[str, Any]:
    tr = trace(build(), inputs, TraceOptions())
    fn = functionalize(tr.output, FunctionalizeOptions(mode="training" if training else "inference"))
    dec = decompose(fn.output, DecomposeOptions())
    kwargs: dict[str, Any] = {"archive": serialize(dec.output, {}).output, "training": training}
    if compile_:
        from pt2flow.stages.aot_compile import aot_compile

        kwargs["package"] = aot_compile(dec.output, AotCompileOptions()).output
    if target_options is not None and not training:
        kwargs["targets"] = _targets(fn.output, target_options)
    dims = tr.metadata["dims"]
    start = time.perf_counter()
    try:
        validate(build, inputs, dims, fixed, **kwargs)
        fixed_passed = True
    except Exception as exc:  # the fixed tolerance may refuse a deep model: that is one of the findings
        fixed_passed = f"{type(exc).__name__}: {str(exc)[:200]}"
    fixed_s = time.perf_counter() - start
    auto = fixed.model_copy(update={"tolerance": "auto", "noise_multiple": 1e9})
    start = time.perf_counter()
    report = validate(build, inputs, dims, auto, **kwargs).output
    auto_s = time.perf_counter() - start
    rows = []
    for cand, entry in report["candidates"].items():
        worst: dict[str, dict[str, Any]] = {}
        for sample in entry["samples"]:
            for leaf, row in sample.get("noise", {}).items():
                if leaf not in worst or (row["err"] / max(row["allowed"], 1e-300)) > (
                    worst[leaf]["err"] / max(worst[leaf]["allowed"], 1e-300)
                ):
                    worst[leaf] = {**row, "sample": sample["label"]}
        for leaf, row in worst.items():
            rows.append({"candidate": cand, "leaf": leaf, **row, "fixed_max_abs_err": entry["max_abs_err"]})
    return {
        "model": name,
        "fixed_passed": fixed_passed,
        "fixed_s": fixed_s,
        "auto_s": auto_s,
        "reference_ms": report["tolerance"]["reference_ms"],
        "applied": report["tolerance"]["applied"],
        "fallback": report["tolerance"]["fallback"],
        "rows": rows,
    }


def _demo_models(
    targets: bool,
) -> list[tuple[str, Callable[[], torch.nn.Module], ModelInputs, ValidateOptions, bool, dict[str, Any] | None]]:
    found = []
    target_models = {m.name: m for m in load_config(ROOT / "configs" / "targets.yaml").models} if targets else {}
    for model in load_config(ROOT / "configs" / "demo.yaml").models:
        factory = import_factory(model.factory, model.search_path)
        loss_output = model.options["functionalize"].loss_output  # type: ignore[attr-defined]
        build = _builder(factory, dict(model.kwargs), model.training, loss_output)
        opts = dict(target_models[model.name].options) if model.name in target_models else None
        found.append((model.name, build, model_inputs(model), model.options["validate"], model.training, opts))
    return found


def _hf_models() -> list[tuple[str, Callable[[], torch.nn.Module], ModelInputs, ValidateOptions, bool, None]]:
    from transformers import BertConfig, BertModel

    from tests import hf_models

    ids = ModelInputs(
        {
            "input_ids": InputSpec((2, 8), dtype="int64", low=0, high=100),
            "attention_mask": InputSpec((2, 8), dtype="int64", value=1),
        }
    )
    roberta_ids = ModelInputs(
        {
            "input_ids": InputSpec((2, 8), dtype="int64", low=3, high=100),
            "attention_mask": InputSpec((2, 8), dtype="int64", value=1),
        }
    )

    def deep_bert(layers: int, hidden: int) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            torch.manual_seed(0)
            config = BertConfig(
                vocab_size=100,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                intermediate_size=4 * hidden,
                max_position_embeddings=64,
            )
            return BertModel(config).eval()

        return build

    fixed = ValidateOptions(atol=1e-4)
    return [
        ("bert-tiny", hf_models.bert_tiny, ids, fixed, False, None),
        ("distilbert-tiny", hf_models.distilbert_tiny, ids, fixed, False, None),
        ("roberta-tiny", hf_models.roberta_tiny, roberta_ids, fixed, False, None),
        ("bert-8x256", deep_bert(8, 256), ids, fixed, False, None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile", action="store_true", help="also the AOTInductor package")
    parser.add_argument(
        "--targets", action="store_true", help="also ONNX, ExecuTorch, OpenVINO (targets.yaml's models)"
    )
    parser.add_argument("--hf", action="store_true", help="also the tiny transformers models and a deeper BERT")
    parser.add_argument("--only", action="append", default=[], help="only these models")
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args()
    models = [*_demo_models(args.targets), *(_hf_models() if args.hf else [])]
    results = []
    for name, build, inputs, fixed, training, target_options in models:
        if args.only and name not in args.only:
            continue
        print(f"== {name}", flush=True)
        found = measure(
            name, build, inputs, fixed, training=training, compile_=args.compile, target_options=target_options
        )
        results.append(found)
        print(
            f"   validate fixed {found['fixed_s']:.2f} s (passed: {found['fixed_passed']}), auto {found['auto_s']:.2f} s "
            f"(float64 reference {found['reference_ms']:.0f} ms), applied {found['applied']} {found['fallback'] or ''}"
        )
        for row in found["rows"]:
            ratio = "exact" if row["ratio"] is None else f"{row['ratio']:.3g}"
            print(
                f"   {row['candidate']:<11} {row['leaf']:<34} eager {row['eager_err']:.3g} ({row['eager_rel_err']:.2g} rel)  "
                f"candidate {row['err']:.3g} ({row['rel_err']:.2g} rel)  ratio {ratio}  "
                f"vs eager {row['fixed_max_abs_err']:.3g}  [{row['sample']}]",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
