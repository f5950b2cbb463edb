"""A cache that can never hand one model another model's program (issue 19), as real runs.

Models that share their factory, code and weights but not their inputs: one nn.Linear at static
shapes [2, 8], [3, 8] and [5, 4, 8], one nn.Embedding fed int64 and int32 ids. Each must get an
archive of its own that takes exactly its configured inputs, with validate off and on, in one
run and across runs, with one and two workers. Before the program fingerprint covered the
placeholders' tensor metadata, every one of them was served the first model's program.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pt2flow.storage import ArtifactStore
from tests.conftest import run_in_process, write_config

pytestmark = pytest.mark.integration

PROGRAM_STAGES = ["trace", "functionalize", "decompose", "serialize"]
IDS = {"low": 0, "high": 16}
FLEET = [
    {"name": "lin-2x8", "factory": "tests.models:plain", "inputs": {"input": {"shape": [2, 8]}}},
    {"name": "lin-3x8", "factory": "tests.models:plain", "inputs": {"input": {"shape": [3, 8]}}},
    {"name": "lin-5x4x8", "factory": "tests.models:plain", "inputs": {"input": {"shape": [5, 4, 8]}}},
    {
        "name": "emb-i64",
        "factory": "tests.models:embedding",
        "inputs": {"input": {"shape": [2, 3], "dtype": "int64", **IDS}},
    },
    {
        "name": "emb-i32",
        "factory": "tests.models:embedding",
        "inputs": {"input": {"shape": [2, 3], "dtype": "int32", **IDS}},
    },
]
TAKES = {
    "lin-2x8": ([2, 8], torch.float32),
    "lin-3x8": ([3, 8], torch.float32),
    "lin-5x4x8": ([5, 4, 8], torch.float32),
    "emb-i64": ([2, 3], torch.int64),
    "emb-i32": ([2, 3], torch.int32),
}


def _archive_inputs(store: Path, digest: str) -> tuple[list[int], torch.dtype]:
    """What the stored archive's program takes: its one user input's shape and dtype."""
    from pt2flow.stages.serialize import load_archive

    program, _ = load_archive(ArtifactStore(str(store)).get_blob(digest))
    spec = next(s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT")
    val = next(n for n in program.graph.nodes if n.name == spec.arg.name).meta["val"]
    return [int(d) for d in val.shape], val.dtype


def _check(document: dict[str, Any], store: Path, *, validated: bool) -> None:
    by_name = {m["name"]: m for m in document["models"]}
    archives = {}
    for name, (shape, dtype) in TAKES.items():
        if name not in by_name:
            continue
        model = by_name[name]
        assert model["status"] == "ok", (name, model["error_class"], model["error"])
        archives[name] = model["artifacts"]["serialized"]
        assert _archive_inputs(store, archives[name]) == (shape, dtype), name
        if validated:
            assert model["validation"]["passed"] is True, name
    assert len(set(archives.values())) == len(archives), archives  # no two models share a program


def _run(config: Path, store: Path, **options: Any) -> dict[str, Any]:
    """The fleet run in this process (pt2flow.flows.api's run: what the cache serves is under test)."""
    code, document = run_in_process(config, store=str(store), **options)
    assert code == 0, document
    return document


@pytest.mark.parametrize(
    ("stages", "workers"),
    [(PROGRAM_STAGES, 1), ([*PROGRAM_STAGES, "validate"], 2)],
    ids=["no-validate-1-worker", "validate-2-workers"],
)
def test_models_that_differ_only_in_inputs_get_programs_of_their_own(
    tmp_path: Path, stages: list[str], workers: int
) -> None:
    config = write_config(tmp_path / "fleet.yaml", FLEET, stages=stages)
    store = tmp_path / "store"
    validated = "validate" in stages
    # across runs: two models first, then the whole fleet, whose other models must not be
    # served the first ones' records
    first = _run(config, store, only=["lin-2x8", "emb-i64"], workers=workers)
    _check(first, store, validated=validated)
    second = _run(config, store, workers=workers)
    _check(second, store, validated=validated)
    cached = {m["name"]: all(s["cached"] for s in m["stages"].values()) for m in second["models"]}
    assert cached == {"lin-2x8": True, "emb-i64": True, "lin-3x8": False, "lin-5x4x8": False, "emb-i32": False}
    # warm: nothing to do, the same artifacts
    third = _run(config, store, workers=workers)
    assert all(s["cached"] for m in third["models"] for s in m["stages"].values())
    assert {m["name"]: m["artifacts"] for m in third["models"]} == {m["name"]: m["artifacts"] for m in second["models"]}


def test_one_cold_run_of_the_whole_fleet_with_validation(tmp_path: Path) -> None:
    config = write_config(tmp_path / "fleet.yaml", FLEET, stages=[*PROGRAM_STAGES, "validate"])
    store = tmp_path / "store"
    _check(_run(config, store, workers=1), store, validated=True)
