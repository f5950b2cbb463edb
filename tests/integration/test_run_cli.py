"""`pt2flow run` end to end as a subprocess: the JSON contract, exit codes, blob digests, archives
that load and match eager, cached re-runs, failure classification, and a run on S3. Where a
test's subject is the fleet's outcome (input dtypes, a device the machine lacks, a warm re-run of
the failure fleet, weights built when a module is imported, the store the S3 queries read) the
fleet runs in this process (conftest run_in_process)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from pt2flow.storage import ArtifactStore
from tests import models
from tests.conftest import ROOT, run_cli, run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

STAGE_NAMES = ["trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"]


def save_weights(path: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in models.tiny_mlp().state_dict().items()}
    save_file(state, str(path))
    return state


def mlp_entry(weights: str | None = None, name: str = "mlp") -> dict:
    entry = {
        "name": name,
        "factory": "tests.models:tiny_mlp",
        "inputs": {"x": {"shape": [3, 8]}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 16}},
    }
    if weights:
        entry["weights"] = weights
    return entry


def assert_clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "database is locked" not in stderr


def test_run_json_contract_digests_and_archive(tmp_path: Path) -> None:
    state = save_weights(tmp_path / "mlp.safetensors")
    config = write_config(
        tmp_path / "pipeline.yaml",
        [
            mlp_entry("mlp.safetensors"),
            {
                "name": "dict-out",
                "factory": "tests.models:dict_out",
                "inputs": {"x": {"shape": [2, 5, 6]}, "scale": {"shape": [2, 5, 6], "value": 0.5}},
                "dynamic_shapes": {"x": {0: "b", 1: "s"}, "scale": {0: "b", 1: "s"}},
                "dims": {"b": {"min": 1, "max": 4}, "s": {"min": 2, "max": 9}},
            },
        ],
        stages=["trace", "functionalize", "decompose", "serialize", "validate"],
    )
    store_dir = tmp_path / "store"
    code, doc, stderr = run_json(["run", str(config), "--store", str(store_dir)])
    assert code == 0, stderr[-3000:]
    assert_clean(stderr)
    assert set(doc) >= {"run_id", "store", "summary", "models"}
    assert doc["summary"]["ok"] == 2 and doc["summary"]["failed"] == 0 and doc["summary"]["seconds"] > 0
    assert doc["store"] == str(store_dir)
    by_name = {m["name"]: m for m in doc["models"]}
    mlp = by_name["mlp"]
    assert mlp["status"] == "ok" and mlp["failed_stage"] is None and mlp["error_class"] is None and mlp["error"] is None
    assert list(mlp["stages"]) == ["trace", "functionalize", "decompose", "serialize", "validate"]
    for info in mlp["stages"].values():
        assert info["status"] == "ok" and info["cached"] is False and info["seconds"] >= 0
        blob = store_dir / "blobs" / "sha256" / info["artifact"][:2] / info["artifact"]
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == info["artifact"]
    assert mlp["artifacts"]["serialized"] == mlp["stages"]["serialize"]["artifact"]
    assert mlp["artifacts"]["compiled"] is None
    assert mlp["validation"]["passed"] is True and mlp["validation"]["samples"] == 3
    assert 0 <= mlp["validation"]["max_abs_err"] < 1e-5

    # the archive, read back from the store, is the model with the configured weights
    archive = ArtifactStore(str(store_dir)).get_blob(mlp["artifacts"]["serialized"])
    program = torch.export.load(io.BytesIO(archive))
    eager = models.tiny_mlp()
    eager.load_state_dict(state)
    eager.eval()
    for batch in (1, 5, 16):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(program.module()(x), eager(x), atol=1e-6, rtol=1e-5)

    # a second run of the unchanged config does no stage work and returns the same IDs
    code2, doc2, stderr2 = run_json(["run", str(config), "--store", str(store_dir)])
    assert code2 == 0, stderr2[-3000:]
    for model in doc2["models"]:
        assert all(s["cached"] for s in model["stages"].values()), model["name"]
        assert {k: v["artifact"] for k, v in model["stages"].items()} == {
            k: v["artifact"] for k, v in by_name[model["name"]]["stages"].items()
        }
    assert doc2["run_id"] != doc["run_id"]

    # both documents are the typed RunDocument's dump, and the drift report between the two runs
    # is the typed DriftReport's: validated back, each dumps to the same JSON, key order included
    from pt2flow.flows.engine.common.documents import RunDocument
    from pt2flow.flows.report.drift import DriftReport

    for document in (doc, doc2):
        assert list(document) == ["run_id", "store", "summary", "models", "workers", "python"]
        assert document["python"] is None  # the workers ran under pt2flow's own interpreter (no --python)
        assert json.dumps(RunDocument.model_validate(document).model_dump(mode="json")) == json.dumps(document)
    code3, drift, stderr3 = run_json(["report", doc["run_id"], doc2["run_id"], "--store", str(store_dir)])
    assert code3 == 0, stderr3[-3000:]
    assert json.dumps(DriftReport.model_validate(drift).model_dump(mode="json")) == json.dumps(drift)
    assert drift["summary"]["models"] == 2 and drift["summary"]["unchanged"] == 2


def test_run_summary_table_without_json(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", [mlp_entry()], stages=["trace", "serialize", "validate"])
    proc = run_cli(["run", str(config), "--store", str(tmp_path / "store")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_clean(proc.stderr)
    assert "mlp" in proc.stdout and "passed" in proc.stdout and "1 ok, 0 failed" in proc.stdout


def test_usage_errors_exit_2_and_run_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", [mlp_entry()])
    store = tmp_path / "store"
    for args in (
        ["--only", "nope"],
        ["--stages", "validate,trace"],
        ["--workers", "0"],
        ["--dask-address", "tcp://x:1"],
    ):
        proc = run_cli(["run", str(config), "--store", str(store), *args])
        assert proc.returncode == 2, (args, proc.stderr)
        assert not store.exists()
    # credentials in the store URL would land in Prefect's flow parameters: refused, not echoed
    proc = run_cli(["run", str(config), "--store", "s3://AKIAEXAMPLE:s3cr3t-sentinel@bucket/prefix"])
    assert proc.returncode == 2
    assert "holds credentials" in proc.stderr and "s3cr3t-sentinel" not in proc.stderr


@pytest.mark.compile
def test_only_takes_comma_lists_the_document_keeps_config_order_and_the_summary_fits_80_columns(tmp_path: Path) -> None:
    """`--only a,b` works like `--only a --only b` (and like `--stages a,b`); `models` of the
    document (CLI and Python) follow the config's order whatever the selection's; on an 80-column
    terminal the summary keeps every model's full name, marks a cached failure ⊗ and prints its
    error once."""
    from pt2flow.flows import api

    names = ["zeta-encoder-large", "alpha-data-dependent-branch", "mid-sized-mlp-model"]
    config = write_config(
        tmp_path / "c.yaml",
        [
            mlp_entry(name=names[0]),
            {"name": names[1], "factory": "tests.models:data_dependent", "inputs": {"x": {"shape": [2, 4]}}},
            mlp_entry(name=names[2]),
        ],
        stages=["trace", "serialize"],
    )
    store = str(tmp_path / "store")
    code, doc, stderr = run_json(["run", str(config), "--store", store, "--only", f"{names[2]},{names[0]}"])
    assert code == 0 and [m["name"] for m in doc["models"]] == [names[0], names[2]], stderr[-3000:]
    code, doc, stderr = run_json(["run", str(config), "--store", store, "--only", names[2], "--only", f" {names[1]} "])
    assert code == 1 and [(m["name"], m["error_class"]) for m in doc["models"]] == [
        (names[1], "data_dependent"),
        (names[2], None),
    ]
    error = doc["models"][0]["error"].strip().splitlines()[0]
    proc = run_cli(["run", str(config), "--store", store, "--only", f"{names[0]},nope"])
    assert proc.returncode == 2 and "no model named ['nope']" in proc.stderr, proc.stderr
    # warm: every stage from the index, the failure cached
    assert [m.name for m in api.run(config, store=store).models] == names
    proc = run_cli(["run", str(config), "--store", store], env={"COLUMNS": "80"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert_clean(proc.stderr)
    lines = proc.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, proc.stdout
    rows = {name: next(line for line in lines if line.startswith(f"│ {name} ")) for name in names}
    assert "⊗ ·" in rows[names[1]] and "data_dependent @ trace" in rows[names[1]] and "● ●" in rows[names[0]], (
        proc.stdout
    )
    assert f"⊗ {names[1]} [data_dependent] at trace (cached" in proc.stdout and "⊗ failed (cached)" in proc.stdout
    assert (proc.stdout + proc.stderr).count(error) == 1, proc.stdout + proc.stderr


def test_uint8_int8_int16_inputs_export_and_validate(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "c.yaml",
        [
            {
                "name": "bytes",
                "factory": "tests.models:byte_image",
                "inputs": {
                    "image": {"shape": [2, 3, 8], "dtype": "uint8", "high": 256},
                    "offset": {"shape": [2, 3, 8], "dtype": "int8", "low": -128, "high": 128},
                    "ids": {"shape": [2, 5], "dtype": "int16", "high": 300},
                },
                "dynamic_shapes": {"image": {0: "batch"}, "offset": {0: "batch"}, "ids": {0: "batch"}},
                "dims": {"batch": {"min": 1, "max": 8}},
            }
        ],
        stages=["trace", "serialize", "validate"],
    )
    code, doc = run_in_process(config, store=str(tmp_path / "store"))  # the fleet's outcome, not the CLI, is under test
    assert code == 0, doc
    (model,) = doc["models"]
    assert model["validation"]["passed"] is True and model["validation"]["samples"] >= 3
    code, record, _ = run_json(["show", model["stages"]["trace"]["artifact"], "--store", str(tmp_path / "store")])
    users = [(i["name"], i["dtype"]) for i in record["signature"]["inputs"] if i["name"] in ("image", "offset", "ids")]
    assert users == [("image", "uint8"), ("offset", "int8"), ("ids", "int16")], record["signature"]


def test_failure_fleet_is_classified_and_the_rest_completes(tmp_path: Path) -> None:
    code, doc, stderr = run_json(["run", str(ROOT / "configs" / "failures.yaml"), "--store", str(tmp_path / "store")])
    assert code == 1
    assert_clean(stderr)
    got = {m["name"]: (m["status"], m["failed_stage"], m["error_class"]) for m in doc["models"]}
    assert got == {
        "data-dependent": ("failed", "trace", "data_dependent"),
        "missing-dependency": ("failed", "trace", "import"),
        "python-class-output": ("failed", "trace", "pytree"),
        "noisy": ("failed", "validate", "nondeterministic"),
        "bf16-stack": ("failed", "validate", "numeric_mismatch"),
        "fixed-batch-strict": ("failed", "trace", "dynamic_shape"),
        "healthy": ("ok", None, None),
    }
    assert doc["summary"] == {**doc["summary"], "ok": 1, "failed": 6}
    by_name = {m["name"]: m for m in doc["models"]}
    mismatch = by_name["bf16-stack"]
    assert mismatch["validation"]["passed"] is False and mismatch["validation"]["max_abs_err"] > 1e-2
    assert "compiled" in mismatch["error"]
    # every failure is on record, with its class, and the draft_export report is kept
    code, rows, _ = run_json(["ls", "--store", str(tmp_path / "store"), "--status", "failed"])
    assert sorted((r["model"], r["stage"], r["error_class"]) for r in rows) == sorted(
        (n, s, c) for n, (status, s, c) in got.items() if status == "failed"
    )
    dd = next(r for r in rows if r["model"] == "data-dependent")
    assert dd["sha256"] and "attempts" in dd["details"]
    report = ArtifactStore(str(tmp_path / "store")).get_blob(dd["sha256"]).decode()
    assert "data dependent" in report.lower() or "data-dependent" in report.lower()
    # warm, on the same store (the fleet run in this process): every model reaches the outcome
    # of the cold run, every failure as classified cold
    code, warm = run_in_process(ROOT / "configs" / "failures.yaml", store=str(tmp_path / "store"))
    assert code == 1, warm
    assert {m["name"]: (m["status"], m["failed_stage"], m["error_class"]) for m in warm["models"]} == got


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_target_without_a_gpu_fails_at_aot_compile_and_keeps_the_archive(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", [{**mlp_entry(), "stages": {"aot_compile": {"device": "cuda"}}}])
    code, doc = run_in_process(config, store=str(tmp_path / "store"))  # the fleet's outcome, not the CLI, is under test
    assert code == 1, doc
    (model,) = doc["models"]
    assert (model["failed_stage"], model["error_class"]) == ("aot_compile", "compile")
    assert model["error"] == "aot_compile.device is 'cuda' but no CUDA device is available here"
    statuses = {name: view["status"] for name, view in model["stages"].items()}
    assert statuses["serialize"] == "ok" and statuses["aot_compile"] == "failed"
    # the machine lacked the device: nothing for torch's maintainers, so no reproducer
    proc = run_cli(["repro", "mlp", "-o", str(tmp_path / "repro"), "--store", str(tmp_path / "store")])
    assert proc.returncode == 1 and "lacked the device" in proc.stderr and not (tmp_path / "repro").exists(), (
        proc.stderr
    )


@pytest.mark.compile
def test_run_on_s3_then_ls_lineage_verify(tmp_path: Path, moto_s3) -> None:
    state = save_weights(tmp_path / "mlp.safetensors", seed=3)
    del state
    config = write_config(tmp_path / "c.yaml", [mlp_entry("mlp.safetensors")], stages=STAGE_NAMES)
    store = f"s3://{moto_s3.bucket}/runs/{tmp_path.name}"
    code, doc, stderr = run_json(["run", str(config), "--store", store], env=moto_s3.env)
    assert code == 0, stderr[-3000:]
    assert_clean(stderr)
    model = doc["models"][0]
    assert model["validation"]["passed"] is True
    compiled = model["artifacts"]["compiled"]
    assert compiled and model["stages"]["aot_compile"]["status"] == "ok"

    code, rows, _ = run_json(["ls", "--store", store, "--model", "mlp"], env=moto_s3.env)
    assert code == 0 and sorted(r["stage"] for r in rows) == sorted(["source", *STAGE_NAMES])

    code, lineage, _ = run_json(["lineage", compiled[:12], "--store", store], env=moto_s3.env)
    assert code == 0
    stages = [r["stage"] for r in lineage["ancestors"]]
    assert stages == ["source", "trace", "functionalize", "decompose"]
    source = lineage["ancestors"][0]
    weights_digest = hashlib.sha256((tmp_path / "mlp.safetensors").read_bytes()).hexdigest()
    assert source["factory"] == "tests.models:tiny_mlp" and source["weights_digest"] == weights_digest
    proc = run_cli(["lineage", compiled[:12], "--store", store], env=moto_s3.env)
    assert "tests.models:tiny_mlp" in proc.stdout and weights_digest[:16] in proc.stdout

    code, verified, _ = run_json(["verify", "--store", store], env=moto_s3.env)
    assert code == 0 and verified["missing"] == [] and verified["corrupt"] == []
    assert verified["checked"] >= 8  # 6 stage artifacts + source manifest + weights

    # the package out of S3, verified, and the run's artifacts checked again under this torch
    target = tmp_path / "mlp-package.pt2"
    code, got, stderr = run_json(
        ["get", "--model", "mlp", "--artifact", "compiled", "-o", str(target), "--store", store], env=moto_s3.env
    )
    assert code == 0 and got["sha256"] == compiled, stderr
    assert hashlib.sha256(target.read_bytes()).hexdigest() == compiled
    code, compat, stderr = run_json(["check-compat", "--store", store], env=moto_s3.env)
    assert code == 0, stderr[-3000:]
    (checked,) = compat["models"]
    assert checked["archive"]["matches"] is True and checked["compiled"]["matches"] is True, checked


def test_queries_on_s3_exit_cleanly(tmp_path: Path, moto_s3) -> None:
    """`lineage`, `ls` and `verify` on S3 exit 0. When pyarrow scanned the index through the fsspec
    filesystem, its scanner threads outlived the interpreter and about one query in ten died with
    SIGABRT ("terminate called without an active exception") after printing its answer; later about
    one in a hundred still did, and on CI a `run` on S3. Each query ran eight times here to catch
    it; now the console script leaves before any C-level exit handler can abort it (flows/cli/main.py
    leave), which tests/flows/test_query_cli.py checks with a handler that aborts every time, so
    each query runs once."""
    config = write_config(
        tmp_path / "c.yaml", [mlp_entry()], stages=["trace", "functionalize", "decompose", "serialize", "validate"]
    )
    store = f"s3://{moto_s3.bucket}/queries/{tmp_path.name}"
    # the store built by a run in this process (the S3 variables are this process's: moto_s3); the
    # queries, the subject, are the binary's
    code, doc = run_in_process(config, store=store)
    assert code == 0, doc
    serialized = doc["models"][0]["artifacts"]["serialized"]
    outcomes = []
    for command in (["lineage", serialized[:12]], ["ls", "--model", "mlp"], ["verify"]):
        proc = run_cli([*command, "--store", store, "--json"], env=moto_s3.env)
        outcomes.append((command[0], proc.returncode, "terminate called" in proc.stderr))
        assert json.loads(proc.stdout)  # the answer itself is there either way
    assert [o for o in outcomes if o[1:] != (0, False)] == [], outcomes


BUILT_AT_IMPORT = """import copy

