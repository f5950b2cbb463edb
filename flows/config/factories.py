"""`module:callable` references (a model's factory and inputs_factory) checked without running
anything (docs/architecture.md §3): the module is found with importlib's finder, without
importing its packages, and the name is looked for at the top level of its source.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from pt2flow.stages.importing import search_path_first
from pt2flow.stages.vocabulary import FACTORY_PATTERN


def _top_level_names(tree: ast.Module) -> frozenset[str]:
    """The names a module's source binds at its top level: functions, classes, assignments and imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
    return frozenset(names)


# a fleet's models mostly share a few modules: each source is parsed once per process, keyed by
# its path and text (an edited module is parsed again: `serve` checks a config before every run)
def _names_in(origin: str) -> frozenset[str] | SyntaxError:
    """_top_level_names of the module at `origin`, or the SyntaxError its source raises."""
    return _names_in_text(origin, Path(origin).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=64)
def _names_in_text(origin: str, text: str) -> frozenset[str] | SyntaxError:
    try:
        return _top_level_names(ast.parse(text, filename=origin))
    except SyntaxError as exc:
        return exc.with_traceback(None)  # kept: no frames held by the cache


def _find_spec_without_importing(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """importlib.util.find_spec, minus its side effect: for "a.b" it imports (runs) package a."""
    parent_name, _, _ = module_name.rpartition(".")
    if not parent_name or module_name in sys.modules:
        return importlib.util.find_spec(module_name)
    parent = _find_spec_without_importing(parent_name)
    if parent is None or parent.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(module_name, list(parent.submodule_search_locations))


def resolve_factory_statically(factory: str, search_path: str) -> str | None:
    """Why `module:callable` cannot resolve, or None. Finds the module without executing it
    and looks for the name at the top level of its source."""
    module_name, _, attr = factory.partition(":")
    with search_path_first(search_path):
        try:
            spec = _find_spec_without_importing(module_name)
        except (ImportError, ValueError) as exc:
            return f"module {module_name!r} cannot be found: {exc}"
        if spec is None:
            return f"module {module_name!r} not found (looked in {search_path} and on sys.path)"
        origin = spec.origin
        if not origin or not origin.endswith(".py") or not os.path.exists(origin):
            return None  # a compiled or namespace module: checked when imported
        names = _names_in(origin)
        if isinstance(names, SyntaxError):
            return f"module {module_name!r} ({origin}) has a syntax error at line {names.lineno}: {names.msg}"
        if attr.split(".")[0] not in names:
            return f"{attr.split('.')[0]!r} is not defined at the top level of {origin}"
        return None


def factory_problem(value: str, search_path: str) -> str | None:
    """Why a `module:callable` reference is unusable (its form, or what the static resolution
    found), or None."""
    if not FACTORY_PATTERN.fullmatch(value):
        return f"{value!r} is not of the form 'package.module:callable'"
    return resolve_factory_statically(value, search_path)
