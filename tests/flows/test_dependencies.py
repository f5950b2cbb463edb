"""A re-run never serves an artifact built from other code: the source key covers the model's
dependency manifest (stages/deps.py), checked on a re-run without importing torch. Fleet runs
(`pt2flow run`'s code path in this process, run_in_process; the models built in worker
processes): an edited helper module re-traces and yields a new, correct artifact. Real CLI runs
(a PYTHONPATH of their own): a changed version of an installed distribution re-traces, and an
identical program still reuses everything after it. Also: the compile key follows the native
toolchain. (Cold and warm runs of the shipped failure fleet reaching the same outcomes:
tests/integration/test_run_cli.py, on the store its cold CLI run built.)"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, run_in_process, run_json

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]

MODELS = """\
import torch
from torch import nn

import layers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return layers.act(self.fc(x))


def build() -> nn.Module:
    return Net()
"""

LAYERS = """\
import torch


def act(x):
    return torch.relu(x)
"""


def _config(folder: Path, factory: str = "my_models:build") -> Path:
    path = folder / "fleet.yaml"
    model = {
        "name": "net",
        "factory": factory,
        "inputs": {"x": {"shape": [3, 8]}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 8}},
    }
    path.write_text(yaml.safe_dump({"version": 1, "stages": STAGES, "models": [model]}, sort_keys=False))
    return path


def _run(config: Path, store: Path) -> dict[str, Any]:
    """The fleet run in this process (what a re-run rebuilds is under test, not the CLI)."""
    code, document = run_in_process(config, store=str(store))
    assert code == 0, document
    return document["models"][0]


def _run_cli(config: Path, store: Path, env: dict[str, str]) -> dict[str, Any]:
    """The real `pt2flow run`, from the config's folder: a process of its own, whose PYTHONPATH
    (in `env`) is the test's to set. The orchestrator reads the installed versions from its own
    sys.path, which a variable set in the test's process does not change."""
    code, document, stderr = run_json(["run", str(config), "--store", str(store)], env=env, cwd=config.parent)
    assert code == 0, stderr[-3000:]
    return document["models"][0]


def _cached(model: dict[str, Any]) -> dict[str, bool]:
    return {stage: info["cached"] for stage, info in model["stages"].items()}


def test_editing_a_helper_module_re_runs_trace_and_builds_a_correct_new_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # run from the project's folder, as a user does: the workers start there
    (tmp_path / "my_models.py").write_text(MODELS)
    (tmp_path / "layers.py").write_text(LAYERS)
    config, store = _config(tmp_path), tmp_path / "store"
    first = _run(config, store)
    assert _cached(_run(config, store)) == dict.fromkeys(STAGES, True)  # unchanged: all cached

    (tmp_path / "layers.py").write_text(LAYERS.replace("torch.relu", "torch.sigmoid"))
    edited = _run(config, store)
    assert _cached(edited) == dict.fromkeys(STAGES, False)
    assert edited["artifacts"]["serialized"] != first["artifacts"]["serialized"]
    assert edited["validation"]["passed"] is True  # the new archive computes what the edited model computes

    from pt2flow.storage import ArtifactStore

    records = ArtifactStore(str(store)).index.read(["sha256", "stage", "op_histogram"]).to_pylist()
    ops = next(
        r["op_histogram"]
        for r in records
        if r["sha256"] == edited["artifacts"]["serialized"] and r["stage"] == "serialize"
    )
    assert "aten.sigmoid.default" in ops and "aten.relu.default" not in ops
    # the source record names the helper module and its content
    source = next(
        r
        for r in ArtifactStore(str(store)).index.read(["sha256", "stage", "details"]).to_pylist()
        if r["sha256"] == edited["source"]
    )
    assert '"layers.py"' in source["details"] and '"torch":' in source["details"]


def _fake_distribution(site: Path, version: str) -> None:
    """What pip leaves after installing (or upgrading to) fakedist `version`."""
    for old in site.glob("fakedist-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"fakedist-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakedist\nVersion: {version}\n")
    (info / "top_level.txt").write_text("fakedist\n")
    package = site / "fakedist"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("import torch\n\n\ndef act(x):\n    return torch.tanh(x)\n")


def test_a_new_version_of_an_installed_distribution_re_runs_trace(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _fake_distribution(site, "1.0")
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_models.py").write_text(MODELS.replace("import layers", "import fakedist as layers"))
    config, store = _config(project), tmp_path / "store"
    env = {"PYTHONPATH": f"{ROOT}:{site}"}
    first = _run_cli(config, store, env)
    assert _cached(_run_cli(config, store, env)) == dict.fromkeys(STAGES, True)

    _fake_distribution(site, "2.0")  # the same code under a new version number
    upgraded = _run_cli(config, store, env)
    assert upgraded["stages"]["trace"]["cached"] is False
    assert upgraded["source"] != first["source"]
    # the re-trace yields the identical program: the program stages after it are reused
    # (fingerprint rule); validate runs again, since its eager reference is the new library's
    assert {s: upgraded["stages"][s]["cached"] for s in STAGES[1:]} == {
        "functionalize": True,
        "decompose": True,
        "serialize": True,
        "validate": False,
    }
    assert upgraded["artifacts"]["serialized"] == first["artifacts"]["serialized"]
    assert upgraded["validation"]["passed"] is True


def test_the_compile_key_follows_the_native_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same program, same options: another C++ compiler (version) or another vector ISA gives
    another aot_compile key, so a package is never reused on a machine it was not built for."""
    from pt2flow.flows.config.load import parse_config
    from pt2flow.flows import pipeline
    from pt2flow.flows.engine.orchestrator.stage_keys import stage_key

    text = "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [3, 8]}}\n"
    model = parse_config(text, source="k.yaml", base_dir=str(ROOT)).models[0]
    from pt2flow.flows.engine.common.documents import Outcome

    inputs = {"program": Outcome(fingerprint="f" * 64, key="k")}
    monkeypatch.setenv("PT2FLOW_CACHE_DIR", str(tmp_path / "cache"))
    key = stage_key(pipeline.get("aot_compile"), model, inputs)
    assert stage_key(pipeline.get("aot_compile"), model, inputs) == key  # stable on one machine

    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed for AOTInductor"
    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo \'g++ (Fake) 99.1.0\'; exit 0; fi\nexec {cxx} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert stage_key(pipeline.get("aot_compile"), model, inputs) != key

    monkeypatch.delenv("CXX")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # inductor then targets no vector ISA
    assert stage_key(pipeline.get("aot_compile"), model, inputs) != key
