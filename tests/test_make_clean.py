"""`make clean` leaves nothing that make, the tests or the docs build made (issue 44): checked on
a copy of the Makefile in a folder holding what a fresh clone holds after `make test` and `make
docs` (the list was read off `git status --ignored` on one, fc51), plus a tracked-like file that
must stay."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import ROOT

MADE = [
    ".venv/bin/python",
    ".prefect/pt2flow-server.log",
    "pt2-store/index/x.parquet",
    "pt2-store-failures/blobs/x",
    ".pytest_cache/v/x",
    ".cache/test-envs/baseline/x",
    ".cache/docs-src/pt2flow/x",
    ".mypy_cache/x",
    ".hypothesis/examples/x",
    ".import_linter_cache/x",
    ".ruff_cache/x",
    "pt2flow.egg-info/PKG-INFO",
    "site/index.html",
    "flows/__pycache__/x.pyc",
    "tests/flows/__pycache__/x.pyc",
    "tests/fixtures/tinyops-1.0/build/lib/x.py",
    "tests/fixtures/tinyops-1.0/tinyops.egg-info/PKG-INFO",
]
KEPT = ["flows/fleet.py", "tests/fixtures/tinyops-1.0/pyproject.toml", "docs/index.md"]


def test_make_clean_removes_everything_it_and_the_tests_made(tmp_path: Path) -> None:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    server = tmp_path / "flows" / "engine" / "services" / "prefect_server.py"
    server.parent.mkdir(parents=True)
    shutil.copy(ROOT / "flows" / "engine" / "services" / "prefect_server.py", server)
    for name in (*MADE, *KEPT):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    proc = subprocess.run(
        ["make", "clean", f"HOME={tmp_path / 'home'}"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    left = [name for name in MADE if (tmp_path / name).exists()]
    assert left == [], left
    assert all((tmp_path / name).is_file() for name in KEPT)
    assert not list(tmp_path.rglob("__pycache__"))
