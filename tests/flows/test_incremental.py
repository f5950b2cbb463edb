"""Incremental re-export: which stages re-run after each kind of change, as real fleet runs (in
this process, pt2flow.flows.api's run; the real `pt2flow run` where its own process matters: a
new torch version, a run killed half-way).

One baseline run builds a store; each test copies it with the config folder, changes one thing
and runs again. `a` is the model that changes, `b` must stay cached throughout (except under a
new torch version). Runs skip aot_compile (one compile test below covers it) to stay quick.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, cli_env, run_in_process, run_json

pytestmark = pytest.mark.integration

NO_COMPILE = ["trace", "functionalize", "decompose", "serialize", "validate"]

MODULE_A = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return Net(hidden)
"""

MODULE_B = """\
import torch
from torch import nn


def build() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh())
"""


def _config(
    folder: Path,
    *,
    stages: list[str] = NO_COMPILE,
    a_extra: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Path:
    model_a = {
        "name": "a",
        "factory": "fleet_a:build",
        "kwargs": {"hidden": 16},
        "weights": "a.safetensors",
        "inputs": {"x": {"shape": [3, 8]}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 8}},
    }
    model_a.update(a_extra or {})
    config = {
        "version": 1,
        "stages": stages,
        "defaults": defaults or {},
        "models": [model_a, {"name": "b", "factory": "fleet_b:build", "inputs": {"input": {"shape": [2, 6]}}}],
    }
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _weights(path: Path, seed: int) -> None:
    from safetensors.torch import save_file

    import torch

    generator = torch.Generator().manual_seed(seed)
    save_file(
        {
            "fc1.weight": torch.randn(16, 8, generator=generator),
            "fc1.bias": torch.randn(16, generator=generator),
            "fc2.weight": torch.randn(4, 16, generator=generator),
            "fc2.bias": torch.randn(4, generator=generator),
        },
        str(path),
    )


def _run(config: Path, store: Path, **options: Any) -> dict[str, Any]:
    """The fleet run in this process (what a re-run builds is under test, not the CLI)."""
    code, document = run_in_process(config, store=str(store), **options)
    assert code == 0, document
    return document


