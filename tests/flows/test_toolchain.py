"""The toolchain identity without torch: computed once in a fresh interpreter, then read from a
cache file named by cheap facts; a changed compiler binary invalidates it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pt2flow.flows.engine.environment.toolchain import toolchain_facts, toolchain_identity
from pt2flow.stages.toolchain import native_toolchain
from tests.stages.test_toolchain import fake_compiler

pytestmark = pytest.mark.integration  # the native toolchain is probed with real compiler subprocesses


def test_cached_identity_is_the_native_one(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    identity = toolchain_identity("cpu", cache)
    assert identity == native_toolchain("cpu")  # the fresh interpreter agrees with this one
    files = list(cache.glob("toolchain-*.json"))
    assert len(files) == 1
    # served from the file from now on: a marker written into it comes back
    payload = json.loads(files[0].read_text())
    payload["identity"]["marker"] = "from-cache"
    files[0].write_text(json.dumps(payload))
    assert toolchain_identity("cpu", cache)["marker"] == "from-cache"


def test_a_changed_compiler_binary_invalidates_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    script = fake_compiler(tmp_path, "fakecc 1.0")
    monkeypatch.setenv("CXX", str(script))
    first = toolchain_identity("cpu", cache)
    assert first["cxx"] == str(script) and first["cxx_version"] == "fakecc 1.0"
    facts = toolchain_facts("cpu")
    fake_compiler(tmp_path, "fakecc 2.0")  # same path, new binary
    os.utime(script, ns=(facts["compiler"]["mtime_ns"] + 10**9,) * 2)
    assert toolchain_facts("cpu") != facts
    second = toolchain_identity("cpu", cache)
    assert second["cxx_version"] == "fakecc 2.0"
    assert len(list(cache.glob("toolchain-*.json"))) == 2


def test_facts_are_read_without_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "import sys; from pt2flow.flows.engine.environment.toolchain import toolchain_facts; f = toolchain_facts('cpu'); print('torch' in sys.modules, bool(f['cpu_flags']))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.split() == ["False", "True"]


def test_another_isa_setting_gets_its_own_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    names = [str(isa) for isa in valid_vec_isa_list()]
    if "avx2" not in names or len(names) < 2:
        pytest.skip(f"needs a CPU with avx2 and a wider ISA; this one offers {names}")
    cache = tmp_path / "cache"
    default = toolchain_identity("cpu", cache)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # what inductor reads to narrow its ISA
    narrowed = toolchain_identity("cpu", cache)
    assert narrowed["vec_isa"] == "avx2" != default["vec_isa"]
    assert narrowed["cxx_version"] == default["cxx_version"]
    assert len(list(cache.glob("toolchain-*.json"))) == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_the_identity_of_a_missing_device_or_a_broken_compiler_is_not_cached(tmp_path: Path) -> None:
    """Installing a driver or a compiler's headers need not change the facts: such an identity is
    computed again next time instead of being served from the cache."""
    cache = tmp_path / "cache"
    assert toolchain_identity("cuda", cache)["device_missing"] == "no CUDA device is available here"
    assert toolchain_identity("cpu", cache, {"cpp.cxx": ["/nonexistent/c++"]})["vec_isa"] == "unknown"
    assert list(cache.glob("toolchain-*.json")) == []
    toolchain_identity("cpu", cache)
    assert len(list(cache.glob("toolchain-*.json"))) == 1  # a working one is cached
