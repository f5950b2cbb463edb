"""The layers stay apart (import-linter contracts in pyproject.toml) and the CLI stays light."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import BIN, ROOT


def test_import_contracts_hold() -> None:
    proc = subprocess.run([str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 kept, 0 broken" in proc.stdout


# the packages `make test` type-checks, every module in them
TYPE_CHECKED = ("flows.api", "flows.pipeline", "flows.builtin", "flows.engine.stage_api", "stages")


@pytest.mark.integration  # mypy / pip in a subprocess
def test_the_python_and_stage_apis_type_check(tmp_path) -> None:
    """mypy (pyproject's [tool.mypy]) on the Python API (flows/api), the stage declarations and
    their registry (flows/builtin, flows/pipeline), what a stage module imports of the engine
    (flows/engine/stage_api.py) and the torch work (stages/): their signatures hold what they
    promise, and tests/plugin_stage.py, a stage written against the stage API, type-checks with
    it. The editable install maps pt2flow.flows to flows/ through an import hook mypy cannot
    follow, so the packages are given to it as a pt2flow/ folder of links on MYPYPATH."""
    package = tmp_path / "pt2flow"
    package.mkdir()
    for top in ("flows", "stages", "storage"):
        (package / top).symlink_to(ROOT / top, target_is_directory=True)
    (tmp_path / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            *(f"--package=pt2flow.{name}" for name in TYPE_CHECKED),
            "--module=tests.plugin_stage",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "MYPYPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_query_commands_import_neither_torch_nor_prefect() -> None:
    # every command's module (run's and serve's too: they import torch and Prefect only when they run)
    code = (
        "import sys; from pt2flow.flows.cli import main; [main.cli.get_command(None, name) for name in main.COMMANDS];"
        "import pt2flow.flows.cli.queries, pt2flow.flows.cli.maintenance, pt2flow.flows.cli.report;"
        "import pt2flow.storage.index, pt2flow.storage.store, pt2flow.flows.engine.orchestrator.planner, pt2flow.flows.engine.orchestrator.runner, pt2flow.flows.engine.maintenance.compat;"
        "print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.integration  # mypy / pip in a subprocess
def test_the_wheel_installs_only_pt2flow_with_every_package_and_the_report_template(tmp_path) -> None:
    """A non-editable install: every module of stages/, storage/ and flows/ lands under pt2flow/
    (a package missing from pyproject's list would only show up there), with the HTML report's
    template, and nothing named stages, storage or flows is importable from it."""
    import pathlib
    import shutil
    import zipfile

    source = tmp_path / "src"  # a copy: setuptools leaves a build/ folder beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "stages", "storage", "flows"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(
            ROOT / name,
            source / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}),
        )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("pt2flow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "pt2flow/" + str(path.relative_to(ROOT))
        for top in ("stages", "storage", "flows")
        for path in (ROOT / top).rglob("*.py")
    }
    assert expected and expected <= names, sorted(expected - names)
    assert "pt2flow/flows/report/templates/report.html.j2" in names
    assert {
        "pt2flow/flows/py.typed",
        "pt2flow/stages/py.typed",
        "pt2flow/storage/py.typed",
    } <= names  # PEP 561: typed for users
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"pt2flow"}
    assert pathlib.Path(wheel).stat().st_size < 2_000_000

    # installed on its own (no .pth of the editable install: python -S), from a folder that is not the checkout
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert installed - {"bin"} == {"pt2flow"}, installed  # bin/: the `pt2flow` script
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    code = (
        "import importlib, importlib.util, json, sys\n"
        "import pt2flow.flows.cli.main, pt2flow.flows.fleet, pt2flow.flows.engine.worker, pt2flow.flows.report.html\n"
        "print(json.dumps({'pt2flow': list(importlib.import_module('pt2flow').__path__),"
        " 'shadowing': [n for n in ('stages', 'storage', 'flows') if importlib.util.find_spec(n)]}))"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join([str(target), site_packages])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found == {"pt2flow": [str(target / "pt2flow")], "shadowing": []}
