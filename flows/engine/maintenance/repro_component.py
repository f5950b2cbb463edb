"""The reproducer of a generative model's component that failed to export (`pt2flow repro M` when
`M/decode`'s trace failed): a script that needs torch, transformers and the model's own code, and
no pt2flow.

A component's trace is not the trace ladder: the worker builds the parent model, decomposes it
with transformers' `decompose_for_generation` under the model's `generate:` (stages.generation
`components`) and exports one component through transformers' `DynamoExporter` (stages.generation
`export_component`). The script makes the same calls with the same values, which repro takes from
pt2flow's own objects rather than restating pt2flow's rules (the size-oblivious setting is
stages.generation.size_oblivious, which export_component uses):

    model              the factory's call (and weights.pt), as the trace repro of any model
    prompt             the capture prompt's token ids (generation.example_prompt), inline
    generation config  the model's own, with the attributes GenerateSpec.generation_config sets
    decomposition      decompose_for_generation(model, prompt, generation_config, multi_token_decode)
    inputs             the component's captured kwargs, less generation.NOT_PROGRAM_INPUTS
    dynamic shapes     the component's (generation.dynamic_shapes: Dim.AUTO hints), inline (repro.dims_code)
    export             DynamoExporter().export_program(module, inputs, DynamoConfig(dynamic_shapes,
                       strict=False)) under the size-oblivious setting export_component chose

Building the model and decomposing it here (in the CLI's process, as the trace repro builds the
model) is what gives those values; the folder gets weights.pt when the run had weights.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pt2flow.flows.engine.maintenance.repro import ReproJob


def trace(job: ReproJob) -> str:
    """The body of a component's trace reproducer (flows/builtin/trace.py `repro` for `M/decode`)."""
    import torch

    from pt2flow.flows.engine.maintenance.repro import ReproError, build_model_code, dims_code, recorded_weights
    from pt2flow.flows.engine.worker.compute import generate_spec
    from pt2flow.stages import generation
    from pt2flow.stages.source import build_model, import_factory

    model, name = job.model, job.model.component
    if model.generate is None:
        raise ReproError(f"the source record of {model.parent} has no generate: its component {name} cannot be rebuilt")
    spec = generate_spec(model)
    state = recorded_weights(job.store, job.source.get("details") or {})
    eager = build_model(import_factory(model.factory, model.search_path), model.kwargs, state)
    prompt = generation.example_prompt(eager, spec.prompt_len)  # what components() captures with
    base = eager.generation_config.to_dict()
    wanted = spec.generation_config(eager).to_dict()
    component = generation.components(eager, spec, prompt)[name]
    oblivious = generation.size_oblivious(component)
    if state is not None:
        job.files.append("weights.pt")
        torch.save(dict(state), job.folder / "weights.pt")

    settings = [
        f"generation_config.{key} = {wanted.get(key)!r}"
        for key in sorted(set(base) | set(wanted))
        if key != "transformers_version" and base.get(key) != wanted.get(key)
    ]
    dims, shapes = dims_code(component.dynamic_shapes)
    dims_text = "".join(line + "\n        " for line in dims)  # named Dims, defined before the tree
    body = "\n" + textwrap.dedent(f"""\
        import copy

        from transformers.exporters import DynamoConfig, DynamoExporter
        from transformers.exporters.utils import decompose_for_generation

        # generate: {dict(model.generate.model_dump(mode="json"))!r}
        # The components are captured from a generate() on a fixed prompt of {spec.prompt_len} tokens
        # (pt2flow's stages.generation.example_prompt), with the model's generation config made greedy
        # and given the configured cache kind (GenerateSpec.generation_config).
        prompt_ids = torch.tensor({prompt.tolist()!r})
        generation_config = copy.deepcopy(model.generation_config)
        """)
    body += "".join(line + "\n" for line in settings)
    body += textwrap.dedent(f"""\
        with torch.no_grad():
            decomposed = decompose_for_generation(
                model,
                {{"input_ids": prompt_ids, "attention_mask": torch.ones_like(prompt_ids)}},
                generation_config=generation_config,
                multi_token_decode={spec.multi_token_decode!r},
            )
        module, inputs = decomposed[{name!r}]
        # generate()'s flags and hints that no exported program takes as an input
        inputs = {{key: value for key, value in inputs.items() if key not in {tuple(generation.NOT_PROGRAM_INPUTS)!r}}}

        # only the axes that vary between calls are dynamic (pt2flow's generation.dynamic_shapes)
        {dims_text}dynamic_shapes = {shapes}

        # the failing call: transformers' DynamoExporter (its patches, the cache classes registered
        # as pytrees, torch.export.export with strict=False)
        with torch.fx.experimental._config.patch(backed_size_oblivious={oblivious!r}):
            program, _ = DynamoExporter().export_program(module, dict(inputs), DynamoConfig(dynamic_shapes=dynamic_shapes, strict=False))
        """)
    return build_model_code(model, state is not None) + body
