"""The command line itself, as real runs of the installed `pt2flow` script: --version, usage
errors (exit 2, a message naming what was wrong, no traceback) and what a light command imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from tests.conftest import run_cli


def imported_modules(args: list[str]) -> tuple[int, set[str]]:
    """Exit code and top-level names of every module `pt2flow ARGS` imported (-X importtime)."""
    proc = run_cli(args, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=120)
    names = {
        m.group(1).split(".")[0] for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", proc.stderr, re.M)
    }
    assert names, proc.stderr[-2000:]
    return proc.returncode, names


def test_version_names_pt2flow_and_torch() -> None:
    proc = run_cli(["--version"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"pt2flow {version('pt2flow')} (torch {version('torch')})"


@pytest.mark.parametrize(
    "args", [["--version"], ["--help"], ["ls", "--help"], ["report", "--help"], ["validate", "--help"]]
)
def test_light_commands_import_neither_torch_nor_prefect(args: list[str]) -> None:
    code, names = imported_modules(args)
    assert code == 0
    assert "click" in names  # the measurement sees the CLI's own imports
    assert not names & {"torch", "prefect"}, args


def test_help_imports_no_command_module() -> None:
    code, names = imported_modules(["--help"])
    assert code == 0
    assert not names & {"pyarrow", "fsspec", "rich", "yaml", "numpy"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["bogus"], "No such command 'bogus'"),
        (["ls", "--bogus"], "No such option '--bogus'"),
        (["--bogus"], "No such option '--bogus'"),
        (["show"], "Missing argument 'ID'"),
        (["diff", "00000000"], "Missing argument 'ID_B'"),
        (["ls", "--limit", "many"], "'many' is not a valid integer"),
        (["ls", "--status", "maybe"], "'maybe' is not one of 'ok', 'failed'"),
        (["run", "c.yaml", "--runner", "slurm"], "'slurm' is not one of 'local', 'process', 'dask'"),
        (["run", "c.yaml", "--workers", "two"], "'two' is not a valid integer"),
        (["serve", "c.yaml", "--cron", "0 3 * * *", "--interval", "5"], "--cron and --interval exclude each other"),
        (["serve", "c.yaml"], "one of --cron or --interval is required"),
        (["gc", "--grace"], "Option '--grace' requires an argument"),
    ],
)
def test_usage_errors_exit_2_naming_the_problem(args: list[str], message: str) -> None:
    proc = run_cli(args, timeout=120)
    assert proc.returncode == 2, (args, proc.stderr)
    assert message in proc.stderr, (args, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr


def test_no_command_prints_the_help_and_exits_2() -> None:
    proc = run_cli([], timeout=120)
    assert proc.returncode == 2
    for command in ("run", "validate", "serve", "ls", "show", "lineage", "diff", "verify", "gc", "report"):
        assert command in proc.stdout + proc.stderr


def test_storage_option_without_a_value_is_a_usage_error(tmp_path) -> None:
    (tmp_path / "store").mkdir()
    proc = run_cli(["ls", "--store", str(tmp_path / "store"), "--storage-option", "anon"], timeout=120)
    assert proc.returncode == 2 and "--storage-option expects KEY=VALUE" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_long_options_may_be_abbreviated_to_a_unique_prefix(tmp_path) -> None:
    (tmp_path / "store").mkdir()
    proc = run_cli(["ls", "--store", str(tmp_path / "store"), "--lim=5", "--js"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    proc = run_cli(["ls", "--st", "x"], timeout=120)  # --store, --storage-option, --stage, --status
    assert proc.returncode == 2 and "No such option" in proc.stderr


def test_ls_prints_a_long_store_path_on_one_line(tmp_path) -> None:
    """The heading names the store whole, however long its path and whatever the table's width
    (it was the title of a ~75-column table, which broke a long path in two)."""
    store = tmp_path / ("a-store-folder-with-a-name-long-enough-to-pass-any-table-width-" * 2) / "store"
    store.mkdir(parents=True)
    proc = run_cli(["ls", "--store", str(store)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"0 record(s) in {store}"


def test_the_console_script_reads_the_index_without_importing_pandas(tmp_path) -> None:
    """pyarrow imports pandas (installed: ExecuTorch requires it) at its first conversion of a
    Python value, 0.19 s of every command; the console script's process tells it none is needed
    (storage.index.skip_pandas_probe), and answers the same. A program that asks pyarrow for
    pandas itself still gets it: shown in a process of its own after the same call."""
    from pt2flow.storage import ArtifactStore
    from tests.records import make_chain

    store = tmp_path / "store"
    make_chain(ArtifactStore(str(store)), "mlp", "run-1", None)
    proc = run_cli(["ls", "--store", str(store), "--model", "mlp", "--json"], env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {r["stage"] for r in json.loads(proc.stdout)} >= {"source", "trace", "validate"}
    loaded = {  # a refused import shows up too, in microseconds: a loaded pandas takes 0.1 s and more
        m.group(2)
        for m in re.finditer(r"^import time:\s+\d+ \|\s+(\d+) \|\s+(\S+)", proc.stderr, re.M)
        if int(m.group(1)) > 5000
    }
    assert "pyarrow" in loaded and "pandas" not in loaded, sorted(loaded)
    program = (
        "import sys\n"
        "import pyarrow as pa\n"
        "from pt2flow.storage.index import skip_pandas_probe\n"
        "assert skip_pandas_probe()\n"
        "assert pa.array(['x']).to_pylist() == ['x'] and 'pandas' not in sys.modules\n"
        "frame = pa.table({'a': [1, 2]}).to_pandas()\n"
        "print(type(frame).__name__, frame['a'].tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "DataFrame [1, 2]", done.stderr[-2000:]
