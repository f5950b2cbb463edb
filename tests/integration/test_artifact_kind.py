"""A new artifact kind, declared in this file alone (issue 41): `onnx-plain`, the functional
program as ONNX without the exporter's optimizer, run by ONNX Runtime. Registered as an installed
distribution would register it (an entry point of the group `pt2flow.stages`, real metadata on
PYTHONPATH), with no pt2flow file changed, it is validated against eager (a plain model at the
edges of its dynamic dim; a generative model, tiny Llama, by the tokens its prefill and decode
generate), benchmarked, named in the run document, served by `get`, re-checked by check-compat
and listed in the drift report, like the kinds pt2flow ships."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pt2flow.flows.pipeline.stage import Input, Stage

# (tests.conftest is imported inside the tests: a worker imports this module for STAGE alone)

pytestmark = pytest.mark.integration

KIND = "onnx-plain"
STAGE = Stage(
    "onnx_plain",
    1,
    compute=f"{__name__}:compute",
    inputs=(Input("program", ("functionalize", "trace")),),
    publishes=KIND,
    artifact=KIND,
    suffix=".onnx",
    candidate=f"{__name__}:load",
    libraries=("onnx", "onnxscript", "onnxruntime"),
    accepts_training=False,
    position=90,
    description="ONNX without the exporter's optimizer, for ONNX Runtime (a test's kind)",
)


def compute(call: Any) -> Any:
    """torch.onnx.export(program, dynamo=True, optimize=False), one self-contained .onnx."""
    import torch

    exported = torch.onnx.export(call.program(), dynamo=True, optimize=False, verbose=False)
    data = exported.model_proto.SerializeToString()
    return call.publish(data, details={"format": "onnx", "optimized": False})


def load(data: bytes) -> Any:
    """A runner of flat tensors (stages/targets.FlatRunner) on ONNX Runtime's CPU provider."""
    import onnxruntime
    import torch

    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(inputs: list[Any]) -> list[Any]:
        if len(inputs) != len(names):
            raise ValueError(f"the model takes {len(names)} tensors, got {len(inputs)}")
        feeds = {name: t.detach().cpu().contiguous().numpy() for name, t in zip(names, inputs)}
        return [torch.from_numpy(out.copy()) for out in session.run(None, feeds)]

    return run


STAGES = ["trace", "functionalize", "serialize", STAGE.name, "validate", "benchmark"]
GENERATIVE_STAGES = ["trace", "serialize", STAGE.name, "validate"]
# the canary on (max_slowdown's default: this fleet is the one that carries it through a real run),
# no retries and a short max_seconds: a size timed in one of the host's slow stretches waits 0.3 s
# for full speed, once, not 3 x 1 s
FEW_RUNS = {
    "warmup": 1,
    "min_runs": 3,
    "max_runs": 5,
    "window": 2,
    "max_seconds": 0.3,
    "quiet_wait_s": 0.5,
    "passes": 2,
    "retries": 0,
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.conftest import ROOT, run_cli, write_config

    folder = tmp_path_factory.mktemp("artifact-kind")
    site = folder / "site"
    info = site / "pt2flow_onnx_plain-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pt2flow-onnx-plain\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pt2flow.stages]\n{STAGE.name} = {__name__}:STAGE\n")
    shutil.copy(ROOT / "configs" / "generative_models.py", folder / "generative_models.py")
    env = {"PYTHONPATH": f"{site}:{ROOT}", "OMP_NUM_THREADS": "1"}
    plain = write_config(
        folder / "plain.yaml",
        [
            {
                "name": "mlp",
                "factory": "tests.models:tiny_mlp",
                "inputs": {"x": {"shape": [3, 8]}},
                "dynamic_shapes": {"x": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 16}},
            },
        ],
        stages=STAGES,
        defaults={"benchmark": FEW_RUNS},
    )
    generative = write_config(
        folder / "generative.yaml",
        [
            {
                "name": "tiny-llama",
                "factory": "generative_models:tiny_llama",
                "generate": {"prompt_lens": [2, 16], "max_new_tokens": 32, "cache": "static", "max_cache_len": 64},
            },
        ],
        stages=GENERATIVE_STAGES,
    )
    store = str(folder / "store")
    runs = {}
    for name, config in (("cold", plain), ("warm", plain), ("generative", generative)):
        proc = run_cli(["run", str(config), "--store", store, "--json"], env=env)
        assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr[-3000:])
        runs[name] = json.loads(proc.stdout)
    return {"runs": runs, "store": store, "env": env, "folder": folder}


