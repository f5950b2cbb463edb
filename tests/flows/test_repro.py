"""`pt2flow repro`: a failed stage as a script that needs torch alone, written from the store, that
raises the same exception in a fresh process (pt2flow made unimportable there)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pt2flow.flows.engine.repro import ReproError, write_repro
from pt2flow.storage import ArtifactStore
from tests.conftest import ROOT, run_json, write_config

pytestmark = pytest.mark.integration

# pt2flow cannot be imported where the script runs: it must need torch alone
NO_PT2FLOW = "import runpy, sys; sys.modules['pt2flow'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"


def _run_script(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_PT2FLOW, str(folder / "repro.py")], cwd=folder, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def failed_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    work = tmp_path_factory.mktemp("repro")
    torch.manual_seed(5)
    save_file({k: v.contiguous() for k, v in __import__("tests.repro_models", fromlist=["x"]).custom_op_model().state_dict().items()}, str(work / "custom.safetensors"))
    config = write_config(work / "c.yaml", [
        {"name": "data-dependent", "factory": "failure_models:data_dependent_branch", "inputs": {"x": {"shape": [2, 8]}}},
        {"name": "custom-op", "factory": "tests.repro_models:custom_op_model", "weights": "custom.safetensors",
         "inputs": {"x": {"shape": [3, 8]}}, "dynamic_shapes": {"x": {0: "batch"}}, "dims": {"batch": {"min": 1, "max": 32}}},
        {"name": "healthy", "factory": "failure_models:healthy_mlp", "inputs": {"input": {"shape": [3, 8]}}},
    ], stages=["trace", "functionalize", "decompose", "serialize"])
    # failure_models lives in configs/: the config's folder is first on sys.path, so put it there
    (work / "failure_models.py").write_text((ROOT / "configs" / "failure_models.py").read_text())
    store = str(work / "store")
    code, doc, stderr = run_json(["run", str(config), "--store", store, "--workers", "1"])
    assert code == 1, stderr[-3000:]
    got = {m["name"]: (m["status"], m["failed_stage"], m["error_class"]) for m in doc["models"]}
    assert got == {
        "data-dependent": ("failed", "trace", "data_dependent"),
        "custom-op": ("failed", "decompose", "decomposition"),
        "healthy": ("ok", None, None),
    }, got
    return store


def test_a_data_dependent_trace_failure_reproduces_with_torch_alone(failed_store: str, tmp_path: Path) -> None:
    written = write_repro(ArtifactStore(failed_store), "data-dependent", str(tmp_path / "dd"))
    assert written["stage"] == "trace" and written["error_class"] == "data_dependent"
    assert written["files"] == ["inputs.pt", "repro.py"]
    script = (tmp_path / "dd" / "repro.py").read_text()
    assert not re.search(r"^\s*(import|from) pt2flow", script, re.M)
    assert "torch.export.export(model, args, kwargs" in script and "strict=False" in script
    proc = _run_script(tmp_path / "dd")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "GuardOnDataDependentSymNode" in proc.stderr and "Could not guard on data-dependent expression" in proc.stderr


def test_a_decomposition_failure_reproduces_from_the_stored_program(failed_store: str, tmp_path: Path) -> None:
    store = ArtifactStore(failed_store)
    failed = [r for r in store.index.read().to_pylist() if r["model"] == "custom-op" and r["status"] == "failed"]
    (record,) = failed
    # by the failure's ID as well as by the model's name
    by_id = write_repro(store, record["sha256"][:12], str(tmp_path / "by-id")) if record["sha256"] else None
    written = write_repro(store, "custom-op", str(tmp_path / "dec"))
    assert written["stage"] == "decompose" and written["error_class"] == "decomposition"
    assert written["files"] == ["program.pt2", "repro.py"]
    if by_id is not None:
        assert by_id["stage"] == "decompose"
    proc = _run_script(tmp_path / "dec")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ops outside core ATen remain after decomposition: pt2flow_repro.scale.default" in proc.stderr
    assert "pt2flow_repro.scale.default" in record["error_message"]


def test_nothing_to_reproduce_is_refused(failed_store: str, tmp_path: Path) -> None:
    store = ArtifactStore(failed_store)
    with pytest.raises(ReproError, match="has no failed stage"):
        write_repro(store, "healthy", str(tmp_path / "h"))
    with pytest.raises(ReproError, match="no model and no artifact ID 'nobody'"):
        write_repro(store, "nobody", str(tmp_path / "n"))
    assert not (tmp_path / "h").exists() and not (tmp_path / "n").exists()
