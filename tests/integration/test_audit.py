"""`pt2flow audit` on real runs: a clean store passes (every program record's blob and its
rebuild give the recorded fingerprint, trace re-traced from the config, each source built again
into the recorded eager model), and a record whose
blob was swapped for another valid program is named, exit 1."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize"]
FLEET = [
    {
        "name": "mlp",
        "factory": "tests.models:tiny_mlp",
        "inputs": {"x": {"shape": [4, 8]}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 16}},
    },
    {"name": "wide", "factory": "tests.models:tiny_mlp", "kwargs": {"hidden": 32}, "inputs": {"x": {"shape": [2, 8]}}},
]


@pytest.fixture(scope="module")
def audited_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    folder = tmp_path_factory.mktemp("audit")
    config = write_config(folder / "fleet.yaml", FLEET, stages=STAGES)
    store = folder / "store"
    code, document = run_in_process(config, store=str(store))  # the fleet run in this process: audit is under test
    assert code == 0, document
    return config, store, document["run_id"]


def test_audit_passes_on_a_clean_store(audited_store: tuple[Path, Path, str]) -> None:
    config, store, run_id = audited_store
    code, doc, stderr = run_json(["audit", "--store", str(store), "--config", str(config), "--workers", "2"])
    assert code == 0, (doc, stderr[-3000:])
    assert doc["run_id"] == run_id
    # two source records (each model built again: its eager digest) and four program records each
    assert doc["sample"] == {"fraction": 1.0, "seed": 0, "records": 10, "checked": 10}
    # models checked side by side (two workers) or one at a time: the same document, in the same order
    code_one, one, _ = run_json(["audit", "--store", str(store), "--config", str(config), "--workers", "1"])
    assert code_one == 0 and one["records"] == doc["records"] and one["summary"] == doc["summary"]
    assert doc["summary"] == {"ok": 10, "failed": 0, "rebuilt": 10}
    for entry in doc["records"]:
        if entry["stage"] == "source":
            assert entry["stored"] == entry["rebuilt"] and len(entry["rebuilt"]) == 64, entry
        else:
            assert entry["stored"] == entry["rebuilt"] == entry["fingerprint"], entry
    # a sample: the same seed picks the same records, never all of them at 0.3 (8 records)
    code, half, _ = run_json(["audit", "--store", str(store), "--sample", "0.3", "--seed", "7"])
    code_again, again, _ = run_json(["audit", run_id[:8], "--store", str(store), "--sample", "0.3", "--seed", "7"])
    assert code == code_again == 0
    assert [r["record_id"] for r in half["records"]] == [r["record_id"] for r in again["records"]]
    assert half["sample"]["checked"] < 10


def test_audit_names_a_record_whose_blob_is_another_valid_program(
    audited_store: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """The index record of mlp's decompose stage is made to point at wide's decompose program
    (a valid program, with its correct hash: `verify` cannot see anything wrong)."""
    import shutil

    _, original, run_id = audited_store
    store = tmp_path / "store"
    shutil.copytree(original, store)
    files = sorted((store / "index").rglob("*.parquet"))
    tables = [pq.read_table(f) for f in files]
    rows = pa.concat_tables(tables).to_pylist()
    wide = next(r for r in rows if r["model"] == "wide" and r["stage"] == "decompose")
    for path, table in zip(files, tables):
        records = table.to_pylist()
        changed = False
        for record in records:
            if record["model"] == "mlp" and record["stage"] == "decompose":
                record.update(sha256=wide["sha256"], size=wide["size"], uri=wide["uri"], blob_stat=None)
                changed = True
        if changed:
            pq.write_table(pa.Table.from_pylist(records, schema=table.schema), path)
    code, verify, _ = run_json(["verify", "--store", str(store)])
    assert code == 0 and verify["missing"] == [] and verify["corrupt"] == []
    code, doc, stderr = run_json(["audit", "--store", str(store)])
    assert code == 1, stderr[-3000:]
    failed = [(r["model"], r["stage"]) for r in doc["records"] if r["status"] == "failed"]
    # the swapped record, and serialize, whose parent program (read through that record) is now
    # another model's: run again on it, serialize gives another program than its record says
    assert failed == [("mlp", "decompose"), ("mlp", "serialize")]
    bad, child = (r for r in doc["records"] if r["status"] == "failed")
    assert bad["stored"] == wide["fingerprint"] and bad["rebuilt"] == bad["fingerprint"]
    assert bad["problem"] == "the stored blob holds another program than the record says"
    assert child["stored"] == child["fingerprint"] and child["rebuilt"] == wide["fingerprint"]
    assert child["problem"] == "serialize run again on the recorded inputs gives another program"
