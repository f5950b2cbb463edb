"""`pt2flow ls / show / lineage / diff / verify / gc` as real subprocesses on a store with real blobs.

Bad input (bit-flipped, truncated, missing blob; unknown, ambiguous or short ID) gets a clear
message and a non-zero exit, and the store is left byte-for-byte as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, cli_in_process, run_cli, run_cli_into_closed_pipe, run_json
from tests.records import CHAIN, h, make_chain

pytestmark = pytest.mark.integration  # each test runs the `pt2flow` query commands as subprocesses


def _json(proc: subprocess.CompletedProcess[str]) -> tuple[int, Any]:
    """(exit code, stdout as one JSON document) of a `--json` command run by cli_in_process."""
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"stdout is not one JSON document ({exc}):\n{proc.stdout[:2000]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        ) from exc


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def populated(tmp_path: Path) -> dict:
    root = tmp_path / "store"
    store = ArtifactStore(str(root))

    def blob(name: str) -> tuple[str, int]:
        ref = store.put_blob(f"artifact {name}".encode() * 50)
        return ref.digest, ref.size

    weights = store.put_blob(b"checkpoint bytes").digest
    alpha = make_chain(store, "alpha", "run-1", weights, salt="v1", blob=blob)
    beta = make_chain(store, "beta", "run-1", None, salt="v1", blob=blob)
    report = {"passed": True, "max_abs_err": 3e-7, "samples": 3}
    rep = store.put_blob(json.dumps(report).encode())
    store.index.append(
        [
            {
                **alpha["validate"],
                "record_id": "rep",
                "run_id": "run-2",
                "sha256": rep.digest,
                "size": rep.size,
                "validation": json.dumps(report),
                "passed": True,
                "max_abs_err": 3e-7,
            }
        ]
    )
    return {"root": root, "store": store, "alpha": alpha, "beta": beta, "weights": weights, "report": rep.digest}


def test_ls_filters_and_json(populated: dict) -> None:
    root = str(populated["root"])
    code, rows, _ = run_json(["ls", "--store", root, "--model", "alpha", "--stage", "trace"])
    assert code == 0
    assert [(r["model"], r["stage"]) for r in rows] == [("alpha", "trace")]
    assert rows[0]["sha256"] == populated["alpha"]["trace"]["sha256"]
    code, rows, _ = run_json(["ls", "--store", root, "--run", "run-2"])
    assert [r["record_id"] for r in rows] == ["rep"]
    code, rows, _ = run_json(
        ["ls", "--store", root, "--since", "2026-11-01T00:00:03", "--until", "2026-11-01T00:00:04", "--model", "beta"]
    )
    assert sorted(r["stage"] for r in rows) == ["decompose", "serialize"]
    proc = run_cli(["ls", "--store", root, "--model", "beta"])
    assert proc.returncode == 0 and "beta" in proc.stdout and "alpha" not in proc.stdout


def test_ls_torch_without_local_part_and_run_prefixes(tmp_path: Path) -> None:
    """`--torch 2.13.0` matches every local build of 2.13.0 (not 2.13.01); `--run` takes a unique
    prefix, as `get --run` and `report` do, and says so when a prefix names several runs or none."""
    from pt2flow.flows import api

    root = tmp_path / "s"
    store = ArtifactStore(str(root))
    runs = {"a": "20261124T150000Z-aaaaaaaa", "b": "20261124T160000Z-bbbbbbbb", "c": "20261125T090000Z-cccccccc"}
    torches = {"a": "2.13.0+cpu", "b": "2.13.0+cu126", "c": "2.13.01"}
    store.index.append(
        [
            {
                "record_id": key,
                "run_id": runs[key],
                "model": "m",
                "stage": "trace",
                "status": "ok",
                "key": h(key),
                "sha256": h(key),
                "size": 1,
                "torch_version": torches[key],
            }
            for key in runs
        ]
        + [
            {
                "record_id": "exact",
                "run_id": runs["c"],
                "model": "n",
                "stage": "trace",
                "status": "ok",
                "key": h("exact"),
                "sha256": h("exact"),
                "size": 1,
                "torch_version": "2.13.0",
            }
        ]
    )
    code, rows, _ = run_json(["ls", "--store", str(root), "--torch", "2.13.0"])
    assert code == 0 and sorted(r["record_id"] for r in rows) == ["a", "b", "exact"]
    code, rows, _ = run_json(["ls", "--store", str(root), "--torch", "2.13.0+cpu"])
    assert code == 0 and [r["record_id"] for r in rows] == ["a"]
    code, rows, _ = run_json(["ls", "--store", str(root), "--run", "20261124T16"])
    assert code == 0 and [r["record_id"] for r in rows] == ["b"]
    code, rows, _ = run_json(["ls", "--store", str(root), "--run", runs["c"][:12], "--torch", "2.13.0"])
    assert code == 0 and [r["record_id"] for r in rows] == ["exact"]
    proc = run_cli(["ls", "--store", str(root), "--run", "20261124"])
    assert (
        proc.returncode == 2
        and "run prefix '20261124' matches 2 runs" in proc.stderr
        and "Traceback" not in proc.stderr
    ), proc.stderr
    proc = run_cli(["ls", "--store", str(root), "--run", "20261126"])
    assert proc.returncode == 1 and "no run '20261126'" in proc.stderr and proc.stdout == "", proc.stderr
    python = api.open_store(str(root))
    assert [r["record_id"] for r in python.ls(run="20261125", torch="2.13.0")] == ["exact"] and python.count(
        run="20261124T15"
    ) == 1


def test_show_prints_every_field_and_the_report(populated: dict) -> None:
    root = str(populated["root"])
    code, record, _ = run_json(["show", populated["report"][:10], "--store", root])
    assert code == 0
    assert record["sha256"] == populated["report"]
    assert record["report"] == {"passed": True, "max_abs_err": 3e-7, "samples": 3}
    assert record["validation"]["max_abs_err"] == 3e-7
    assert record["recorded_in_runs"] == ["run-2"]
    proc = run_cli(["show", populated["alpha"]["trace"]["sha256"][:12], "--store", root])
    assert proc.returncode == 0 and populated["alpha"]["trace"]["sha256"] in proc.stdout


def test_lineage_json_starts_at_the_source(populated: dict) -> None:
    root = str(populated["root"])
    target = populated["alpha"]["aot_compile"]["sha256"]
    code, doc, _ = run_json(["lineage", target[:9], "--store", root])
    assert code == 0
    assert doc["id"] == target
    assert [r["stage"] for r in doc["ancestors"]] == ["source", "trace", "functionalize", "decompose"]
    assert doc["ancestors"][0]["factory"] == "zoo:net"
    assert doc["ancestors"][0]["weights_digest"] == populated["weights"]
    assert doc["descendants"] == []
    code, doc, _ = run_json(["lineage", populated["alpha"]["decompose"]["sha256"], "--descendants", "--store", root])
    assert sorted(r["stage"] for r in doc["descendants"]) == ["aot_compile", "serialize", "validate"]
    proc = run_cli(["lineage", target[:9], "--store", root])
    assert proc.returncode == 0
    assert "zoo:net" in proc.stdout and populated["weights"][:16] in proc.stdout


def test_lineage_by_weights(populated: dict) -> None:
    code, doc, _ = run_json(["lineage", "--weights", populated["weights"][:10], "--store", str(populated["root"])])
    assert code == 0
    assert [s["model"] for s in doc["sources"]] == ["alpha"]
    assert {r["stage"] for r in doc["descendants"]} == set(CHAIN[1:])


def test_diff_reports_histogram_changes(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "s"))
    base = {"run_id": "r", "model": "m", "stage": "decompose", "status": "ok", "key": "k"}
    store.index.append(
        [
            {
                **base,
                "record_id": "a",
                "sha256": h("a"),
                "size": 100,
                "node_count": 10,
                "seconds": 1.0,
                "op_histogram": json.dumps({"aten.addmm.default": 2, "aten.relu.default": 1, "aten.gelu.default": 1}),
                "signature": json.dumps({"inputs": [{"name": "x"}], "outputs": []}),
            },
            {
                **base,
                "record_id": "b",
                "sha256": h("b"),
                "size": 120,
                "node_count": 12,
                "seconds": 2.0,
                "op_histogram": json.dumps({"aten.addmm.default": 3, "aten.relu.default": 1, "aten.tanh.default": 2}),
                "signature": json.dumps({"inputs": [{"name": "x"}], "outputs": []}),
            },
        ]
    )
    code, doc, _ = run_json(["diff", h("a")[:8], h("b")[:8], "--store", str(tmp_path / "s")])
    assert code == 0
    assert doc["op_histogram"]["added"] == {"aten.tanh.default": 2}
    assert doc["op_histogram"]["removed"] == {"aten.gelu.default": 1}
    assert doc["op_histogram"]["changed"] == {"aten.addmm.default": [2, 3]}
    assert doc["op_histogram"]["counts"] == {"added": 1, "removed": 1, "changed": 1}
    assert doc["node_count"] == {"a": 10, "b": 12, "same": False}
    assert doc["signature"]["same"] is True
    proc = run_cli(["diff", h("a")[:8], h("b")[:8], "--store", str(tmp_path / "s")])
    assert proc.returncode == 0 and "+ aten.tanh.default" in proc.stdout and "- aten.gelu.default" in proc.stdout


def test_diff_does_not_compare_the_seconds_of_cached_records(tmp_path: Path) -> None:
    """A cached record's seconds time the index lookup: two of them are not "changed" timings."""
    store = ArtifactStore(str(tmp_path / "s"))
    base = {
        "run_id": "r",
        "model": "m",
        "stage": "decompose",
        "status": "ok",
        "key": "k",
        "node_count": 10,
        "size": 100,
    }
    store.index.append(
        [
            {**base, "record_id": "a", "sha256": h("a"), "seconds": 0.0012, "cached": True},
            {**base, "record_id": "b", "sha256": h("b"), "seconds": 0.0009, "cached": True},
            {**base, "record_id": "c", "sha256": h("c"), "seconds": 1.5, "cached": False},
            {**base, "record_id": "d", "sha256": h("d"), "seconds": 2.5, "cached": False},
        ]
    )
    root = str(tmp_path / "s")
    code, doc, _ = run_json(["diff", h("a")[:8], h("b")[:8], "--store", root])
    assert code == 0 and doc["seconds"] == {"a": 0.0012, "b": 0.0009, "same": None, "cached": {"a": True, "b": True}}
    assert doc["node_count"]["same"] is True and doc["size"]["same"] is True
    proc = run_cli(["diff", h("a")[:8], h("b")[:8], "--store", root])
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("│ seconds ")]
    assert proc.returncode == 0 and "0.0012 (cached)" in row and "not compared" in row and "changed" not in row, (
        proc.stdout
    )
    code, doc, _ = run_json(["diff", h("c")[:8], h("d")[:8], "--store", root])  # two stage runs are timed and compared
    assert doc["seconds"] == {"a": 1.5, "b": 2.5, "same": False, "cached": {"a": False, "b": False}}


