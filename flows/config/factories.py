"""`module:callable` references (a model's factory and inputs_factory) checked without running
anything (docs/architecture.md §3): the module is found with importlib's finder, without
importing its packages, and the name is looked for at the top level of its source.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from pt2flow.stages.importing import search_path_first
from pt2flow.stages.vocabulary import FACTORY_PATTERN


def _defines(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
    return False


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
        try:
            tree = ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
        except SyntaxError as exc:
            return f"module {module_name!r} ({origin}) has a syntax error at line {exc.lineno}: {exc.msg}"
        if not _defines(tree, attr.split(".")[0]):
            return f"{attr.split('.')[0]!r} is not defined at the top level of {origin}"
        return None


def factory_problem(value: str, search_path: str) -> str | None:
    """Why a `module:callable` reference is unusable (its form, or what the static resolution
    found), or None."""
    if not FACTORY_PATTERN.fullmatch(value):
        return f"{value!r} is not of the form 'package.module:callable'"
    return resolve_factory_statically(value, search_path)
