"""Native toolchain identity: what inductor itself picks here, and a different one when the ISA or
the compiler differs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch._inductor import config
from torch._inductor.cpp_builder import get_cpp_compiler
from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

from pt2flow.stages.toolchain import native_toolchain


def fake_compiler(folder: Path, version: str) -> Path:
    """A compiler wrapper that reports `version` and passes every other call to the real g++."""
    real = shutil.which("g++")
    assert real, "these tests need g++"
    script = folder / "fake-cxx"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\nexec {real} "$@"\n')
    script.chmod(0o755)
    return script


def test_identity_is_what_inductor_picks_here() -> None:
    identity = native_toolchain("cpu")
    isa = pick_vec_isa()
    assert identity["vec_isa"] == str(isa) and identity["vec_bits"] == str(isa.bit_width())
    cxx = get_cpp_compiler()
    first_line = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0].strip()
    assert identity["cxx"] == cxx and identity["cxx_version"] == first_line
    assert first_line  # a real version line, e.g. "g++ (Debian 12.2.0-14+deb12u1) 12.2.0"
    assert "gpu_arch" not in identity
    assert native_toolchain("cpu") == identity  # cached, and stable


def test_another_compiler_gives_another_identity(tmp_path: Path) -> None:
    before = native_toolchain("cpu")
    script = fake_compiler(tmp_path, "fakecc 99.1")
    by_option = native_toolchain("cpu", {"cpp.cxx": (None, str(script))})
    assert by_option["cxx"] == str(script) and by_option["cxx_version"] == "fakecc 99.1"
    assert by_option["vec_isa"] == before["vec_isa"]
    with config.patch({"cpp.cxx": (None, str(script))}):  # what CXX=... sets when inductor is imported
        assert native_toolchain("cpu") == by_option
    assert native_toolchain("cpu") == before


def test_another_isa_gives_another_identity() -> None:
    widths = sorted({isa.bit_width() for isa in valid_vec_isa_list()})
    if len(widths) < 2:
        pytest.skip(f"this CPU offers one vector width only: {widths}")
    default = native_toolchain("cpu")
    narrow = native_toolchain("cpu", {"cpp.simdlen": widths[0]})
    assert narrow["vec_bits"] == str(widths[0]) != default["vec_bits"]
    with config.patch({"cpp.simdlen": widths[0]}):
        assert narrow["vec_isa"] == str(pick_vec_isa())
    assert narrow["vec_isa"] != default["vec_isa"]
