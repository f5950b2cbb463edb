"""int8 through a fleet (flows/builtin/executorch_int8.py): a conv net, a model with an outlier
channel and tiny BERT quantized with PT2E and lowered to .pte, judged by their accuracy budgets; the artifact
`get` serves run by the ExecuTorch runtime in a plain interpreter; calibration on the model's own
data (`data:`, a factory reading a file), one batch of that file changed, an inputs change that
leaves the program as it was, or a module kept float rebuilds exactly the int8 artifacts (and the
verdicts that read them), nothing else;
check-compat holds the int8 artifacts to the same budgets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_cli, run_in_process, write_config
from tests.stages.test_quantize import PLAIN_SCRIPT, run_plain

pytest.importorskip("executorch")
pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "serialize", "executorch_int8", "validate"]


DATA_MODULE = """import os

import torch


def batches():
    # the user's own calibration data: a file this factory reads, which no config line names
    for x in torch.load(os.path.join(os.path.dirname(__file__), "calibration.pt")):
        yield {"x": x}
"""


def _config(tmp_path: Path, *, seed: int = 0, kept: tuple[str, ...] = (), high: int = 100, data: bool = False) -> Path:
    convnet = {
        "name": "convnet",
        "factory": "tests.models:small_convnet",
        "inputs": {"x": {"shape": [2, 3, 16, 16]}},
        "stages": {"executorch_int8": {"calibration_seed": seed}},
        **({"data": {"factory": "int8data:batches", "calibration": 4, "evaluation": 2}} if data else {}),
    }
    outlier = {
        "name": "outlier",
        "factory": "tests.models:outlier_mlp",
        "inputs": {"x": {"shape": [4, 8]}},
        "require": ["serialized"],  # the int8 artifact may miss its budget without failing the model
        "stages": {
            "executorch_int8": {"float_modules": list(kept)},
            "validate": {"accuracy": {"sqnr_db": {"min": 25}}},
        },
    }
    bert = {  # transformers' attention mask indexes with integer arithmetic the quantizer must leave alone
        "name": "tiny-bert",
        "factory": "tests.hf_models:bert_tiny",
        "inputs": {
            "input_ids": {"shape": [2, 8], "dtype": "int64", "low": 0, "high": high},
            "attention_mask": {"shape": [2, 8], "dtype": "int64", "value": 1},
        },
    }
    return write_config(tmp_path / "int8.yaml", [convnet, outlier, bert], stages=STAGES, store="store")


def _stages(model: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    return {name: (view["status"], view["cached"]) for name, view in model["stages"].items()}


def test_int8_artifacts_are_judged_by_budgets_and_rebuilt_alone_when_their_calibration_changes(
    tmp_path: Path,
) -> None:
    code, first = run_in_process(_config(tmp_path))
    assert code == 0, first  # the outlier's int8 missing its budget leaves it partial, not failed
    models = {m["name"]: m for m in first["models"]}
    convnet, outlier = models["convnet"], models["outlier"]
    assert convnet["status"] == "ok" and convnet["validation"]["passed"] is True
    assert outlier["status"] == "partial", outlier
    assert "executorch_int8 misses its accuracy budget: sqnr_db" in json.dumps(outlier), outlier
    assert models["tiny-bert"]["status"] == "ok" and models["tiny-bert"]["artifacts"]["pte-int8"]

    # what `get` serves is the int8 program: the runtime runs it in a plain interpreter, close to eager
    store = str(tmp_path / "store")
    pte = tmp_path / "convnet.int8.pte"
    proc = run_cli(["get", "--model", "convnet", "--artifact", "pte-int8", "-o", str(pte), "--store", store])
    assert proc.returncode == 0, proc.stderr
    # what it was calibrated on, as its record says: no data of the model's own, so its inputs spec
    assert "calibrated on 8 batches drawn from the model's inputs spec (seeds 1000000..1000007)" in proc.stdout
    seen = run_plain(PLAIN_SCRIPT, pte, 7)
    assert seen["argmax_agrees"] and 20 < seen["sqnr_db"] < 120, seen

    # the conv net calibrated on its own data (a factory reading a file no config line names),
    # `wide` and `head` kept float in the outlier model, tiny BERT's token ids drawn below 60
    (tmp_path / "int8data.py").write_text(DATA_MODULE)
    # four to calibrate on, two held out that its accuracy is measured on
    batches = [torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(i)) * 3 for i in range(6)]
    torch.save(batches, tmp_path / "calibration.pt")
    code, second = run_in_process(_config(tmp_path, kept=("wide", "head"), high=60, data=True))
    assert code == 0, second
    again = {m["name"]: m for m in second["models"]}
    for name in ("convnet", "outlier"):
        assert _stages(again[name]) == {
            "trace": ("ok", name == "outlier"),  # the conv net's source changed: it has data now
            "functionalize": ("ok", True),
            "serialize": ("ok", True),
            "executorch_int8": ("ok", False),
            "validate": ("ok", False),
        }, (name, _stages(again[name]))
        assert again[name]["artifacts"]["pte-int8"] != models[name]["artifacts"]["pte-int8"]
        assert again[name]["artifacts"]["serialized"] == models[name]["artifacts"]["serialized"]
    assert again["outlier"]["status"] == "ok" and again["outlier"]["validation"]["passed"] is True
    proc = run_cli(["get", "--model", "convnet", "--artifact", "pte-int8", "-o", str(pte), "--store", store, "--json"])
    assert json.loads(proc.stdout)["details"]["calibration"] == {
        "data": "int8data:batches",
        "batches": 4,
        "first_batch": 0,
    }
    from pt2flow.storage import ArtifactStore

    report = json.loads(ArtifactStore(store).get_blob(again["convnet"]["stages"]["validate"]["artifact"]))
    measured = report["candidates"]["executorch_int8"]["accuracy"]
    assert (report["evaluation"], measured["on"], measured["measured_on"]) == (2, "evaluation", 2), measured
    assert report["candidates"]["archive"]["samples"][-1]["label"] == "evaluation[1]"  # every candidate ran them
    # tiny BERT's token ids now drawn below 60: the same program, other calibration batches
    bert, before = again["tiny-bert"], models["tiny-bert"]
    assert bert["stages"]["trace"]["cached"] is False and bert["stages"]["executorch_int8"]["cached"] is False
    assert _stages(bert) == {
        "trace": ("ok", False),  # its source changed
        "functionalize": ("ok", True),  # into the same program: the int8 keys must see the source, not only it
        "serialize": ("ok", True),
        "executorch_int8": ("ok", False),
        "validate": ("ok", False),
    }, _stages(bert)
    assert bert["artifacts"]["pte-int8"] != before["artifacts"]["pte-int8"], _stages(bert)

    # check-compat runs the stored samples again and holds the int8 artifact to the same budget:
    # errors allclose(atol=1e-5) would refuse, within the budget, pass
    proc = run_cli(["check-compat", "--store", store, "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    checked = {m["name"]: m for m in json.loads(proc.stdout)["models"]}
    for name in ("convnet", "outlier"):
        int8 = checked[name]["pte-int8"]
        assert (int8["loads"], int8["runs"], int8["matches"]) == (True, True, True), int8
        assert int8["max_abs_err"] > 1e-4 and int8["sha256"] == again[name]["artifacts"]["pte-int8"]

    # one batch of the conv net's calibration file changed: its int8 artifact, and nothing else
    batches[2] = batches[2] * 0.5
    torch.save(batches, tmp_path / "calibration.pt")
    code, third = run_in_process(_config(tmp_path, kept=("wide", "head"), high=60, data=True))
    assert code == 0, third
    changed = {m["name"]: m for m in third["models"]}
    assert _stages(changed["convnet"]) == {
        "trace": ("ok", False),  # its source's data changed
        "functionalize": ("ok", True),  # into the same program
        "serialize": ("ok", True),
        "executorch_int8": ("ok", False),
        "validate": ("ok", False),
    }, _stages(changed["convnet"])
    assert changed["convnet"]["artifacts"]["pte-int8"] != again["convnet"]["artifacts"]["pte-int8"]
    for name in ("outlier", "tiny-bert"):  # nothing of theirs changed
        assert {view[1] for view in _stages(changed[name]).values()} == {True}, (name, _stages(changed[name]))


UNSEEN_DATA_MODULE = """import os

