"""Generative models whose target fails where `require:` lets them, and an encoder-decoder (T5),
through the pipeline.

A fleet of its own, cold then warm: tiny Llama with a dynamic cache and `require: [serialized]`.
ExecuTorch refuses a dynamic cache (no maximum on its axes) for the prefill component: the model
goes on without the `.pte` (decode's executorch is not run), validate judges the other kinds by 32
greedy tokens at prompts of 2 and 16 (the dynamic cache's archive and ONNX model: eager's tokens,
every step's logits within 1e-4), and the model is `partial` with the pte verdict naming the
component; the warm run is all cached with the same verdicts; `get` hands out the serialized set
and refuses the pte; the drift report reads the model as partial.

Tiny T5 (T5ForConditionalGeneration, a dynamic cache, `require: [serialized, onnx]`) is read from
the shared generative fleet (tests/fleets.py: its run of tiny Llama and T5 as configs/generative.yaml
ships them, aot_compile included). T5's encoder is a component too (`encoder`, first: exported, through every stage, and
the encoder validate's generations run), so ExecuTorch refuses T5 at the encoder; its AOTInductor
packages generate eager's tokens (the decode package is compiled size-obliviously:
stages/aot_compile.size_oblivious); `get`'s serialized set of T5 runs in
docs/examples/generate_from_components.py (no pt2flow) to eager's tokens, and to other tokens with
the encoder's file perturbed; the drift report reads it as partial. (T5's warm run:
test_generative.py's test_the_warm_run_is_cached_with_the_same_artifacts, for every model of the
fleet.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, run_as_cli, run_cli, write_config
from tests.fleets import Fleet, Run

# one group with the shared generative fleet (tests/fleets.py), which T5's tests read
pytestmark = [pytest.mark.integration]

pytest.importorskip("transformers")

STAGES = ["trace", "serialize", "onnx", "executorch", "validate"]
GENERATE = {"prompt_lens": [2, 16], "max_new_tokens": 32, "cache": "dynamic"}
ENV = {"OMP_NUM_THREADS": "1"}
LLAMA, T5 = "tiny-llama-dynamic", "tiny-t5"
T5_COMPONENTS = ["encoder", "prefill", "decode"]  # in call order: the encoder is a component too
MODELS = [
    {"name": LLAMA, "factory": "generative_models:tiny_llama", "generate": GENERATE, "require": ["serialized"]},
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("generative-partial")
    shutil.copy(ROOT / "configs" / "generative_models.py", folder / "generative_models.py")
    store = str(folder / "store")
    config = write_config(
        folder / "fleet.yaml", MODELS, store=store, stages=STAGES, defaults={"executorch": {"partitioners": []}}
    )
    cold, warm = run_as_cli(config), run_as_cli(config)  # from this process: tests read their documents
    return {"cold": cold, "warm": warm, "store": store, "folder": folder}


def _models(proc: subprocess.CompletedProcess[str] | Run) -> dict[str, dict[str, Any]]:
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    document = json.loads(proc.stdout)
    assert document["summary"]["partial"] >= 1 and document["summary"]["failed"] == 0, document["summary"]
    return {m["name"]: m for m in document["models"]}


@pytest.fixture
def shipped(generative_fleet: Fleet) -> dict[str, Any]:
    """The shared generative fleet's store and the run that built T5 as configs/generative.yaml
    ships it, every stage (its `full` run; under the name `cold`: T5's first build of every kind)."""
    assert generative_fleet.full is not None
    return {
        "cold": generative_fleet.full,
        "warm": generative_fleet.warm,
        "store": generative_fleet.store,
        "folder": generative_fleet.folder,
    }


def _report(fleet: dict[str, Any], digest: str) -> dict[str, Any]:
    out = Path(fleet["folder"]) / f"report-{digest[:12]}.json"
    proc = run_cli(["get", digest, "--store", fleet["store"], "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def _assert_pte_failed_at_prefill(model: dict[str, Any], first: str = "prefill") -> None:
    """The .pte is refused at the model's first component (T5's: its encoder)."""
    pte = model["validation"]["verdicts"]["pte"]
    assert not pte["passed"] and pte["error_class"] == "dynamic_shape", pte
    assert pte["error"].startswith(f"executorch failed: {first}: dynamic_shape: "), pte["error"]


def test_a_component_failing_a_target_not_required_leaves_the_model_partial(fleet: dict[str, Any]) -> None:
    model = _models(fleet["cold"])[LLAMA]
    assert model["status"] == "partial" and model["failed_stage"] is None and model["error"] is None, model
    verdicts = model["validation"]["verdicts"]
    assert verdicts["serialized"]["passed"] and verdicts["onnx"]["passed"], verdicts
    _assert_pte_failed_at_prefill(model)
    prefill, decode = model["components"]["prefill"], model["components"]["decode"]
    assert prefill["stages"]["executorch"]["status"] == "failed"
    assert "executorch" not in decode["stages"], decode  # the kind is unusable: not built for decode
    assert all(decode["stages"][s]["status"] == "ok" for s in ("trace", "serialize", "onnx")), decode
    assert decode["artifacts"]["serialized"] and not decode["artifacts"].get("pte")
    assert model["stages"]["validate"]["status"] == "ok"
    # a dynamic cache goes to ONNX: its model (onnx_step) generates eager's 32 tokens at both prompts,
    # every step's logits within 1e-4
    report = _report(fleet, model["stages"]["validate"]["artifact"])
    assert set(report["candidates"]) == {"archive", "onnx"}, set(report["candidates"])
    for prompt in ("2", "16"):
        eager = report["eager"][prompt]
        assert len(eager) == 32 and len(set(eager)) > 3, (prompt, eager)
        for name in ("archive", "onnx"):
            got = report["candidates"][name]["prompts"][prompt]
            assert got["tokens"] == eager and got["first_divergence"] is None, (name, prompt)
            assert len(got["max_error"]) == 32 and max(got["max_error"]) < 1e-4, (name, prompt, got["max_error"])


@pytest.mark.compile
def test_t5_generates_eagers_tokens_with_every_kind_it_builds(shipped: dict[str, Any]) -> None:
    model = _models(shipped["cold"])[T5]
    assert model["status"] == "partial", model
    assert list(model["components"]) == T5_COMPONENTS
    encoder = model["components"]["encoder"]
    assert all(encoder["stages"][s]["status"] == "ok" for s in ("trace", "serialize", "aot_compile", "onnx")), encoder
    assert encoder["artifacts"]["serialized"] and encoder["artifacts"]["onnx"] and encoder["artifacts"]["compiled"], (
        encoder
    )
    assert encoder["stages"]["executorch"]["status"] == "failed"  # the encoder's sequence axis has no maximum
    assert "executorch" not in model["components"]["prefill"]["stages"]
    for component in T5_COMPONENTS:  # every component compiles (decode size-obliviously)
        assert model["components"][component]["stages"]["aot_compile"]["status"] == "ok", component
    verdicts = model["validation"]["verdicts"]
    assert verdicts["serialized"]["passed"] and verdicts["onnx"]["passed"] and verdicts["compiled"]["passed"], verdicts
    _assert_pte_failed_at_prefill(model, "encoder")

    report = _report(shipped, model["stages"]["validate"]["artifact"])
    assert report["generation"] is True and set(report["candidates"]) == {"archive", "compiled", "onnx"}
    assert len(set(report["eager"]["16"])) > 1  # the reference is not one token repeated
    for name, candidate in report["candidates"].items():
        for prompt in ("2", "16"):
            got = candidate["prompts"][prompt]
            assert (
                got["first_divergence"] is None
                and got["tokens"] == report["eager"][prompt]
                and len(got["tokens"]) == 32
            ), (name, prompt)
            assert max(got["max_error"]) < 1e-4, (
                name,
                prompt,
                got["max_error"],
            )  # every step's logits, not only the argmax


def test_the_warm_run_is_cached_with_the_same_verdicts(fleet: dict[str, Any]) -> None:
    cold, warm = _models(fleet["cold"]), _models(fleet["warm"])
    for name in (LLAMA,):
        assert warm[name]["status"] == "partial"
        assert warm[name]["validation"]["verdicts"] == cold[name]["validation"]["verdicts"]
        assert list(warm[name]["components"]) == list(cold[name]["components"])
        for component in cold[name]["components"]:  # T5's encoder too
            stages = warm[name]["components"][component]["stages"]
            assert list(stages) == list(cold[name]["components"][component]["stages"])
            assert all(s["cached"] for s in stages.values()), stages
            assert warm[name]["components"][component]["artifacts"] == cold[name]["components"][component]["artifacts"]
        assert (
            warm[name]["stages"]["validate"]["cached"]
            and warm[name]["stages"]["validate"]["artifact"] == cold[name]["stages"]["validate"]["artifact"]
        )


def test_get_hands_out_the_required_kind_and_refuses_the_failed_one(fleet: dict[str, Any]) -> None:
    cold = _models(fleet["cold"])[LLAMA]
    folder = Path(fleet["folder"]) / "serialized"
    proc = run_cli(
        ["get", "--store", fleet["store"], "--model", LLAMA, "--artifact", "serialized", "-o", str(folder), "--json"]
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((folder / "manifest.json").read_text())
    for component in ("prefill", "decode"):
        assert manifest["components"][component]["sha256"] == cold["components"][component]["artifacts"]["serialized"]
        assert (folder / manifest["components"][component]["file"]).stat().st_size == manifest["components"][component][
            "size"
        ]

    refused = Path(fleet["folder"]) / "pte"
    proc = run_cli(["get", "--store", fleet["store"], "--model", LLAMA, "--artifact", "pte", "-o", str(refused)])
    assert proc.returncode == 1 and "prefill's executorch failed" in proc.stderr and "dynamic_shape" in proc.stderr, (
        proc.stderr
    )
    assert not refused.exists()  # a refused set writes nothing
    proc = run_cli(
        [
            "get",
            "--store",
            fleet["store"],
            "--model",
            LLAMA,
            "--component",
            "decode",
            "--artifact",
            "pte",
            "-o",
            str(refused),
        ]
    )
    assert proc.returncode == 1 and "prefill's executorch failed" in proc.stderr, proc.stderr


@pytest.mark.compile  # the shared generative fleet compiles
def test_t5s_set_runs_in_a_plain_script_with_its_exported_encoder(shipped: dict[str, Any]) -> None:
    """`get --model tiny-t5 --artifact serialized -o DIR`: the encoder first in the manifest's
    order; docs/examples/generate_from_components.py (no pt2flow) generates eager's tokens with
    the three programs, and other tokens once encoder.pt2 is replaced by a perturbed program (the
    encoder generate() runs is the file's, not the eager model's)."""
    cold = _models(shipped["cold"])[T5]
    folder = Path(shipped["folder"]) / "t5-serialized"
    proc = run_cli(
        ["get", "--store", shipped["store"], "--model", T5, "--artifact", "serialized", "-o", str(folder), "--json"]
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["order"] == T5_COMPONENTS, manifest["order"]
    for component in T5_COMPONENTS:
        assert manifest["components"][component]["sha256"] == cold["components"][component]["artifacts"]["serialized"]

    def generated() -> dict[str, Any]:
        script = ROOT / "docs" / "examples" / "generate_from_components.py"
        argv = [
            str(script),
            str(folder),
            "--factory",
            "generative_models:tiny_t5",
            "--path",
            str(shipped["folder"]),
            "--prompt-lens",
            "3,17",
            "--seed",
            "7",
        ]
        code = f"import runpy, sys; sys.modules['pt2flow'] = None; sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
        ran = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=600,
            env=_plain_env(),
            cwd=str(shipped["folder"]),
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
        return json.loads(ran.stdout.strip().splitlines()[-1])

    for length, run in generated().items():
        assert run["components"] == run["eager"] and len(run["eager"]) == 32, (length, run)
    # the encoder's program with its final layer norm's weight perturbed, saved over encoder.pt2
    encoder = folder / manifest["components"]["encoder"]["file"]
    perturb = (
        "import sys, torch; from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model as r; r(torch.nn.Module());"
        "import transformers.modeling_outputs; p = torch.export.load(sys.argv[1]);"
        "w = next(v for k, v in p.state_dict.items() if k.endswith('final_layer_norm.weight'));"
        "w.data.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)));"
        "torch.export.save(p, sys.argv[1])"
    )
    ran = subprocess.run(
        [sys.executable, "-c", perturb, str(encoder)], capture_output=True, text=True, timeout=300, env=_plain_env()
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert any(run["components"] != run["eager"] for run in generated().values())


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ENV


@pytest.mark.compile  # the shared generative fleet compiles
def test_the_drift_report_reads_the_model_as_partial(fleet: dict[str, Any], shipped: dict[str, Any]) -> None:
    """The dynamic-cache Llama's two runs, and T5's in the shared fleet (the newest two runs there
    hold the bad decode model too, which fails)."""
    _models(fleet["warm"])
    for store, name in ((fleet["store"], LLAMA), (shipped["store"], T5)):
        proc = run_cli(["report", "--store", store, "--json"])
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        entries = {m["model"]: m for m in report["models"]}
        failed = ["pte"] if name == LLAMA else ["pte", "openvino"]  # the shipped T5's OpenVINO is refused too
        for side in ("a", "b"):
            state = entries[name]["status"][side]
            assert state["status"] == "partial" and state["failed_artifacts"] == failed, (name, side, state)
            assert state["verdicts"]["serialized"] is True
        kinds = entries[name]["artifacts"]  # each kind's own verdict, in both runs
        assert [
            kind for kind, facts in kinds.items() if facts["passed"] == {"a": False, "b": False, "changed": False}
        ] == failed, kinds
        assert all(
            kinds[kind]["error_class"]["b"] == ("dynamic_shape" if kind == "pte" else "lowering") for kind in failed
        ), kinds
        if name == LLAMA:
            assert report["runs"]["b"]["failed"] == 0
