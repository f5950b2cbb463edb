"""`checkpoint:` and `depends_on:` (issue 29): `pt2flow validate` says when they name nothing,
each at its YAML path, and a run fails that model's source with `config` instead of building
from files that are not there. Real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli, run_json

pytestmark = pytest.mark.integration  # `pt2flow validate` and `run` as subprocesses


def _config(folder: Path, **model: object) -> Path:
    path = folder / "fleet.yaml"
    entry = {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [2, 8]}}, **model}
    path.write_text(yaml.safe_dump({"version": 1, "stages": ["trace"], "models": [entry]}, sort_keys=False))
    return path


def test_validate_names_a_missing_checkpoint_and_an_empty_glob(tmp_path: Path) -> None:
    config = _config(tmp_path, checkpoint="ckpt", depends_on=["vocab/*.txt", "present.json"])
    (tmp_path / "present.json").write_text("{}")
    proc = run_cli(["validate", str(config)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "models[0].checkpoint" in out and f"checkpoint folder not found: {tmp_path / 'ckpt'}" in out, out
    assert "models[0].depends_on[0]" in out and "names no file: vocab/*.txt" in out, out
    assert "depends_on[1]" not in out

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "a.txt").write_text("a")
    config = _config(tmp_path, depends_on=["vocab/*.txt", "present.json"])
    assert run_cli(["validate", str(config)]).returncode == 0


def test_a_run_fails_the_source_when_a_declared_file_is_gone(tmp_path: Path) -> None:
    config = _config(tmp_path, depends_on=["vocab/*.txt"])
    code, document, stderr = run_json(["run", str(config), "--store", str(tmp_path / "store")])
    assert code == 1, stderr[-2000:]
    model = document["models"][0]
    assert (model["failed_stage"], model["error_class"]) == ("source", "config"), model
    assert "names no file: vocab/*.txt" in model["error"]
