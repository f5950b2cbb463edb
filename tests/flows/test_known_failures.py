"""Known failures are cached like successes: an unchanged model that failed for a reason its
key fully determines is reported again from the index (same stage, class and message, every
stage `cached`), without a worker; `--retry-failed` runs it again; a failure whose cause lies
outside the key (a crashed worker) is always retried. Real CLI runs on real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_in_process, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]
X = {"x": {"shape": [2, 8]}}
FLEET = [
    {"name": "healthy", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}},
    {
        "name": "branchy",
        "factory": "tests.models:data_dependent",
        "inputs": {"x": {"shape": [4]}},
    },  # data_dependent at trace
    {
        "name": "object-out",
        "factory": "tests.models:python_object_out",
        "inputs": {"x": {"shape": [2, 4]}},
    },  # pytree at trace
    {
        "name": "noisy",
        "factory": "tests.models:noisy",
        "inputs": {"x": {"shape": [2, 8]}},
        "stages": {"validate": {"samples": 2}},
    },  # nondeterministic
    {
        "name": "segfault",
        "factory": "tests.hostile_models:segfault",
        "inputs": {"x": {"shape": [3, 8]}},
    },  # crash: not cached
]
EXPECTED = {
    "branchy": ("trace", "data_dependent"),
    "object-out": ("trace", "pytree"),
    "noisy": ("validate", "nondeterministic"),
    "segfault": ("trace", "crash"),
}


def _outcomes(document: dict[str, Any]) -> dict[str, tuple[str, str | None, str | None]]:
    return {m["name"]: (m["status"], m["failed_stage"], m["error_class"]) for m in document["models"]}


def test_deterministic_failures_are_reported_from_the_index_and_retried_on_request(tmp_path: Path) -> None:
    config = write_config(tmp_path / "fleet.yaml", FLEET, stages=STAGES)
    store = str(tmp_path / "store")
    code, cold = run_in_process(config, store=store, workers=1)  # the fleet run in this process
    assert code == 1, cold
    assert _outcomes(cold) == {"healthy": ("ok", None, None), **{n: ("failed", s, c) for n, (s, c) in EXPECTED.items()}}

    # unchanged, without the crashing model: nothing to build, not even a worker
    deterministic = [m["name"] for m in FLEET if m["name"] != "segfault"]
    code, warm = run_in_process(config, store=store, only=deterministic)
    assert code == 1, warm
    assert warm["workers"] == 0, "a worker was started for a fleet with nothing to build"
    assert _outcomes(warm) == {n: o for n, o in _outcomes(cold).items() if n in deterministic}
    cold_by_name = {m["name"]: m for m in cold["models"]}
    for model in warm["models"]:
        assert all(stage["cached"] for stage in model["stages"].values()), model
        assert model["error"] == cold_by_name[model["name"]]["error"]  # the original message
        assert list(model["stages"]) == list(cold_by_name[model["name"]]["stages"])

    # a crash is no property of the key: it is retried every run, and crashes again
    code, again = run_in_process(config, store=store, only=["segfault", "branchy"])
    assert code == 1, again
    by_name = {m["name"]: m for m in again["models"]}
    assert by_name["segfault"]["stages"]["trace"]["cached"] is False
    assert by_name["segfault"]["error_class"] == "crash"
    assert by_name["branchy"]["stages"]["trace"]["cached"] is True

    # --retry-failed runs the known failures again (and they fail the same way)
    code, retried = run_in_process(config, store=store, retry_failed=True, only=deterministic)
    assert code == 1, retried
    assert _outcomes(retried) == _outcomes(warm)
    for model in retried["models"]:
        if model["status"] == "failed":
            assert model["stages"][model["failed_stage"]]["cached"] is False, model
        else:
            assert all(stage["cached"] for stage in model["stages"].values())
