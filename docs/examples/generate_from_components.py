"""Greedy generation with the components `pt2flow get --model M [--artifact KIND] -o DIR` wrote,
without pt2flow: torch, transformers (the model's own generate() loop and its cache classes) and,
for a `.pte`, the ExecuTorch runtime.

    python docs/examples/generate_from_components.py DIR --factory module:callable [--path FOLDER]
        [--prompt-lens 2,16] [--seed 0]

DIR holds `manifest.json` and one file per component (`prefill.pte`, `decode.pte`, and an
encoder-decoder's `encoder.pte`, first in the manifest's `order`). The
factory builds the eager model (the same one pt2flow exported: its config, its weights); FOLDER is
put on sys.path to import it. For each prompt length the script draws a prompt of random ids,
runs eager `generate()` and the same `generate()` with `model.forward` replaced by the components
(the first call `prefill`, every later one `decode`, the cache each returns carried to the next)
and, when the manifest has an `encoder`, the encoder generate() calls (`model.get_encoder()`, once,
for `encoder_outputs`) replaced by it too, and prints one JSON line: `{length: {"eager": [ids], "components": [ids]}}`.

How a component is called (manifest `components[name].call_specs`): `in_spec` is the tree spec of
the program's `(args, kwargs)`; generate()'s kwargs flattened by it give the runtime's inputs (the
tensor leaves, a None leaf kept in place for ExecuTorch). `out_spec` puts the runtime's flat
outputs back into the model's output (logits and the cache object); `out_constants` are outputs
the program holds as constants, which the runtime does not return. ExecuTorch returns the inputs a
program updates in place (a static cache's layers) before the user outputs: the last ones are the
user outputs. The tree specs name transformers' cache classes, which must be registered as pytree
nodes first (transformers' own `register_cache_pytrees_for_model`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch
import torch.fx._pytree as fx_pytree
from torch.utils import _pytree as pytree


def load_step(kind: str, path: Path, specs: dict[str, Any]) -> Callable[..., Any]:
    """A function taking generate()'s forward kwargs and returning the model's output."""
    in_spec = pytree.treespec_loads(specs["in_spec"])
    out_spec = pytree.treespec_loads(specs["out_spec"])
    constants = {int(i): v for i, v in specs.get("out_constants", {}).items()}
    names = list(in_spec.child(1).context)  # the kwargs the program takes, in its order

    if kind == "serialized":  # a .pt2 archive: torch.export.load, called with the kwargs
        # its example inputs hold a transformers cache: allowed to torch's weights_only unpickler,
        # they load with no fallback to an unsafe unpickle (T5's encoder outputs, an OrderedDict,
        # still take torch's fallback, which logs it)
        from transformers import cache_utils

        caches = [c for c in vars(cache_utils).values() if isinstance(c, type) and c.__module__ == cache_utils.__name__]
        with torch.serialization.safe_globals(caches):
            module = torch.export.load(str(path)).module()
        return lambda **kw: module(**{n: kw.get(n) for n in names})
    if kind == "compiled":  # an AOTInductor package: it flattens by its own call spec
        runner = torch._inductor.aoti_load_package(str(path))
        contiguous = functools.partial(pytree.tree_map_only, torch.Tensor, torch.Tensor.contiguous)
        return lambda **kw: runner(**contiguous({n: kw.get(n) for n in names}))
    if kind == "pte":
        from executorch.runtime import Runtime

        method = Runtime.get().load_program(path).load_method("forward")

        def run(flat: list[Any]) -> list[Any]:
            # the outputs live in the runtime's planned memory, which the next call overwrites
            return [t.clone() for t in method.execute([t.contiguous() if t is not None else t for t in flat])]

        keep_none = True
    elif kind == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        inputs = [i.name for i in session.get_inputs()]

        def run(flat: list[Any]) -> list[Any]:
            return [torch.from_numpy(o) for o in session.run(None, {n: t.numpy() for n, t in zip(inputs, flat)})]

        keep_none = False
    else:
        raise SystemExit(f"no runner here for artifact kind {kind!r}")

    def step(**kw: Any) -> Any:
        leaves = fx_pytree.tree_flatten_spec(((), {n: kw.get(n) for n in names}), in_spec)
        flat = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) or (keep_none and leaf is None)]
        with torch.no_grad():
            outputs = run(flat)
        wanted = out_spec.num_leaves - len(constants)
        tensors = iter(outputs[len(outputs) - wanted :])
        return pytree.tree_unflatten(
            [constants[i] if i in constants else next(tensors) for i in range(out_spec.num_leaves)], out_spec
        )

    return step


def generate(
    model: torch.nn.Module, prompt: torch.Tensor, settings: dict[str, Any], steps: dict[str, Callable[..., Any]] | None
) -> list[int]:
    """Greedy new tokens of `model.generate()`; with `steps`, every forward call goes to a component."""
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.num_beams, config.max_new_tokens = False, 1, settings["max_new_tokens"]
    if settings.get("cache") == "static":
        config.cache_implementation, config.max_cache_len = "static", settings["max_cache_len"]
    calls: list[str] = []
    replaced = []  # (module, whether forward was its own attribute, the original forward)
    if steps is not None:

        def swap(module: torch.nn.Module, name: Callable[[], str]) -> None:
            original = module.forward

            @functools.wraps(original)  # generate() reads forward's signature to build its kwargs
            def forward(**kw: Any) -> Any:
                calls.append(name())
                return steps[calls[-1]](**kw)

            replaced.append((module, "forward" in vars(module), original))
            module.forward = forward

        swap(model, lambda: "prefill" if "prefill" not in calls else "decode")
        if "encoder" in steps:  # an encoder-decoder: generate() runs model.get_encoder() once, first
            swap(model.get_encoder(), lambda: "encoder")
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                generation_config=config,
                return_dict_in_generate=True,
                output_logits=True,
            )
    finally:
        for module, own, original in replaced:
            if own:
                module.forward = original
            else:
                del module.forward
    if steps is not None and (
        calls.count("decode") != len(out.logits) - 1 or calls.count("encoder") != ("encoder" in steps)
    ):
        raise SystemExit(f"generate() made {len(calls)} calls for {len(out.logits)} tokens")
    return out.sequences[0, out.sequences.shape[1] - len(out.logits) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="what `pt2flow get --model M -o DIR` wrote")
    parser.add_argument("--factory", required=True, help="module:callable building the eager model")
    parser.add_argument("--path", default=None, help="a folder to import the factory's module from")
    parser.add_argument("--prompt-lens", default=None, help="comma-separated prompt lengths (default: the manifest's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model

    register_cache_pytrees_for_model(torch.nn.Module())  # the call specs name the cache classes
    manifest = json.loads((args.folder / "manifest.json").read_text())
    steps = {
        name: load_step(manifest["artifact"], args.folder / entry["file"], entry["call_specs"])
        for name, entry in manifest["components"].items()
    }
    if args.path:
        sys.path.insert(0, args.path)
    module, _, attr = args.factory.partition(":")
    model = getattr(importlib.import_module(module), attr)().eval()
    settings = manifest["generate"]
    lengths = [int(n) for n in args.prompt_lens.split(",")] if args.prompt_lens else settings["prompt_lens"]
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    result = {}
    for length in lengths:
        prompt = torch.randint(3, vocab, (1, length), generator=generator)
        result[length] = {
            "eager": generate(model, prompt, settings, None),
            "components": generate(model, prompt, settings, steps),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
