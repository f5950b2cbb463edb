"""What the read recorder (stages/reads.py) sees, and what it cannot see: real files, real
loaders (json, numpy, torch.load, safetensors' native reader), real subprocesses.

Each case runs in a fresh interpreter, as a worker is one: the recorder is installed first,
then the model code runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _record(folder: Path, body: str, exclude: list[str] | None = None) -> list[str]:
    """The files `body` (run inside recording()) reads, relative to `folder`."""
    script = textwrap.dedent("""
        import json, os, subprocess, sys
        from pt2flow.stages.reads import install, recording
        install()
        folder = sys.argv[1]
        with recording(exclude=json.loads(sys.argv[2])) as reads:
        {body}
        print(json.dumps([os.path.relpath(p, folder) for p in reads.files()]))
    """).replace("{body}", textwrap.indent(textwrap.dedent(body), "    "))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder), json.dumps(exclude or [])],
        capture_output=True,
        text=True,
        cwd=folder,
        env={"PYTHONPATH": f"{ROOT}:{folder}", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def data(tmp_path: Path) -> Path:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    (tmp_path / "arch.json").write_text('{"width": 3}')
    np.save(tmp_path / "w.npy", np.ones(3))
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "skip.json").write_text("{}")
    return tmp_path


def test_python_and_native_loaders_are_seen(data: Path) -> None:
    found = _record(
        data,
        """
        import numpy, torch
        from safetensors.torch import load_file
        json.load(open("arch.json")); numpy.load("w.npy"); torch.load("w.pt"); load_file("w.safetensors")
        fd = os.open("arch.json", os.O_RDONLY); os.close(fd)
    """,
    )
    assert found == ["arch.json", "w.npy", "w.pt", "w.safetensors"]


def test_a_module_holding_safe_open_from_before_is_seen_too(data: Path) -> None:
    # transformers' modeling_utils does `from safetensors import safe_open` when imported
    found = _record(
        data,
        """
        from safetensors import safe_open
        with safe_open("w.safetensors", framework="pt") as f:
            f.get_tensor("w")
    """,
    )
    assert found == ["w.safetensors"]


def test_what_is_not_a_model_input(data: Path) -> None:
    found = _record(
        data,
        """
        open("written.json", "w").write("{}"); json.load(open("written.json"))  # its own output
        open("gone.json", "w").write("{}"); open("gone.json").read(); os.remove("gone.json")
        json.load(open("cache/skip.json"))  # an excluded folder
        import email.mime.text  # code: the import manifest covers it
        import importlib.metadata
        importlib.metadata.distribution("numpy").read_text("METADATA")  # installed files: the distributions cover them
    """,
        exclude=[str(data / "cache")],
    )
    assert found == []


def test_the_limits_what_other_processes_and_the_environment_give(data: Path) -> None:
    # documented limits (docs/architecture.md §5): the eager digest is the backstop for these
    found = _record(
        data,
        """
        subprocess.run(["cat", "arch.json"], capture_output=True, check=True)
        os.environ.get("SCALE")
    """,
    )
    assert found == []


def test_import_time_reads_belong_to_the_module_and_count_in_any_worker(data: Path) -> None:
    (data / "configured.py").write_text("import json\nSETTINGS = json.load(open('arch.json'))\n")
    script = textwrap.dedent("""
        import json, sys
        from pt2flow.stages.reads import import_reads, install, recording
        install()
        import configured  # before any recording: a reused worker imported it for another model
        with recording() as reads:
            import configured  # noqa: F811  (already imported: nothing read now)
        print(json.dumps([reads.files(), sorted(import_reads(["configured"]))]))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=data,
        env={"PYTHONPATH": f"{ROOT}:{data}", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    direct, by_module = json.loads(proc.stdout.strip().splitlines()[-1])
    assert direct == [] and by_module == [str(data / "arch.json")]
