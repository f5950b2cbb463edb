"""Cached means correct when a model is built from files the config does not name (issue 29).

Fleet runs (`pt2flow run`'s code path, in this process: run_in_process; the models built in
worker processes of the config's `python:`) of a fleet whose factories read a JSON, a .npy, a
torch.save file, a safetensors file (safetensors' native reader), a transformers checkpoint
folder (undeclared, through `from_pretrained` in the factory, and declared with `checkpoint:`),
and an editable install of the team's own library. After each file changes, the re-run rebuilds
exactly those models and the archive it serves holds the new content (checked by loading it with
torch.export.load, not through pt2flow); without a change, every stage is cached, a `touch`
included. A factory that reads an environment variable is seen by `pt2flow audit` (the eager
digest) and re-exported by a run with --verify-sources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import run_cli, run_in_process

pytestmark = pytest.mark.integration

STAGES = ["trace", "serialize"]

FACTORIES = """\
import json
import os

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


def from_json():
    torch.manual_seed(0)
    width = json.load(open(os.path.join(HERE, "arch.json")))["width"]
    return nn.Linear(4, width, bias=False)


def _linear(weight):
    layer = nn.Linear(4, 3, bias=False)
    layer.weight.data = weight.float()
    return layer


def from_npy():
    return _linear(torch.from_numpy(np.load(os.path.join(HERE, "w.npy"))))


def from_pt():
    return _linear(torch.load(os.path.join(HERE, "w.pt"))["weight"])


def from_safetensors():
    from safetensors.torch import load_file

    return _linear(load_file(os.path.join(HERE, "w.safetensors"))["weight"])


def from_folder():
    from transformers import AutoModel

    return AutoModel.from_pretrained(os.path.join(HERE, "bert")).eval()


def from_environment():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=False)
    layer.weight.data *= float(os.environ.get("PT2FLOW_TEST_SCALE", "1"))
    return layer


def from_library():
    import teamlib

    return _linear(torch.full((3, 4), teamlib.SCALE))
"""

CONFIGURED = """\
import json
import os

import torch
from torch import nn

SETTINGS = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_level.json")))  # read when imported


def from_module_level():
    layer = nn.Linear(4, 3, bias=False)
    layer.weight.data = torch.full((3, 4), float(SETTINGS["scale"]))
    return layer
"""

TEAMLIB = "SCALE = 2.0\n"


def _save_bert(folder: Path, seed: int) -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(folder)


def _write_data(folder: Path, version: int) -> None:
    """Every data file, with content that depends on `version`."""
    from safetensors.torch import save_file

    (folder / "arch.json").write_text(json.dumps({"width": 8 * version}))
    weight = torch.full((3, 4), float(version))
    np.save(folder / "w.npy", weight.numpy())
    torch.save({"weight": weight + 10}, folder / "w.pt")
    save_file({"weight": weight + 20}, str(folder / "w.safetensors"))
    (folder / "module_level.json").write_text(json.dumps({"scale": 30 + version}))
    _save_bert(folder / "bert", seed=version)


def _editable_env(root: Path) -> str:
    """A virtualenv over the runner's site-packages with `teamlib` installed editable (pip -e)."""
    lib = root / "libraries" / "teamlib"
    (lib / "teamlib").mkdir(parents=True)
    (lib / "teamlib" / "__init__.py").write_text(TEAMLIB)
    (lib / "pyproject.toml").write_text(
        '[project]\nname = "teamlib"\nversion = "1.0"\n[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "_runner_site.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(lib),
        ],
        check=True,
        timeout=600,
        cwd=root,
    )
    return str(python)


LINEAR_INPUTS = {"input": {"shape": [2, 4]}}
BERT_INPUTS = {"input_ids": {"shape": [1, 8], "dtype": "int64", "low": 0, "high": 100}}


def _config(folder: Path, python: str) -> Path:
    models = [
        {"name": n, "factory": f"team_models:{f}", "inputs": LINEAR_INPUTS}
        for n, f in [
            ("json", "from_json"),
            ("npy", "from_npy"),
            ("pt", "from_pt"),
            ("safetensors", "from_safetensors"),
            ("environment", "from_environment"),
            ("library", "from_library"),
        ]
    ]
    models.append({"name": "module-level", "factory": "configured:from_module_level", "inputs": LINEAR_INPUTS})
    models.append({"name": "bert-tracked", "factory": "team_models:from_folder", "inputs": BERT_INPUTS})
    models.append(
        {
            "name": "bert-declared",
            "factory": "transformers.models.auto.modeling_auto:AutoModel",
            "checkpoint": "bert",
            "inputs": BERT_INPUTS,
        }
    )
    path = folder / "fleet.yaml"
    path.write_text(
        yaml.safe_dump(
            {"version": 1, "store": "store", "python": python, "stages": STAGES, "models": models}, sort_keys=False
        )
    )
    return path


