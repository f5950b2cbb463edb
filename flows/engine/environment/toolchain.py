"""The native toolchain identity (stages.toolchain) without importing torch: a fully cached re-run
must decide aot_compile cache hits in milliseconds.

The identity is computed once, with torch, in a fresh interpreter (the one a worker would be),
and kept in a small JSON file named by the cheap facts that determine it: the torch version, the
CPU (architecture and /proc/cpuinfo flags), the compiler inductor would pick (CXX or g++) by path,
size and mtime, the environment variables inductor reads, and for CUDA the visible devices and the
driver's GPU list. When any fact changes the file name changes, and the identity is computed anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from pt2flow.flows.engine.environment.interpreter import this_process
from pt2flow.flows.engine.common.keys import canonical_json

# environment variables that inductor reads when it picks the compiler or the ISA
_ENV = ("CXX", "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CPP_MARCH", "TORCH_INDUCTOR_INSTALL_GXX", "CUDA_VISIBLE_DEVICES")

_COMPUTE = """
import json, sys
from pt2flow.stages.toolchain import native_toolchain
print(json.dumps(native_toolchain(sys.argv[1], json.loads(sys.argv[2]))))
"""


def toolchain_facts(
    device: str, inductor_configs: Mapping[str, Any] | None = None, python: Any = None
) -> dict[str, Any]:
    """Cheap facts that determine the identity, read without torch (a few stats and file reads).
    `python`: the Interpreter the workers run in (flows/engine/environment/interpreter.py; None: this one)."""
    if python is None:
        python = this_process()
    configs = dict(inductor_configs or {})
    compiler = configs.get("cpp.cxx") or os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    if isinstance(compiler, (list, tuple)):
        compiler = next((c for c in compiler if c), "")
    facts: dict[str, Any] = {
        "device": device,
        "configs": configs,
        "torch": python.version("torch", None),
        "triton": python.version("triton", None),
        "python": python.python,
        "machine": platform.machine(),
        "cpu_flags": _cpu_flags_hash(),
        "compiler": _file_facts(compiler),
        "env": {name: os.environ.get(name) for name in _ENV},
    }
    if device.startswith("cuda"):
        facts["gpus"] = _gpu_list_hash()
    return facts


def toolchain_identity(
    device: str,
    cache_dir: str | os.PathLike[str],
    inductor_configs: Mapping[str, Any] | None = None,
    python: Any = None,
) -> dict[str, str]:
    """stages.toolchain.native_toolchain(device, inductor_configs), from `cache_dir` when the
    facts are unchanged; otherwise computed in a fresh interpreter (`python`'s, the workers')
    and cached there."""
    facts = toolchain_facts(device, inductor_configs, python)
    digest = hashlib.sha256(canonical_json(facts).encode()).hexdigest()
    path = Path(cache_dir) / f"toolchain-{digest[:40]}.json"
    try:
        return dict(json.loads(path.read_text())["identity"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    identity = _compute(device, dict(inductor_configs or {}), facts["python"])
    if "device_missing" not in identity and identity.get("vec_isa") != "unknown":
        # an identity of a missing device or a compiler that does not work is computed again next
        # time: what fixes it (a driver, headers) need not change the facts
        _write_atomically(path, {"facts": facts, "identity": identity})
    return identity


def _compute(device: str, configs: dict[str, Any], executable: str) -> dict[str, str]:
    result = subprocess.run(
        [executable, "-c", _COMPUTE, device, json.dumps(configs)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"computing the native toolchain identity failed: {result.stderr.strip()[-2000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _write_atomically(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".toolchain-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, sort_keys=True, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _file_facts(program: str) -> dict[str, Any]:
    """A program by resolved path, size and mtime: an upgrade replaces the file."""
    found = shutil.which(program) if program else None
    if not found:
        return {"name": program, "path": None}
    real = os.path.realpath(found)
    stat = os.stat(real)
    return {"name": program, "path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _cpu_flags_hash() -> str:
    """sha256 of the CPU's feature flags (/proc/cpuinfo), or of the processor name elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return hashlib.sha256(platform.processor().encode()).hexdigest()
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features", "features"):
            flags.update(value.split())
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()


def _gpu_list_hash() -> str | None:
    """The NVIDIA driver's description of each GPU (model, bus), if the driver exposes it."""
    root = Path("/proc/driver/nvidia/gpus")
    try:
        texts = [(p / "information").read_text() for p in sorted(root.iterdir())]
    except OSError:
        return None
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()
