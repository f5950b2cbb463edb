"""A stage from outside the package (tests/plugin_stage.py), registered through the entry point
group `pt2flow.stages` as an installed distribution would, runs, caches, records, lists, shows
in lineage, is got, reported and reproduced, with no pt2flow file touched.

The distribution is real metadata on disk: a `*.dist-info` folder with an entry_points.txt on
PYTHONPATH, which importlib.metadata finds in the CLI process and in its worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate", "opcount"]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    info = site / "pt2flow_opcount-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pt2flow-opcount\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pt2flow.stages]\nopcount = tests.plugin_stage:STAGE\n")
    return {"PYTHONPATH": f"{site}:{ROOT}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, plugin_env: dict[str, str]) -> dict[str, object]:
    """Two models: one whose program passes the check, one that calls a forbidden operator;
    run cold, then warm."""
    folder = tmp_path_factory.mktemp("plugin")
    models = [
        {"name": "plain", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}},
        {
            "name": "forbidden",
            "factory": "tests.models:tiny_mlp",
            "kwargs": {"hidden": 12},
            "inputs": {"x": {"shape": [3, 8]}},
            "stages": {"opcount": {"forbid": ["aten.relu.default"]}},
        },
    ]
    config = write_config(folder / "plugin.yaml", models, stages=STAGES, defaults={"validate": {"samples": 1}})
    store = str(folder / "store")
    cold = run_cli(["run", str(config), "--store", store, "--json"], env=plugin_env)
    warm = run_cli(["run", str(config), "--store", store, "--json"], env=plugin_env)
    return {"cold": cold, "warm": warm, "store": store, "folder": folder}


def test_the_plugin_stage_runs_and_is_cached_like_a_built_in(fleet: dict[str, object]) -> None:
    cold, warm = fleet["cold"], fleet["warm"]
    assert cold.returncode == 1, cold.stderr[-3000:]  # `forbidden` fails at opcount, the rest runs
    models = {m["name"]: m for m in json.loads(cold.stdout)["models"]}
    assert list(models["plain"]["stages"]) == STAGES
    assert models["plain"]["status"] == "ok" and not models["plain"]["stages"]["opcount"]["cached"]
    assert models["forbidden"]["failed_stage"] == "opcount"
    assert models["forbidden"]["error_class"] == "unsupported_op"
    assert "aten.relu.default" in models["forbidden"]["error"]
    # warm: nothing runs again, the failure (a deterministic class) included
    again = {m["name"]: m for m in json.loads(warm.stdout)["models"]}
    assert all(s["cached"] for m in again.values() for s in m["stages"].values())
    assert again["plain"]["stages"]["opcount"]["artifact"] == models["plain"]["stages"]["opcount"]["artifact"]
    assert again["forbidden"]["error"] == models["forbidden"]["error"]


def test_the_plugin_stage_is_listed_in_lineage_and_got(
    fleet: dict[str, object], plugin_env: dict[str, str], tmp_path: Path
) -> None:
    store = str(fleet["store"])
    rows = json.loads(run_cli(["ls", "--store", store, "--stage", "opcount", "--json"], env=plugin_env).stdout)
    assert sorted((r["model"], r["status"]) for r in rows) == [
        ("forbidden", "failed"),
        ("forbidden", "failed"),
        ("plain", "ok"),
        ("plain", "ok"),
    ]
    digest = next(r["sha256"] for r in rows if r["status"] == "ok")
    lineage = json.loads(run_cli(["lineage", digest, "--store", store, "--json"], env=plugin_env).stdout)
    # the counts descend from decompose's program, which descends from trace's and the source
    assert [a["stage"] for a in lineage["ancestors"]] == ["source", "trace", "functionalize", "decompose"]
    program = lineage["ancestors"][-1]["sha256"]
    below = json.loads(
        run_cli(["lineage", program, "--store", store, "--descendants", "--json"], env=plugin_env).stdout
    )
    assert [(d["stage"], d["sha256"]) for d in below["descendants"] if d["stage"] == "opcount"] == [("opcount", digest)]
    out = tmp_path / "ops.json"
    got = run_cli(
        ["get", "--model", "plain", "--artifact", "opcount", "-o", str(out), "--store", store, "--json"], env=plugin_env
    )
    assert got.returncode == 0, got.stderr
    counts = json.loads(out.read_text())
    assert counts["aten.relu.default"] == 1 and counts["aten.addmm.default"] == 2  # core ATen: linear is addmm


def test_the_plugin_failure_reproduces_in_a_fresh_process(
    fleet: dict[str, object], plugin_env: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "repro"
    made = run_cli(["repro", "forbidden", "-o", str(folder), "--store", str(fleet["store"]), "--json"], env=plugin_env)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["stage"] == "opcount"
    ran = subprocess.run(
        [sys.executable, str(folder / "repro.py")], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert ran.returncode != 0
    assert "RuntimeError: forbidden operators in the program: aten.relu.default" in ran.stderr


def test_without_the_plugin_a_config_naming_its_stage_is_a_config_error(fleet: dict[str, object]) -> None:
    result = run_cli(["validate", str(Path(str(fleet["folder"])) / "plugin.yaml")])
    assert result.returncode == 2
    assert "unknown stage(s) ['opcount']" in result.stderr
    assert "Traceback" not in result.stderr
