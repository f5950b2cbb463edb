"""Around the artifacts, through the real `pt2flow` binary on a real run's store: `get` (verified
copies out of the store, refusals), `repro` (torch-only scripts that raise the recorded exception
in a fresh process where pt2flow cannot be imported) and `schema`."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pt2flow.storage import ArtifactStore
from tests.conftest import ROOT, run_cli, run_cli_into_closed_pipe, run_in_process, run_json, write_config
from tests.repro_models import custom_op_model

pytestmark = pytest.mark.integration

# pt2flow cannot be imported where the script runs: it must need torch alone
NO_PT2FLOW = "import runpy, sys; sys.modules['pt2flow'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"


def _run_script(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_PT2FLOW, str(folder / "repro.py")],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real run: a data_dependent trace failure, a decomposition failure (a custom op with no
    core ATen decomposition), a functionalize failure (a training step through that op, which has
    no autograd formula), a traced program that fails the round trip (an output type torch cannot
    serialize), a healthy model that validates, and one validated in training mode."""
    work = tmp_path_factory.mktemp("artifacts")
    torch.manual_seed(5)
    save_file({k: v.contiguous() for k, v in custom_op_model().state_dict().items()}, str(work / "custom.safetensors"))
    # failure_models lives in configs/: the config's folder is first on sys.path, so put a copy there
    (work / "failure_models.py").write_text((ROOT / "configs" / "failure_models.py").read_text())
    config = write_config(
        work / "c.yaml",
        [
            {
                "name": "data-dependent",
                "factory": "failure_models:data_dependent_branch",
                "inputs": {"x": {"shape": [2, 8]}},
            },
            {
                "name": "custom-op",
                "factory": "tests.repro_models:custom_op_model",
                "weights": "custom.safetensors",
                "inputs": {"x": {"shape": [3, 8]}},
                "dynamic_shapes": {"x": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 32}},
            },
            {"name": "healthy", "factory": "failure_models:healthy_mlp", "inputs": {"input": {"shape": [3, 8]}}},
            {
                "name": "train-custom-op",
                "factory": "tests.repro_models:loss_through_custom_op",
                "inputs": {"x": {"shape": [3, 8]}},
                "stages": {"functionalize": {"mode": "training", "loss_output": 0}},
            },
            {"name": "pair-output", "factory": "tests.repro_models:pair_output", "inputs": {"x": {"shape": [3, 8]}}},
            {
                "name": "train-regressor",
                "factory": "tests.models:regressor",
                "inputs": {"x": {"shape": [4, 4]}, "y": {"shape": [4]}},
                "stages": {"functionalize": {"mode": "training"}},
            },
        ],
        stages=["trace", "functionalize", "decompose", "serialize", "validate"],
    )
    store = str(work / "store")
    code, doc = run_in_process(config, store=store)  # the fleet run in this process: get and repro are under test
    assert code == 1, doc
    got = {m["name"]: (m["status"], m["failed_stage"], m["error_class"]) for m in doc["models"]}
    assert got == {
        "data-dependent": ("failed", "trace", "data_dependent"),
        "custom-op": ("failed", "decompose", "decomposition"),
        "healthy": ("ok", None, None),
        "train-custom-op": ("failed", "functionalize", "decomposition"),
        "pair-output": ("failed", "trace", "serialization"),
        "train-regressor": ("ok", None, None),
    }, got
    return {"store": store, "doc": doc}


def _failure_report(store: str, model: str) -> str:
    """The artifact ID of a model's failure report (its failed record's sha256)."""
    (row,) = [
        r for r in ArtifactStore(store).index.read().to_pylist() if r["model"] == model and r["status"] == "failed"
    ]
    assert row["sha256"], row
    return str(row["sha256"])


# ---------------------------------------------------------------------------------------------
# get