import torch


def batches():
    # the user's data, scaled by a variable that no key sees: a dependency pt2flow cannot track
    scale = float(os.environ.get("PT2FLOW_TEST_DATA_SCALE", "1"))
    for i in range(4):
        yield {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) * scale}
"""


def test_audit_rebuilds_the_int8_pte_byte_for_byte_and_names_what_its_key_missed(tmp_path: Path) -> None:
    """`pt2flow audit --config` quantizes the stored functional program again in a fresh worker,
    on the model's calibration data: the same bytes as the record's (the blob `get` serves); with
    the data changed through something no key sees (a variable its factory reads), the int8
    record alone fails, naming its stage; every program record still passes."""
    import hashlib

    from tests.conftest import run_json

    (tmp_path / "unseen.py").write_text(UNSEEN_DATA_MODULE)
    model = {
        "name": "mlp",
        "factory": "tests.models:tiny_mlp",
        "inputs": {"x": {"shape": [4, 8]}},
        "data": {"factory": "unseen:batches", "calibration": 4},
    }
    config = write_config(
        tmp_path / "q.yaml", [model], stages=["trace", "functionalize", "executorch_int8"], store="store"
    )
    code, document = run_in_process(config)
    assert code == 0, document
    served = tmp_path / "mlp.int8.pte"
    proc = run_cli(["get", "--model", "mlp", "--artifact", "pte-int8", "-o", str(served), "--config", str(config)])
    assert proc.returncode == 0, proc.stderr

    code, audited, stderr = run_json(["audit", "--config", str(config)])
    assert code == 0, (audited, stderr[-2000:])
    assert audited["summary"] == {"ok": 4, "failed": 0, "rebuilt": 4}  # source, trace, functionalize, the .pte
    (int8,) = [r for r in audited["records"] if r["stage"] == "executorch_int8"]
    assert int8["stored"] == int8["rebuilt"] == int8["fingerprint"] == hashlib.sha256(served.read_bytes()).hexdigest()

    proc = run_cli(["audit", "--config", str(config), "--json"], env={"PT2FLOW_TEST_DATA_SCALE": "3"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = [r for r in json.loads(proc.stdout)["records"] if r["status"] != "ok"]
    assert [r["stage"] for r in failed] == ["executorch_int8"], failed
    assert failed[0]["problem"] == "executorch_int8 run again on the recorded inputs gives another artifact", failed


MISSHAPEN_DATA_MODULE = """import torch


