"""Generative models through the pipeline (issue 34): the shipped fleet, configs/generative.yaml
(tiny Llama, Qwen2, Gemma and Phi3 with a static cache, tiny T5 with a dynamic one), run into a
fresh store, cold then warm. Each model is decomposed into its components; each component goes
through the stages as the model `M/prefill`, `M/decode` (keyed, cached, recorded); validate
generates 32 greedy tokens at prompts of 2 and 16 with each artifact kind's components and
requires eager `generate()`'s token ids. Every model is built to archives and ONNX models;
tiny Llama (and T5) also to AOTInductor packages, .ptes and OpenVINO models, every stage as shipped
(tests/fleets.py says why the other decoders' are built by `make bench-generation` instead).
Beside them, the same Llama whose exported decode program has one weight wrong
(tests/generative_faults.py) is caught at the first token decode makes. The fleet is built once
per session (tests/fleets.py `generative_fleet`) and shared with test_generative_t5.py and
test_reproducible_identity.py. `get --component` hands
out one component's artifact; `get --model M -o DIR` writes a set that
docs/examples/generate_from_components.py, a script using only torch, transformers and the
ExecuTorch runtime, runs to eager's tokens; the same sets' archives and .ptes, through pt2flow's
own step functions (stages/generation.py archive_step, pte_step with the manifest's call specs) in
a fresh process whose model has other weights, generate eager's tokens and logits. (T5's own
assertions: test_generative_t5.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, run_as_cli, run_cli, run_plain_script, write_config
from tests.fleets import BAD_DECODE, GENERATIVE_COLD_STAGES, GENERATIVE_FULL, Fleet, Run

pytestmark = [pytest.mark.integration, pytest.mark.compile]

pytest.importorskip("transformers")

STAGES = ["trace", "serialize", "aot_compile", "onnx", "executorch", "openvino", "validate"]
COMPONENTS = ("prefill", "decode")
KINDS = ("serialized", "compiled", "onnx", "pte", "openvino")
COLD_KINDS = ("serialized", "onnx")  # what the cold run's stages build (GENERATIVE_COLD_STAGES)
NEW_TOKENS = 32
PROMPTS = (2, 16)
GOOD, BAD = "tiny-llama", BAD_DECODE
DECODERS = (GOOD, "tiny-qwen2", "tiny-gemma", "tiny-phi3")
T5 = "tiny-t5"


@pytest.fixture
def fleet(generative_fleet: Fleet) -> dict[str, Any]:
    """The shared generative fleet (tests/fleets.py): configs/generative.yaml run cold to archives
    and ONNX, then tiny Llama and T5 with every stage; the bad decode model added (its run builds
    only it), and Llama, T5 and it run again, warm. `cold` holds every model's newest build before
    the warm run: Llama's and T5's from the run with every stage, Qwen2's, Gemma's and Phi3's from
    the cold run, the bad model's from its own."""
    config = yaml.safe_load(generative_fleet.shipped.read_text())
    assert config["stages"] == STAGES and [m["name"] for m in config["models"]] == [*DECODERS, T5]
    assert generative_fleet.fault is not None and generative_fleet.full is not None
    assert generative_fleet.full.returncode == 0, generative_fleet.full.stdout[-3000:]
    full = generative_fleet.full.models()
    assert set(full) == set(GENERATIVE_FULL)
    cold = {**generative_fleet.cold.document}
    cold["models"] = [full.get(m["name"], m) for m in cold["models"]] + [generative_fleet.fault.models()[BAD]]
    return {
        "cold": Built(generative_fleet.fault.returncode, json.dumps(cold)),
        "warm": generative_fleet.warm,
        "store": generative_fleet.store,
        "folder": generative_fleet.folder,
        "fleet": generative_fleet,
    }


@dataclass(frozen=True)
class Built:
    """What the tests read of a run: its exit code and its document."""

    returncode: int
    stdout: str
    stderr: str = ""


def _model(proc: Built | Run, name: str = GOOD) -> dict[str, Any]:
    assert proc.returncode == 1, (proc.stdout[-3000:], proc.stderr[-5000:])  # the bad decode fails the run
    (model,) = [m for m in json.loads(proc.stdout)["models"] if m["name"] == name]
    return model


