"""A worker is replaced after PT2FLOW_MODELS_PER_WORKER models (torch keeps objects from every
export for the life of a process, and each model got slower with them: pool.MODELS_PER_WORKER).
The ground truth is the process each model was really built in: its factory writes its pid."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.conftest import run_in_process, write_config

pytestmark = pytest.mark.integration

FACTORY = """
import os

import torch


def logged_mlp(log: str, hidden: int = 8) -> torch.nn.Module:
    with open(log, "a") as out:
        out.write(f"{hidden} {os.getpid()}\\n")
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
"""


def test_a_worker_runs_at_most_models_per_worker_models(tmp_path: Path) -> None:
    (tmp_path / "pid_models.py").write_text(FACTORY)
    log = tmp_path / "pids.log"
    models = [
        {
            "name": f"m{i}",
            "factory": "pid_models:logged_mlp",
            "kwargs": {"log": str(log), "hidden": 4 + i},
            "inputs": {"input": {"shape": [2, 8]}},
        }
        for i in range(5)
    ]
    config = write_config(tmp_path / "fleet.yaml", models, stages=["trace"])
    code, document = run_in_process(
        config, store=str(tmp_path / "store"), workers=1, env={"PT2FLOW_MODELS_PER_WORKER": "2"}
    )
    assert code == 0, document
    built_in: dict[str, set[int]] = collections.defaultdict(set)  # model -> the pids its factory ran in
    for line in log.read_text().splitlines():
        hidden, pid = line.split()
        built_in[f"m{int(hidden) - 4}"].add(int(pid))
    assert sorted(built_in) == [f"m{i}" for i in range(5)]
    assert all(len(pids) == 1 for pids in built_in.values()), built_in  # each model built in one worker
    pid_of = {name: next(iter(pids)) for name, pids in built_in.items()}
    # the run document names the same process for each model
    assert {m["name"]: int(m["worker"].rsplit(":", 1)[1]) for m in document["models"]} == pid_of
    per_worker = collections.Counter(pid_of.values())
    assert max(per_worker.values()) <= 2, per_worker  # no worker ran a third model
    assert len(per_worker) >= 3, per_worker  # five models, two at most each: three workers at least
    # one worker at a time, in config order: a replaced worker never comes back
    order = [pid_of[f"m{i}"] for i in range(5)]
    assert all(order.index(pid) == i or order[i - 1] == pid for i, pid in enumerate(order)), order


def test_a_bad_models_per_worker_is_a_usage_error(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "fleet.yaml", [{"name": "m", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [2, 8]}}}]
    )
    code, document = run_in_process(config, store=str(tmp_path / "store"), env={"PT2FLOW_MODELS_PER_WORKER": "0"})
    assert code == 2
    assert document["error"] == "PT2FLOW_MODELS_PER_WORKER must be a whole number of at least 1, not '0'"
