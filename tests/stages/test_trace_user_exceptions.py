"""trace: the model's own exception is what a failed ladder reports (issue 44), whichever rung
came last, with the model's file and line; Dynamo's rewording of it ("Observed exception") is a
runtime failure, not an unsupported op."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pt2flow.stages.errors import StageError
from pt2flow.stages.options import TraceOptions
from pt2flow.stages.trace import trace
from tests import models
from tests.stages.helpers import mlp_inputs, static_inputs

SOURCE = """\
import torch
from torch import nn


class Raising(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[-1] == 8:
            raise ValueError("boom")
        return self.fc(x)


class RefusesExport(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if torch.compiler.is_exporting():
            raise ValueError("not while exporting")
        return self.fc(x)
"""


BOOM_LINE = 1 + SOURCE.splitlines().index('            raise ValueError("boom")')
REFUSAL_LINE = 1 + SOURCE.splitlines().index('            raise ValueError("not while exporting")')


@pytest.fixture
def user_module(tmp_path: Path) -> Iterator[tuple[ModuleType, Path]]:
    """SOURCE as the user's own module, imported from a file outside the repository."""
    path = tmp_path / "user_raising_models.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("user_raising_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    try:
        yield module, path
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize(
    "options",
    [TraceOptions(), TraceOptions(strict=True), TraceOptions(strict=True, fallback=False)],
    ids=["non-strict-first", "strict-first", "strict-only"],
)
def test_a_forward_that_raises_is_reported_as_its_own_exception(
    user_module: tuple[ModuleType, Path], options: TraceOptions
) -> None:
    module, path = user_module
    with pytest.raises(StageError) as info:
        trace(module.Raising(), mlp_inputs(), options)
    err = info.value
    assert err.error_class == "runtime"
    assert err.message.startswith("ValueError: boom\n"), err.message
    assert f"{path}:{BOOM_LINE} (Raising.forward): raise ValueError" in err.message
    assert "fails in eager mode" in err.message and "Observed exception" not in err.message
    assert err.details["origin"]["module"] == "user_raising_models"
    # every rung, strict ones included, is recorded as the model's runtime failure
    assert {a["error_class"] for a in err.attempts} == {"runtime"}
    assert any(a["strict"] for a in err.attempts)


def test_a_model_that_raises_only_while_exported_says_where_and_that_eager_runs(
    user_module: tuple[ModuleType, Path],
) -> None:
    module, path = user_module
    with pytest.raises(StageError) as info:
        trace(module.RefusesExport(), static_inputs(2, 8), TraceOptions(strict=True))
    err = info.value
    assert err.error_class == "runtime"
    assert err.message.startswith("ValueError: not while exporting\n"), err.message
    assert f"{path}:{REFUSAL_LINE} (RefusesExport.forward): raise ValueError" in err.message
    assert "while torch.export traced it (strict=False); it runs in eager mode" in err.message


def test_an_eager_failure_inside_torch_names_the_models_line() -> None:
    """The exception is torch's (a shape mismatch), raised on the model's behalf: the location is
    the model's line that called it."""
    with pytest.raises(StageError) as info:
        trace(models.tiny_mlp(), static_inputs(4, 5), TraceOptions())  # 5 features; fc1 wants 8
    err = info.value
    assert err.error_class == "runtime"
    assert err.message.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert f"{Path(models.__file__).resolve()}:" in err.message or f"{models.__file__}:" in err.message