@pytest.mark.parametrize("name", DECODERS)
def test_every_component_is_built_and_every_artifact_generates_eagers_tokens(fleet: dict[str, Any], name: str) -> None:
    """tiny Llama: every stage, its archives, packages, ONNX models and .ptes; the other decoders:
    the cold run's stages, archives and ONNX models (never served from another model's records)."""
    model = _model(fleet["cold"], name)
    stages, kinds = (STAGES, KINDS) if name in GENERATIVE_FULL else (GENERATIVE_COLD_STAGES, COLD_KINDS)
    assert model["status"] == "ok", model
    assert set(model["components"]) == set(COMPONENTS)
    for component in COMPONENTS:
        view = model["components"][component]
        assert list(view["stages"]) == stages[:-1]
        assert all(s["status"] == "ok" for s in view["stages"].values()), view
        if name != GOOD:  # (tiny Llama's run with every stage is served what its cold run built)
            assert not any(s["cached"] for s in view["stages"].values()), view
        assert all(view["artifacts"][kind] for kind in kinds), view
    assert model["stages"]["validate"]["status"] == "ok"
    verdicts = model["validation"]["verdicts"]
    assert set(verdicts) == set(kinds) and all(v["passed"] for v in verdicts.values()), verdicts

    report = _report(fleet, model["stages"]["validate"]["artifact"])
    assert report["generation"] is True and set(report["eager"]) == {str(p) for p in PROMPTS}
    assert {c["artifact"] for c in report["candidates"].values()} == set(kinds)
    for prompt in PROMPTS:  # a sequence of one repeated token would be a weak check of equality
        assert len(set(report["eager"][str(prompt)])) > 2, (prompt, report["eager"])
    for kind, candidate in report["candidates"].items():
        for prompt in PROMPTS:
            got = candidate["prompts"][str(prompt)]
            assert got["first_divergence"] is None, (kind, prompt)
            assert got["tokens"] == report["eager"][str(prompt)] and len(got["tokens"]) == NEW_TOKENS
            assert len(got["max_error"]) == NEW_TOKENS and max(got["max_error"]) < 1e-3, (
                kind,
                prompt,
                got["max_error"],
            )


def test_the_shipped_encoder_decoder_is_partial_without_its_pte(fleet: dict[str, Any]) -> None:
    model = _model(fleet["cold"], T5)
    assert model["status"] == "partial", model
    verdicts = model["validation"]["verdicts"]
    assert {kind: v["passed"] for kind, v in verdicts.items()} == {
        "serialized": True,
        "compiled": True,
        "onnx": True,
        "pte": False,
        "openvino": False,
    }
    assert verdicts["pte"]["error_class"] == "dynamic_shape", verdicts["pte"]
    # judged like every kind, never skipped: OpenVINO's frontend refuses T5's prefill, and says what
    assert verdicts["openvino"]["error_class"] == "lowering", verdicts["openvino"]
    assert verdicts["openvino"]["error"].startswith("openvino failed: prefill: lowering: OpenVINO cannot convert "), (
        verdicts["openvino"]
    )
    assert "aten.cat.default" in verdicts["openvino"]["error"], verdicts["openvino"]