def test_get_by_model_and_by_id(run_store: dict, tmp_path: Path) -> None:
    store = run_store["store"]
    healthy = next(m for m in run_store["doc"]["models"] if m["name"] == "healthy")
    code, record, stderr = run_json(
        ["get", "--model", "healthy", "-o", str(tmp_path / "healthy.pt2"), "--store", store]
    )
    assert code == 0, stderr
    assert record["sha256"] == healthy["artifacts"]["serialized"] and record["artifact"] == "serialized"
    assert record["path"] == str(tmp_path / "healthy.pt2") and record["run_id"] == run_store["doc"]["run_id"]
    data = (tmp_path / "healthy.pt2").read_bytes()
    assert hashlib.sha256(data).hexdigest() == healthy["artifacts"]["serialized"]
    program = torch.export.load(str(tmp_path / "healthy.pt2"))  # a usable archive, as torch sees it
    assert program.module()(torch.ones(3, 8)).shape == (3, 4)

    # the validation report by ID prefix, and by model with --run (a prefix of the run ID)
    report_id = healthy["stages"]["validate"]["artifact"]
    proc = run_cli(
        ["get", report_id[:12], "--artifact", "report", "-o", str(tmp_path / "report.json"), "--store", store]
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "report artifact of healthy" in proc.stdout
        and json.loads((tmp_path / "report.json").read_text())["passed"] is True
    )
    code, record, _ = run_json(
        [
            "get",
            "--model",
            "healthy",
            "--run",
            run_store["doc"]["run_id"][:12],
            "--artifact",
            "report",
            "-o",
            str(tmp_path / "r2.json"),
            "--store",
            store,
        ]
    )
    assert code == 0 and record["sha256"] == report_id


def test_get_refuses_what_the_index_does_not_vouch_for(run_store: dict, tmp_path: Path) -> None:
    store = run_store["store"]
    out = tmp_path / "out.bin"
    stray = ArtifactStore(store).put_blob(b"a blob no record names").digest  # in the store, not in the index
    failed = _failure_report(store, "data-dependent")  # the draft_export report of a failed trace
    cases = [
        (["get", stray], 1, f"no artifact with ID '{stray}'"),
        (["get", failed], 1, "its only records are failures"),
        (["get", "--model", "data-dependent"], 1, "no ok serialized artifact of model 'data-dependent'"),
        (["get", "--model", "healthy", "--artifact", "compiled"], 1, "no ok compiled artifact"),
        (["get", "--model", "healthy", "--run", "no-such-run"], 1, "no run 'no-such-run'"),
        (["get"], 2, "give an artifact ID or --model NAME"),
        (["get", "0123"], 2, "at least 8"),
        (["get", "--model", "healthy", "--artifact", "weights"], 2, "'weights' is not one of"),
    ]
    for args, code, message in cases:
        proc = run_cli([*args, "-o", str(out), "--store", store])
        assert (proc.returncode, message in proc.stderr) == (code, True), (args, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not out.exists()
    proc = run_cli(
        ["get", "--model", "healthy", "-o", "/proc/pt2flow-get.pt2", "--store", store]
    )  # a folder no file can be made in
    assert (
        proc.returncode == 2 and "cannot write /proc/pt2flow-get.pt2" in proc.stderr and "Traceback" not in proc.stderr
    ), proc.stderr


def test_get_refuses_a_corrupt_blob_and_writes_nothing(run_store: dict, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(run_store["store"], store)  # the module's store stays intact
    healthy = next(m for m in run_store["doc"]["models"] if m["name"] == "healthy")
    digest = healthy["artifacts"]["serialized"]
    blob = store / "blobs" / "sha256" / digest[:2] / digest
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    proc = run_cli(["get", digest[:16], "-o", str(tmp_path / "model.pt2"), "--store", str(store)])
    assert proc.returncode == 1 and f"blob {digest} is corrupt" in proc.stderr, proc.stderr
    assert not (tmp_path / "model.pt2").exists() and not list(tmp_path.glob(".pt2flow-get-*"))


# ---------------------------------------------------------------------------------------------
# repro


def test_repro_of_a_data_dependent_trace_failure_raises_it_with_torch_alone(run_store: dict, tmp_path: Path) -> None:
    code, written, stderr = run_json(
        ["repro", "data-dependent", "-o", str(tmp_path / "dd"), "--store", run_store["store"]]
    )
    assert code == 0, stderr
    assert (written["stage"], written["error_class"], written["files"]) == (
        "trace",
        "data_dependent",
        ["inputs.pt", "repro.py"],
    )
    # the failure's draft_export report ID names the same failure
    code, by_id, _ = run_json(
        [
            "repro",
            _failure_report(run_store["store"], "data-dependent")[:12],
            "-o",
            str(tmp_path / "by-id"),
            "--store",
            run_store["store"],
        ]
    )
    assert code == 0 and by_id["model"] == "data-dependent" and by_id["stage"] == "trace"
    script = (tmp_path / "dd" / "repro.py").read_text()
    assert not re.search(r"^\s*(import|from) pt2flow", script, re.M)
    assert "torch.export.export(model, args, kwargs" in script and "strict=False" in script
    proc = _run_script(tmp_path / "dd")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "GuardOnDataDependentSymNode" in proc.stderr and "Could not guard on data-dependent expression" in proc.stderr
    )
    # `repro ... --json | head` after head left: the script is written, the exit is 141, no traceback
    piped = run_cli_into_closed_pipe(
        ["repro", "data-dependent", "-o", str(tmp_path / "piped"), "--store", run_store["store"], "--json"]
    )
    assert (piped.returncode, piped.stderr) == (141, ""), piped.stderr
    assert sorted(p.name for p in (tmp_path / "piped").iterdir()) == ["inputs.pt", "repro.py"]


def test_repro_of_a_decomposition_failure_raises_it_from_the_stored_program(run_store: dict, tmp_path: Path) -> None:
    custom = next(m for m in run_store["doc"]["models"] if m["name"] == "custom-op")
    assert "pt2flow_repro.scale.default" in custom["error"]
    proc = run_cli(["repro", "custom-op", "-o", str(tmp_path / "dec"), "--store", run_store["store"]])
    assert proc.returncode == 0, proc.stderr
    assert "custom-op: decompose failed with decomposition" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "dec").iterdir()) == ["program.pt2", "repro.py"]
    result = _run_script(tmp_path / "dec")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ops outside core ATen remain after decomposition: pt2flow_repro.scale.default" in result.stderr


