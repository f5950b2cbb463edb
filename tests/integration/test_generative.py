"""Generative models through the pipeline (issue 34): a tiny random Llama with `generate:` is
decomposed into prefill and decode; each component goes through trace, serialize, onnx and
executorch as the model `M/prefill`, `M/decode` (keyed, cached, recorded); validate generates 32
greedy tokens at prompts of 2 and 16 with each artifact kind's components and requires eager
`generate()`'s token ids. Cold, then warm (every stage cached, the same artifacts); `get
--component` hands out one component's artifact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, run_cli, write_config

pytestmark = pytest.mark.integration

pytest.importorskip("transformers")

STAGES = ["trace", "serialize", "onnx", "executorch", "validate"]
COMPONENTS = ("prefill", "decode")
KINDS = ("serialized", "onnx", "pte")
NEW_TOKENS = 32
PROMPTS = (2, 16)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("generative")
    shutil.copy(ROOT / "configs" / "generative_models.py", folder / "generative_models.py")
    store = str(folder / "store")
    generate = {"prompt_lens": list(PROMPTS), "max_new_tokens": NEW_TOKENS, "cache": "static", "max_cache_len": 64}
    config = write_config(folder / "generative.yaml", [
        {"name": "tiny-llama", "factory": "generative_models:tiny_llama", "generate": generate},
    ], store=store, stages=STAGES, defaults={"executorch": {"partitioners": []}})
    env = {"OMP_NUM_THREADS": "1"}
    cold = run_cli(["run", str(config), "--json"], env=env)
    warm = run_cli(["run", str(config), "--json"], env=env)
    return {"cold": cold, "warm": warm, "store": store, "folder": folder}


def _model(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    (model,) = json.loads(proc.stdout)["models"]
    return model


def test_every_component_is_built_and_every_artifact_generates_eagers_tokens(fleet: dict[str, Any]) -> None:
    model = _model(fleet["cold"])
    assert model["status"] == "ok", model
    assert set(model["components"]) == set(COMPONENTS)
    for component in COMPONENTS:
        view = model["components"][component]
        assert list(view["stages"]) == STAGES[:-1]
        assert all(s["status"] == "ok" and not s["cached"] for s in view["stages"].values()), view
        assert all(view["artifacts"][kind] for kind in KINDS), view
    assert model["stages"]["validate"]["status"] == "ok"
    verdicts = model["validation"]["verdicts"]
    assert set(verdicts) == set(KINDS) and all(v["passed"] for v in verdicts.values()), verdicts

    report = _report(fleet, model["stages"]["validate"]["artifact"])
    assert report["generation"] is True and set(report["eager"]) == {str(p) for p in PROMPTS}
    for name, candidate in report["candidates"].items():
        for prompt in PROMPTS:
            got = candidate["prompts"][str(prompt)]
            assert got["first_divergence"] is None, (name, prompt)
            assert got["tokens"] == report["eager"][str(prompt)] and len(got["tokens"]) == NEW_TOKENS
            assert len(got["max_error"]) == NEW_TOKENS


def test_the_warm_run_is_cached_with_the_same_artifacts(fleet: dict[str, Any]) -> None:
    cold, warm = _model(fleet["cold"]), _model(fleet["warm"])
    assert warm["status"] == "ok"
    for component in COMPONENTS:
        assert all(s["cached"] for s in warm["components"][component]["stages"].values()), warm["components"][component]
        assert warm["components"][component]["artifacts"] == cold["components"][component]["artifacts"]
    assert warm["stages"]["validate"]["cached"] and warm["stages"]["validate"]["artifact"] == cold["stages"]["validate"]["artifact"]


def test_components_are_recorded_under_their_model(fleet: dict[str, Any]) -> None:
    proc = run_cli(["ls", "--store", fleet["store"], "--json"])
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    models = {r["model"] for r in records}
    assert {"tiny-llama", "tiny-llama/prefill", "tiny-llama/decode"} <= models
    assert {r["stage"] for r in records if r["model"] == "tiny-llama/decode"} == set(STAGES[:-1])


def test_get_hands_out_one_components_artifact(fleet: dict[str, Any]) -> None:
    cold = _model(fleet["cold"])
    out = fleet["folder"] / "decode.pte"
    proc = run_cli(["get", "--store", fleet["store"], "--model", "tiny-llama", "--component", "decode", "--artifact", "pte", "-o", str(out), "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sha256"] == cold["components"]["decode"]["artifacts"]["pte"]
    assert out.stat().st_size > 0


def test_get_writes_every_component_with_a_manifest_that_generates_eagers_tokens(fleet: dict[str, Any]) -> None:
    """`get --model M --artifact pte -o DIR`: both .pte files and manifest.json; a fresh process
    that reads only those (and the model's factory, for eager generate() and generate()'s loop)
    generates eager's tokens on the ExecuTorch runtime."""
    cold = _model(fleet["cold"])
    folder = Path(fleet["folder"]) / "set"
    proc = run_cli(["get", "--store", fleet["store"], "--model", "tiny-llama", "--artifact", "pte", "-o", str(folder), "--json"])
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["order"] == list(COMPONENTS) and manifest["generate"]["max_new_tokens"] == NEW_TOKENS
    for component in COMPONENTS:
        entry = manifest["components"][component]
        assert entry["sha256"] == cold["components"][component]["artifacts"]["pte"] and entry["call_specs"]
        assert (folder / entry["file"]).stat().st_size == entry["size"]
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(fleet["folder"])!r})
        from generative_models import tiny_llama
        from pt2flow.stages import generation as G
        folder = {str(folder)!r}
        manifest = json.load(open(folder + "/manifest.json"))
        steps = {{name: G.pte_step(open(folder + "/" + part["file"], "rb").read(), G.CallSpecs.from_json(part["call_specs"]))
                 for name, part in manifest["components"].items()}}
        g = manifest["generate"]
        spec = G.GenerateSpec(prompt_len=8, max_new_tokens=g["max_new_tokens"], cache=g["cache"], max_cache_len=g["max_cache_len"])
        model = tiny_llama()
        out = {{}}
        for length in g["prompt_lens"]:
            prompt = G.example_prompt(model, length, seed=length)
            out[length] = [G.eager_generation(model, spec, prompt).tokens, G.greedy_tokens(model, steps, prompt, spec).tokens]
        print(json.dumps(out))
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    for length, (eager, got) in json.loads(ran.stdout.strip().splitlines()[-1]).items():
        assert got == eager and len(got) == NEW_TOKENS, length


