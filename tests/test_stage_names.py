"""No stage is named outside its own module (docs/architecture.md §2, "A stage is one module").

Every string literal of the package (flows/, stages/, storage/) equal to the name of a registered
stage is listed; it may stand only in a stage module: a module of flows/builtin/ that declares a
stage, or a module its declaration names (its compute, key, candidate loader, repro template,
rebuild, device function or options model: the torch half of a stage lives in stages/). Anywhere
else, code must ask the registry (flows/pipeline: by what a stage publishes, the stage that starts
from the source, the stage an options model configures) so that a stage added as one module is
known everywhere. Docstrings and comments are prose, not literals; tests name stages freely.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

from pt2flow.flows import pipeline
from tests.conftest import ROOT

PACKAGE_FOLDERS = ("flows", "stages", "storage")

# a literal that is a stage's name but not a stage: (file, literal) -> why it is not one
NOT_STAGES = {
    ("flows/cli/main.py", "validate"): "the `pt2flow validate` command (checks a config)",
    ("flows/cli/validate.py", "validate"): "the `pt2flow validate` command (checks a config)",
}


def _file_of(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return str(Path(spec.origin).resolve().relative_to(ROOT))


def stage_modules() -> set[str]:
    """The files that are a stage's own: its declaring module and the modules it names."""
    found = set()
    for stage in pipeline.stages():
        paths = [stage.compute, stage.key, stage.candidate, stage.repro, stage.rebuild, stage.device]
        modules = {path.split(":", 1)[0] for path in paths if path} | {stage.options.__module__}
        for module in modules:
            if (file := _file_of(module)) is not None:
                found.add(file)
    builtin = ROOT / "flows" / "builtin"
    found |= {str(p.relative_to(ROOT)) for p in builtin.glob("*.py")}  # their shared inputs (_programs.py) too
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                ids.add(id(first.value))
    return ids


def stage_literals() -> list[tuple[str, int, str]]:
    """(file, line, literal) of every string constant of the package equal to a stage's name."""
    names = set(pipeline.names())
    found = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            prose = _docstrings(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and node.value in names
                    and id(node) not in prose
                ):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.value))
    return found


def test_stage_names_are_quoted_only_in_stage_modules() -> None:
    own = stage_modules()
    elsewhere = [
        f"{file}:{line}: {literal!r}"
        for file, line, literal in stage_literals()
        if file not in own and (file, literal) not in NOT_STAGES
    ]
    assert elsewhere == [], (
        "stage names quoted outside the stages' own modules (ask flows/pipeline instead):\n" + "\n".join(elsewhere)
    )


def test_the_scan_sees_the_literals_it_allows() -> None:
    """The scan is not blind: the stage modules do quote names (their declarations), and every
    exception listed is still there (a stale one would hide nothing but mislead)."""
    literals = stage_literals()
    own = stage_modules()
    assert {"flows/builtin/trace.py", "flows/builtin/validate.py", "stages/onnx_target.py"} <= own
    declared = {literal for file, _, literal in literals if file.startswith("flows/builtin/")}
    assert declared == set(pipeline.names())  # each stage's name is in its own declaration
    assert {(file, literal) for file, _, literal in literals if (file, literal) in NOT_STAGES} == set(NOT_STAGES)
