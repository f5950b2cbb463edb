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