def test_lineage_shows_a_component_under_its_model(fleet: dict[str, Any]) -> None:
    cold = _model(fleet["cold"])
    proc = run_cli(["lineage", cold["components"]["decode"]["artifacts"]["pte"], "--store", fleet["store"], "--json"])
    assert proc.returncode == 0, proc.stderr
    ancestors = [(r["model"], r["stage"]) for r in json.loads(proc.stdout)["ancestors"]]
    assert ancestors[0] == ("tiny-llama", "source") and ("tiny-llama/decode", "trace") in ancestors


def _report(fleet: dict[str, Any], digest: str) -> dict[str, Any]:
    out = Path(fleet["folder"]) / "report.json"
    proc = run_cli(["get", digest, "--store", fleet["store"], "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_a_component_that_fails_names_itself(tmp_path: Path) -> None:
    """A dynamic cache has no maximum on its length: ExecuTorch refuses the prefill component, and
    the model fails with the class and the component's name (`prefill: dynamic_shape: ...`)."""
    shutil.copy(ROOT / "configs" / "generative_models.py", tmp_path / "generative_models.py")
    config = write_config(tmp_path / "dynamic.yaml", [
        {"name": "tiny-llama-dynamic", "factory": "generative_models:tiny_llama",
         "generate": {"prompt_lens": [2], "max_new_tokens": 4, "cache": "dynamic"}},
    ], store=str(tmp_path / "store"), stages=["trace", "executorch", "validate"], defaults={"executorch": {"partitioners": []}})
    proc = run_cli(["run", str(config), "--json"], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    (model,) = json.loads(proc.stdout)["models"]
    assert model["status"] == "failed" and model["failed_stage"] == "executorch" and model["error_class"] == "dynamic_shape", model
    assert model["error"].startswith("prefill: dynamic_shape: ") and model["error"].endswith("bounds the prompt and cache axes by max_cache_len)"), model["error"]
    assert model["components"]["prefill"]["stages"]["executorch"]["status"] == "failed"
    assert "decode" not in model["components"]
