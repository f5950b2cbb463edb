"""One config, one store (issue 23, items 2 and 5).

A config in `sub/` names its store, factory module and weights by relative paths: run by the real
CLI from the parent folder and from inside `sub/` (the current folder is what these runs are
about), it writes one store beside it (the second run is fully cached), and a query command with
`--config` finds that store from anywhere. Then a run with `--only a` (in the test's process:
run_in_process, `pt2flow run`'s code path) makes a partial run: `report` pairs it with the full
run that covered `a` and compares `a` only, `check-compat` checks the whole fleet, `b` from the
full run, and both say so."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import run_cli, run_in_process, run_json

pytestmark = pytest.mark.integration

OWN_MODELS = """\
import torch
from torch import nn


class Small(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.lin = nn.Linear(n, 2)

    def forward(self, x):
        return self.lin(x).relu()


def small(n=4):
    return Small(n)
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import torch
    from safetensors.torch import save_file

    parent = tmp_path_factory.mktemp("project")
    sub = parent / "sub"
    (sub / "checkpoints").mkdir(parents=True)
    (sub / "own_models.py").write_text(OWN_MODELS)
    torch.manual_seed(3)
    save_file({"lin.weight": torch.randn(2, 4), "lin.bias": torch.randn(2)}, str(sub / "checkpoints" / "a.safetensors"))
    (sub / "own.yaml").write_text(
        textwrap.dedent("""\
        version: 1
        store: ./own-store
        stages: [trace, functionalize, decompose, serialize, validate]
        models:
          - name: a
            factory: own_models:small
            weights: checkpoints/a.safetensors
            inputs: {x: {shape: [2, 4], dtype: float32}}
          - name: b
            factory: own_models:small
            kwargs: {n: 6}
            inputs: {x: {shape: [2, 6], dtype: float32}}
        """)
    )
    elsewhere = parent / "elsewhere"
    elsewhere.mkdir()
    docs = {}
    for name, args, cwd in (
        ("from_parent", ["run", "sub/own.yaml"], parent),
        ("from_sub", ["run", "own.yaml"], sub),
    ):
        code, doc, stderr = run_json(args, cwd=cwd)
        assert code == 0, stderr[-3000:]
        docs[name] = doc
    # the partial run: what it selects and records is under test, not the folder it starts in
    code, docs["only_a"] = run_in_process(sub / "own.yaml", only=["a"])
    assert code == 0, docs["only_a"]
    return {"parent": parent, "sub": sub, "elsewhere": elsewhere, "config": sub / "own.yaml", **docs}


def artifacts(doc: dict) -> dict[str, dict]:
    return {m["name"]: m["artifacts"] for m in doc["models"]}


def test_runs_from_two_folders_write_one_store_and_the_second_is_cached(fleet: dict) -> None:
    store = fleet["sub"] / "own-store"
    first, second = fleet["from_parent"], fleet["from_sub"]
    assert first["store"] == second["store"] == str(store) and (store / "index").is_dir()
    assert not (fleet["parent"] / "own-store").exists() and not (fleet["parent"] / "pt2-store").exists()
    assert not any(s["cached"] for m in first["models"] for s in m["stages"].values())
    assert all(s["cached"] for m in second["models"] for s in m["stages"].values())
    assert artifacts(first) == artifacts(second) and second["workers"] == 0


def test_a_query_with_config_finds_the_store_from_anywhere(fleet: dict) -> None:
    config = os.path.relpath(fleet["config"], fleet["elsewhere"])
    code, rows, stderr = run_json(
        ["ls", "--config", config, "--stage", "serialize", "--limit", "0"], cwd=fleet["elsewhere"]
    )
    assert code == 0, stderr
    runs = {fleet[k]["run_id"] for k in ("from_parent", "from_sub", "only_a")}
    assert {r["run_id"] for r in rows} == runs and {r["model"] for r in rows} == {"a", "b"}
    assert {r["sha256"] for r in rows if r["model"] == "a"} == {
        fleet["from_parent"]["models"][0]["artifacts"]["serialized"]
    }


def test_report_after_a_partial_run_compares_its_models_with_the_last_full_run(fleet: dict) -> None:
    code, doc, stderr = run_json(["report", "--config", str(fleet["config"])], cwd=fleet["elsewhere"])
    assert code == 0, stderr
    full, partial = fleet["from_sub"]["run_id"], fleet["only_a"]["run_id"]
    assert (doc["runs"]["a"]["run_id"], doc["runs"]["b"]["run_id"]) == (full, partial)
    assert (
        [m["model"] for m in doc["models"]] == ["a"]
        and doc["only_in_a"] == []
        and doc["models"][0]["presence"] == "both"
    )
    assert doc["selection"]["rule"] == "newest" and doc["selection"]["not_compared"] == ["b"]
    assert doc["selection"]["reason"] == (
        f"{partial} is the newest run (1 model); {full} is the newest earlier run that covered all of them; "
        f"1 model of {full} that {partial} did not cover is not compared"
    )
    text = " ".join(run_cli(["report", "--config", str(fleet["config"])], cwd=fleet["elsewhere"]).stdout.split())
    assert f"runs: {partial} is the newest run (1 model); {full} is the newest earlier run" in text


def test_check_compat_after_a_partial_run_checks_the_whole_fleet(fleet: dict) -> None:
    code, doc, stderr = run_json(["check-compat", "--config", str(fleet["config"])], cwd=fleet["elsewhere"])
    assert code == 0, stderr
    full, partial = fleet["from_sub"]["run_id"], fleet["only_a"]["run_id"]
    assert doc["run_id"] == partial and doc["runs"] == [partial, full]
    assert {m["name"]: (m["run_id"], m["status"]) for m in doc["models"]} == {"a": (partial, "ok"), "b": (full, "ok")}
    assert doc["summary"] == {"ok": 2, "failed": 0, "unchecked": 0}
    assert doc["selection"]["rule"] == "fleet" and doc["selection"]["models"] == {"a": partial, "b": full}
    assert doc["models"][1]["archive"]["sha256"] == artifacts(fleet["from_sub"])["b"]["serialized"]
    proc = run_cli(["check-compat", "--config", str(fleet["config"])], cwd=fleet["elsewhere"])
    text = " ".join(proc.stdout.split())
    assert (
        proc.returncode == 0
        and f"b ({full})" in text
        and f"runs: {partial}, the newest run, covered 1 model, fewer than {full}" in text
    )
