"""`pt2flow upgrade-check` against real second environments (tests/environments.py, cached between
test runs): a baseline venv with the tinyops 1.0 fixture distribution, and a candidate venv with
tinyops 2.0 (one op changed, one helper made data-dependent) and transformers 5.24.0 from the
registry (the runner has 5.23.0). Both share the runner's local torch build.

The fleet: tiny BERT and DistilBERT (transformers), a plain model, and two models on tinyops. The baseline
runs under the baseline environment (`run --python`); upgrade-check then runs the fleet under the
candidate, checks the baseline's artifacts in candidate workers, and with --attribute puts each
differing distribution alone into the baseline to find what breaks the failing model."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from tests.conftest import cli_env, cli_in_process, run_cli, run_in_process, run_json, write_config
from tests.environments import CANDIDATE_TRANSFORMERS, overlay_env

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]
IDS = {"shape": [2, 8], "dtype": "int64", "low": 0, "high": 100}
FLEET = [
    {
        "name": "bert",
        "factory": "tests.hf_models:bert_tiny",
        "inputs": {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}},
    },
    {
        "name": "distilbert",
        "factory": "tests.hf_models:distilbert_tiny",
        "inputs": {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}},
    },
    {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}},
    {"name": "scaled", "factory": "tests.upgrade_models:scaled", "inputs": {"x": {"shape": [4, 8]}}},
    {"name": "gated", "factory": "tests.upgrade_models:gated", "inputs": {"x": {"shape": [4, 8]}}},
]


@pytest.fixture(scope="module")
def environments() -> tuple[str, str]:
    baseline = overlay_env("baseline", ["tinyops-1.0"])
    candidate = overlay_env("candidate", ["tinyops-2.0", f"transformers=={CANDIDATE_TRANSFORMERS}"])
    return baseline, candidate


@contextlib.contextmanager
def _this_interpreter_after() -> Iterator[None]:
    """This process's interpreter the active one again afterwards: a fleet run, or a command
    given --python, makes its workers' the active one (flows/engine/environment/interpreter.py)."""
    from pt2flow.flows.engine.environment import interpreter

    try:
        yield
    finally:
        interpreter.activate(None)


def _baseline_run(config: Path, **options: Any) -> tuple[int, dict[str, Any]]:
    """The baseline's `pt2flow run CONFIG` (its workers in the baseline environment), in this
    process: it builds the store upgrade-check reads, and the CLI is not what is under test (the
    upgrade-check runs are the binary). The workers get the variables `pt2flow` would have
    (PYTHONPATH: the repository)."""
    with _this_interpreter_after():
        return run_in_process(config, env={"PYTHONPATH": cli_env()["PYTHONPATH"]}, **options)


def _refused_in_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    """`pt2flow ARGS` as main(ARGS) in this process."""
    with _this_interpreter_after():
        return cli_in_process(args)


def _fingerprints(store: Path, run_id: str) -> dict[str, str | None]:
    code, records, stderr = run_json(["ls", "--store", str(store), "--stage", "decompose", "--json"])
    assert code == 0, stderr[-2000:]
    return {r["model"]: r["fingerprint"] for r in records if r["run_id"] == run_id}


