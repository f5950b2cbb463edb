"""Shared helpers for the stage tests: inputs of the tiny models and the stage chain up to a point."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch

from pt2flow.stages.decompose import decompose
from pt2flow.stages.functionalize import functionalize
from pt2flow.stages.options import DecomposeOptions, FunctionalizeOptions, TraceOptions
from pt2flow.stages.result import StageResult
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.source import build_model, training_step
from pt2flow.stages.trace import trace


def mlp_inputs(lo: int = 1, hi: int = 16) -> ModelInputs:
    """tiny_mlp's x: [4, 8] with a dynamic batch in [lo, hi]."""
    return ModelInputs({"x": InputSpec((4, 8))}, {"x": {0: "batch"}}, {"batch": (lo, hi)})


def static_inputs(*shape: int, name: str = "x") -> ModelInputs:
    return ModelInputs({name: InputSpec(tuple(shape))})


def regressor_inputs() -> ModelInputs:
    """Regressor's (x, y) with a batch shared by both, in [2, 16]."""
    return ModelInputs(
        {"x": InputSpec((4, 4)), "y": InputSpec((4,))},
        {"x": {0: "batch"}, "y": {0: "batch"}},
        {"batch": (2, 16)},
    )


def builder(
    factory: Callable[..., torch.nn.Module], *, training: bool = False, loss_output: int | None = None
) -> Callable[[], torch.nn.Module]:
    """What flows.engine.worker.compute.model_builder returns: a fresh, seeded model (a TrainingStep in training mode)."""

    def build() -> torch.nn.Module:
        module = build_model(factory, {}, training=training)
        return training_step(module, loss_output) if training else module

    return build


def traced(build: Callable[[], torch.nn.Module], inputs: ModelInputs, **options: Any) -> StageResult:
    return trace(build(), inputs, TraceOptions(**options))


def functional(build: Callable[[], torch.nn.Module], inputs: ModelInputs, mode: str = "inference") -> StageResult:
    return functionalize(traced(build, inputs).output, FunctionalizeOptions(mode=mode))


def decomposed(
    build: Callable[[], torch.nn.Module], inputs: ModelInputs, mode: str = "inference"
) -> tuple[StageResult, StageResult]:
    """(trace result, decompose result) of the chain trace -> functionalize -> decompose(core_aten)."""
    tr = traced(build, inputs)
    fn = functionalize(tr.output, FunctionalizeOptions(mode=mode))
    return tr, decompose(fn.output, DecomposeOptions())


def call_targets(ep: torch.export.ExportedProgram) -> list[Any]:
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def op_overloads(ep: torch.export.ExportedProgram) -> list[torch._ops.OpOverload]:
    return [t for t in call_targets(ep) if isinstance(t, torch._ops.OpOverload)]


def runner_errors_at(
    case: Any, runner: Callable[[list[torch.Tensor]], list[torch.Tensor]], sizes: dict[str, int]
) -> list[float]:
    """Run a target's runner and the eager model on the same inputs of `sizes`; the max absolute
    error of each output leaf (after checking shapes and dtypes leaf by leaf)."""
    import torch.utils._pytree as pytree

    from pt2flow.stages.targets import flat_tensor_inputs

    model = case.build()
    bound = case.bound(**sizes)
    with torch.no_grad():
        expected = [leaf for leaf in pytree.tree_leaves(bound.call(model)) if isinstance(leaf, torch.Tensor)]
    got = runner(flat_tensor_inputs(bound.args, bound.kwargs))
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in expected]
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    return [float((g.double() - e.double()).abs().max()) if e.numel() else 0.0 for g, e in zip(got, expected)]


def run_repro(script: str, program: torch.export.ExportedProgram, workdir: Any) -> Any:
    """Save `program` beside `script` and run the script in a fresh Python process (the repo on
    its path, for modules the script imports); returns the CompletedProcess."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    torch.export.save(program, str(Path(workdir) / "program.pt2"))
    (Path(workdir) / "repro.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "repro.py"], cwd=str(workdir), env=env, capture_output=True, text=True, timeout=600
    )