def _run(config: Path, env: dict[str, str] | None = None, **options: Any) -> dict[str, Any]:
    """`pt2flow run CONFIG --workers 1` in this process (what a re-run rebuilds is under test, not
    the CLI); a run that builds starts fresh workers, which inherit `env`."""
    code, document = run_in_process(config, env=env, workers=1, **options)
    assert code == 0, document
    return {m["name"]: m for m in document["models"]}


def _rebuilt(models: dict[str, Any]) -> set[str]:
    return {name for name, m in models.items() if not m["stages"]["trace"]["cached"]}


def _state(config: Path, model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The archive the run served, loaded with plain torch.export.load."""
    path = (
        config.parent
        / "store"
        / "blobs"
        / "sha256"
        / model["artifacts"]["serialized"][:2]
        / model["artifacts"]["serialized"]
    )
    return torch.export.load(str(path)).state_dict


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model-files")
    (folder / "team_models.py").write_text(FACTORIES)
    (folder / "configured.py").write_text(CONFIGURED)
    _write_data(folder, 1)
    return _config(folder, _editable_env(folder))


def test_every_file_a_build_reads_is_in_its_identity(fleet: Path) -> None:
    folder = fleet.parent
    cold = _run(fleet)
    assert _rebuilt(cold) == set(cold), "a cold run builds everything"
    assert _state(fleet, cold["json"])["weight"].shape == (8, 4)
    source = json.loads(run_cli(["show", cold["json"]["source"], "--config", str(fleet), "--json"]).stdout)
    assert set(source["details"]["manifest"]["deps"]["reads"]) == {"arch.json"}
    source = json.loads(run_cli(["show", cold["module-level"]["source"], "--config", str(fleet), "--json"]).stdout)
    assert set(source["details"]["manifest"]["deps"]["reads"]) == {
        "module_level.json"
    }  # read when its module was imported
    declared = json.loads(run_cli(["show", cold["bert-declared"]["source"], "--config", str(fleet), "--json"]).stdout)
    assert set(declared["details"]["manifest"]["deps"]["declared"]["bert"]) == {
        "bert/config.json",
        "bert/model.safetensors",
    }

    warm = _run(fleet)
    assert _rebuilt(warm) == set(), "nothing changed: every stage is served from the cache"
    assert all(s["cached"] for m in warm.values() for s in m["stages"].values())
    for path in folder.rglob("*"):
        if path.is_file() and "store" not in path.parts:
            os.utime(path)  # a touch changes no content: still fully cached
    assert _rebuilt(_run(fleet)) == set()

    _write_data(folder, 2)
    (folder / "libraries" / "teamlib" / "teamlib" / "__init__.py").write_text(
        "SCALE = 5.0\n"
    )  # edited, version still 1.0
    changed = _run(fleet)
    assert _rebuilt(changed) == set(changed) - {"environment"}
    assert _state(fleet, changed["json"])["weight"].shape == (16, 4)
    for name, offset in [("npy", 0), ("pt", 10), ("safetensors", 20)]:
        assert torch.equal(_state(fleet, changed[name])["weight"], torch.full((3, 4), 2.0 + offset)), name
    assert torch.equal(_state(fleet, changed["module-level"])["weight"], torch.full((3, 4), 32.0))
    assert torch.equal(_state(fleet, changed["library"])["weight"], torch.full((3, 4), 5.0))
    from transformers import AutoModel

    saved = AutoModel.from_pretrained(folder / "bert").state_dict()
    for name in ("bert-tracked", "bert-declared"):
        served = _state(fleet, changed[name])
        key = next(k for k in served if k.endswith("word_embeddings.weight"))
        assert torch.equal(served[key], saved["embeddings.word_embeddings.weight"]), name
    assert _rebuilt(_run(fleet)) == set()

    (folder / "bert" / "extra.json").write_text("{}")  # a new file in a declared folder
    assert _rebuilt(_run(fleet)) == {"bert-declared"}


def test_what_no_tracker_sees_is_caught_by_the_eager_digest(fleet: Path) -> None:
    models = _run(fleet)  # settled (the test above ran first), or built now
    env = {"PT2FLOW_TEST_SCALE": "3"}
    proc = run_cli(["audit", "--config", str(fleet), "--json"], env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = [r for r in json.loads(proc.stdout)["records"] if r["status"] != "ok"]
    assert {r["model"] for r in failed} == {"environment"}, failed
    source = next(r for r in failed if r["stage"] == "source")
    assert "eager model" in source["problem"], source

    plain = _run(fleet, env=env)
    assert _rebuilt(plain) == set(), "without --verify-sources the recorded manifest is trusted"
    verified = _run(fleet, env=env, verify_sources=True)
    assert _rebuilt(verified) == {"environment"}
    assert torch.equal(
        _state(fleet, verified["environment"])["weight"], _state(fleet, models["environment"])["weight"] * 3
    )
    assert _rebuilt(_run(fleet, env=env, verify_sources=True)) == set()
