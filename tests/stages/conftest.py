"""Fixtures of the stage tests. The AOTInductor package is compiled once per session, and only
when a test marked `compile` asks for it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pt2flow.stages.aot_compile import aot_compile
from pt2flow.stages.options import AotCompileOptions
from pt2flow.stages.result import StageResult
from tests import models
from tests.stages.helpers import builder, decomposed, mlp_inputs


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
