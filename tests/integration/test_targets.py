"""The deployment targets end to end through `pt2flow run`: the shipped configs/targets.yaml (the
demo's inference models to the archive, the AOTInductor package, ONNX, ExecuTorch and OpenVINO,
every one validated against eager at the edges of every dynamic dim; the session's shared targets
fleet, tests/fleets.py), cached on a re-run, got, traced back to one export and re-checked by
check-compat; and a fleet of models the targets refuse, each refusal with its
class, naming why, and a repro that raises it again in a fresh process with torch and the
target's library alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_as_cli, run_cli, write_config
from tests.fleets import Fleet, Run

# one group with the shared targets fleet (tests/fleets.py), which the first tests read
pytestmark = [pytest.mark.integration]


def _models(result: subprocess.CompletedProcess[str] | Run) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in json.loads(result.stdout)["models"]}


@pytest.fixture
def demo(targets_fleet: Fleet) -> dict[str, Any]:
    """The shared targets fleet (tests/fleets.py): configs/targets.yaml as shipped (aot_compile
    included) with the benchmark stage after validate, cold then warm."""
    return {
        "cold": targets_fleet.cold,
        "warm": targets_fleet.warm,
        "store": targets_fleet.store,
        "folder": targets_fleet.folder,
    }


@pytest.mark.compile  # the shared targets fleet compiles
def test_every_demo_model_reaches_every_target_validated(demo: dict[str, Any]) -> None:
    cold = demo["cold"]
    assert cold.returncode == 0, cold.stderr[-3000:]
    models = _models(cold)
    assert sorted(models) == ["mlp", "multi-head", "small-cnn", "tiny-encoder"]
    for name, model in models.items():
        assert all(model["artifacts"][kind] for kind in ("serialized", "compiled", "onnx", "pte", "openvino")), name
        assert model["validation"]["passed"] is True
    store = demo["store"]
    report_id = models["tiny-encoder"]["stages"]["validate"]["artifact"]
    record = json.loads(run_cli(["show", report_id, "--store", store, "--json"]).stdout)
    candidates = record["report"]["candidates"]
    assert set(candidates) == {"archive", "compiled", "onnx", "executorch", "openvino"}
    for name, candidate in candidates.items():
        # the example, then batch and seq at their min and at their max: the same samples for every candidate
        assert [s["label"] for s in candidate["samples"]] == ["example", "min", "max"], name
        assert [s["sizes"] for s in candidate["samples"]][1:] == [{"batch": 1, "seq": 2}, {"batch": 8, "seq": 64}], name
        assert all(s["ok"] for s in candidate["samples"]) and candidate["max_abs_err"] < 1e-4, name


@pytest.mark.compile  # the shared targets fleet compiles
def test_a_re_run_is_served_from_the_cache(demo: dict[str, Any]) -> None:
    warm = demo["warm"]
    assert warm.returncode == 0, warm.stderr[-3000:]
    cold, again = _models(demo["cold"]), _models(warm)
    for name, model in again.items():
        assert all(stage["cached"] for stage in model["stages"].values()), name
        assert model["artifacts"] == cold[name]["artifacts"], name


@pytest.mark.compile  # the shared targets fleet compiles
def test_targets_are_got_and_descend_from_the_same_export(demo: dict[str, Any], tmp_path: Path) -> None:
    store, model = demo["store"], _models(demo["cold"])["multi-head"]
    lines = {}
    for kind in ("serialized", "onnx", "pte", "openvino"):
        out = tmp_path / f"multi-head.{kind}"
        got = run_cli(["get", "--model", "multi-head", "--artifact", kind, "-o", str(out), "--store", store, "--json"])
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["sha256"] == model["artifacts"][kind]
        lineage = json.loads(run_cli(["lineage", model["artifacts"][kind], "--store", store, "--json"]).stdout)
        lines[kind] = {a["stage"]: a["sha256"] for a in lineage["ancestors"]}
    assert (
        lines["onnx"]["trace"] == lines["pte"]["trace"] == lines["openvino"]["trace"] == lines["serialized"]["trace"]
    )  # one export
    assert lines["onnx"]["functionalize"] == lines["pte"]["functionalize"] == lines["openvino"]["functionalize"]
    assert "decompose" not in lines["onnx"] and "decompose" not in lines["openvino"]
    import onnx  # the file is a real ONNX model naming its dynamic dims

    proto = onnx.load(str(tmp_path / "multi-head.onnx"))
    assert [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim][2] == 12
    # the OpenVINO IR loads in OpenVINO's own runtime, outside pt2flow, and takes the dims' edges
    script = (
        "import sys, zipfile, numpy as np, openvino as ov\n"
        "z = zipfile.ZipFile(sys.argv[1]); core = ov.Core()\n"
        "model = core.read_model(model=z.read('model.xml'), weights=ov.Tensor(np.frombuffer(z.read('model.bin'), dtype=np.uint8)))\n"
        "compiled = core.compile_model(model, 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'})\n"
        "for b, s in ((1, 2), (8, 32)):\n"
        "    out = compiled([np.ones((b, s, 12), np.float32), np.ones((b, s), np.float32)])\n"
        "    print(out[0].shape[0])\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "multi-head.openvino")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CI": "true"},
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["1", "8"]  # one output row per batch item, at the dims' min and max


@pytest.mark.compile  # the shared targets fleet compiles
def test_check_compat_re_runs_every_target(demo: dict[str, Any]) -> None:
    result = run_cli(["check-compat", "--store", demo["store"], "--json"])
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads(result.stdout)
    for model in document["models"]:
        for kind in ("archive", "compiled", "onnx", "pte", "openvino"):
            assert model[kind]["loads"] and model[kind]["runs"] and model[kind]["matches"], (model["name"], kind)
    # the text and HTML reports show every kind the document checked, not only the archive and
    # the package (they once did: a failing target showed only in a count)
    from rich.console import Console

    from pt2flow.flows.report.compat import compat_html, render_compat

    console = Console(record=True, width=400)
    render_compat(document, console)
    text, page = console.export_text(), compat_html(document)
    for model in document["models"]:
        for kind in ("archive", "compiled", "onnx", "pte", "openvino"):
            row = f"{kind} {model[kind]['sha256'][:12]}"
            assert row in text, (model["name"], kind, text[-3000:])
            assert f"<td>{kind} <code>{model[kind]['sha256'][:12]}</code></td>" in page, (model["name"], kind)
        assert f'<td rowspan="5">{model["name"]}</td>' in page, model["name"]


@pytest.mark.compile  # the shared targets fleet compiles
def test_the_drift_report_of_the_two_runs_has_a_row_per_target(demo: dict[str, Any]) -> None:
    """`pt2flow report` between the fleet's cold and warm runs: every model's archive, package,
    ONNX model, .pte and OpenVINO model, each with its size (the same in both runs) and its own
    verdict, in the JSON and the text (issue 41: the report once knew the archive and the package only)."""
    kinds = ("serialized", "compiled", "onnx", "pte", "openvino")
    done = run_cli(["report", "--store", demo["store"], "--json"])
    assert done.returncode == 0, done.stderr[-2000:]
    comparison = json.loads(done.stdout)
    assert (comparison["runs"]["a"]["run_id"], comparison["runs"]["b"]["run_id"]) == (
        demo["cold"].document["run_id"],
        demo["warm"].document["run_id"],
    )
    cold = _models(demo["cold"])
    for model in comparison["models"]:
        facts = model["artifacts"]
        assert list(facts) == list(kinds), model["model"]
        for kind in kinds:
            size = json.loads(
                run_cli(["show", cold[model["model"]]["artifacts"][kind], "--store", demo["store"], "--json"]).stdout
            )["size"]
            assert facts[kind]["size"] == {"a": size, "b": size, "delta": 0, "ratio": 1.0, "changed": False}, (
                model["model"],
                kind,
            )
            assert facts[kind]["passed"] == {"a": True, "b": True, "changed": False}, (model["model"], kind)
    text = run_cli(["report", "--store", demo["store"]]).stdout
    cells = [
        [c.strip() for c in re.split("[│┃|]", line) if c.strip()] for line in text.split("artifacts", 1)[1].splitlines()
    ]
    rows = [row for row in cells if row and row[0] in cold]
    assert sorted((row[0], row[1]) for row in rows) == sorted((name, kind) for name in cold for kind in kinds), text[
        -3000:
    ]
    assert all(row[-1] == "pass" for row in rows), text[-3000:]


REFUSED = [
    # a joint forward+backward program: no target deploys training
    {
        "name": "trainer",
        "factory": "tests.models:regressor",
        "inputs": {"x": {"shape": [4, 4]}, "y": {"shape": [4]}},
        "stages": {"functionalize": {"mode": "training", "loss_output": 0}},
    },
    # updates buffers on every call: an ONNX model has no state
    {"name": "stateful", "factory": "tests.models:buffer_counter", "inputs": {"x": {"shape": [2, 8]}}},
    # a custom op no exporter translates
    {"name": "wobbly", "factory": "tests.custom_op_models:wobbly", "inputs": {"x": {"shape": [1, 8]}}},
    # dict outputs and an op XNNPACK does not take (argmax): portable kernels when allowed ...
    {
        "name": "dict-out",
        "factory": "tests.models:dict_out",
        "inputs": {"x": {"shape": [2, 3, 6]}, "scale": {"shape": []}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 8}},
    },
    # ... and `lowering` naming it when not
    {
        "name": "dict-strict",
        "factory": "tests.models:dict_out",
        "kwargs": {},
        "inputs": {"x": {"shape": [2, 3, 6]}, "scale": {"shape": []}},
        "stages": {"executorch": {"portable_fallback": False}, "onnx": {"optimize": False}},
    },
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("refused")
    config = write_config(
        folder / "refused.yaml",
        REFUSED,
        stages=["trace", "functionalize", "onnx", "executorch", "validate"],
        defaults={"validate": {"samples": 3}},
    )
    store = str(folder / "store")
    return {"run": run_as_cli(config, store=store), "store": store}  # from this process: its document is read


def test_each_refusal_has_its_class_and_says_why(refused: dict[str, Any]) -> None:
    result = refused["run"]
    assert result.returncode == 1, result.stderr[-3000:]
    models = _models(result)
    assert (models["trainer"]["failed_stage"], models["trainer"]["error_class"]) == ("onnx", "config")
    assert "takes inference programs" in models["trainer"]["error"]
    assert (models["stateful"]["failed_stage"], models["stateful"]["error_class"]) == ("onnx", "lowering")
    assert "stateless" in models["stateful"]["error"]
    assert (models["wobbly"]["failed_stage"], models["wobbly"]["error_class"]) == ("onnx", "lowering")
    assert "pt2flow_test.wobble.default" in models["wobbly"]["error"]
    assert models["dict-out"]["status"] == "ok" and models["dict-out"]["validation"]["passed"]
    assert (models["dict-strict"]["failed_stage"], models["dict-strict"]["error_class"]) == ("executorch", "lowering")
    assert "aten.argmax.default" in models["dict-strict"]["error"]
    lowered = json.loads(
        run_cli(["ls", "--store", refused["store"], "--model", "dict-out", "--stage", "executorch", "--json"]).stdout
    )[0]
    assert "aten.argmax.default" in lowered["details"]["portable_ops"]  # ran on the portable kernels


@pytest.mark.parametrize(
    ("model", "raised"), [("wobbly", "pt2flow_test.wobble"), ("dict-strict", "aten.argmax.default")]
)
def test_a_target_failure_reproduces_in_a_fresh_process(
    refused: dict[str, Any], model: str, raised: str, tmp_path: Path
) -> None:
    folder = tmp_path / model
    made = run_cli(["repro", model, "-o", str(folder), "--store", refused["store"]])
    assert made.returncode == 0, made.stderr
    ran = subprocess.run(
        [sys.executable, str(folder / "repro.py")], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert ran.returncode != 0 and raised in ran.stderr, ran.stderr[-3000:]


@pytest.fixture(scope="module")
def openvino_refused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A model OpenVINO's frontend refuses (an FFT) beside one it takes, through the openvino target alone."""
    folder = tmp_path_factory.mktemp("openvino-refused")
    models = [
        {"name": "spectrum", "factory": "tests.models:spectrum", "inputs": {"x": {"shape": [2, 16]}}},
        {
            "name": "mlp",
            "factory": "tests.models:tiny_mlp",
            "inputs": {"x": {"shape": [3, 8]}},
            "dynamic_shapes": {"x": {0: "batch"}},
            "dims": {"batch": {"min": 1, "max": 16}},
        },
    ]
    config = write_config(
        folder / "openvino.yaml",
        models,
        stages=["trace", "functionalize", "openvino", "validate"],
        defaults={"validate": {"samples": 3}},
    )
    store = str(folder / "store")
    return {"run": run_as_cli(config, store=store), "store": store}  # from this process: its document is read


def test_openvino_refuses_an_op_it_cannot_convert_naming_it(openvino_refused: dict[str, Any], tmp_path: Path) -> None:
    result = openvino_refused["run"]
    assert result.returncode == 1, result.stderr[-3000:]
    models = _models(result)
    assert (models["spectrum"]["failed_stage"], models["spectrum"]["error_class"]) == ("openvino", "lowering")
    assert "aten._fft_r2c.default" in models["spectrum"]["error"]
    assert models["mlp"]["status"] == "ok" and models["mlp"]["validation"]["passed"]  # the other model is not held back
    folder = tmp_path / "repro"
    made = run_cli(["repro", "spectrum", "-o", str(folder), "--store", openvino_refused["store"]])
    assert made.returncode == 0, made.stderr
    ran = subprocess.run(
        [sys.executable, str(folder / "repro.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "CI": "true"},
    )
    assert ran.returncode != 0 and "aten._fft_r2c.default" in ran.stderr, ran.stderr[-3000:]
