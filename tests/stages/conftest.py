"""Fixtures of the stage tests. The AOTInductor package is compiled once per session, and only
when a test marked `compile` asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import pytest
import torch

from pt2flow.stages.aot_compile import aot_compile
from pt2flow.stages.binding import bind_inputs
from pt2flow.stages.example_inputs import BoundInputs, InputSpec, ModelInputs
from pt2flow.stages.functionalize import functionalize
from pt2flow.stages.options import AotCompileOptions, FunctionalizeOptions
from pt2flow.stages.result import StageResult
from tests import models
from tests.stages.helpers import builder, decomposed, functional, mlp_inputs, regressor_inputs, traced


@dataclass(frozen=True)
class Compiled:
    trace: StageResult
    program: torch.export.ExportedProgram
    package: StageResult


@pytest.fixture(scope="session")
def compiled_mlp() -> Compiled:
    """tiny_mlp (dynamic batch 1..16) through trace, functionalize, decompose and one real compile."""
    tr, dec = decomposed(builder(models.tiny_mlp), mlp_inputs(1, 16))
    return Compiled(tr, dec.output, aot_compile(dec.output, AotCompileOptions(device="cpu")))


# --- the deployment targets' programs (tests/stages/test_onnx_target.py, test_executorch_target.py) ---


@dataclass(frozen=True)
class TargetCase:
    """A model's functional program (what a target consumes), with what validate needs."""

    build: Callable[[], torch.nn.Module]
    inputs: ModelInputs
    dims: dict[str, Any]  # trace metadata: what the program accepts
    program: torch.export.ExportedProgram
    dim_names: list[Any]  # per user tensor input, {dim index: dim name}

    def bound(self, **sizes: int) -> BoundInputs:
        return bind_inputs(self.build(), self.inputs, seed=sum(sizes.values()), dim_sizes=sizes)


def _target_case(factory: Callable[[], torch.nn.Module], inputs: ModelInputs) -> TargetCase:
    build = builder(factory)
    tr = traced(build, inputs)
    program = functionalize(tr.output, FunctionalizeOptions()).output
    names = [per for _, _, per in bind_inputs(build(), inputs).tensor_leaves()]
    return TargetCase(build, inputs, tr.metadata["dims"], program, names)


def seq_inputs() -> ModelInputs:
    """seq_encoder's x: [3, 5, 8], batch in [1, 8] and seq in [2, 16]."""
    return ModelInputs({"x": InputSpec((3, 5, 8))}, {"x": {0: "batch", 1: "seq"}}, {"batch": (1, 8), "seq": (2, 16)})


def dict_out_inputs() -> ModelInputs:
    """dict_out's x: [2, 3, 6] with a batch in [1, 8], and a scalar scale."""
    return ModelInputs({"x": InputSpec((2, 3, 6)), "scale": InputSpec(())}, {"x": {0: "batch"}}, {"batch": (1, 8)})


@pytest.fixture(scope="session")
def seq_case() -> TargetCase:
    return _target_case(models.seq_encoder, seq_inputs())


@pytest.fixture(scope="session")
def dict_case() -> TargetCase:
    return _target_case(models.dict_out, dict_out_inputs())


@pytest.fixture(scope="session")
def wobbly_case() -> TargetCase:
    """A model calling a custom op no target translates (tests/custom_op_models.py)."""
    from tests import custom_op_models

    return _target_case(custom_op_models.wobbly, mlp_inputs(1, 8))


@pytest.fixture(scope="session")
def joint_program() -> torch.export.ExportedProgram:
    """The regressor's joint forward+backward program (functionalize, mode: training)."""
    return functional(builder(models.regressor, training=True), regressor_inputs(), mode="training").output
