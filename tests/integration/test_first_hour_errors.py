"""A newcomer's first runs (issue 44), through the real `pt2flow run`:

- a forward() that raises the user's own exception is reported as that exception (class
  runtime, `ValueError: boom`, the user's file and line), whichever rung of the trace ladder
  came last: non-strict first (Dynamo's "Observed exception" came last) and strict only;
- a store the user cannot write is a setup error: exit 2 before anything runs, naming the store
  and what to do, not a storage failure of every model (exit 1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli, run_json

pytestmark = pytest.mark.integration

RAISING = """\
import torch
from torch import nn


class Raising(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        if h.shape[-1] == 8:
            raise ValueError("boom")
        return h


def raising():
    return Raising()


def mlp():
    return nn.Sequential(nn.Linear(8, 4))
"""
RAISE_LINE = 1 + RAISING.splitlines().index('            raise ValueError("boom")')


def _config(folder: Path, models: list[dict]) -> Path:
    (folder / "user_models.py").write_text(RAISING)
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "stages": ["trace", "serialize"], "models": models}, sort_keys=False))
    return path


def test_a_forward_that_raises_is_reported_as_the_users_exception(tmp_path: Path) -> None:
    models = [
        # non-strict first: it sees ValueError, then strict (the ladder's last rung) sees Dynamo's
        # "Observed exception", which is what used to be reported (unsupported_op)
        {"name": "raiser", "factory": "user_models:raising", "inputs": {"x": {"shape": [2, 8]}}},
        # strict only: the one rung sees nothing but Dynamo's "Observed exception"
        {
            "name": "raiser-strict",
            "factory": "user_models:raising",
            "inputs": {"x": {"shape": [2, 8]}},
            "stages": {"trace": {"strict": True, "fallback": False}},
        },
    ]
    config = _config(tmp_path, models)
    code, document, stderr = run_json(["run", str(config), "--store", str(tmp_path / "store")], timeout=600)
    assert code == 1, stderr[-3000:]
    by_name = {m["name"]: m for m in document["models"]}
    source = tmp_path / "user_models.py"
    for name in ("raiser", "raiser-strict"):
        model = by_name[name]
        assert (model["status"], model["failed_stage"], model["error_class"]) == ("failed", "trace", "runtime"), model
        error = model["error"]
        assert error.startswith("ValueError: boom\n"), error
        assert f"{source}:{RAISE_LINE} " in error, error  # the user's file and line
        assert 'raise ValueError("boom")' in error
        assert "Observed exception" not in error and "Dynamo" not in error
    # the failure group names the user's code as where it happened
    groups = {tuple(g["models"]): g for g in document["failure_groups"]}
    group = groups[("raiser", "raiser-strict")]
    assert (group["error_class"], group["stage"]) == ("runtime", "trace")
    assert group["where"] == "user_models:Raising.forward", group

    # the human summary says the same
    proc = run_cli(["run", str(config), "--store", str(tmp_path / "store"), "--only", "raiser"], timeout=600)
    assert proc.returncode == 1
    assert "✗ raiser [runtime] at trace:" in proc.stdout, proc.stdout
    assert "ValueError: boom" in proc.stdout and f"user_models.py:{RAISE_LINE}" in proc.stdout.replace("\n", "")


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder this user cannot create files in: mode 0555 for a normal user; for root, who
    ignores file modes, the immutable attribute (chattr +i). Skipped where neither works."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root without chattr +i: no folder here refuses root's writes")
    try:
        yield folder
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=True)


@pytest.mark.parametrize("where", ["read-only-folder", "under-a-file"])
def test_a_store_that_cannot_be_written_is_a_setup_error(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    config = _config(tmp_path, [{"name": "mlp", "factory": "user_models:mlp", "inputs": {"input": {"shape": [2, 8]}}}])
    if where == "read-only-folder":
        store = request.getfixturevalue("read_only_folder")
        with pytest.raises(OSError):  # the folder really refuses this user's writes
            (store / "probe").write_text("x")
        fix = "make that folder writable"
    else:  # a regular file where a folder of the store would go: refused for root too
        (tmp_path / "a-file").write_text("")
        store = tmp_path / "a-file" / "store"
        fix = "a file stands where the store's folder (or one above it) would go"
    for json_flag in ([], ["--json"]):
        proc = run_cli(["run", str(config), "--store", str(store), *json_flag], timeout=300)
        assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        assert proc.stdout == ""  # nothing ran: no table, no run document
        message = proc.stderr.strip().splitlines()[-1]
        assert message.startswith(f"pt2flow: error: the store {store} cannot be written"), proc.stderr
        assert "nothing ran" in message and fix in message and "--store" in message
    assert not any(store.iterdir()) if store.is_dir() else not store.exists()
