"""What an AOTInductor package's native code depends on besides the program: the CPU vector ISA
inductor targets, the C++ compiler and its version, and for CUDA the GPU architecture, the CUDA
version and Triton. It goes into the aot_compile key (docs/architecture.md §5), so a store shared by
machines of different kinds never hands one a package built for another.

Everything is read from inductor itself (the compiler it would call, the ISA it would pick), under
the same inductor config patches the compile gets.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from typing import Any
from collections.abc import Mapping

import torch

from pt2flow.stages.devices import missing_device
from pt2flow.stages.distributions import installed_version

UNKNOWN = "unknown"  # the vector ISA could not be probed (no working compiler): not worth caching
# inductor options that change which compiler or ISA is used, and so the key's identity
_CONFIG_KEYS = ("cpp.cxx", "cpp.simdlen", "cpp.march")


def native_toolchain(device: str, inductor_configs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The native toolchain identity for compiling on `device` here: str -> str, JSON-able.

    `inductor_configs`: the aot_compile stage's inductor options (those that pick the compiler or
    the ISA are applied while reading). Cached per process for each device and configuration."""
    from torch._inductor import config

    overrides = {k: v for k, v in dict(inductor_configs or {}).items() if k in _CONFIG_KEYS}
    with config.patch(overrides):
        state = (
            torch.device(device).type,
            torch.device(device).index,
            repr(config.cpp.cxx),
            config.cpp.simdlen,
            config.cpp.march,
            os.environ.get("ATEN_CPU_CAPABILITY"),
        )
        return dict(_identity(state))


@functools.lru_cache(maxsize=16)
def _identity(state: tuple[Any, ...]) -> tuple[tuple[str, str], ...]:
    """Computed under the config `state` describes (the caller holds the patch)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    kind, index = state[0], state[1]
    try:
        isa = pick_vec_isa()  # builds a probe with the compiler: none that works, no ISA to name
    except Exception:  # noqa: BLE001 - inductor's InvalidCxxCompiler and the like: the compile will say
        isa = None
    cxx, version = _compiler()
    identity = {
        "machine": platform.machine(),
        "vec_isa": UNKNOWN if isa is None else (str(isa) or "none"),
        "vec_bits": str(isa.bit_width()) if isa else "0",
        "cxx": cxx,
        "cxx_version": version,
        "march": config.cpp.march or "",
    }
    missing = missing_device(str(torch.device(kind, index)))
    if missing is not None:  # aot_compile will fail with this reason; the key still says why
        identity["device_missing"] = missing
    elif kind == "cuda":
        major, minor = torch.cuda.get_device_capability(index)
        identity["gpu_arch"] = f"sm_{major}{minor}"
        identity["cuda"] = str(torch.version.cuda)
        identity["triton"] = installed_version("triton", "absent")
    return tuple(sorted(identity.items()))


def _compiler() -> tuple[str, str]:
    """The C++ compiler inductor picks (cpp_builder.get_cpp_compiler) and the first line of its
    `--version`."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        cxx = get_cpp_compiler()
    except Exception:  # inductor's InvalidCxxCompiler: no compiler here; compiles will fail anyway
        return "none", ""
    env = {**os.environ, "LC_ALL": "C"}
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, env=env, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx, ""
    first = next((line.strip() for line in out.splitlines() if line.strip()), "")
    return cxx, first
