"""The Python environment the workers run in: this interpreter, or another one (`run --python
PATH`, the config's `python:`), e.g. a virtualenv with a candidate torch or transformers.

Everything the orchestrator derives from installed versions (the keys' environment, the toolchain
identity, the check of a recorded dependency manifest, the index records' versions) asks the
active Interpreter, never importlib.metadata of its own process. Another interpreter is asked
once in a subprocess that imports neither torch nor the model's code (only importlib.metadata
and pt2flow's protocol number), and the answer is cached in pt2flow's cache folder under the
interpreter's path, checked against the mtimes of the folders on its sys.path (an install or
uninstall renames a *.dist-info folder, which changes its parent's mtime).

One fleet runs at a time in an orchestrator process (a served deployment runs its fleets one
after another), so the active interpreter is process state, set by the fleet before it plans.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Mapping

from pt2flow.flows.engine.common.keys import Environment, environment_of
from pt2flow.flows.engine.common.protocol import WORKER_PROTOCOL
from pt2flow.flows.options import UsageError
from pt2flow.stages.distributions import installed_version, normalize_name

_Missing = TypeVar("_Missing")

QUERY_TIMEOUT_S = 120.0
# run by the other interpreter: stdlib and pt2flow's protocol module only (no torch)
_QUERY = r"""
import importlib, importlib.metadata as md, json, os, platform, re, site, sys
out = {"executable": sys.executable, "python_version": platform.python_version(),
       "prefix": sys.prefix, "sys_path": [os.path.abspath(p or os.curdir) for p in sys.path], "distributions": {},
       "dist_info": {}, "site_packages": [p for p in site.getsitepackages() if os.path.isdir(p)]}
for dist in md.distributions():  # in sys.path order: the first of a name is the one an import sees
    try:
        name = dist.metadata["Name"]
    except Exception:
        continue
    if name:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key not in out["distributions"]:
            out["distributions"][key] = dist.version
            out["dist_info"][key] = str(getattr(dist, "_path", "") or "")
try:
    try:
        from pt2flow.flows.engine.common.protocol import WORKER_PROTOCOL
    except ModuleNotFoundError:  # a pt2flow from before the engine's subpackages (protocol 1)
        WORKER_PROTOCOL = importlib.import_module("pt2flow.flows.engine" + ".protocol").WORKER_PROTOCOL
    out["protocol"] = WORKER_PROTOCOL