def test_a_decode_program_with_one_wrong_weight_is_caught_at_its_first_diverging_token(fleet: dict[str, Any]) -> None:
    good, bad = _model(fleet["cold"]), _model(fleet["cold"], BAD)
    assert (
        bad["status"] == "failed" and bad["failed_stage"] == "validate" and bad["error_class"] == "numeric_mismatch"
    ), bad
    # only the decode program is wrong: the prefill programs have one fingerprint, and its .pte and
    # ONNX model are byte for byte the good model's (an archive or a package also holds its lineage)
    fingerprints = _trace_fingerprints(fleet)
    assert fingerprints[f"{BAD}/prefill"] == fingerprints[f"{GOOD}/prefill"]
    assert fingerprints[f"{BAD}/decode"] != fingerprints[f"{GOOD}/decode"]
    for kind in ("pte", "onnx", "openvino"):
        assert bad["components"]["prefill"]["artifacts"][kind] == good["components"]["prefill"]["artifacts"][kind], kind
    for kind in KINDS:
        assert bad["components"]["decode"]["artifacts"][kind] != good["components"]["decode"]["artifacts"][kind], kind
    (record,) = json.loads(
        run_cli(
            [
                "ls",
                "--store",
                fleet["store"],
                "--model",
                BAD,
                "--stage",
                "validate",
                "--run",
                fleet["fleet"].fault.document["run_id"],
                "--json",
            ]
        ).stdout
    )
    shown = run_cli(
        ["show", record["sha256"], "--store", fleet["store"], "--json"]
    )  # a failed validate keeps its report
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)["report"]
    assert report["eager"] == _report(fleet, good["stages"]["validate"]["artifact"])["eager"]  # eager is untouched
    for name, candidate in report["candidates"].items():
        firsts = {}
        for prompt in PROMPTS:
            got, eager = candidate["prompts"][str(prompt)], report["eager"][str(prompt)]
            first = got["first_divergence"]
            if first is not None:  # the tokens before it are eager's, the one at it is not
                assert first >= 1 and got["tokens"][:first] == eager[:first] and got["tokens"][first] != eager[first], (
                    name,
                    prompt,
                )
                assert got["max_error"][0] < 1e-4 and got["max_error"][first] > 1e-3, (
                    name,
                    prompt,
                )  # prefill's logits are right
                firsts[prompt] = first
            else:
                assert got["tokens"] == eager
        assert firsts, (name, candidate["prompts"])
        prompt = min(firsts)
        kind = candidate["artifact"]
        assert (
            candidate["verdict"]["error"]
            == f"{kind}: generated tokens diverge from eager at position {firsts[prompt]} (prompt {prompt})"
        ), candidate["verdict"]
        assert candidate["verdict"]["error"] in bad["error"]  # every kind's verdict is in the model's error
    assert set(bad["validation"]["verdicts"]) == set(KINDS) and not any(
        v["passed"] for v in bad["validation"]["verdicts"].values()
    )
    # a wrong artifact is not handed out
    proc = run_cli(
        [
            "get",
            "--store",
            fleet["store"],
            "--model",
            BAD,
            "--component",
            "decode",
            "--artifact",
            "pte",
            "-o",
            str(Path(fleet["folder"]) / "bad.pte"),
        ]
    )
    assert proc.returncode == 1 and "generated tokens diverge from eager" in proc.stderr, proc.stderr


def test_the_warm_run_is_cached_with_the_same_artifacts(fleet: dict[str, Any]) -> None:
    """Every component's every stage and every validate served from the index, each model given
    exactly the artifacts of its cold run: tiny-llama's and the bad model's prefill are one program
    with one key per stage, and a model is served its own record of a key first (an archive also
    holds its lineage, so the two models' archives differ in bytes)."""
    cold_models = {m["name"]: m for m in json.loads(fleet["cold"].stdout)["models"]}
    warm_models = {m["name"]: m for m in json.loads(fleet["warm"].stdout)["models"]}
    assert set(cold_models) == {*DECODERS, T5, BAD}
    assert fleet["warm"].returncode == 1 and set(warm_models) == {*GENERATIVE_FULL, BAD}
    for name, warm in warm_models.items():
        cold = cold_models[name]
        assert warm["status"] == cold["status"], name
        assert list(warm["components"]) == list(cold["components"]), name  # the same components, in call order
        for component, view in warm["components"].items():
            assert all(s["cached"] for s in view["stages"].values()), (name, view)
            assert view["artifacts"] == cold["components"][component]["artifacts"], (name, component)
        assert warm["stages"]["validate"]["cached"], name
        assert warm["stages"]["validate"]["artifact"] == cold["stages"]["validate"]["artifact"], name
        assert warm["validation"]["verdicts"] == cold["validation"]["verdicts"], name


def _trace_fingerprints(fleet: dict[str, Any]) -> dict[str, str]:
    proc = run_cli(["ls", "--store", fleet["store"], "--stage", "trace", "--json"])
    assert proc.returncode == 0, proc.stderr
    return {r["model"]: r["fingerprint"] for r in json.loads(proc.stdout)}


def test_components_are_recorded_under_their_model(fleet: dict[str, Any]) -> None:
    proc = run_cli(["ls", "--store", fleet["store"], "--json"])
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    models = {r["model"] for r in records}
    assert {GOOD, f"{GOOD}/prefill", f"{GOOD}/decode"} <= models
    assert {r["stage"] for r in records if r["model"] == f"{GOOD}/decode"} == set(STAGES[:-1])


