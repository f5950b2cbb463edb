"""A fault for tests/integration/test_generative.py: a tiny Llama whose *exported* decode program
has one weight wrong, while the model itself (eager `generate()`) and its prefill program are right.

No configuration can make torch.export produce a wrong program, so the fault is injected: building
the model wraps pt2flow's component export (stages.generation_export.export_component, which the trace
stage looks up when it runs) so that the decode program it returns holds `lm_head.weight[7, 3] +
1.0` (a copy: the model's own parameter is untouched). Every artifact built from that program
(archive, ONNX, .pte) carries the fault; validation by generation must catch it at the first new
token the decode program makes differently (not at token 0, which prefill makes).

Copied beside a test's config with configs/generative_models.py (its factories' module).
"""

from __future__ import annotations

from typing import Any

from generative_models import tiny_llama

WEIGHT, INDEX, DELTA = "lm_head.weight", (7, 3), 1.0


def tiny_llama_bad_decode(seed: int = 0, **overrides: Any) -> Any:
    """tiny_llama, with the decode program it will be exported to perturbed (see the module's doc)."""
    import torch

    from pt2flow.stages import generation, generation_export

    # where export_component is defined, which the trace stage imports it from when it runs
    if not getattr(generation_export.export_component, "perturbs_decode", False):
        export = generation_export.export_component

        def export_component(component: Any) -> Any:
            program = export(component)
            if component.name == generation.DECODE:
                weight = program.state_dict[WEIGHT]
                wrong = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
                with torch.no_grad():
                    wrong[INDEX] += DELTA
                program.state_dict[WEIGHT] = wrong
            return program

        export_component.perturbs_decode = True  # type: ignore[attr-defined]
        generation_export.export_component = generation.export_component = export_component
    return tiny_llama(seed, **overrides)
