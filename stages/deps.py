"""Dependency manifest of a model's code, as a compiler cache keeps one: which local files (by
content) and which installed distributions (by name and version) a model was built and traced from.

Which modules a model depends on (the rule). Seeds: the factory's module, the inputs factory's
module and the modules that define the built model's classes (all fixed by the config and the
code). From the seeds, the walk follows each *local* module's import statements (read from its
source with `ast`, so `from layers import SCALE` and an import inside a function both count),
resolving every name to a file the way the import system would, but without importing it. A
module is then one of

- standard library or pt2flow's own packages (stages, storage, flows): left out; the Python,
  pt2flow and stage versions are in every key already;
- part of an installed distribution (its file lies in the sys.path entry that holds the
  distribution's metadata): recorded as the distribution's name and version; the walk does not go
  into it, but the distributions it requires (its metadata's Requires-Dist, extras left out) are
  recorded too, and so is torch always;
- anything else (the config's folder, a checkout on PYTHONPATH, an editable install): a local
  file, recorded by sha256 of its bytes, and walked.

Why it is deterministic (docs/architecture.md §5): nothing in the rule depends on what the
process imported before. A worker is reused across models and may have any history; the walk
reads only the seeds, source files and the file system, so the same model gets the same manifest
in a fresh worker, a reused one, under `--workers 2` or on a Dask worker (tests/flows/
test_dependencies.py runs all of them). The earlier rule also seeded the walk with "every module
newly imported while the model was built" and followed module globals; both depend on the
process's history (a lazily imported `h2` or `tomli`, a submodule another model imported) and
made unchanged re-runs re-trace. What it can miss: code reached only through a string import
(importlib.import_module) that no import statement names, and an installed distribution that a
distribution imports optionally without requiring it. The manifest can hold more than a model
needs (an import inside a function that this model never calls): that costs a re-trace, never a
stale artifact.

Use (in the worker, after building the model):

    recorded = manifest([factory_module, *(type(m) for m in model.modules())], search_path)

Checking a manifest (`changed_entries`) reads and hashes the files and reads the installed
versions from the dist-info folder names on sys.path: it imports neither torch nor the user's
modules, so a fully cached re-run decides cache hits without them.

What is installed, and at which version, is read by stages.distributions.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Iterable, Iterator, Mapping

from pt2flow.stages.datafiles import Hashed, changed_declared, changed_files, expand, file_key, is_inside
from pt2flow.stages.datafiles import is_under as _is_under
from pt2flow.stages.reads import import_reads, interpreter_folders
from pt2flow.stages.distributions import (
    import_path,
    installed_distributions,
    normalize_name,
    requirements,
    top_level_owners,
)

OWN_PACKAGE = "pt2flow"  # its changes reach the keys through the stage versions, not the manifest
ALWAYS_DISTRIBUTIONS = ("torch",)
_SKIPPED_NAMES = frozenset({"__main__", "__mp_main__", "builtins"})


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
    """Where imports are looked up, in order: the config's folder first (the worker puts it
    first on sys.path before importing a factory), then sys.path."""
    roots = [os.path.abspath(search_path)] if search_path else []
    roots += [os.path.abspath(p or os.curdir) for p in import_path()]
    return tuple(dict.fromkeys(roots))


def _home(path: str, candidates: tuple[str, ...]) -> str | None:
    """The longest of `candidates` (sys.path and the config's folder) that holds `path`."""
    best = None
    for folder in candidates:
        if _is_under(path, folder) and (best is None or len(folder) > len(best)):
            best = folder
    return best


@dataclass(frozen=True)
class ModuleKind:
    """What a module is to a manifest."""

    kind: str  # "skip", "dist" or "file"
    value: str = ""  # the distribution's canonical name, or the file's absolute path


@dataclass(frozen=True)
class Located:
    """Where a module's code is, found without importing it: its file (None for a namespace
    package or a builtin) and, for a package, the folders its submodules are looked up in."""

    path: str | None
    search: tuple[str, ...] = ()


def _locate(name: str, roots: tuple[str, ...]) -> Located | None:
    """The module `name` as the import system would find it, importing nothing. A module loaded
    from outside the interpreter's folders (local code: the config's folder, an editable
    install's finder, a module a factory registered) is where it was loaded from. Anything else
    is looked up on `roots` (the config's folder and the start-up sys.path): its top-level
    package there and each submodule in its parent's folders (importlib.machinery.PathFinder,
    which only reads the file system). So a module loaded from inside the interpreter's folders
    through a path added later (`tomli` from setuptools' vendored folder, which setuptools
    appends to sys.path during a compile) is not seen: a fresh worker would not see it either.
    None when it cannot be found (a name that is an attribute, not a module)."""
    loaded = sys.modules.get(name)
    if isinstance(loaded, ModuleType):
        path = _module_file(loaded)
        if path is not None and not is_inside(path, interpreter_folders()):
            return Located(path, tuple(getattr(loaded, "__path__", None) or ()))
    parent, _, _leaf = name.rpartition(".")
    spec = None
    if parent:
        above = _locate(parent, roots)
        if above is None or not above.search:
            return None
        where = list(above.search)
    else:
        where = list(roots)
    try:
        spec = importlib.machinery.PathFinder.find_spec(name, where)
    except (ImportError, ValueError, OSError):
        spec = None
    if spec is None:
        return None
    origin = spec.origin if spec.has_location and spec.origin and os.path.isfile(spec.origin) else None
    return Located(os.path.abspath(origin) if origin else None, tuple(spec.submodule_search_locations or ()))


def _classify(
    name: str, path: str | None, roots: tuple[str, ...], owners: Mapping[tuple[str, str], list[str]]
) -> ModuleKind:
    top = name.partition(".")[0]
    if name in _SKIPPED_NAMES or top in sys.stdlib_module_names or top.startswith("__editable__"):
        return ModuleKind("skip")
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


def _package_of(name: str, path: str) -> str:
    """The package relative imports in module `name` (from file `path`) resolve against."""
    return name if os.path.basename(path).startswith("__init__.") else name.rpartition(".")[0]


def _referenced_modules(name: str, path: str) -> Iterator[str]:
    """Names of the modules a local source file's import statements name (and, for `from m
    import x`, `m.x`, which is a module when x is a submodule)."""
    if not path.endswith(".py"):
        return
    package = _package_of(name, path)
    for target, names in _import_statements(path):
        try:
            resolved = importlib.util.resolve_name(target, package) if target.startswith(".") else target
        except (ImportError, ValueError):
            continue
        yield resolved
        for sub in names:
            if sub != "*":
                yield f"{resolved}.{sub}"


def _with_parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _seed_name(seed: Any) -> str | None:
    if isinstance(seed, str):
        return seed
    if isinstance(seed, ModuleType):
        return seed.__name__
    owner = getattr(seed, "__module__", None) if isinstance(seed, type) or callable(seed) else type(seed).__module__
    return owner if isinstance(owner, str) else None


def dependency_modules(seeds: Iterable[Any], search_path: str | None = None) -> dict[str, ModuleKind]:
    """The modules the seeds depend on, by the rule of this module's docstring.

    Seeds are module names, modules, classes, functions or instances (their defining module).
    Returns module name -> what it is; pt2flow's own and standard-library modules are left out.
    Depends only on the seeds and the files on disk, not on what this process imported before."""
    pending: list[str] = []
    for seed in seeds:
        name = _seed_name(seed)
        if name:
            pending.extend(_with_parents(name))
    roots, owners = _import_roots(search_path), top_level_owners()
    kinds: dict[str, ModuleKind] = {}
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.partition(".")[0]
        if not top or top in sys.stdlib_module_names or top == OWN_PACKAGE:
            continue
        located = _locate(name, roots)
        if located is None:
            continue
        kind = _classify(name, located.path, roots, owners)
        if kind.kind == "skip":
            continue
        if kind.kind == "dist" and any(k.kind == "dist" and n.partition(".")[0] == top for n, k in kinds.items()):
            continue  # one module of a distribution names it
        kinds[name] = kind
        if kind.kind == "file" and located.path:
            for ref in _referenced_modules(name, located.path):
                pending.extend(n for n in _with_parents(ref) if n not in seen)
    return kinds


# ---------------------------------------------------------------------------------------------
# the manifest and its check


def manifest(
    seeds: Iterable[Any],
    search_path: str | None = None,
    *,
    reads: Iterable[str] | None = None,
    declared: Iterable[str] = (),
    hashed: Hashed | None = None,
) -> dict[str, Any]:
    """{"files": {name: sha256}, "distributions": {canonical name: version}}, plus "reads" (data
    files the build read: {name: sha256}) and "declared" (a checkpoint folder or `depends_on`
    glob -> {name: sha256} of the files it names) when given: deterministic, JSON-able.

    `seeds`: what `dependency_modules` takes (the factory's module, the model's classes).
    Distributions include what the recorded ones require, and torch. `reads` (a recording was
    made, stages/reads.py): the files read while building, to which the import-time reads of
    every local module the code depends on are added (a reused worker imported them before).
    `hashed` collects each file's stat signature for a cheap re-check (stages/datafiles.py)."""
    hashed = hashed or Hashed()
    kinds = dependency_modules(seeds, search_path)
    files = hashed.table([k.value for k in kinds.values() if k.kind == "file"], search_path)
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
    found: dict[str, Any] = {"files": files, "distributions": dict(sorted(distributions.items()))}
    specs = {spec: expand(spec) for spec in declared}
    if specs:
        found["declared"] = {
            file_key(spec, search_path): hashed.table(paths, search_path) for spec, paths in sorted(specs.items())
        }
    if reads is not None:
        local = {name: kind.value for name, kind in kinds.items() if kind.kind == "file"}
        everything = {os.path.abspath(p) for p in reads} | import_reads(local)
        skip = {p for paths in specs.values() for p in paths} | set(local.values())
        found["reads"] = hashed.table(sorted(p for p in everything - skip if os.path.isfile(p)), search_path)
    return found


def changed_entries(
    recorded: Mapping[str, Any],
    search_path: str | None = None,
    versions: Mapping[str, str] | None = None,
    stats: Mapping[str, str] | None = None,
    taken_ns: int | None = None,
) -> list[str]:
    """What differs between a recorded manifest and this machine now, one line per entry (empty:
    unchanged). Looks the versions up and checks the files, imports nothing. `versions`
    (canonical name -> version): another environment's distributions, instead of this one's.
    `stats`/`taken_ns`: the files' stat signatures when they were hashed; a file whose
    signature still holds is not read again (stages/datafiles.py)."""
    changes = changed_files(recorded.get("files", {}), search_path, stats, taken_ns)
    changes += changed_files(recorded.get("reads", {}), search_path, stats, taken_ns)
    changes += changed_declared(recorded.get("declared", {}), search_path, stats, taken_ns)
    now = versions if versions is not None else {name: dist.version for name, dist in installed_distributions().items()}
    for name, version in sorted(recorded.get("distributions", {}).items()):
        found = now.get(normalize_name(name))
        if found is None:
            changes.append(f"{name}: {version} -> not installed")
        elif found != version:
            changes.append(f"{name}: {version} -> {found}")
    return changes
