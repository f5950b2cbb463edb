"""The targets' options: torch-free and strict (a missing library: tests/flows/test_stage_module.py)."""

from __future__ import annotations

import subprocess
import sys

import pydantic
import pytest

from pt2flow.stages.target_options import ExecutorchOptions, OnnxOptions


def test_the_options_import_without_torch() -> None:
    code = "import sys, pt2flow.stages.target_options; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_options_are_strict() -> None:
    assert ExecutorchOptions().partitioners == ("xnnpack",) and ExecutorchOptions().portable_fallback is True
    with pytest.raises(pydantic.ValidationError):
        ExecutorchOptions(partitioners=["qnn"])  # not a partitioner pt2flow knows
    with pytest.raises(pydantic.ValidationError):
        OnnxOptions(external_data_threshold_mb=-1)
    with pytest.raises(pydantic.ValidationError):
        OnnxOptions(opsett=18)