def _run_cli(config: Path, store: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The real `pt2flow run` (a process of its own: its environment is the test's to set)."""
    code, document, stderr = run_json(["run", str(config), "--store", str(store)], cwd=config.parent, env=env)
    assert code == 0, stderr[-3000:]
    return document


def _stages(document: dict[str, Any], model: str) -> dict[str, dict[str, Any]]:
    return next(m for m in document["models"] if m["name"] == model)["stages"]


def fresh(document: dict[str, Any], model: str) -> set[str]:
    """The stages of `model` that did real work in this run."""
    return {stage for stage, info in _stages(document, model).items() if not info["cached"]}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("baseline")
    (folder / "fleet_a.py").write_text(MODULE_A)
    (folder / "fleet_b.py").write_text(MODULE_B)
    _weights(folder / "a.safetensors", seed=1)
    document = _run(_config(folder), folder / "store")
    assert fresh(document, "a") == set(NO_COMPILE) and fresh(document, "b") == set(NO_COMPILE)
    return folder, document


@pytest.fixture
def copy(baseline: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of the baseline's folder: modules, weights, config and store."""
    target = tmp_path / "work"
    shutil.copytree(baseline[0], target)
    return target


def test_unchanged_rerun_does_no_stage_work_and_returns_the_same_ids(
    baseline: tuple[Path, dict[str, Any]], copy: Path
) -> None:
    again = _run(copy / "fleet.yaml", copy / "store")
    for name in ("a", "b"):
        assert fresh(again, name) == set()
        before = {s: i["artifact"] for s, i in _stages(baseline[1], name).items()}
        assert {s: i["artifact"] for s, i in _stages(again, name).items()} == before
    store = ArtifactStore(str(copy / "store"))
    # the cached run is recorded too (cached=True), but published no new blob
    rows = store.index.read(columns=["run_id", "cached", "stage"])
    this_run = [r for r in rows.to_pylist() if r["run_id"] == again["run_id"]]
    assert this_run and all(r["cached"] for r in this_run)


def test_new_weights_rerun_only_that_model(copy: Path) -> None:
    _weights(copy / "a.safetensors", seed=2)
    document = _run(copy / "fleet.yaml", copy / "store")
    assert fresh(document, "a") == set(NO_COMPILE)
    assert fresh(document, "b") == set()


def test_new_kwargs_rerun_only_that_model(copy: Path) -> None:
    (copy / "a.safetensors").unlink()
    _config(copy, a_extra={"kwargs": {"hidden": 24}, "weights": None})
    document = _run(copy / "fleet.yaml", copy / "store")
    assert fresh(document, "a") == set(NO_COMPILE)
    assert fresh(document, "b") == set()


def test_changed_forward_code_reruns_that_model(copy: Path) -> None:
    (copy / "fleet_a.py").write_text(MODULE_A.replace("torch.relu", "torch.nn.functional.gelu"))
    document = _run(copy / "fleet.yaml", copy / "store")
    assert fresh(document, "a") == set(NO_COMPILE)
    assert fresh(document, "b") == set()


def test_refactor_that_changes_no_graph_reuses_the_program(copy: Path) -> None:
    """New source -> new source key -> re-trace; the same program fingerprint -> the downstream
    program artifacts are reused. Validate re-runs: eager is new code and must be compared again."""
    (copy / "fleet_a.py").write_text(
        MODULE_A.replace("    def forward(self, x):\n", "    def forward(self, x):\n        # refactored: same graph\n")
    )
    document = _run(copy / "fleet.yaml", copy / "store")
    assert fresh(document, "a") == {"trace", "validate"}
    assert fresh(document, "b") == set()


def test_changed_stage_options_rerun_from_that_stage(copy: Path) -> None:
    _config(copy, a_extra={"stages": {"decompose": {"table": "none"}}})
    document = _run(copy / "fleet.yaml", copy / "store")
    assert fresh(document, "a") == {"decompose", "serialize", "validate"}
    assert fresh(document, "b") == set()


def test_changed_atol_reruns_only_validate(copy: Path) -> None:
    _config(copy, defaults={"validate": {"atol": 1e-4}})
    document = _run(copy / "fleet.yaml", copy / "store")
    assert fresh(document, "a") == {"validate"}
    assert fresh(document, "b") == {"validate"}


def test_new_torch_version_reruns_everything(copy: Path, tmp_path: Path) -> None:
    """A different installed torch version (as importlib.metadata reports it) changes every key."""
    fake = tmp_path / "fake-dist"
    dist = fake / "torch-2.99.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.99.0\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake), cli_env()["PYTHONPATH"]])}
    document = _run_cli(copy / "fleet.yaml", copy / "store", env=env)  # the orchestrator's own torch version too
    assert fresh(document, "a") == set(NO_COMPILE)
    assert fresh(document, "b") == set(NO_COMPILE)
    store = ArtifactStore(str(copy / "store"))
    versions = {
        r["torch_version"]
        for r in store.index.read(columns=["run_id", "torch_version"]).to_pylist()
        if r["run_id"] == document["run_id"]
    }
    assert versions == {"2.99.0"}


def test_force_reruns_everything(copy: Path) -> None:
    document = _run(copy / "fleet.yaml", copy / "store", force=True)
    assert fresh(document, "a") == set(NO_COMPILE) and fresh(document, "b") == set(NO_COMPILE)


def test_a_corrupt_cached_blob_is_rebuilt_not_reused(copy: Path, baseline: tuple[Path, dict[str, Any]]) -> None:
    digest = _stages(baseline[1], "b")["serialize"]["artifact"]
    blob = copy / "store" / "blobs" / "sha256" / digest[:2] / digest
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    document = _run(copy / "fleet.yaml", copy / "store")
    assert "serialize" in fresh(document, "b")
    assert ArtifactStore(str(copy / "store")).blob_status(_stages(document, "b")["serialize"]["artifact"]) == "ok"


@pytest.mark.compile
def test_refactor_reuses_the_compiled_package(tmp_path: Path) -> None:
    """With aot_compile in the pipeline, a graph-neutral refactor compiles nothing."""
    (tmp_path / "fleet_a.py").write_text(MODULE_A)
    (tmp_path / "fleet_b.py").write_text(MODULE_B)
    _weights(tmp_path / "a.safetensors", seed=1)
    config = _config(tmp_path, stages=["trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"])
    config_text = yaml.safe_load(config.read_text())
    config_text["models"] = config_text["models"][:1]
    config.write_text(yaml.safe_dump(config_text, sort_keys=False))
    first = _run(config, tmp_path / "store")
    (tmp_path / "fleet_a.py").write_text(
        MODULE_A.replace("        return self.fc2", "        # a comment\n        return self.fc2")
    )
    second = _run(config, tmp_path / "store")
    assert fresh(second, "a") == {"trace", "validate"}
    assert _stages(second, "a")["aot_compile"]["artifact"] == _stages(first, "a")["aot_compile"]["artifact"]


def test_a_run_killed_half_way_resumes_with_only_what_was_left(tmp_path: Path) -> None:
    """SIGKILL the whole CLI once model `a` is fully recorded; the next run redoes only `b`."""
    (tmp_path / "fleet_a.py").write_text(MODULE_A)
    (tmp_path / "fleet_b.py").write_text(MODULE_B)
    _weights(tmp_path / "a.safetensors", seed=1)
    config = _config(tmp_path)
    store_dir = tmp_path / "store"
    proc = subprocess.Popen(
        [str(BIN / "pt2flow"), "run", str(config), "--store", str(store_dir), "--json", "--workers", "1"],  # a, then b
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    store = ArtifactStore(str(store_dir))

    def recorded() -> list[dict[str, Any]]:
        if not (store_dir / "index").exists():
            return []
        return store.index.read(columns=["model", "stage", "status", "key"]).to_pylist()

    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if any(r["model"] == "a" and r["stage"] == "validate" for r in recorded()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    b_done_before = {r["stage"] for r in recorded() if r["model"] == "b" and r["status"] == "ok"}
    assert b_done_before != set(NO_COMPILE) | {"source"}, "model b finished before the kill; nothing to resume"

    document = _run(config, store_dir)
    assert fresh(document, "a") == set()
    assert fresh(document, "b") == set(NO_COMPILE) - b_done_before
    # every ok record of the resumed run points at a blob that verifies, and no key was built twice
    rows = [r for r in recorded() if r["status"] == "ok"]
    built = store.index.read(columns=["key", "cached", "status", "sha256"]).to_pylist()
    fresh_keys = [r["key"] for r in built if r["status"] == "ok" and not r["cached"]]
    assert len(fresh_keys) == len(set(fresh_keys))
    assert rows and all(store.blob_status(r["sha256"]) == "ok" for r in built if r["status"] == "ok")