@pytest.mark.parametrize(
    ("model", "stage", "raised"),
    [
        (
            "train-custom-op",
            "functionalize",
            "RuntimeError: Trying to backward through pt2flow_repro.scale.default but no autograd formula",
        ),
        (
            "pair-output",
            "trace",
            "NotImplementedError: No registered serialization name for <class 'tests.repro_models.Pair'>",
        ),
    ],
)
def test_repro_of_functionalize_and_round_trip_failures_raises_them(
    run_store: dict, tmp_path: Path, model: str, stage: str, raised: str
) -> None:
    failed = next(m for m in run_store["doc"]["models"] if m["name"] == model)
    code, written, stderr = run_json(["repro", model, "-o", str(tmp_path / model), "--store", run_store["store"]])
    assert code == 0, stderr
    assert (written["stage"], written["error_class"]) == (stage, failed["error_class"])
    result = _run_script(tmp_path / model)
    assert result.returncode == 1, result.stdout + result.stderr
    assert raised in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert "does not reproduce" not in result.stdout


def test_repro_of_an_aot_compile_failure_raises_it(tmp_path: Path) -> None:
    """AOTInductor told to use a C++ compiler that does not exist: the package cannot be built."""
    config = write_config(
        tmp_path / "c.yaml",
        [
            {
                "name": "no-compiler",
                "factory": "tests.models:tiny_mlp",
                "inputs": {"x": {"shape": [3, 8]}},
                "stages": {"aot_compile": {"inductor_configs": {"cpp.cxx": ["/nonexistent/c++"]}}},
            },
        ],
        stages=["trace", "functionalize", "decompose", "aot_compile"],
    )  # the default stages but serialize and validate, which nothing here reads
    store = str(tmp_path / "store")
    code, doc = run_in_process(config, store=store)
    (model,) = doc["models"]
    assert code == 1 and (model["failed_stage"], model["error_class"]) == ("aot_compile", "compile"), doc
    code, written, stderr = run_json(["repro", "no-compiler", "-o", str(tmp_path / "out"), "--store", store])
    assert code == 0 and written["files"] == ["program.pt2", "repro.py"], stderr
    result = _run_script(tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "InvalidCxxCompiler: No working C++ compiler found" in result.stderr.strip().splitlines()[-1]


def test_repro_refuses_when_there_is_nothing_to_reproduce(run_store: dict, tmp_path: Path) -> None:
    for target, message in (
        ("healthy", "'healthy' has no failed stage"),
        ("nobody", "no model and no artifact ID 'nobody'"),
    ):
        proc = run_cli(["repro", target, "-o", str(tmp_path / target), "--store", run_store["store"]])
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / target).exists()
    (tmp_path / "a-file").write_text("")
    for out, message in (
        (tmp_path / "a-file", "is a file: give the folder"),
        (Path("/proc/pt2flow-repro"), "cannot write into /proc/pt2flow-repro"),
    ):
        proc = run_cli(["repro", "data-dependent", "-o", str(out), "--store", run_store["store"]])
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_repro_refuses_failures_before_torch_and_leaves_no_folder(tmp_path: Path) -> None:
    """An `import` failure (the shipped failures.yaml's) and a `config` one (an input forward()
    does not take) happen before torch is reached: one line naming why, exit 1, no folder. A
    model that can no longer be built here leaves nothing behind either, in a new folder or an
    existing one."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "configs" / "broken_import_models.py", work / "broken_import_models.py")
    (work / "moved_models.py").write_text((ROOT / "configs" / "failure_models.py").read_text())
    config = write_config(
        work / "c.yaml",
        [
            {"name": "missing-dependency", "factory": "broken_import_models:model", "inputs": {"x": {"shape": [2, 4]}}},
            {"name": "wrong-input", "factory": "tests.models:tiny_mlp", "inputs": {"y": {"shape": [2, 8]}}},
            {"name": "moved", "factory": "moved_models:data_dependent_branch", "inputs": {"x": {"shape": [2, 8]}}},
        ],
        stages=["trace"],
    )
    store = str(work / "store")
    code, doc = run_in_process(config, store=store)
    got = {m["name"]: (m["failed_stage"], m["error_class"]) for m in doc["models"]}
    assert code == 1 and got == {
        "missing-dependency": ("trace", "import"),
        "wrong-input": ("trace", "config"),
        "moved": ("trace", "data_dependent"),
    }, got
    for model, why in (
        ("missing-dependency", "the model's code does not import: importing 'broken_import_models' failed"),
        ("wrong-input", "the config does not fit the model"),
    ):
        out = tmp_path / model
        proc = run_cli(["repro", model, "-o", str(out), "--store", store])
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith(f"pt2flow repro: {model} failed at trace with ") and why in proc.stderr, (
            proc.stderr
        )
        assert "cannot reproduce" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists()
    (work / "moved_models.py").unlink()  # the model's code is gone since the run
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    for out in (tmp_path / "new" / "repro", existing):
        proc = run_cli(["repro", "moved", "-o", str(out), "--store", store])
        assert proc.returncode == 1 and "cannot rebuild moved to write its reproducer: import:" in proc.stderr, (
            proc.stderr
        )
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "new" / "repro").exists()
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------
# schema


def test_schema_prints_the_shipped_json_schema() -> None:
    proc = run_cli(["schema"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "docs" / "config.schema.json").read_text()
    assert json.loads(proc.stdout)["properties"]["version"] == {"const": 1}


# ---------------------------------------------------------------------------------------------
# check-compat


def _altered_archive(data: bytes, major: int) -> bytes:
    """The archive with its program's serializer schema version set to `major`.0, as an archive
    written by a torch whose format this one does not read."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            content = src.read(info.filename)
            if "/models/" in info.filename and info.filename.endswith(".json"):
                program = json.loads(content)
                program["schema_version"] = {"major": major, "minor": 0}
                content = json.dumps(program).encode()
            dst.writestr(info, content)
    return out.getvalue()