def test_verify_clean_store(populated: dict) -> None:
    code, doc, _ = run_json(["verify", "--store", str(populated["root"])])
    assert code == 0
    assert doc["missing"] == [] and doc["corrupt"] == []
    assert doc["checked"] == len(list(populated["store"].list_blobs()))


@pytest.mark.parametrize("damage", ["bit_flip", "truncate", "delete"])
def test_verify_names_damaged_blobs_and_their_records(populated: dict, damage: str) -> None:
    store, root = populated["store"], populated["root"]
    victim = populated["alpha"]["serialize"]["sha256"]
    path = Path(store.blob_path(victim))
    data = path.read_bytes()
    if damage == "bit_flip":
        path.write_bytes(data[:10] + bytes([data[10] ^ 0x40]) + data[11:])
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    before = snapshot(root)
    code, doc, _ = run_json(["verify", "--store", str(root)])
    assert code == 1
    bucket = doc["missing"] if damage == "delete" else doc["corrupt"]
    assert [item["sha256"] for item in bucket] == [victim]
    assert [(r["model"], r["stage"]) for r in bucket[0]["records"]] == [("alpha", "serialize")]
    proc = run_cli(["verify", "--store", str(root)])
    assert proc.returncode == 1 and victim in proc.stdout and "alpha/serialize" in proc.stdout
    assert snapshot(root) == before  # verify changes nothing


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["show", "0123456789abcdef"], 1, "no artifact with ID"),
        (["show", "abc"], 2, "at least 8"),
        (["show", "not-hex-at-all"], 2, "not a hex"),
        (["lineage", "0123456"], 2, "at least 8"),
        (["lineage"], 2, "give an artifact ID"),
        (["diff", "00000000", "11111111"], 1, "no artifact"),
    ],
)
def test_bad_ids_exit_non_zero_and_change_nothing(populated: dict, args: list[str], code: int, message: str) -> None:
    before = snapshot(populated["root"])
    proc = run_cli([*args, "--store", str(populated["root"])])
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(populated["root"]) == before