def _model(document: dict[str, Any]) -> dict[str, Any]:
    (model,) = document["models"]
    return model


def _blob(fleet: dict[str, Any], digest: str) -> dict[str, Any]:
    """A JSON report from the store, read without pt2flow's CLI."""
    from pt2flow.storage import ArtifactStore

    return dict(json.loads(ArtifactStore(fleet["store"]).get_blob(digest)))


def test_the_kind_is_validated_benchmarked_and_named_in_the_run_document(fleet: dict[str, Any]) -> None:
    cold = _model(fleet["runs"]["cold"])
    assert cold["status"] == "ok" and list(cold["stages"]) == STAGES, cold
    digest = cold["artifacts"][KIND]
    assert digest == cold["stages"][STAGE.name]["artifact"]
    assert cold["validation"]["verdicts"][KIND]["passed"] is True
    report = _blob(fleet, cold["stages"]["validate"]["artifact"])
    samples = report["candidates"][STAGE.name]["samples"]  # at the edges of the dynamic dim, as every candidate
    assert [s["sizes"] for s in samples][1:] == [{"batch": 1}, {"batch": 16}] and all(s["ok"] for s in samples), samples
    timed = _blob(fleet, cold["stages"]["benchmark"]["artifact"])
    assert set(timed["artifacts"]) == {"eager", "archive", STAGE.name}  # timed beside the archive, at every point
    assert all(0 < timed["artifacts"][STAGE.name]["points"][p["label"]]["p50_ms"] for p in timed["points"]), timed[
        "artifacts"
    ][STAGE.name]
    # every sample was watched by the canary: its fastest recorded, each point's samples left out counted
    assert timed["load"]["canary_fastest_us"] > 0, timed["load"]
    assert all("slow_samples" in e for a in timed["artifacts"].values() for e in a["points"].values()), timed
    warm = _model(fleet["runs"]["warm"])
    assert all(stage["cached"] for stage in warm["stages"].values()) and warm["artifacts"][KIND] == digest


def test_a_generative_model_generates_eagers_tokens_through_the_kind(fleet: dict[str, Any]) -> None:
    model = _model(fleet["runs"]["generative"])
    assert model["status"] == "ok", model
    for component in ("prefill", "decode"):
        assert model["components"][component]["artifacts"][KIND], component
    assert model["validation"]["verdicts"][KIND]["passed"] is True
    report = _blob(fleet, model["stages"]["validate"]["artifact"])
    candidate = report["candidates"][STAGE.name]
    for prompt, eager in report["eager"].items():
        assert candidate["prompts"][prompt]["tokens"] == eager and len(eager) == 32, prompt


def test_get_check_compat_and_the_drift_report_know_the_kind(fleet: dict[str, Any], tmp_path: Path) -> None:
    import onnx

    from tests.conftest import run_cli

    store, env = fleet["store"], fleet["env"]
    digest = _model(fleet["runs"]["cold"])["artifacts"][KIND]
    out = tmp_path / "mlp.onnx"
    got = run_cli(["get", "--model", "mlp", "--artifact", KIND, "-o", str(out), "--store", store, "--json"], env=env)
    assert got.returncode == 0 and json.loads(got.stdout)["sha256"] == digest, got.stderr
    assert onnx.load_model_from_string(out.read_bytes()).graph.input[0].name  # an ONNX model, as the kind says

    compat = run_cli(["check-compat", fleet["runs"]["warm"]["run_id"], "--store", store, "--json"], env=env)
    assert compat.returncode == 0, compat.stderr[-2000:]
    (checked,) = json.loads(compat.stdout)["models"]
    assert (checked[KIND]["loads"], checked[KIND]["runs"], checked[KIND]["matches"]) == (True, True, True), checked

    drift = run_cli(
        ["report", fleet["runs"]["cold"]["run_id"], fleet["runs"]["warm"]["run_id"], "--store", store, "--json"],
        env=env,
    )
    assert drift.returncode == 0, drift.stderr[-2000:]
    (entry,) = json.loads(drift.stdout)["models"]
    assert list(entry["artifacts"]) == ["serialized", KIND] and entry["artifacts"][KIND]["passed"] == {
        "a": True,
        "b": True,
        "changed": False,
    }
