"""How many worker processes a run starts when --workers is not given
(flows/engine/orchestrator/pool.py default_workers): PT2FLOW_WORKERS where it is set, else
one per core and per 3 GiB of free memory; never more than one per model with work. A bad value is
a usage error, naming the variable, before anything runs (flows/api/running.py load_for_run), and
--workers given outright does not read it."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from pt2flow.flows.api.running import load_for_run
from pt2flow.flows.engine.orchestrator.pool import default_workers
from pt2flow.flows.options import UsageError
from tests.conftest import write_config

VARIABLE = "PT2FLOW_WORKERS"


def test_the_variable_is_the_default_and_a_smaller_fleet_caps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, "3")
    assert [default_workers(models) for models in (1, 2, 3, 7)] == [1, 2, 3, 3]
    monkeypatch.setenv(VARIABLE, " 2 ")
    assert default_workers(7) == 2


def test_without_the_variable_it_is_one_per_core_and_per_3_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    cores = len(os.sched_getaffinity(0))
    memory = psutil.virtual_memory().available // (3 * 2**30)
    assert default_workers(64) == max(1, min(64, cores, memory))
    assert default_workers(1) == 1
    monkeypatch.setenv(VARIABLE, "")  # set but empty: as unset
    assert default_workers(64) == max(1, min(64, cores, memory))


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "+2"])
def test_a_bad_value_is_a_usage_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    config = write_config(
        tmp_path / "c.yaml", [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}]
    )
    monkeypatch.setenv(VARIABLE, value)
    message = f"{VARIABLE} must be a whole number of at least 1 (the default for --workers), not {value!r}"
    with pytest.raises(ValueError) as raised:
        default_workers(2)
    assert str(raised.value) == message
    with pytest.raises(UsageError) as refused:
        load_for_run(str(config))
    assert str(refused.value) == message
    assert [m.name for m in load_for_run(str(config), workers=2).models] == ["mlp"]  # --workers given: not read
