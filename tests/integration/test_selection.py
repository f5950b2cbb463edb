"""Selection that follows the config (issue 31): what a store-reading command read, the exact
`failures` command a run's summary prints (it reads the run's store), `failures` after an
`--only` run (only the models both runs covered are compared), `upgrade-check --only` counting
only the models it checked, and `ls --model` naming the models a store has. Real runs of a
config whose store is beside it: the first by the CLI from another folder (its terminal summary
is under test), the `--only` runs in the test's process (run_in_process, `pt2flow run`'s code
path); the commands that read the store run from another folder."""

from __future__ import annotations

import re
import shlex
import sys
from typing import Any

import pytest

from tests.conftest import run_cli, run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

X4 = {"x": {"shape": [2, 4]}}
FLEET = [
    {"name": "gated", "factory": "tests.failure_models:gated_small", "inputs": X4},  # data_dependent at trace
    {"name": "opaque", "factory": "tests.failure_models:opaque_small", "inputs": X4},  # unsupported_op at trace
    {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}},
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A config whose store (`store:`, relative) is beside it, in a folder that is not the
    current one; its first run, in full, on the terminal."""
    root = tmp_path_factory.mktemp("selection")
    folder = root / "project"
    config = write_config(folder / "fleet.yaml", FLEET, stages=["trace"], store="store")
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli(["run", str(config)], cwd=elsewhere, env={"COLUMNS": "240"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    run_id = re.search(r"pt2flow run (\S+)", proc.stdout).group(1)
    return {
        "root": root,
        "config": config,
        "store": folder / "store",
        "elsewhere": elsewhere,
        "run1": run_id,
        "summary": proc.stdout,
    }


def test_the_run_summary_prints_the_failures_command_of_its_store(fleet: dict[str, Any]) -> None:
    expected = f"pt2flow failures {fleet['run1']} --config {shlex.quote(str(fleet['config']))}"
    assert f"(in full: {expected}):" in fleet["summary"], fleet["summary"]
    # the printed command, run as printed from where the run was started, reads the run's store
    proc = run_cli(shlex.split(expected)[1:], cwd=fleet["elsewhere"], env={"COLUMNS": "240"})
    assert proc.returncode == 0, proc.stderr
    assert f"failures of run {fleet['run1']} in {fleet['store']}" in proc.stdout
    assert "2 failed model(s) in 2 group(s): 2 new, 0 persisting, 0 gone" in proc.stdout, proc.stdout
    # ground truth from the index itself: the models with a failed record in that run
    code, records, _ = run_json(["ls", "--store", str(fleet["store"]), "--run", fleet["run1"], "--status", "failed"])
    assert code == 0 and sorted({r["model"] for r in records}) == ["gated", "opaque"]
    # a run given --store elsewhere prints --store (the config's store is not the one it wrote)
    from pt2flow.flows.cli.summary import failures_command

    assert (
        failures_command({"run_id": "R", "store": "/s 1"}, "fleet.yaml", "/s 1") == "pt2flow failures R --store '/s 1'"
    )


def test_failures_after_an_only_run_compares_only_the_models_both_runs_covered(fleet: dict[str, Any]) -> None:
    config, store = fleet["config"], fleet["store"]
    code, doc = run_in_process(config, only=["mlp"])  # what the run covers is under test, not the CLI
    assert code == 0, doc
    code, report, stderr = run_json(["failures", "--config", str(config)], cwd=fleet["elsewhere"])
    assert code == 0, stderr
    assert report["run_id"] == doc["run_id"] and report["against"] == fleet["run1"] and report["store"] == str(store)
    # gated and opaque were not run, so not fixed: no "gone" group for them (there were 2 before issue 31)
    assert report["summary"] == {"failures": 0, "groups": 0, "new": 0, "persisting": 0, "gone": 0, "fixed_models": 0}
    assert report["groups"] == [] and "2 models of" in report["selection"] and "not compared" in report["selection"]
    proc = run_cli(["failures", "--config", str(config)], cwd=fleet["elsewhere"])
    assert f"failures of run {doc['run_id']} in {store}" in proc.stdout and "0 failed model(s)" in proc.stdout
    # named runs too: the models the newer run did not cover are named as not compared
    code, named, _ = run_json(["failures", doc["run_id"], "--against", fleet["run1"], "--store", str(store)])
    assert code == 0 and named["summary"]["gone"] == 0
    assert (
        named["selection"]
        == f"named by the caller; 2 model(s) of {fleet['run1']} that {doc['run_id']} did not cover are not compared"
    )
    # a model both runs covered that now passes is still a gone group: gated fixed, opaque not run
    fixed = write_config(
        config.parent / "fixed.yaml",
        [{**FLEET[0], "kwargs": {"safe": True}}, *FLEET[1:]],
        stages=["trace"],
        store="store",
    )
    code, doc3 = run_in_process(fixed, only=["gated", "mlp"])
    assert code == 0, doc3
    code, report, _ = run_json(["failures", "--config", str(fixed), "--against", fleet["run1"]], cwd=fleet["elsewhere"])
    assert code == 0 and [(g["status"], g["error_class"], g["models_against"]) for g in report["groups"]] == [
        ("gone", "data_dependent", ["gated"])
    ]
    assert report["summary"]["fixed_models"] == 1


def test_a_command_that_finds_nothing_names_the_store_it_read(fleet: dict[str, Any]) -> None:
    empty = fleet["root"] / "empty-store"
    empty.mkdir()
    proc = run_cli(["report", "--store", str(empty)], cwd=fleet["elsewhere"])
    assert proc.returncode == 1 and proc.stderr.strip().endswith(f"(store {empty})"), proc.stderr
    proc = run_cli(["failures", "--store", str(empty)], cwd=fleet["elsewhere"])
    assert proc.returncode == 1 and str(empty) in proc.stderr and "Traceback" not in proc.stderr


def test_ls_of_an_unknown_model_names_the_models_there(fleet: dict[str, Any]) -> None:
    proc = run_cli(["ls", "--config", str(fleet["config"]), "--model", "mlpp"], cwd=fleet["elsewhere"])
    assert proc.returncode == 0 and f"0 record(s) in {fleet['store']}" in proc.stdout
    assert (
        proc.stderr.strip()
        == f"no model named 'mlpp' in {fleet['store']} (did you mean 'mlp'?); its models: mlp, gated, opaque"
    ), proc.stderr
    code, rows, stderr = run_json(["ls", "--config", str(fleet["config"]), "--model", "nosuch"], cwd=fleet["elsewhere"])
    assert (
        code == 0
        and rows == []
        and stderr.strip() == f"no model named 'nosuch' in {fleet['store']}; its models: gated, mlp, opaque"
    )
    # a model that is there, filtered to nothing by another option: no hint
    proc = run_cli(
        ["ls", "--config", str(fleet["config"]), "--model", "mlp", "--status", "failed"], cwd=fleet["elsewhere"]
    )
    assert proc.returncode == 0 and proc.stderr == ""


def test_upgrade_check_only_counts_the_models_it_checked(fleet: dict[str, Any]) -> None:
    """The candidate is this very environment (its pt2flow and torch): every model unchanged, so
    the counts are the selection's alone. Before issue 31, the baseline's third model was
    counted too ("3 models", 1 "only in baseline")."""
    code, report, stderr = run_json(
        ["upgrade-check", str(fleet["config"]), "--python", sys.executable, "--only", "mlp,opaque"],
        cwd=fleet["elsewhere"],
        timeout=600,
    )
    assert code == 0, stderr[-3000:]
    assert report["baseline"]["run_id"] == fleet["run1"]  # the newest run that covered both
    assert sorted(m["model"] for m in report["models"]) == ["mlp", "opaque"]
    summary = report["summary"]
    assert summary["models"] == 2 and summary["only_in_baseline"] == 0 and summary["only_in_candidate"] == 0, summary
    assert summary["unchanged"] + summary["still_failing"] == 2 and summary["still_failing"] == 1
    assert report["drift"]["selection"]["not_compared"] == ["gated"]
