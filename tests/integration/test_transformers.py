"""Models nobody on the team wrote: transformers' BERT and GPT-2 with tiny random configs (built
in tests/hf_models.py, no download) through a real `pt2flow run`. BERT exports and validates;
GPT-2 fails at decompose (a view its core ATen decomposition cannot express) with the same stage
and class cold, warm (from the index) and when the decompose stage runs again in a fresh worker
process on its functionalize program read back from the store: that program's output type is
transformers' own pytree node, registered when the model's code is imported. `check-compat` then
loads BERT's archive in a fresh process and matches the outputs validate stored."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]
IDS = {"shape": [2, 8], "dtype": "int64", "low": 0, "high": 100}
FLEET = [
    {
        "name": "bert",
        "factory": "tests.hf_models:bert_tiny",
        "inputs": {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}},
    },
    {"name": "gpt2", "factory": "tests.hf_models:gpt2_tiny", "inputs": {"input_ids": IDS}},
]


# three transformers architectures, a known failure (GPT-2 at decompose) and a plain model
MIXED = [
    *FLEET,
    {
        "name": "distilbert",
        "factory": "tests.hf_models:distilbert_tiny",
        "inputs": {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}},
    },
    {
        "name": "roberta",
        "factory": "tests.hf_models:roberta_tiny",
        "inputs": {"input_ids": {**IDS, "low": 3}, "attention_mask": {**IDS, "value": 1}},
    },
    {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}},
]


def _sources(document: dict) -> dict[str, str]:
    return {m["name"]: m["source"] for m in document["models"]}


def _bert_validated_gpt2_failed(document: dict) -> tuple[Any, ...]:
    """BERT exported and validated; GPT-2's (status, failed stage, class, cached per stage)."""
    by_name = {m["name"]: m for m in document["models"]}
    assert by_name["bert"]["status"] == "ok" and by_name["bert"]["validation"]["passed"] is True
    gpt2 = by_name["gpt2"]
    return (
        gpt2["status"],
        gpt2["failed_stage"],
        gpt2["error_class"],
        {s: v["cached"] for s, v in gpt2["stages"].items()},
    )


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """MIXED (BERT and GPT-2 among them), cold, with one worker, through the real `pt2flow run`
    (its stderr is read): the cold run of both tests. The manifests test re-runs it warm in this
    store; the other test runs into a copy of it."""
    work = tmp_path_factory.mktemp("transformers")
    config = write_config(work / "hf.yaml", MIXED, stages=STAGES)
    store = work / "store-one"
    code, document, stderr = run_json(["run", str(config), "--store", str(store), "--workers", "1"])
    return {"work": work, "config": config, "store": store, "code": code, "document": document, "stderr": stderr}


def test_tiny_bert_and_gpt2_cold_warm_and_retried(cold: dict[str, Any], tmp_path: Path) -> None:
    """Cold (the module's cold run) and retried here; warm: the manifests test's warm re-run."""
    code, document, stderr = cold["code"], cold["document"], cold["stderr"]
    assert code == 1, stderr[-3000:]
    outcome = _bert_validated_gpt2_failed(document)
    assert "Traceback" not in stderr
    assert outcome[:3] == ("failed", "decompose", "decomposition")
    assert outcome[3] == {"trace": False, "functionalize": False, "decompose": False}

    # --retry-failed on a copy of that store, with BERT and GPT-2 alone
    store = tmp_path / "store"
    shutil.copytree(cold["store"], store)
    config = write_config(tmp_path / "hf.yaml", FLEET, stages=STAGES)
    code, retried_run, stderr = run_json(["run", str(config), "--store", str(store), "--retry-failed"])
    assert code == 1, stderr[-3000:]
    retried = _bert_validated_gpt2_failed(retried_run)
    assert "Traceback" not in stderr
    assert retried[:3] == ("failed", "decompose", "decomposition")
    assert retried[3] == {"trace": True, "functionalize": True, "decompose": False}  # loaded from the store

    # BERT's archive under check-compat, in a fresh worker that has never imported transformers:
    # its output type (a ModelOutput) is registered by the module the archive's metadata names.
    # The retried run is named: the store's first run covered MIXED, so the default (the fleet)
    # would check every model of it
    code, report, stderr = run_json(["check-compat", retried_run["run_id"], "--store", str(store)])
    assert code == 0, stderr[-3000:]
    assert [m["name"] for m in report["models"]] == ["bert"]  # GPT-2 built no archive
    archive = report["models"][0]["archive"]
    assert (archive["loads"], archive["runs"], archive["matches"]) == (True, True, True), archive
    assert archive["samples"] == 3 and archive["max_abs_err"] < 1e-4


def test_manifests_do_not_depend_on_workers_order_or_runner_and_a_warm_rerun_does_nothing(
    cold: dict[str, Any], tmp_path: Path
) -> None:
    """The source blob is the canonical manifest: the same fleet, cold, with one worker (the
    module's cold run), with two in the reverse order and on a Dask cluster, records the same one
    for every model; an unchanged re-run then does no stage work at all (no worker started)."""
    expected = {
        "bert": ("ok", None),
        "gpt2": ("failed", "decompose"),
        "distilbert": ("ok", None),
        "roberta": ("ok", None),
        "mlp": ("ok", None),
    }
    config = cold["config"]
    reverse = write_config(tmp_path / "reverse" / "hf.yaml", MIXED[::-1], stages=STAGES)
    runs = {}
    assert cold["code"] == 1, cold["stderr"][-3000:]
    runs["one"] = cold["document"]
    # two workers, the reverse order: the fleet run in this process (its document is what is read)
    code, runs["two"] = run_in_process(reverse, store=str(tmp_path / "store-two"), workers=2)
    assert code == 1, runs["two"]
    code, runs["dask"], stderr = run_json(
        ["run", str(config), "--store", str(tmp_path / "store-dask"), "--runner", "dask", "--workers", "2"]
    )
    assert code == 1, stderr[-3000:]
    for document in runs.values():
        statuses = {m["name"]: (m["status"], m["failed_stage"]) for m in document["models"]}
        assert statuses == expected
    assert _sources(runs["one"]) == _sources(runs["two"]) == _sources(runs["dask"])

    code, warm, stderr = run_json(["run", str(config), "--store", str(cold["store"]), "--workers", "2"])
    assert code == 1, stderr[-3000:]
    assert warm["workers"] == 0  # no worker process: nothing to build
    assert all(s["cached"] for m in warm["models"] for s in m["stages"].values())
    assert _sources(warm) == _sources(runs["one"])
    # GPT-2's failure is known: the same stage and class from the index, BERT still validated
    outcome = _bert_validated_gpt2_failed(warm)
    assert "Traceback" not in stderr
    assert outcome[:3] == ("failed", "decompose", "decomposition")
    assert outcome[3] == {"trace": True, "functionalize": True, "decompose": True}  # a known failure
