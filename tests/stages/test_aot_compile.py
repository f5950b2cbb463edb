"""aot_compile: an AOTInductor package from torch._inductor.aoti_compile_and_package."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pydantic
import pytest
import torch

import torch._inductor
from pt2flow.stages.aot_compile import aot_compile, load_package
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import AotCompileOptions
from tests import models
from tests.stages.helpers import builder


@pytest.mark.compile
def test_compiled_package_matches_eager(compiled_mlp, tmp_path: Path) -> None:
    result = compiled_mlp.package
    data = result.output
    assert result.metadata == {"size": len(data), "device": "cpu"}
    assert zipfile.is_zipfile(io.BytesIO(data))
    runner = load_package(data, str(tmp_path))
    eager = builder(models.tiny_mlp)()
    for batch in (1, 4, 7, 16):  # the example, both ends of the dynamic range, and between
        x = torch.randn(batch, 8)
        got = runner(x)
        with torch.no_grad():
            expected = eager(x)
        assert got.shape == (batch, 4)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


# --- no compile: the stage's own logic around torch's call ------------------------------------


def _tiny_program() -> torch.export.ExportedProgram:
    return torch.export.export(models.tiny_mlp().eval(), (torch.randn(2, 8),))


def test_options_are_passed_to_aoti_compile_and_package(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake(ep, package_path, inductor_configs):
        seen.update(ep=ep, inductor_configs=inductor_configs)
        Path(package_path).write_bytes(b"package bytes")
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake)
    ep = _tiny_program()
    result = aot_compile(ep, AotCompileOptions(inductor_configs={"max_autotune": False}))
    assert result.output == b"package bytes"
    assert result.metadata == {"size": len(b"package bytes"), "device": "cpu"}
    assert seen["ep"] is ep
    assert seen["inductor_configs"] == {"max_autotune": False}
    aot_compile(ep, AotCompileOptions())
    assert seen["inductor_configs"] is None  # no configs: torch's defaults


@pytest.mark.parametrize(
    ("raised", "error_class"),
    [(RuntimeError("C++ compile error: g++ failed"), "compile"), (MemoryError(), "out_of_memory")],
)
def test_compile_failures_are_classified(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException, error_class: str
) -> None:
    def fake(ep, package_path, inductor_configs):
        raise raised

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake)
    with pytest.raises(StageError) as info:
        aot_compile(_tiny_program(), AotCompileOptions())
    assert info.value.error_class == error_class
    assert info.value.message.startswith("AOTInductor compile failed")


def test_a_device_that_is_not_one_is_refused_by_the_options() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        AotCompileOptions(device="gpu0")
    assert info.value.errors()[0]["loc"] == ("device",) and "pattern" in info.value.errors()[0]["msg"]
    assert AotCompileOptions(device="cuda:1").device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_compile_error() -> None:
    with pytest.raises(StageError) as info:
        aot_compile(_tiny_program(), AotCompileOptions(device="cuda"))
    assert info.value.error_class == "compile"
    assert "no CUDA device" in info.value.message
