"""The targets' options and extras: torch-free, strict, and a missing library named with its extra."""

from __future__ import annotations

import subprocess
import sys

import pydantic
import pytest

from pt2flow.stages import target_options
from pt2flow.stages.target_options import ExecutorchOptions, OnnxOptions, missing_extra


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


def test_a_missing_library_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert missing_extra("onnx") is None and missing_extra("executorch") is None  # make install installs both
    monkeypatch.setitem(target_options.TARGET_EXTRAS, "onnx", ("onnx", ("onnx", "no_such_module_for_pt2flow")))
    assert missing_extra("onnx") == "the onnx target needs no_such_module_for_pt2flow: pip install 'pt2flow[onnx]'"


def test_a_target_without_its_library_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pt2flow.stages.errors import StageError
    from pt2flow.stages.onnx_target import export_onnx

    monkeypatch.setitem(target_options.TARGET_EXTRAS, "onnx", ("onnx", ("no_such_module_for_pt2flow",)))
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(StageError) as info:
        export_onnx(program, OnnxOptions())
    assert info.value.error_class == "config" and "pt2flow[onnx]" in info.value.message