def test_ambiguous_prefix_exits_2(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "s"))
    base = {"run_id": "r", "model": "m", "stage": "trace", "status": "ok", "key": "k"}
    store.index.append(
        [
            {**base, "record_id": "1", "sha256": "deadbeef" + "0" * 56},
            {**base, "record_id": "2", "sha256": "deadbeef" + "1" * 56},
        ]
    )
    proc = run_cli(["show", "deadbeef", "--store", str(tmp_path / "s")])
    assert proc.returncode == 2
    assert "matches 2 artifacts" in proc.stderr


def test_a_closed_stdout_ends_every_query_quietly_with_141(populated: dict) -> None:
    """`pt2flow ls --json | head`: the reader leaves, pt2flow stops with 141 (as if SIGPIPE had
    ended it) and prints no traceback; the same command into an open pipe exits 0."""
    root, sha = str(populated["root"]), populated["alpha"]["decompose"]["sha256"]
    commands = [
        ["ls"],
        ["ls", "--json"],
        ["show", sha[:10]],
        ["show", sha[:10], "--json"],
        ["lineage", sha[:10]],
        ["diff", sha[:10], populated["beta"]["decompose"]["sha256"][:10], "--json"],
        ["report"],
        ["report", "--json"],
        ["verify", "--json"],
        ["failures"],
        ["failures", "--json"],
    ]
    for args in commands:
        assert run_cli([*args, "--store", root]).returncode == 0, args
        proc = run_cli_into_closed_pipe([*args, "--store", root])
        assert (proc.returncode, proc.stderr) == (141, ""), (args, proc.stderr)
    proc = run_cli_into_closed_pipe(["schema"])  # no store: stdout only
    assert (proc.returncode, proc.stderr) == (141, ""), proc.stderr


