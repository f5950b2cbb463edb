"""Index scale benchmark: 1,000,000 synthetic records, then `pt2flow ls --model X` and
`pt2flow lineage ID` timed as whole CLI processes (interpreter start-up and imports included).

    .venv/bin/python bench/index_scale.py [--records 1000000] [--store /tmp/pt2-bench-index] [--repeat 5]

Goal (issue 3): each command <= 1 s on a 2-core machine. Prints the median and min of --repeat
runs of each command, and how long building and compacting the index took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pt2flow.storage import ArtifactStore
from pt2flow.storage.records import SCHEMA, SCHEMA_VERSION

STAGES = ["source", "trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"]


def _hex_digests(rng: np.random.Generator, n: int) -> pa.Array:
    raw = rng.integers(0, 256, size=(n, 32), dtype=np.uint8)
    return pa.array([bytes(row).hex() for row in raw], pa.string())


def write_index_file(store: ArtifactStore, table: pa.Table) -> None:
    """Write synthetic records as one new file of the store's index, as MetadataIndex.append
    would write them, without building a million IndexRecord objects first."""
    table = table.append_column("schema_version", pa.array([SCHEMA_VERSION] * table.num_rows, pa.int16()))
    columns = [
        table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in SCHEMA
    ]
    index = store.index
    index.fs.makedirs(index.root, exist_ok=True)
    with index.fs.open(f"{index.root}/part-bench-{uuid.uuid4().hex[:12]}.parquet", "wb") as out:
        pq.write_table(pa.Table.from_arrays(columns, schema=SCHEMA), out, row_group_size=65536, compression="zstd")


def build_index(store: ArtifactStore, records: int, seed: int = 0) -> dict[str, object]:
    """About records/7 models, each with one record per stage, written in 10 files then compacted."""
    rng = np.random.default_rng(seed)
    per_model = len(STAGES)
    models = records // per_model
    chunk_models = max(1, models // 10)
    started = time.perf_counter()
    sample = {}
    for start in range(0, models, chunk_models):
        count = min(chunk_models, models - start)
        n = count * per_model
        model_ids = np.repeat(np.arange(start, start + count), per_model)
        stage_idx = np.tile(np.arange(per_model), count)
        names = pa.array([f"model-{i:06d}" for i in model_ids])
        keys = _hex_digests(rng, n)
        shas = _hex_digests(rng, n)
        key_list = keys.to_pylist()
        parents = [
            [] if s == 0 else ([key_list[i - s]] if s < 6 else [key_list[i - 6], key_list[i - 2], key_list[i - 1]])
            for i, s in enumerate(stage_idx)
        ]
        weights = _hex_digests(rng, count).to_pylist()
        weights_col = [weights[i // per_model] if s == 0 else None for i, s in enumerate(stage_idx)]
        ended = pa.array(
            (np.datetime64("2026-01-01T00:00:00") + (np.arange(n) + start * per_model).astype("timedelta64[s]")).astype(
                "datetime64[us]"
            ),
            pa.timestamp("us", tz="UTC"),
        )
        table = pa.table(
            {
                "record_id": _hex_digests(rng, n),
                "run_id": pa.array(["bench-run"] * n),
                "model": names,
                "stage": pa.array([STAGES[s] for s in stage_idx]),
                "status": pa.array(["ok"] * n),
                "cached": pa.array([False] * n),
                "key": keys,
                "parent_keys": pa.array(parents, pa.list_(pa.string())),
                "sha256": shas,
                "size": pa.array(rng.integers(1000, 5_000_000, n)),
                "seconds": pa.array(rng.random(n) * 20),
                "started_at": ended,
                "ended_at": ended,
                "torch_version": pa.array(["2.13.0"] * n),
                "factory": pa.array([f"zoo:model_{i}" if s == 0 else None for i, s in zip(model_ids, stage_idx)]),
                "weights_digest": pa.array(weights_col, pa.string()),
                "op_histogram": pa.array(['{"aten.addmm.default": 4, "aten.relu.default": 3}'] * n),
                "node_count": pa.array(rng.integers(10, 2000, n)),
            }
        )
        write_index_file(store, table)
        if not sample:
            sample = {"model": names[per_model * 3].as_py(), "compiled": shas[per_model * 3 + 5].as_py()}
    written = time.perf_counter() - started
    t0 = time.perf_counter()
    result = store.index.compact()
    compacted = time.perf_counter() - t0
    return {
        "models": models,
        "records": models * per_model,
        "write_s": round(written, 2),
        "compact_s": round(compacted, 2),
        "index_files": len(store.index.files()),
        "merged": result.merged_files,
        **sample,
    }


def time_cli(args: list[str], repeat: int) -> dict[str, float]:
    cli = str(Path(sys.executable).parent / "pt2flow")
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run([cli, *args], capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{args} failed: {proc.stderr}")
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--store", default="/tmp/pt2-bench-index")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="reuse an existing benchmark store")
    args = parser.parse_args()
    if not args.keep and os.path.exists(args.store):
        shutil.rmtree(args.store)
    store = ArtifactStore(args.store)
    if args.keep and store.index.files():
        info_path = Path(args.store) / "bench.json"
        info = json.loads(info_path.read_text())
    else:
        info = build_index(store, args.records)
        (Path(args.store) / "bench.json").write_text(json.dumps(info))
    results = {
        "ls --model": time_cli(["ls", "--store", args.store, "--model", info["model"], "--json"], args.repeat),
        "lineage": time_cli(["lineage", info["compiled"][:12], "--store", args.store, "--json"], args.repeat),
        "ls --model (table)": time_cli(["ls", "--store", args.store, "--model", info["model"]], args.repeat),
        "python -c pass": {"median_s": 0.0, "min_s": 0.0},
    }
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    results["python -c pass"] = {
        "median_s": round(time.perf_counter() - start, 3),
        "min_s": round(time.perf_counter() - start, 3),
    }
    print(json.dumps({"index": info, "cli": results}, indent=1))


if __name__ == "__main__":
    main()
