"""Devices: a package compiled for a GPU is called with CPU tensors like the eager model
(stages/devices.py), and a device this machine lacks is a clear error, never a crash.

OnDevice is exercised here with device "cpu", where it still copies every input (as it would to
a GPU) and copies back what the callee changed in place: the same code path as on CUDA, minus the
transfer. The tests marked `cuda` run only where torch sees a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pt2flow.stages.aot_compile import load_package, load_runner
from pt2flow.stages.compat import check_artifact
from pt2flow.stages.devices import OnDevice, device_index, missing_device, on_device, parse_device, require_device
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import ValidateOptions
from pt2flow.stages.validate import validate
from tests import models
from tests.stages.helpers import builder, mlp_inputs

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")


def test_on_device_gives_the_callee_copies_and_copies_in_place_changes_back() -> None:
    seen: list[torch.Tensor] = []

    def package(x: torch.Tensor, *, extra: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seen.extend([x, extra[0], extra[1]])
        extra[0].add_(10.0)  # an input the package mutates
        return x * 2, {"sum": x + extra[1]}

    x, a, b = torch.ones(3), torch.zeros(3), torch.full((3,), 5.0)
    out, rest = OnDevice(package, "cpu")(x, extra=[a, b])
    assert all(got is not mine for got, mine in zip(seen, (x, a, b)))  # the callee never saw the caller's tensors
    assert torch.equal(a, torch.full((3,), 10.0))  # the mutation came back
    assert torch.equal(x, torch.ones(3)) and torch.equal(b, torch.full((3,), 5.0))  # the rest untouched
    assert torch.equal(out, torch.full((3,), 2.0)) and torch.equal(rest["sum"], torch.full((3,), 6.0))
    assert out.device.type == "cpu" and rest["sum"].device.type == "cpu"


def test_an_input_holding_nan_is_not_taken_for_a_mutated_one() -> None:
    # an expanded tensor cannot be written to: copying "back" into it would raise
    x = torch.full((1,), float("nan")).expand(3)
    out = OnDevice(lambda t: t.clone(), "cpu")(x)
    assert out.isnan().all()


def test_on_device_is_the_function_itself_on_the_cpu() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x

    assert on_device(fn, "cpu") is fn
    assert isinstance(on_device(fn, "cuda:0"), OnDevice)  # wrapping needs no GPU; calling does


def test_device_strings() -> None:
    assert device_index("cuda") == -1 and device_index("cuda:1") == 1 and device_index("cpu") == -1
    assert missing_device("cpu") is None
    with pytest.raises(StageError) as info:
        parse_device("gpu0")
    assert info.value.error_class == "config" and "'gpu0' is not a torch device" in info.value.message


@no_cuda
def test_a_missing_cuda_device_is_named() -> None:
    assert missing_device("cuda") == "no CUDA device is available here"
    assert missing_device("cuda:3") == "no CUDA device is available here"
    with pytest.raises(StageError) as info:
        require_device("cuda:3", "runtime")
    assert info.value.error_class == "runtime"
    assert info.value.message == "aot_compile.device is 'cuda:3' but no CUDA device is available here"


@no_cuda
def test_validate_of_a_cuda_package_without_cuda_is_a_runtime_error_before_anything_loads() -> None:
    with pytest.raises(StageError) as info:
        validate(
            builder(models.tiny_mlp),
            mlp_inputs(),
            {},
            ValidateOptions(samples=2),
            package=b"not even a zip",
            device="cuda",
        )
    assert info.value.error_class == "runtime"
    assert "no CUDA device is available here" in info.value.message


@no_cuda
def test_check_compat_skips_a_cuda_package_without_cuda_and_claims_nothing() -> None:
    result = check_artifact("compiled", b"not even a zip", None, 1e-5, 1e-4, device="cuda")
    assert result["skipped"] == "compiled for cuda, and no CUDA device is available here: not checked"
    assert (result["loads"], result["runs"], result["matches"], result["error_class"]) == (None, None, None, None)
    # an archive is device-free: the same bytes are checked (and here, fail to load)
    archive = check_artifact("archive", b"not even a zip", None, 1e-5, 1e-4, device="cuda")
    assert archive["skipped"] is None and archive["error_class"] == "incompatible"


@pytest.mark.compile
def test_a_real_package_through_on_device_matches_the_plain_runner(compiled_mlp, tmp_path: Path) -> None:
    data = compiled_mlp.package.output
    for sub in "abc":
        (tmp_path / sub).mkdir()
    plain = load_package(data, str(tmp_path / "a"))
    wrapped = OnDevice(load_package(data, str(tmp_path / "b")), "cpu")
    assert not isinstance(load_runner(data, str(tmp_path / "c"), "cpu"), OnDevice)
    for batch in (1, 16):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(wrapped(x), plain(x), atol=0, rtol=0)


@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_package_validates_against_cpu_eager() -> None:  # pragma: no cover - GPU machines only
    from pt2flow.stages.aot_compile import aot_compile
    from pt2flow.stages.options import AotCompileOptions
    from tests.stages.helpers import decomposed

    build = builder(models.tiny_mlp)
    trace, dec = decomposed(build, mlp_inputs(1, 16))
    package = aot_compile(dec.output, AotCompileOptions(device="cuda")).output
    result = validate(
        build,
        mlp_inputs(1, 16),
        trace.metadata["dims"],
        ValidateOptions(samples=4, atol=1e-4, rtol=1e-3),
        package=package,
        device="cuda",
    )
    assert result.output["passed"] is True and result.output["device"] == "cuda"
    assert [s["label"] for s in result.output["candidates"]["compiled"]["samples"]] == [
        "example",
        "min",
        "max",
        "random-1",
    ]