EXIT_HANDLER_THAT_ABORTS = """import atexit, ctypes, os
libc = ctypes.CDLL(None)
# a C-level exit handler that aborts, as a C++ std::thread destroyed while it still runs does
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
atexit.register(lambda: open(os.environ["ATEXIT_MARK"], "a").write("ran\\n"))  # Python's own atexit
"""


def test_a_command_exits_with_its_code_whatever_a_c_exit_handler_would_do(populated: dict, tmp_path: Path) -> None:
    """A library's C++ thread still running when the interpreter tore itself down made a finished
    command die with SIGABRT ("terminate called without an active exception") after printing its
    answer: a query on S3 about once in a hundred, a `run` on S3 on CI. The console script leaves
    after the atexit callbacks, before any C-level exit handler (flows/cli/main.py leave); here a
    handler that aborts is planted in the real process (a sitecustomize on PYTHONPATH)."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(EXIT_HANDLER_THAT_ABORTS)
    mark = tmp_path / "atexit.txt"
    env = {**os.environ, "PYTHONPATH": str(plant), "ATEXIT_MARK": str(mark)}
    root = str(populated["root"])
    python = str(Path(sys.executable))
    # the handler is real: the process dies with it when the interpreter exits the usual way
    proc = subprocess.run([python, "-c", "pass"], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT and mark.read_text() == "ran\n"
    mark.unlink()
    commands = [
        (["ls", "--store", root, "--json"], 0),
        (["show", "zzzz", "--store", root], 2),  # an unknown ID: its own exit code, not SIGABRT's
    ]
    for args, code in commands:
        for argv in ([str(BIN / "pt2flow"), *args], [python, "-m", "pt2flow.flows.cli.main", *args]):
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == code, (argv, proc.returncode, proc.stderr[-2000:])
            if code == 0:
                assert [r["model"] for r in json.loads(proc.stdout)], proc.stdout  # the answer, whole
    assert mark.read_text() == "ran\n" * 4  # every process ran Python's atexit callbacks first


def test_bad_ids_are_not_storage_errors_in_python(populated: dict) -> None:
    """The CLI exits 2 for a bad or ambiguous ID and 1 for a storage error: from Python they are
    told apart the same way (`except api.StorageError` does not swallow a caller's bad ID)."""
    from pt2flow.flows import api

    store = api.open_store(str(populated["root"]))
    populated["store"].index.append(
        [
            {
                "record_id": "x1",
                "run_id": "r",
                "model": "m",
                "stage": "trace",
                "status": "ok",
                "key": "k",
                "sha256": "deadbeef" + "0" * 56,
            },
            {
                "record_id": "x2",
                "run_id": "r",
                "model": "m",
                "stage": "trace",
                "status": "ok",
                "key": "k",
                "sha256": "deadbeef" + "1" * 56,
            },
        ]
    )
    for bad, error, builtin in (("xyz", api.InvalidId, ValueError), ("deadbeef", api.AmbiguousId, LookupError)):
        with pytest.raises(error) as raised:
            store.show(bad)
        assert isinstance(raised.value, builtin) and not isinstance(raised.value, api.StorageError)
        assert run_cli(["show", bad, "--store", str(populated["root"])]).returncode == 2
    with pytest.raises(api.StorageError):  # what the store does not hold is still one
        store.show("0" * 64)


QUERY_COMMANDS = (
    "ls",
    "show",
    "lineage",
    "diff",
    "verify",
    "gc",
    "report",
    "get",
    "repro",
    "check-compat",
    "audit",
    "failures",
)


def test_the_query_commands_say_how_the_store_is_chosen(populated: dict, tmp_path: Path) -> None:
    """Every query command takes --config and documents the rule (README "Which store"): --store,
    else --config's store, else $PT2FLOW_STORE, else ./pt2-store; run's --store overrides the config's."""
    for name in QUERY_COMMANDS:
        text = " ".join(run_cli([name, "--help"]).stdout.split())
        assert (
            "default: --config's store, else $PT2FLOW_STORE, else ./pt2-store" in text and "--config CONFIG" in text
        ), (name, text)
    assert "overrides the config's store:" in " ".join(cli_in_process(["run", "--help"]).stdout.split())
    sha = populated["alpha"]["trace"]["sha256"]
    # $PT2FLOW_STORE: main(ARGS) in this process, with the variables and folder a subprocess would get
    code, rows = _json(
        cli_in_process(
            ["ls", "--model", "alpha", "--stage", "trace", "--json"],
            env={"PT2FLOW_STORE": str(populated["root"])},
            cwd=tmp_path,
        )
    )
    assert code == 0 and [r["sha256"] for r in rows] == [sha]


def test_config_names_the_store_relative_to_its_folder_and_beats_the_environment(
    populated: dict, tmp_path: Path
) -> None:
    """`--config CONFIG` reads CONFIG's `store:` resolved against CONFIG's folder (as `run` writes
    it), from any current folder; --store beats it, it beats $PT2FLOW_STORE; its models are not
    checked (a query needs only the store)."""
    sha = populated["alpha"]["trace"]["sha256"]
    config = tmp_path / "team" / "fleet.yaml"
    config.parent.mkdir()
    config.write_text(
        f"version: 1\nstore: {os.path.relpath(populated['root'], config.parent)}\n"
        "models: [{name: m, factory: 'not_importable_here:f', inputs: {x: {shape: [1], dtype: float32}}}]\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    empty = tmp_path / "empty-store"
    empty.mkdir()
    query = ["ls", "--model", "alpha", "--stage", "trace"]
    for cwd, path in ((elsewhere, str(config)), (config.parent, "fleet.yaml"), (tmp_path, "team/fleet.yaml")):
        proc = cli_in_process([*query, "--config", path, "--json"], env={"PT2FLOW_STORE": str(empty)}, cwd=cwd)
        code, rows = _json(proc)
        assert code == 0 and [r["sha256"] for r in rows] == [sha], (cwd, proc.stderr)
    code, rows, _ = run_json([*query, "--config", str(config), "--store", str(empty)])
    assert code == 0 and rows == []  # --store wins
    config.write_text("version: 1\nstore: ./not-run-yet\nmodels: []\n")
    proc = run_cli(["ls", "--config", str(config)], cwd=elsewhere)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"pt2flow ls: no store at {config.parent / 'not-run-yet'} (the store of {config}; give --store URL, --config CONFIG or set PT2FLOW_STORE)"
    )
    config.write_text("version: 1\nstore: {a: b}\nmodels: []\n")
    proc = run_cli(["report", "--config", str(config)])
    assert (
        proc.returncode == 2
        and f"{config}:2: store: expected a store URL or path" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def test_missing_store_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli(["ls", "--store", str(tmp_path / "nowhere")])
    assert proc.returncode == 2 and "no store at" in proc.stderr
    assert not (tmp_path / "nowhere").exists()


def test_gc_deletes_only_old_unreferenced_blobs(populated: dict) -> None:
    store, root = populated["store"], populated["root"]
    orphan = store.put_blob(b"orphan: no record points here")
    old = store.blob_path(orphan.digest)
    os.utime(old, (1_000_000_000, 1_000_000_000))  # long past any grace period
    young = store.put_blob(b"just published, record not written yet")
    referenced = {b.digest for b in store.list_blobs()} - {orphan.digest, young.digest}

    code, doc, _ = run_json(["gc", "--dry-run", "--store", str(root)])
    assert code == 0 and doc["would_delete"] == [orphan.digest] and doc["kept_within_grace"] == 1
    assert store.has_blob(orphan.digest)

    code, doc, _ = run_json(["gc", "--store", str(root)])
    assert doc["deleted"] == [orphan.digest]
    remaining = {b.digest for b in store.list_blobs()}
    assert remaining == referenced | {young.digest}  # weights and every recorded artifact kept
    code, doc, _ = run_json(["verify", "--store", str(root)])
    assert code == 0


def test_gc_compact_merges_the_index(populated: dict) -> None:
    root = populated["root"]
    before = run_json(["ls", "--store", str(root), "--limit", "0"])[1]
    code, doc, _ = run_json(["gc", "--compact", "--store", str(root)])
    assert code == 0 and doc["compacted"]["records"] == len(before)
    assert len(populated["store"].index.files()) == 1
    after = run_json(["ls", "--store", str(root), "--limit", "0"])[1]
    assert sorted(r["record_id"] for r in after) == sorted(r["record_id"] for r in before)


def test_help_explains_each_command() -> None:
    proc = run_cli(["--help"])
    assert proc.returncode == 0
    for command in ("run", "validate", "ls", "show", "lineage", "diff", "verify", "gc"):
        assert command in proc.stdout
    proc = run_cli(["lineage", "--help"])
    assert "--descendants" in proc.stdout and "--weights" in proc.stdout
