"""The dependency manifest of a transformers model is the same in a fresh worker and in one that
ran an AOTInductor compile first (which imports setuptools, which appends its vendored folder,
with a `tomli` distribution, to sys.path). Real compile, real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.compile

SCRIPT = textwrap.dedent("""
    import json, sys
    from pt2flow.stages.distributions import pin_import_path
    pin_import_path()  # as the worker does at start
    import torch
    if sys.argv[1] == "compile-first":
        program = torch.export.export(torch.nn.Linear(3, 3), (torch.randn(2, 3),))
        torch._inductor.aoti_compile_and_package(program, package_path=sys.argv[2])
    from pt2flow.stages.deps import manifest
    from tests.hf_models import bert_tiny
    model = bert_tiny()
    print(json.dumps([manifest(["tests.hf_models", *(type(m) for m in model.modules())]), [p for p in sys.path if "_vendor" in p]]))
""")


def _manifest(mode: str, package: str) -> tuple[dict, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, package], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found, vendored = json.loads(proc.stdout.strip().splitlines()[-1])
    return found, vendored


def test_a_worker_that_compiled_records_the_manifest_of_a_fresh_one(tmp_path) -> None:
    fresh, fresh_path = _manifest("fresh", "")
    compiled, compiled_path = _manifest("compile-first", str(tmp_path / "linear.pt2"))
    assert compiled_path and not fresh_path, "the compile appended setuptools' vendored folder to sys.path (the cause)"
    assert "tomli" not in compiled["distributions"]
    assert compiled == fresh