import torch
from torch import nn

torch.randn(3)  # whatever the module draws first: the import itself consumes torch's RNG
MODEL = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # built when imported, as ExportDB's examples are


def at_import():
    return copy.deepcopy(MODEL)


def fresh():
    return nn.Linear(4, 3)
"""


def test_a_model_built_when_its_module_is_imported_gets_the_same_weights_in_any_order_and_process(
    tmp_path: Path,
) -> None:
    """torch's RNG is seeded before a factory's module is first imported (stages/source.py), as
    before the factory is called: a model that module builds at import (torch's ExportDB does)
    gets the same weights, keys and archive whatever the worker ran first. Before, a fresh worker
    process started from a random seed: each run built other weights and another archive ID."""
    (tmp_path / "import_built.py").write_text(BUILT_AT_IMPORT)
    entries = [
        {"name": "fresh", "factory": "import_built:fresh", "inputs": {"input": {"shape": [2, 4]}}},
        {"name": "at-import", "factory": "import_built:at_import", "inputs": {"input": {"shape": [2, 4]}}},
    ]
    archives = []
    for n, (order, workers) in enumerate([(entries, 1), (entries[::-1], 2)]):
        config = write_config(tmp_path / f"c{n}.yaml", order, stages=["trace", "serialize"])
        # the fleet run in this process (what the workers build is under test, not the CLI); its
        # workers are forked processes either way, one, then two in the reverse order
        code, doc = run_in_process(config, store=str(tmp_path / f"store-{n}"), workers=workers)
        assert code == 0, doc
        archives.append({m["name"]: m["artifacts"]["serialized"] for m in doc["models"]})
    assert archives[0] == archives[1], archives
