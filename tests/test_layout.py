"""The layers stay apart (import-linter contracts in pyproject.toml) and the CLI stays light."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import BIN, ROOT


def test_import_contracts_hold() -> None:
    proc = subprocess.run([str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


def test_query_commands_import_neither_torch_nor_prefect() -> None:
    code = (
        "import sys; from flows import cli, queries; cli.build_parser();"
        "import storage.index, storage.store;"
        "print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_wheel_holds_every_package_and_the_report_template(tmp_path) -> None:
    """A non-editable install must find every module the code imports (a package missing from the
    build configuration would only show up there) and the HTML report's template."""
    import pathlib
    import shutil
    import zipfile

    source = tmp_path / "src"  # a copy: setuptools leaves a build/ folder beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "stages", "storage", "flows"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("pt2flow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        str(path.relative_to(ROOT))
        for top in ("stages", "storage", "flows")
        for path in (ROOT / top).rglob("*.py")
    }
    assert expected and expected <= names, sorted(expected - names)
    assert "flows/report/templates/report.html.j2" in names
    assert not any(n.startswith(("tests/", "bench/", "configs/")) for n in names)
    assert pathlib.Path(wheel).stat().st_size < 2_000_000