def test_upgrade_check_names_versions_changes_failures_and_their_cause(
    tmp_path: Path, environments: tuple[str, str]
) -> None:
    baseline_python, candidate_python = environments
    store = tmp_path / "store"
    config = write_config(tmp_path / "fleet.yaml", FLEET, stages=STAGES, store=str(store))

    code, baseline = _baseline_run(config, python=baseline_python)
    assert code == 0, baseline
    assert [m["status"] for m in baseline["models"]] == ["ok"] * 5 and baseline["python"] == baseline_python

    repro_dir = tmp_path / "repro"
    code, report, stderr = run_json(
        [
            "upgrade-check",
            str(config),
            "--python",
            candidate_python,
            "--baseline-python",
            baseline_python,
            "--attribute",
            "--repro-dir",
            str(repro_dir),
            "--json",
        ],
        cwd=tmp_path,
    )
    assert code == 1, stderr[-4000:]  # gated regresses
    assert "Traceback" not in stderr
    assert report["baseline"]["run_id"] == baseline["run_id"]
    assert report["candidate"]["python"] == candidate_python and report["baseline"]["python"] == baseline_python

    # the versions that differ, with the models whose code imports them
    versions = {v["name"]: (v["baseline"], v["candidate"], v["used_by"]) for v in report["versions"]}
    assert versions == {
        "tinyops": ("1.0", "2.0", ["gated", "scaled"]),
        "transformers": ("5.23.0", CANDIDATE_TRANSFORMERS, ["bert", "distilbert"]),
    }

    by_name = {m["model"]: m for m in report["models"]}
    # plain models: the candidate cannot change them, so the cache served them and they are unchanged
    assert by_name["mlp"]["verdict"] == "unchanged" and by_name["mlp"]["regressions"] == []
    mlp_drift = next(m for m in report["drift"]["models"] if m["model"] == "mlp")
    assert mlp_drift["status"]["b"]["cached"] is True
    # the transformers models ran again under 5.24.0 (their keys name the version): each verdict follows its program
    prints_a, prints_b = _fingerprints(store, baseline["run_id"]), _fingerprints(store, report["candidate"]["run_id"])
    for name in ("bert", "distilbert"):
        drift = next(m for m in report["drift"]["models"] if m["model"] == name)
        assert drift["status"]["b"]["cached"] is False and "trace" in drift["keys_changed"]
        assert by_name[name]["program_changed"] == (prints_a[name] != prints_b[name])
        assert by_name[name]["verdict"] == ("changed" if prints_a[name] != prints_b[name] else "unchanged")
    # scaled: same numbers, another op
    scaled = by_name["scaled"]
    assert scaled["verdict"] == "changed" and scaled["program_changed"] is True
    assert scaled["op_histogram"]["added"] == {"aten.add.Tensor": 1} and scaled["op_histogram"]["removed"] == {
        "aten.mul.Tensor": 1
    }
    assert prints_a["scaled"] != prints_b["scaled"]
    # gated: newly failing, with a repro the candidate's pt2flow wrote, caused by tinyops alone
    gated = by_name["gated"]
    assert gated["verdict"] == "newly_failing"
    assert (gated["failure"]["stage"], gated["failure"]["error_class"]) == ("trace", "data_dependent")
    assert gated["repro"] == str(repro_dir / "gated") and (repro_dir / "gated" / "repro.py").is_file()
    assert gated["attribution"]["distributions"] == ["tinyops"]
    assert set(gated["attribution"]["tried"]) == {"tinyops"}  # transformers is not a suspect: gated does not import it
    assert report["summary"]["newly_failing"] == 1 and report["regressed"] is True
    assert set(report["attribution_runs"]) == {"tinyops"}

    # check-compat of the baseline's artifacts ran in candidate workers, and they all still load and match
    compat = report["compat"]
    assert compat["python"] == candidate_python and compat["run_id"] == baseline["run_id"]
    assert {m["name"]: m["status"] for m in compat["models"]} == {
        name: "ok" for name in ("bert", "distilbert", "mlp", "scaled", "gated")
    }

    # the repro script reproduces the failure under the candidate, and passes under the baseline
    script = repro_dir / "gated" / "repro.py"
    env = cli_env()
    under_candidate = subprocess.run(
        [candidate_python, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=script.parent
    )
    under_baseline = subprocess.run(
        [baseline_python, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=script.parent
    )
    assert under_candidate.returncode != 0 and "data-dependent" in under_candidate.stdout + under_candidate.stderr
    assert under_baseline.returncode == 0, under_baseline.stderr[-2000:]

    # again, as text: the default baseline is still the baseline's run (the candidate's run covered
    # every model too, but with the candidate's versions); versions first
    code = run_cli(
        [
            "upgrade-check",
            str(config),
            "--python",
            candidate_python,
            "--baseline-python",
            baseline_python,
            "--repro-dir",
            str(repro_dir / "again"),
        ],
        cwd=tmp_path,
    )
    assert code.returncode == 1, code.stderr[-3000:]
    text = code.stdout
    assert f"baseline run {baseline['run_id']} vs" in text
    assert text.index("tinyops 1.0 → 2.0") < text.index("gated: newly failing")
    assert (
        f"transformers 5.23.0 → {CANDIDATE_TRANSFORMERS}" in text
        and "unchanged: " in text
        and "mlp" in text.split("unchanged: ")[1]
    )


def test_a_change_no_model_imports_passes_and_an_environment_without_pt2flow_is_refused(
    tmp_path: Path, environments: tuple[str, str]
) -> None:
    baseline_python, _ = environments
    store = tmp_path / "store"
    fleet = [m for m in FLEET if m["name"] in ("mlp", "scaled")]
    # the config names its workers' environment, relative to its own folder (this one has no tinyops)
    config = write_config(
        tmp_path / "fleet.yaml",
        fleet,
        stages=STAGES,
        store=str(store),
        python=os.path.relpath(baseline_python, tmp_path),
    )
    with contextlib.chdir("/"):  # not the config's folder
        code, baseline = _baseline_run(config)
    assert code == 0, baseline
    assert [m["status"] for m in baseline["models"]] == ["ok", "ok"]

    # the candidate as requirements over the baseline (pip from the registry, into a cached overlay):
    # transformers changes, but neither model imports it, so nothing the fleet depends on differs
    code, report, stderr = run_json(
        [
            "upgrade-check",
            str(config),
            "--with",
            f"transformers=={CANDIDATE_TRANSFORMERS}",
            "--baseline-python",
            baseline_python,
            "--json",
        ]
    )
    assert code == 0, stderr[-3000:]
    assert report["baseline"]["run_id"] == baseline["run_id"] and report["candidate"]["python"] != baseline_python
    assert report["versions"] == [] and report["regressed"] is False
    assert [(v["name"], v["baseline"], v["candidate"]) for v in report["other_version_changes"]] == [
        ("transformers", "5.23.0", CANDIDATE_TRANSFORMERS)
    ]
    assert [m["verdict"] for m in report["models"]] == ["unchanged", "unchanged"]
    assert report["summary"]["unchanged"] == 2

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    # refused before anything runs: `main(ARGS)` in this process (cli_in_process: the binary's exit code and stderr)
    for args in (["run", str(config), "--python", str(bare)], ["upgrade-check", str(config), "--python", str(bare)]):
        proc = _refused_in_process(args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "pt2flow is not importable" in proc.stderr and "install it into that environment" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert json.loads(run_cli(["ls", "--store", str(store), "--json"]).stdout)  # nothing stored was harmed
