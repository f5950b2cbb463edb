"""Greedy generation with the components `pt2flow get --model M [--artifact KIND] -o DIR` wrote,
without pt2flow: torch, transformers (the model's own generate() loop and its cache classes) and,
for a `.pte`, the ExecuTorch runtime.

    python docs/examples/generate_from_components.py DIR --factory module:callable [--path FOLDER]
        [--prompt-lens 2,16] [--seed 0] [--json] [--verbose]

DIR holds `manifest.json` and one file per component (`prefill.pte`, `decode.pte`, and an
encoder-decoder's `encoder.pte`, first in the manifest's `order`). The
factory builds the eager model (the same one pt2flow exported: its config, its weights); FOLDER is
put on sys.path to import it. For each prompt length the script draws a prompt of random ids,
runs eager `generate()` and the same `generate()` with `model.forward` replaced by the components
(the first call `prefill`, every later one `decode`, the cache each returns carried to the next)
and, when the manifest has an `encoder`, the encoder generate() calls (`model.get_encoder()`, once,
for `encoder_outputs`) replaced by it too. It prints one verdict line per prompt (the components
generate eager's tokens, or from which new token they differ) with the tokens, then, as its last
line, the same as JSON: `{length: {"eager": [ids], "components": [ids], "match": bool}}`
(`--json`: that line alone). The libraries' chatter (torchao's optional kernels, cpuinfo,
deprecation warnings) is kept off the terminal (`--verbose` lets it through); should the script
fail, what native code wrote to stderr meanwhile is shown with the error.

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
import contextlib
import copy
import functools
import importlib
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """Warnings and loggers (below ERROR) silenced, and what native code writes to stderr (cpuinfo)
    captured; the captured text is written out should the block raise."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        failed = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logging.disable(logging.WARNING)
                try:
                    yield
                finally:
                    logging.disable(logging.NOTSET)
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:  # what the libraries said may explain the failure
                sink.seek(0)
                sys.stderr.write(sink.read().decode(errors="replace"))
                sys.stderr.flush()


def verdict(length: int, eager: list[int], components: list[int]) -> str:
    """One line: whether the components generated eager's tokens, and the tokens."""
    if components == eager:
        return f"prompt of {length} tokens: same tokens as eager ({len(eager)} new): {components}"
    first = next((i for i, (a, b) in enumerate(zip(eager, components)) if a != b), min(len(eager), len(components)))
    return (
        f"prompt of {length} tokens: DIFFERENT from eager from new token {first + 1} of {len(eager)}: "
        f"components {components}, eager {eager}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="what `pt2flow get --model M -o DIR` wrote")
    parser.add_argument("--factory", required=True, help="module:callable building the eager model")
    parser.add_argument("--path", default=None, help="a folder to import the factory's module from")
    parser.add_argument("--prompt-lens", default=None, help="comma-separated prompt lengths (default: the manifest's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON line alone")
    parser.add_argument("--verbose", action="store_true", help="let the libraries' warnings and logs through")
    args = parser.parse_args()

    manifest = json.loads((args.folder / "manifest.json").read_text())
    settings = manifest["generate"]
    lengths = [int(n) for n in args.prompt_lens.split(",")] if args.prompt_lens else settings["prompt_lens"]
    result = {}
    with quiet(not args.verbose):
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model

        register_cache_pytrees_for_model(torch.nn.Module())  # the call specs name the cache classes
        steps = {
            name: load_step(manifest["artifact"], args.folder / entry["file"], entry["call_specs"])
            for name, entry in manifest["components"].items()
        }
        if args.path:
            sys.path.insert(0, args.path)
        module, _, attr = args.factory.partition(":")
        model = getattr(importlib.import_module(module), attr)().eval()
        vocab = model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(args.seed)
        for length in lengths:
            prompt = torch.randint(3, vocab, (1, length), generator=generator)
            eager = generate(model, prompt, settings, None)
            components = generate(model, prompt, settings, steps)
            result[length] = {"eager": eager, "components": components, "match": components == eager}
    if not args.json:
        print(f"{args.factory} generating greedily: eager against its {manifest['artifact']} components")
        for length, run in result.items():
            print(verdict(length, run["eager"], run["components"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
