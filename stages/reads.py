"""Which data files building a model reads: what a model is made of beyond its code and weights.

A factory that sizes a layer from `arch.json`, `from_pretrained(folder)` on a checkpoint folder,
`numpy.load`, `torch.load`: the files they read are part of the model's identity, and neither
the config nor the import statements name them. `recording()` collects them while a block of
code runs (the worker builds the model inside it), through two mechanisms:

- the interpreter's `open` audit event (PEP 578), raised by `open()`, `io.open`, `os.open` and so
  by every library that opens files through Python: json, pickle, numpy.load, torch.load
  (mmap=True too: it opens the file in Python first), tokenizers' Python side, PIL;
- safetensors' native reader, whose Rust code opens files without Python's `open`:
  `safetensors.safe_open` is wrapped (in safetensors and in every loaded module that holds it
  under that name: transformers' modeling_utils does), so `load_file` and `from_pretrained` are
  seen.

What it cannot see (docs/architecture.md §5): files opened by other native code (a C++ loader,
`np.fromfile` of an already-open descriptor is fine, a file a subprocess reads is not), the
network, environment variables, the clock. The source record's eager digest is the backstop
for those (`pt2flow audit`, `run --verify-sources`).

What is not a model input: files under the interpreter's prefixes and site-packages (installed
code and data: the manifest's distributions cover them), system folders, Python source and
bytecode (the import manifest covers code), folders the caller excludes (the store, pt2flow's
cache), files the recorded code wrote itself, and files gone when the recording ends.

Reads made while a module is being imported happen once per process, so a reused worker would
not see them again: they are remembered per importing module (`import_reads`) for the whole
process, and the caller adds the import-time reads of every local module the model's code
depends on, which makes the set independent of what the worker imported before.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any
from collections.abc import Callable, Iterable, Iterator

from pt2flow.stages.datafiles import is_inside

SYSTEM_FOLDERS = ("/proc", "/sys", "/dev", "/etc", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/run", "/boot")
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyi", ".so", ".pyd", ".pth")

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "excluded": None}
_active: list[Reads] = []
_import_reads: dict[str, set[str]] = {}
_native_wrappers: dict[int, Callable[..., Any]] = {}


@dataclass
class Reads:
    """The files one recording saw opened for reading, and those it saw opened for writing."""

    excluded: tuple[str, ...]
    read: set[str] = field(default_factory=set)
    written: set[str] = field(default_factory=set)

    def files(self) -> list[str]:
        """The model inputs: read, not written by the recorded code, still there, not excluded."""
        return sorted(
            p for p in self.read if p not in self.written and os.path.isfile(p) and not is_inside(p, self.excluded)
        )


def _real(path: str) -> str:
    return os.path.realpath(path)


@functools.cache
def interpreter_folders() -> tuple[str, ...]:
    """Folders whose files are never model inputs: the interpreter's, its site-packages, the system's."""
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *SYSTEM_FOLDERS}
    try:
        folders.update(site.getsitepackages())
        folders.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    # every site-packages on the path: an environment layered on another (a .pth naming the base
    # environment's site-packages) imports, and reads metadata, from both
    folders.update(p for p in sys.path if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages"))
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pt2flow's installed folders
    folders.update({os.path.join(own, "stages"), os.path.join(own, "storage"), os.path.join(own, "flows")})
    return tuple(sorted({_real(f) for f in folders if f} | {os.path.abspath(f) for f in folders if f}))


def _importing_module() -> str | None:
    """The innermost module whose body is executing because it is being imported, if any."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            spec = frame.f_globals.get("__spec__")
            if isinstance(name, str) and spec is not None and getattr(spec, "_initializing", False):
                return name
        frame = frame.f_back
    return None


def _is_write(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    if isinstance(flags, int):
        return (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & (os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    return False


def _note(path: Any, write: bool = False) -> None:
    """Record one open of `path` (from the audit hook or a native loader's wrapper)."""
    if isinstance(path, int):
        return  # an open descriptor: the file it names was opened (and noted) before
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return
    if not text or text.endswith(CODE_SUFFIXES) or f"{os.sep}__pycache__{os.sep}" in text:
        return
    full = os.path.abspath(text)
    excluded = _state["excluded"]
    if excluded is not None and is_inside(full, excluded):
        return
    if write:
        for reads in list(_active):
            reads.written.add(full)
        return
    module = _importing_module()
    with _lock:
        if module is not None:  # an import-time read: the module's, remembered for the process
            _import_reads.setdefault(module, set()).add(full)
        else:
            for reads in _active:
                reads.read.add(full)


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event != "open":
        return
    try:
        path, mode, flags = args
        _note(path, _is_write(mode, flags))
    except Exception:  # noqa: BLE001 - an audit hook must never break the code it watches
        pass


def install() -> None:
    """Start watching this process's file opens (once; an audit hook cannot be removed). A worker
    calls it at start, before any model's module is imported, so import-time reads are seen."""
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
        _state["excluded"] = interpreter_folders()
    sys.addaudithook(_hook)
    _wrap_native_loaders()


def _wrap_native_loaders() -> None:
    """Wrap `safetensors.safe_open` wherever a loaded module holds it by that name (and in
    safetensors itself, so later `from safetensors import safe_open` gets the wrapper)."""
    try:
        import safetensors
    except ImportError:
        return
    original = getattr(safetensors, "safe_open", None)
    if original is None:
        return
    original = getattr(original, "__wrapped__", original)
    wrapper = _native_wrappers.get(id(original))
    if wrapper is None:

        def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
            _note(filename)
            return original(filename, *args, **kwargs)

        safe_open.__wrapped__ = original  # type: ignore[attr-defined]
        safe_open.__doc__ = original.__doc__
        wrapper = _native_wrappers[id(original)] = safe_open
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("safe_open") is original:
            namespace["safe_open"] = wrapper


def import_reads(modules: Iterable[str]) -> set[str]:
    """The files read while any of `modules` was being imported in this process."""
    found: set[str] = set()
    with _lock:
        for name in modules:
            found |= _import_reads.get(name, set())
    return found


@contextmanager
def recording(exclude: Iterable[str] = ()) -> Iterator[Reads]:
    """Collect the files read while the block runs (any thread); `exclude`: more folders that are
    not model inputs (the store, caches)."""
    install()
    _wrap_native_loaders()  # modules imported since the last recording may hold the original
    folders = tuple(sorted({os.path.abspath(f) for f in exclude if f} | {_real(f) for f in exclude if f}))
    reads = Reads(excluded=(_state["excluded"] or ()) + folders)
    with _lock:
        _active.append(reads)
    try:
        yield reads
    finally:
        with _lock:
            _active.remove(reads)