except Exception as exc:
    out["pt2flow_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Interpreter:
    """A Python environment workers can run in: its executable, Python version and installed
    distributions (canonical name -> version, the one an import there would see)."""

    python: str  # the executable workers are started with
    python_version: str
    distributions: Mapping[str, str] = field(default_factory=dict)
    sys_path: tuple[str, ...] = ()
    site_packages: tuple[str, ...] = ()
    dist_info: Mapping[str, str] = field(default_factory=dict)  # canonical name -> its .dist-info folder
    local: bool = False  # this very process: versions are read here, as they always were

    def __hash__(self) -> int:
        return hash((self.python, self.local, self.python_version, frozenset(self.distributions.items())))

    def version(self, dist: str, missing: _Missing) -> str | _Missing:
        """The installed version of `dist` there, or `missing`."""
        if self.local:
            return installed_version(dist, missing)
        return self.distributions.get(normalize_name(dist), missing)

    def describe(self) -> str:
        return f"{self.python} (Python {self.python_version}, torch {self.version('torch', 'not installed')})"


def this_process() -> Interpreter:
    return Interpreter(python=sys.executable, python_version=platform.python_version(), local=True)


def full(python: Interpreter) -> Interpreter:
    """`python` with its distributions listed (this process's are read lazily otherwise)."""
    return describe(python.python) if python.local else python


_active: Interpreter | None = None


def current() -> Interpreter:
    """The interpreter this process's workers run in (this one unless a fleet chose another)."""
    return _active if _active is not None else this_process()


def current_environment() -> Environment:
    """The environment the workers run in (torch, Python and pt2flow's versions, the host: what
    every key names), read once per interpreter."""
    return _environment(current())


@functools.lru_cache(maxsize=8)
def _environment(python: Interpreter) -> Environment:
    return environment_of(python)  # installed versions do not change under a running interpreter


def activate(python: str | os.PathLike[str] | None) -> Interpreter:
    """Make `python` (None: this interpreter) the one workers run in and versions are read from;
    UsageError when it cannot run pt2flow's workers."""
    global _active
    _active = None if python is None else describe(python)
    return current()


def describe(python: str | os.PathLike[str]) -> Interpreter:
    """The Interpreter at `python` (a path, or a command found on PATH); UsageError naming what
    to install when it lacks pt2flow or speaks another worker protocol."""
    executable = _executable(str(python))
    facts = _cached_facts(executable)
    if "pt2flow_error" in facts or "protocol" not in facts:
        raise UsageError(
            f"the Python at {executable} cannot run pt2flow's workers: pt2flow is not importable there "
            f"({facts.get('pt2flow_error', 'no protocol')}); install it into that environment: "
            f"{executable} -m pip install pt2flow (or -e {_source_hint()})"
        )
    if facts["protocol"] != WORKER_PROTOCOL:
        theirs = facts["distributions"].get("pt2flow", "unknown")
        raise UsageError(
            f"the pt2flow at {executable} ({theirs}) speaks worker protocol {facts['protocol']}, this one "
            f"({installed_version('pt2flow', 'unknown')}) speaks {WORKER_PROTOCOL}: install the same pt2flow into both environments"
        )
    return Interpreter(
        python=executable,
        python_version=facts["python_version"],
        distributions=dict(facts["distributions"]),
        sys_path=tuple(facts["sys_path"]),
        site_packages=tuple(facts.get("site_packages", ())),
        dist_info=dict(facts.get("dist_info", {})),
    )


def _source_hint() -> str:
    return str(Path(__file__).resolve().parents[2])


def _executable(python: str) -> str:
    """An absolute path to the interpreter (a venv's bin/python stays a link: the venv is what
    counts, not the base interpreter it points to)."""
    import shutil

    candidate = python if os.sep in python else (shutil.which(python) or python)
    path = os.path.abspath(os.path.expanduser(candidate))
    if os.path.isdir(path):  # a virtualenv's folder
        for inner in ("bin/python", "Scripts/python.exe"):
            if os.path.isfile(os.path.join(path, inner)):
                path = os.path.join(path, inner)
                break
    if not os.path.isfile(path):
        raise UsageError(
            f"--python {python}: no such interpreter (give the path of a Python executable or of a virtualenv)"
        )
    if not os.access(path, os.X_OK):
        raise UsageError(f"--python {python}: {path} is not executable")
    return path


def _stamp(paths: Any, executable: str) -> list[list[Any]]:
    stamp: list[list[Any]] = []
    for folder in [executable, *paths]:
        try:
            stamp.append([folder, os.stat(folder).st_mtime_ns])
        except OSError:
            stamp.append([folder, -1])
    return stamp


def _cached_facts(executable: str) -> dict[str, Any]:
    # the protocol in the name: facts cached by a pt2flow of another protocol were asked its module path
    path = (
        Path(cache_dir())
        / f"interpreter-v2-p{WORKER_PROTOCOL}-{hashlib.sha256(executable.encode()).hexdigest()[:40]}.json"
    )
    try:
        cached = json.loads(path.read_text())
        if cached["stamp"] == _stamp(cached["facts"]["sys_path"], executable):
            return dict(cached["facts"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    facts = query(executable)
    if "protocol" in facts:  # an environment without pt2flow is asked again next time (it may be installed)
        _write(path, {"stamp": _stamp(facts["sys_path"], executable), "facts": facts})
    return facts


def query(executable: str) -> dict[str, Any]:
    """Ask the interpreter at `executable` for its facts (a subprocess; no torch is imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME",)}
    try:
        result = subprocess.run(
            [executable, "-c", _QUERY],
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"--python {executable}: could not run it: {exc}") from None
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--python {executable}: it did not answer pt2flow's query (exit {result.returncode}): {tail}")
    try:
        return dict(json.loads(lines[-1]))
    except ValueError:
        raise UsageError(
            f"--python {executable}: its answer to pt2flow's query is not JSON: {lines[-1][:200]}"
        ) from None


def _write(path: Path, payload: Mapping[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".interpreter-", suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a cache that cannot be written costs a query next time, nothing more
        pass


def cache_dir() -> str:
    """Where pt2flow keeps per-machine facts (the native toolchain identity, interpreters' facts)
    and the environments it makes (overlays): PT2FLOW_CACHE_DIR, else $XDG_CACHE_HOME/pt2flow,
    else ~/.cache/pt2flow."""
    explicit = os.environ.get("PT2FLOW_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pt2flow")
