"""Dependency manifest of a model's code, as a compiler cache keeps one: which local files (by
content) and which installed distributions (by name and version) a model was built and traced from.

Which modules a model depends on (the rule). Seeds: the factory's module, the modules that define
the built model's classes, every module newly imported while the model was built and traced
(`record_imports`), and every loaded module imported from the config's folder (`search_path`;
not from a more specific sys.path entry inside it, such as a virtual environment's site-packages). From the seeds, the walk follows each *local* module's imports: the names its
`import` statements name (read from its source, so `from layers import SCALE` counts) and the
modules of the objects in its globals (so imports made by code that ran also count). A module
is then one of

- standard library or pt2flow's own packages (stages, storage, flows): left out; the Python,
  pt2flow and stage versions are in every key already;
- part of an installed distribution (its file lies in the sys.path entry that holds the
  distribution's metadata): recorded as the distribution's name and version; the walk does not go
  into it, but the distributions it requires (its metadata's Requires-Dist, extras left out) are
  recorded too, and so is torch always;
- anything else (the config's folder, a checkout on PYTHONPATH, an editable install): a local
  file, recorded by sha256 of its bytes, and walked.

Why it is sound where it matters: a worker process is reused across models, so a module an
earlier model imported is not "new" for a later one; the walk from the factory's module and the
model's classes finds it anyway, from what is loaded, not from what happened to be imported
last. What it can miss: code reached only through a string import (importlib.import_module) of a
module that was already loaded and that lives outside the config's folder, and a change in
*which* module an import resolves to when the earlier one was absent (a try/except ImportError
fallback that starts succeeding). The manifest can hold more than a model needs (a sibling model's
file in the same folder, once loaded): that costs a re-trace, never a stale artifact.

Use (in the worker, around the model's build and trace):

    with record_imports() as rec:
        factory = import_factory(...); model = build_model(...); trace(...)
    recorded = manifest([factory_module, *rec.new_modules, *(type(m) for m in model.modules())], search_path)

The manifest can differ with a worker's history (a first model in a fresh worker also records
what torch imports lazily). A re-run should therefore check the manifest recorded by the last
run (`changed_entries`), not compute a new one to look the key up.

Checking a manifest (`changed_entries`) reads and hashes the files and reads the installed
versions from the dist-info folder names on sys.path: it imports neither torch nor the user's
modules, so a fully cached re-run decides cache hits without them.

What is installed, and at which version, is read by stages.distributions.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any, Iterable, Iterator, Mapping

from pt2flow.stages.distributions import installed_distributions, normalize_name, requirements, top_level_owners

OWN_PACKAGE = "pt2flow"  # its changes reach the keys through the stage versions, not the manifest
ALWAYS_DISTRIBUTIONS = ("torch",)
_SKIPPED_NAMES = frozenset({"__main__", "__mp_main__", "builtins"})


# ---------------------------------------------------------------------------------------------
# recording what gets imported


@dataclass
class ImportRecorder:
    """Snapshot of sys.modules on entry; `new_modules` holds what was imported inside the block."""

    before: frozenset[str] = field(default_factory=frozenset)
    new_modules: tuple[str, ...] = ()

    def __enter__(self) -> "ImportRecorder":
        self.before = frozenset(list(sys.modules))
        return self

    def __exit__(self, *exc: object) -> None:
        self.new_modules = tuple(sorted(name for name in list(sys.modules) if name not in self.before))


def record_imports() -> ImportRecorder:
    """`with record_imports() as rec: build and trace` -> rec.new_modules."""
    return ImportRecorder()


# ---------------------------------------------------------------------------------------------
# which modules, and what each one is


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths}
    dirs.add(os.path.abspath(os.path.dirname(os.__file__)))
    dirs |= {os.path.join(d, "lib-dynload") for d in list(dirs)}
    return tuple(sorted(dirs))


def _module_file(module: ModuleType) -> str | None:
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return None
    path = os.path.abspath(path)
    return path if os.path.isfile(path) else None


def _import_roots(search_path: str | None) -> tuple[str, ...]:
    roots = [os.path.abspath(p or os.curdir) for p in sys.path]
    if search_path:
        roots.append(os.path.abspath(search_path))
    return tuple(roots)


def _home(path: str, candidates: tuple[str, ...]) -> str | None:
    """The longest of `candidates` (sys.path and the config's folder) that holds `path`."""
    best = None
    for folder in candidates:
        if _is_under(path, folder) and (best is None or len(folder) > len(best)):
            best = folder
    return best


def _is_under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class ModuleKind:
    """What a loaded module is to a manifest."""

    kind: str  # "skip", "dist" or "file"
    value: str = ""  # the distribution's canonical name, or the file's absolute path


def _classify(name: str, module: ModuleType, roots: tuple[str, ...], owners: Mapping[tuple[str, str], list[str]]) -> ModuleKind:
    top = name.partition(".")[0]
    if name in _SKIPPED_NAMES or top in sys.stdlib_module_names or top.startswith("__editable__"):
        return ModuleKind("skip")
    path = _module_file(module)
    if path is None:  # builtin, frozen or namespace package: nothing on disk of its own
        return ModuleKind("skip")
    if top == OWN_PACKAGE:
        return ModuleKind("skip")
    home = _home(path, roots)
    if home is not None and home in _stdlib_dirs():
        return ModuleKind("skip")
    if home is not None:
        found = owners.get((home, top))
        if found:
            return ModuleKind("dist", found[0])
    if home is None and any(_is_under(path, d) for d in _stdlib_dirs()):
        return ModuleKind("skip")
    return ModuleKind("file", path)


_imports_cache: dict[tuple[str, int, int], tuple[tuple[str, tuple[str, ...]], ...]] = {}


def _import_statements(path: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(module, names) of every import statement in a source file; relative ones keep their dots."""
    try:
        stat = os.stat(path)
    except OSError:
        return ()
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key in _imports_cache:
        return _imports_cache[key]
    found: list[tuple[str, tuple[str, ...]]] = []
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except (SyntaxError, ValueError, OSError):
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append(("." * node.level + (node.module or ""), tuple(a.name for a in node.names)))
    _imports_cache[key] = tuple(found)
    return _imports_cache[key]


def _referenced_modules(name: str, module: ModuleType) -> Iterator[str]:
    """Names of the modules a local module refers to: by its import statements and its globals."""
    path = _module_file(module)
    if path and path.endswith(".py"):
        package = getattr(module, "__package__", None) or (name if hasattr(module, "__path__") else name.rpartition(".")[0])
        for target, names in _import_statements(path):
            try:
                resolved = importlib.util.resolve_name(target, package) if target.startswith(".") else target
            except (ImportError, ValueError):
                continue
            yield resolved
            for sub in names:
                yield f"{resolved}.{sub}"
    for value in list(vars(module).values()):
        if isinstance(value, ModuleType):
            yield value.__name__
        elif isinstance(value, type) or _is_function(value):
            owner = getattr(value, "__module__", None)
            if isinstance(owner, str):
                yield owner
        else:
            yield type(value).__module__


def _is_function(value: Any) -> bool:
    return isinstance(value, (FunctionType, BuiltinFunctionType, MethodType))


def _with_parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _seed_name(seed: Any) -> str | None:
    if isinstance(seed, str):
        return seed
    if isinstance(seed, ModuleType):
        return seed.__name__
    owner = getattr(seed, "__module__", None) if isinstance(seed, type) or _is_function(seed) else type(seed).__module__
    return owner if isinstance(owner, str) else None


def dependency_modules(seeds: Iterable[Any], search_path: str | None = None) -> dict[str, ModuleKind]:
    """The loaded modules the seeds depend on, by the rule of this module's docstring.

    Seeds are module names, modules, classes, functions or instances (their defining module).
    Returns module name -> what it is; pt2flow's own and standard-library modules are left out."""
    modules = dict(sys.modules)
    pending: list[str] = []
    for seed in seeds:
        name = _seed_name(seed)
        if name:
            pending.extend(_with_parents(name))
    roots, owners = _import_roots(search_path), top_level_owners()
    if search_path:  # modules imported from the config's folder itself (not a site-packages inside it)
        folder = os.path.abspath(search_path)
        for name, module in modules.items():
            path = _module_file(module) if isinstance(module, ModuleType) else None
            if path and _is_under(path, folder) and _home(path, roots) == folder:
                pending.append(name)
    kinds: dict[str, ModuleKind] = {}
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        module = modules.get(name)
        if not isinstance(module, ModuleType):
            continue
        kind = _classify(name, module, roots, owners)
        if kind.kind == "skip":
            continue
        kinds[name] = kind
        if kind.kind == "file":
            for ref in _referenced_modules(name, module):
                pending.extend(n for n in _with_parents(ref) if n not in seen)
    return kinds


# ---------------------------------------------------------------------------------------------
# the manifest and its check


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_key(path: str, search_path: str | None) -> str:
    """A file's name in the manifest: relative to the config's folder when inside it (so a moved
    config folder keeps its cache), absolute otherwise; '/' separators either way."""
    if search_path and _is_under(path, os.path.abspath(search_path)):
        return Path(os.path.relpath(path, os.path.abspath(search_path))).as_posix()
    return Path(path).as_posix()


def _file_path(key: str, search_path: str | None) -> str:
    if os.path.isabs(key) or not search_path:
        return key
    return os.path.join(os.path.abspath(search_path), *key.split("/"))


def manifest(seeds: Iterable[Any], search_path: str | None = None) -> dict[str, dict[str, str]]:
    """{"files": {name: sha256}, "distributions": {canonical name: version}}: deterministic, JSON-able.

    `seeds`: what `dependency_modules` takes (the factory's module, the model's classes and the
    recorder's new_modules). Distributions include what the recorded ones require, and torch."""
    kinds = dependency_modules(seeds, search_path)
    files = {}
    for kind in kinds.values():
        if kind.kind == "file":
            files[_file_key(kind.value, search_path)] = sha256_file(kind.value)
    table = installed_distributions()
    wanted = [k.value for k in kinds.values() if k.kind == "dist"] + [normalize_name(n) for n in ALWAYS_DISTRIBUTIONS]
    distributions: dict[str, str] = {}
    while wanted:
        name = wanted.pop()
        dist = table.get(name)
        if name in distributions or dist is None:
            continue
        distributions[name] = dist.version
        wanted.extend(requirements(dist))
    return {"files": dict(sorted(files.items())), "distributions": dict(sorted(distributions.items()))}


def changed_entries(recorded: Mapping[str, Mapping[str, str]], search_path: str | None = None) -> list[str]:
    """What differs between a recorded manifest and this machine now, one line per entry (empty:
    unchanged). Hashes the files and looks the versions up; imports nothing."""
    changes = []
    for key, digest in sorted(recorded.get("files", {}).items()):
        path = _file_path(key, search_path)
        try:
            now = sha256_file(path)
        except OSError:
            changes.append(f"{key}: file missing")
            continue
        if now != digest:
            changes.append(f"{key}: content changed")
    table = installed_distributions()
    for name, version in sorted(recorded.get("distributions", {}).items()):
        dist = table.get(normalize_name(name))
        if dist is None:
            changes.append(f"{name}: {version} -> not installed")
        elif dist.version != version:
            changes.append(f"{name}: {version} -> {dist.version}")
    return changes


def manifest_unchanged(recorded: Mapping[str, Mapping[str, str]], search_path: str | None = None) -> bool:
    return not changed_entries(recorded, search_path)