def test_get_hands_out_one_components_artifact(fleet: dict[str, Any]) -> None:
    cold = _model(fleet["cold"])
    out = fleet["folder"] / "decode.pte"
    proc = run_cli(
        [
            "get",
            "--store",
            fleet["store"],
            "--model",
            "tiny-llama",
            "--component",
            "decode",
            "--artifact",
            "pte",
            "-o",
            str(out),
            "--json",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sha256"] == cold["components"]["decode"]["artifacts"]["pte"]
    assert out.stat().st_size > 0


@pytest.mark.parametrize("kind", ["pte", "compiled"])
def test_get_writes_every_component_with_a_manifest_a_plain_script_generates_eagers_tokens(
    fleet: dict[str, Any], kind: str
) -> None:
    """`get --model M --artifact KIND -o DIR`: every component's file and manifest.json; a fresh
    process running docs/examples/generate_from_components.py (torch, transformers' generate() loop
    and, for .pte, the ExecuTorch runtime: no pt2flow) on prompts pt2flow never validated with
    generates eager's tokens."""
    cold = _model(fleet["cold"])
    folder = Path(fleet["folder"]) / f"set-{kind}"
    proc = run_cli(["get", "--store", fleet["store"], "--model", GOOD, "--artifact", kind, "-o", str(folder), "--json"])
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["order"] == list(COMPONENTS) and manifest["generate"]["max_new_tokens"] == NEW_TOKENS
    for component in COMPONENTS:
        entry = manifest["components"][component]
        assert entry["sha256"] == cold["components"][component]["artifacts"][kind] and entry["call_specs"]
        assert (folder / entry["file"]).stat().st_size == entry["size"]
    script = ROOT / "docs" / "examples" / "generate_from_components.py"
    # pt2flow cannot be imported in that process (None in sys.modules makes `import pt2flow` fail)
    argv = [
        str(script),
        str(folder),
        "--factory",
        "generative_models:tiny_llama",
        "--path",
        str(fleet["folder"]),
        "--prompt-lens",
        "3,17",
        "--seed",
        "7",
    ]
    code = f"import runpy, sys; sys.modules['pt2flow'] = None; sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=str(fleet["folder"])
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    generated = json.loads(ran.stdout.strip().splitlines()[-1])
    assert set(generated) == {"3", "17"}
    for length, got in generated.items():
        assert got["components"] == got["eager"] and len(got["eager"]) == NEW_TOKENS, length


FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, sys.argv[1])  # the fleet's folder: its factories' module
    from generative_models import tiny_llama
    from pt2flow.stages import generation as G

    torch.set_num_threads(1)
    sets = {kind: Path(folder) for kind, folder in json.loads(sys.argv[2]).items()}
    manifests = {kind: json.loads((folder / "manifest.json").read_text()) for kind, folder in sets.items()}
    generate = manifests["pte"]["generate"]
    spec = G.GenerateSpec(**{k: generate[k] for k in ("max_new_tokens", "cache", "max_cache_len", "multi_token_decode") if k in generate})
    # the call specs through their JSON form, as the manifest beside each .pte holds them
    specs = {name: G.CallSpecs.from_json(entry["call_specs"]) for name, entry in manifests["pte"]["components"].items()}
    files = {kind: {name: (sets[kind] / entry["file"]).read_bytes() for name, entry in m["components"].items()} for kind, m in manifests.items()}
    kinds = {
        "serialized": {name: G.archive_step(data) for name, data in files["serialized"].items()},
        "pte": {name: G.pte_step(data, specs[name]) for name, data in files["pte"].items()},
    }
    eager_model = tiny_llama()  # the fleet's model: eager generate()'s tokens and logits
    shell = tiny_llama(1234)  # the same config with other weights: only the components compute the tokens
    out = {"decode_kwargs": specs["decode"].kwargs, "eager": {}, "kinds": {kind: {} for kind in kinds}}
    for length in (2, 16):
        prompt = G.example_prompt(eager_model, length, seed=length)
        eager = G.eager_generation(eager_model, spec, prompt)
        out["eager"][str(length)] = eager.tokens
        for kind, steps in kinds.items():
            got = G.greedy_tokens(shell, steps, prompt, spec)
            compared = G.compare_generation(eager.tokens, eager.logits, got.tokens, got.logits)
            out["kinds"][kind][str(length)] = {"tokens": got.tokens, "first_divergence": compared.first_divergence,
                                               "max_error": compared.max_error}
    print(json.dumps(out))
""")


def test_archives_and_ptes_generate_eagers_tokens_through_pt2flows_steps_in_a_fresh_process(
    fleet: dict[str, Any],
) -> None:
    """tiny-llama's `get` sets (serialized, pte) in a process that exported nothing: archive_step
    and pte_step (the call specs from the manifest's JSON), driven by a model of other weights,
    generate eager's 32 tokens at prompts 2 and 16 (the validate report's) with every step's logits
    within 1e-4."""
    cold = _model(fleet["cold"])
    sets = {}
    for kind in ("serialized", "pte"):
        sets[kind] = str(Path(fleet["folder"]) / f"fresh-{kind}")
        proc = run_cli(
            ["get", "--store", fleet["store"], "--model", GOOD, "--artifact", kind, "-o", sets[kind], "--json"]
        )
        assert proc.returncode == 0, proc.stderr
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(fleet["folder"]), json.dumps(sets)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=str(fleet["folder"]),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["decode_kwargs"] == ["input_ids", "attention_mask", "position_ids", "past_key_values"]
    assert got["eager"] == _report(fleet, cold["stages"]["validate"]["artifact"])["eager"]  # the fleet's reference
    for kind, prompts in got["kinds"].items():
        for prompt in PROMPTS:
            run, eager = prompts[str(prompt)], got["eager"][str(prompt)]
            assert len(eager) == NEW_TOKENS and len(set(eager)) > 3
            assert run["tokens"] == eager and run["first_divergence"] is None, (kind, prompt)
            assert len(run["max_error"]) == NEW_TOKENS and max(run["max_error"]) < 1e-4, (
                kind,
                prompt,
                run["max_error"],
            )


ARCHIVE_LOAD = """
import json, sys
from pt2flow.stages.serialize import PYTREE_MODULES, archive_metadata, load_archive
data = open(sys.argv[1], "rb").read()
ep, _ = load_archive(data, import_pytree_modules=True)  # as check-compat's worker loads an archive
print(json.dumps({"modules": archive_metadata(data).get(PYTREE_MODULES), "inputs": len(ep.graph_signature.user_inputs)}))
"""


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_components_archive_loads_in_a_fresh_process_as_check_compat_loads_it(
    fleet: dict[str, Any], component: str, tmp_path: Path
) -> None:
    """A decoder's program takes (or gives) transformers' cache: a process that loads its archive
    must register the Cache classes as pytrees, which importing transformers.cache_utils (what the
    archive names) does not do. check-compat once reported every generative archive broken
    ("transformers.cache_utils:StaticCache in pytree is not registered")."""
    listed = run_cli(
        ["ls", "--store", fleet["store"], "--model", f"{GOOD}/{component}", "--stage", "serialize", "--json"]
    )
    from pt2flow.storage import ArtifactStore

    sha = next(
        r["sha256"] for r in json.loads(listed.stdout) if r["status"] == "ok" and r["model"] == f"{GOOD}/{component}"
    )
    path = tmp_path / f"{component}.pt2"
    path.write_bytes(ArtifactStore(fleet["store"]).get_blob(sha))  # the stored bytes, as check-compat reads them
    seen = run_plain_script(ARCHIVE_LOAD, path)
    assert "transformers.cache_utils" in seen["modules"], seen
    assert seen["inputs"] > 1, seen


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
    config = write_config(
        tmp_path / "dynamic.yaml",
        [
            {
                "name": "tiny-llama-dynamic",
                "factory": "generative_models:tiny_llama",
                "generate": {"prompt_lens": [2], "max_new_tokens": 4, "cache": "dynamic"},
            },
        ],
        store=str(tmp_path / "store"),
        stages=["trace", "executorch", "validate"],
        defaults={"executorch": {"partitioners": []}},
    )
    proc = run_as_cli(config)  # from this process: the document is what is read
    assert proc.returncode == 1, proc.stdout[-3000:]
    (model,) = json.loads(proc.stdout)["models"]
    assert (
        model["status"] == "failed"
        and model["failed_stage"] == "executorch"
        and model["error_class"] == "dynamic_shape"
    ), model
    assert model["error"].startswith("prefill: dynamic_shape: ") and model["error"].endswith(
        "bounds the prompt and cache axes by max_cache_len)"
    ), model["error"]
    assert model["components"]["prefill"]["stages"]["executorch"]["status"] == "failed"
    assert "decode" not in model["components"]