def batches():
    # the user's data, one feature short of what the model takes: calibration fails on it
    for i in range(4):
        yield {"x": torch.randn(4, 7, generator=torch.Generator().manual_seed(i))}
"""


def test_a_failed_quantization_names_its_class_spares_the_float_artifacts_and_reproduces_alone(tmp_path: Path) -> None:
    """Calibration data of another shape than the program takes: executorch_int8 fails with class
    `quantization` naming the step, the model is partial (its archive validated), and `pt2flow
    repro` writes a script that raises the same error with torch, torchao and ExecuTorch alone,
    in an interpreter without pt2flow, on the calibration batches the stage took."""
    import subprocess
    import sys

    (tmp_path / "misshapen.py").write_text(MISSHAPEN_DATA_MODULE)
    model = {
        "name": "mlp",
        "factory": "tests.models:tiny_mlp",
        "inputs": {"x": {"shape": [4, 8]}},
        "data": {"factory": "misshapen:batches", "calibration": 4},
        "require": ["serialized"],
    }
    stages = ["trace", "functionalize", "serialize", "executorch_int8", "validate"]
    config = write_config(tmp_path / "q.yaml", [model], stages=stages, store="store")
    code, document = run_in_process(config)
    (mlp,) = document["models"]
    assert code == 0 and mlp["status"] == "partial", mlp  # the int8 artifact is not required
    int8 = mlp["stages"]["executorch_int8"]
    assert int8["status"] == "failed" and int8["error_class"] == "quantization", int8
    assert int8["error"].startswith("calibration failed on the observed program"), int8
    assert mlp["stages"]["serialize"]["status"] == "ok" and mlp["validation"]["verdicts"]["serialized"]["passed"]

    proc = run_cli(["repro", "mlp", "-o", str(tmp_path / "repro"), "--config", str(config), "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads(proc.stdout)
    assert (written["stage"], written["error_class"]) == ("executorch_int8", "quantization")
    assert written["files"] == ["calibration.pt", "program.pt2", "repro.py"], written
    script = (tmp_path / "repro" / "repro.py").read_text()
    assert "import pt2flow" not in script and "from pt2flow" not in script  # torch, torchao, ExecuTorch alone
    ran = subprocess.run(
        [sys.executable, str(tmp_path / "repro" / "repro.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"},
        cwd=tmp_path,
    )
    assert ran.returncode != 0 and "no error" not in ran.stdout, (ran.stdout, ran.stderr[-2000:])
    # it fails where the stage did: calibrating, on the batch of 7 features. (The run's worker
    # met the batch in the matmul, "mat1 and mat2 shapes cannot be multiplied (4x7 and 8x16)";
    # a plain interpreter meets the program's own guard first, "Guard failed: x.size()[1] == 8".)
    assert "prepared(*args, **kwargs)" in ran.stderr, ran.stderr[-3000:]
    assert "4x7" in int8["error"] or "x.size()[1] == 8" in int8["error"], int8
    assert "4x7" in ran.stderr or "x.size()[1] == 8" in ran.stderr, ran.stderr[-3000:]


def test_calibration_from_a_data_file_takes_its_first_batches_and_its_bytes_are_the_key(tmp_path: Path) -> None:
    """`data: {file: batches.npz}` (numpy.savez, batch index first): the .pte is calibrated on the
    file's first `calibration` batches and measured on the `evaluation` ones after them. A change
    to an evaluation batch rebuilds the int8 stage (the file's bytes are in the key) into the same
    bytes (nothing it calibrates on changed) and measures again; a change to a calibration batch
    gives another artifact. `get` names the file it was calibrated on."""
    import numpy

    batches = numpy.stack([numpy.random.default_rng(i).normal(size=(4, 8)).astype(numpy.float32) for i in range(6)])
    numpy.savez(tmp_path / "batches.npz", x=batches)
    model = {
        "name": "mlp",
        "factory": "tests.models:tiny_mlp",
        "inputs": {"x": {"shape": [4, 8]}},
        "data": {"file": "batches.npz", "calibration": 4, "evaluation": 2},
    }
    config = write_config(tmp_path / "q.yaml", [model], stages=STAGES, store="store")

    def run() -> dict[str, Any]:
        code, document = run_in_process(config)
        (mlp,) = document["models"]
        assert mlp["stages"]["executorch_int8"]["status"] == "ok", mlp
        return mlp

    first = run()
    assert first["status"] == "ok", first
    store = tmp_path / "store"
    from pt2flow.storage import ArtifactStore

    report = json.loads(ArtifactStore(str(store)).get_blob(first["stages"]["validate"]["artifact"]))
    assert report["evaluation"] == 2 and report["candidates"]["executorch_int8"]["accuracy"]["measured_on"] == 2
    proc = run_cli(
        ["get", "--model", "mlp", "--artifact", "pte-int8", "-o", str(tmp_path / "m.pte"), "--store", str(store)]
    )
    assert proc.returncode == 0, proc.stderr
    assert "calibrated on the first 4 batches of data.file batches.npz" in proc.stdout

    batches[5] *= (
        0.5  # an evaluation batch (inside the calibrated range): the int8 stage runs again, on the same batches
    )
    numpy.savez(tmp_path / "batches.npz", x=batches)
    second = run()
    assert second["status"] == "ok", second
    assert _stages(second) == {
        "trace": ("ok", False),  # the model's source: its data file changed
        "functionalize": ("ok", True),
        "serialize": ("ok", True),
        "executorch_int8": ("ok", False),
        "validate": ("ok", False),
    }, _stages(second)
    assert second["artifacts"]["pte-int8"] == first["artifacts"]["pte-int8"]  # calibrated on the first four alone

    batches[1] *= 3.0  # a calibration batch, now the widest: other ranges, another artifact
    numpy.savez(tmp_path / "batches.npz", x=batches)
    third = run()
    assert third["stages"]["executorch_int8"]["cached"] is False
    assert third["artifacts"]["pte-int8"] != first["artifacts"]["pte-int8"]
    assert third["artifacts"]["serialized"] == first["artifacts"]["serialized"]
