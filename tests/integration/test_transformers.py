"""Models nobody on the team wrote: transformers' BERT and GPT-2 with tiny random configs (built
in tests/hf_models.py, no download) through a real `pt2flow run`. BERT exports and validates;
GPT-2 fails at decompose (a view its core ATen decomposition cannot express) with the same stage
and class cold, warm (from the index) and when the decompose stage runs again in a fresh worker
process on its functionalize program read back from the store: that program's output type is
transformers' own pytree node, registered when the model's code is imported. `check-compat` then
loads BERT's archive in a fresh process and matches the outputs validate stored."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_json, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]
IDS = {"shape": [2, 8], "dtype": "int64", "low": 0, "high": 100}
FLEET = [
    {"name": "bert", "factory": "tests.hf_models:bert_tiny", "inputs": {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}}},
    {"name": "gpt2", "factory": "tests.hf_models:gpt2_tiny", "inputs": {"input_ids": IDS}},
]


def test_tiny_bert_and_gpt2_cold_warm_and_retried(tmp_path: Path) -> None:
    config = write_config(tmp_path / "hf.yaml", FLEET, stages=STAGES)
    args = ["run", str(config), "--store", str(tmp_path / "store")]
    outcomes = []
    for extra in ([], [], ["--retry-failed"]):
        code, document, stderr = run_json([*args, *extra])
        assert code == 1, stderr[-3000:]
        by_name = {m["name"]: m for m in document["models"]}
        assert by_name["bert"]["status"] == "ok" and by_name["bert"]["validation"]["passed"] is True
        gpt2 = by_name["gpt2"]
        outcomes.append((gpt2["status"], gpt2["failed_stage"], gpt2["error_class"], {s: v["cached"] for s, v in gpt2["stages"].items()}))
        assert "Traceback" not in stderr
    cold, warm, retried = outcomes
    assert cold[:3] == warm[:3] == retried[:3] == ("failed", "decompose", "decomposition")
    assert cold[3] == {"trace": False, "functionalize": False, "decompose": False}
    assert warm[3] == {"trace": True, "functionalize": True, "decompose": True}  # a known failure
    assert retried[3] == {"trace": True, "functionalize": True, "decompose": False}  # loaded from the store

    # BERT's archive under check-compat, in a fresh worker that has never imported transformers:
    # its output type (a ModelOutput) is registered by the module the archive's metadata names
    code, report, stderr = run_json(["check-compat", "--store", str(tmp_path / "store")])
    assert code == 0, stderr[-3000:]
    assert [m["name"] for m in report["models"]] == ["bert"]  # GPT-2 built no archive
    archive = report["models"][0]["archive"]
    assert (archive["loads"], archive["runs"], archive["matches"]) == (True, True, True), archive
    assert archive["samples"] == 3 and archive["max_abs_err"] < 1e-4


# three transformers architectures, a known failure (GPT-2 at decompose) and a plain model
MIXED = [
    *FLEET,
    {"name": "distilbert", "factory": "tests.hf_models:distilbert_tiny", "inputs": {"input_ids": IDS, "attention_mask": {**IDS, "value": 1}}},
    {"name": "roberta", "factory": "tests.hf_models:roberta_tiny", "inputs": {"input_ids": {**IDS, "low": 3}, "attention_mask": {**IDS, "value": 1}}},
    {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}},
]


def _sources(document: dict) -> dict[str, str]:
    return {m["name"]: m["source"] for m in document["models"]}


def test_manifests_do_not_depend_on_workers_order_or_runner_and_a_warm_rerun_does_nothing(tmp_path: Path) -> None:
    """The source blob is the canonical manifest: the same fleet, cold, with one worker, with two
    in the reverse order and on a Dask cluster, records the same one for every model; an
    unchanged re-run then does no stage work at all (no worker started)."""
    config = write_config(tmp_path / "hf.yaml", MIXED, stages=STAGES)
    reverse = write_config(tmp_path / "reverse" / "hf.yaml", MIXED[::-1], stages=STAGES)
    runs = {}
    for label, path, extra in (("one", config, ["--workers", "1"]), ("two", reverse, ["--workers", "2"]), ("dask", config, ["--runner", "dask", "--workers", "2"])):
        code, document, stderr = run_json(["run", str(path), "--store", str(tmp_path / f"store-{label}"), *extra])
        assert code == 1, stderr[-3000:]
        statuses = {m["name"]: (m["status"], m["failed_stage"]) for m in document["models"]}
        assert statuses == {"bert": ("ok", None), "gpt2": ("failed", "decompose"), "distilbert": ("ok", None), "roberta": ("ok", None), "mlp": ("ok", None)}
        runs[label] = document
    assert _sources(runs["one"]) == _sources(runs["two"]) == _sources(runs["dask"])

    code, warm, stderr = run_json(["run", str(config), "--store", str(tmp_path / "store-one"), "--workers", "2"])
    assert code == 1, stderr[-3000:]
    assert warm["workers"] == 0  # no worker process: nothing to build
    assert all(s["cached"] for m in warm["models"] for s in m["stages"].values())
    assert _sources(warm) == _sources(runs["one"])