def test_check_compat_of_a_run_without_packages_says_what_it_could_not_compare(run_store: dict, tmp_path: Path) -> None:
    code, report, stderr = run_json(["check-compat", "--store", run_store["store"]])
    assert code == 0, stderr
    models = {m["name"]: m for m in report["models"]}
    assert set(models) == {"healthy", "train-regressor"}  # the failed models built no archive
    assert (models["healthy"]["archive"]["matches"], models["healthy"]["note"]) == (True, None)
    assert "compiled" not in models["healthy"]
    trained = models["train-regressor"]
    assert (trained["status"], trained["archive"]["loads"], trained["archive"]["matches"]) == ("ok", True, None)
    assert trained["note"] == "training mode: the candidates' outputs are a loss and gradients"
    for page, message in ((tmp_path / "no-such-folder" / "c.html", "no folder"), (tmp_path, "is a directory")):
        proc = run_cli(["check-compat", "--store", run_store["store"], "--html", str(page)])
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.compile
def test_check_compat_passes_a_run_and_flags_an_archive_of_an_unsupported_format(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "c.yaml",
        [
            {
                "name": "mlp",
                "factory": "tests.models:tiny_mlp",
                "inputs": {"x": {"shape": [3, 8]}},
                "dynamic_shapes": {"x": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 16}},
            },
        ],
    )
    store = str(tmp_path / "store")
    code, doc = run_in_process(config, store=store)
    assert code == 0, doc

    # the archive version is on record, and ls filters by it
    code, rows, _ = run_json(["ls", "--archive-version", torch_archive_version(), "--store", store])
    assert code == 0 and [(r["model"], r["stage"]) for r in rows] == [("mlp", "serialize")]

    code, report, stderr = run_json(["check-compat", "--store", store, "--html", str(tmp_path / "compat.html")])
    assert code == 0, stderr
    (model,) = report["models"]
    assert report["run_id"] == doc["run_id"] and report["built_with"] == [torch.__version__]
    for kind in ("archive", "compiled"):
        checked = model[kind]
        assert (checked["loads"], checked["runs"], checked["matches"], checked["error_class"]) == (
            True,
            True,
            True,
            None,
        ), checked
        assert (
            checked["samples"] == 3 and checked["max_abs_err"] <= 1e-5
        )  # every validation sample, from the stored inputs
    assert model["archive"]["archive_version"] == torch_archive_version()
    html = (tmp_path / "compat.html").read_text()
    assert "<script" not in html and "mlp" in html and doc["run_id"] in html

    # a loader that kills its process fails that artifact alone: the checks run in a worker, and
    # a fresh one checks the rest (PT2FLOW_CRASH_AT kills the first worker as it starts a check)
    crash = {"PT2FLOW_CRASH_AT": "before_compat_check", "PT2FLOW_CRASH_ONCE": str(tmp_path / "crashed")}
    code, report, stderr = run_json(["check-compat", "--store", store], env=crash)
    assert code == 1, stderr
    (model,) = report["models"]
    assert model["status"] == "failed" and model["error_class"] == "crash"
    assert model["archive"]["error_class"] == "crash" and "was killed by SIGKILL" in model["archive"]["error"]
    assert model["archive"]["loads"] is None  # nothing is claimed about an artifact whose check died
    assert (model["compiled"]["loads"], model["compiled"]["matches"]) == (True, True)

    # the same run, but its archive written in a format version this torch does not read
    records = [r for r in ArtifactStore(store).index.read().to_pylist() if r["run_id"] == doc["run_id"]]
    serialized = next(r for r in records if r["stage"] == "serialize")
    altered = ArtifactStore(store).put_blob(_altered_archive(ArtifactStore(store).get_blob(serialized["sha256"]), 99))
    upgraded_run = "altered-" + doc["run_id"]
    copies = []
    for r in records:
        r = {**r, "record_id": r["record_id"] + "x", "run_id": upgraded_run}
        if r["stage"] == "serialize":
            r.update(sha256=altered.digest, size=altered.size, archive_version="99.0")
        copies.append(r)
    ArtifactStore(store).index.append(copies)

    code, report, stderr = run_json(["check-compat", upgraded_run, "--store", store])
    assert code == 1, stderr
    (model,) = report["models"]
    assert model["status"] == "failed" and model["error_class"] == "incompatible"
    assert model["archive"]["loads"] is False and model["archive"]["error_class"] == "incompatible"
    assert "schema version" in model["archive"]["error"] and "99" in model["archive"]["error"]
    assert model["compiled"]["matches"] is True  # the package is untouched and still fine
    proc = run_cli(["check-compat", upgraded_run[:12], "--store", store])  # a unique prefix
    assert proc.returncode == 1 and "incompatible" in proc.stdout and "Traceback" not in proc.stderr

    if torch.cuda.is_available():
        return  # what follows is the view from a checker without a GPU
    # the same run, as if its package had been compiled for a GPU: a CPU-only checker cannot run
    # it, says so, and claims nothing about it (neither compatible nor incompatible)
    gpu_run = "gpu-" + doc["run_id"]
    ArtifactStore(store).index.append(
        [
            {
                **r,
                "record_id": r["record_id"] + "g",
                "run_id": gpu_run,
                **({"device": "cuda"} if r["stage"] == "aot_compile" else {}),
            }
            for r in records
        ]
    )
    code, report, stderr = run_json(["check-compat", gpu_run, "--store", store])
    assert code == 0, stderr
    (model,) = report["models"]
    assert model["status"] == "unchecked" and model["error_class"] is None
    assert report["summary"] == {"ok": 0, "failed": 0, "unchecked": 1}
    assert model["archive"]["matches"] is True
    assert model["compiled"]["loads"] is None and "no CUDA device is available here" in model["compiled"]["skipped"]
    proc = run_cli(["check-compat", gpu_run, "--store", store])
    assert proc.returncode == 0 and "0 compatible, 0 not, 1 not checked here" in proc.stdout, proc.stdout


def torch_archive_version() -> str:
    from torch._export.serde.schema import SCHEMA_VERSION

    return f"{SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}"
