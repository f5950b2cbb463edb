"""The workers' interpreter (flows/engine/environment/interpreter.py) and overlay environments
(flows/engine/environment/overlay.py), against real second environments (tests/environments.py)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pt2flow.flows.engine.environment import interpreter
from pt2flow.flows.engine.environment.overlay import overlay_environment
from pt2flow.flows.options import UsageError
from pt2flow.stages.deps import changed_entries
from tests.environments import CANDIDATE_TRANSFORMERS, overlay_env

pytestmark = pytest.mark.integration  # asks other interpreters, makes virtual environments


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PT2FLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_another_interpreter_is_asked_once_and_again_after_an_install(cache: Path) -> None:
    candidate = overlay_env("candidate", ["tinyops-2.0", f"transformers=={CANDIDATE_TRANSFORMERS}"])
    found = interpreter.describe(candidate)
    assert found.version("transformers", None) == CANDIDATE_TRANSFORMERS != importlib.metadata.version("transformers")
    assert found.version("tinyops", None) == "2.0" and found.version("torch", None) == importlib.metadata.version(
        "torch"
    )
    [cached] = cache.glob("interpreter-*.json")
    first = cached.stat().st_mtime_ns
    assert interpreter.describe(candidate) == found and cached.stat().st_mtime_ns == first  # answered from the cache
    site = next(p for p in found.site_packages if p.startswith(str(Path(candidate).parents[1])))
    os.utime(site)  # what an install or uninstall does to the folder
    assert interpreter.describe(candidate) == found and cached.stat().st_mtime_ns != first


def test_a_manifest_is_checked_against_the_workers_distributions() -> None:
    recorded = {"files": {}, "distributions": {"transformers": "5.23.0", "torch": importlib.metadata.version("torch")}}
    assert changed_entries(recorded) == []
    assert changed_entries(
        recorded, versions={"transformers": CANDIDATE_TRANSFORMERS, "torch": recorded["distributions"]["torch"]}
    ) == [f"transformers: 5.23.0 -> {CANDIDATE_TRANSFORMERS}"]


def test_activation_changes_the_keys_environment(cache: Path) -> None:
    from pt2flow.flows.engine.environment.interpreter import current_environment
    from pt2flow.flows.engine.orchestrator.stage_keys import environment_part as _env

    candidate = overlay_env("candidate", ["tinyops-2.0", f"transformers=={CANDIDATE_TRANSFORMERS}"])
    try:
        here = _env("cpu", ["transformers"])
        interpreter.activate(candidate)
        there = _env("cpu", ["transformers"])
        assert there["transformers"] == CANDIDATE_TRANSFORMERS and here["transformers"] == importlib.metadata.version(
            "transformers"
        )
        assert current_environment().torch_version == importlib.metadata.version("torch")
    finally:
        interpreter.activate(None)
    assert interpreter.current().local


def test_an_overlay_takes_one_distribution_from_the_candidate(cache: Path) -> None:
    candidate = interpreter.describe(
        overlay_env("candidate", ["tinyops-2.0", f"transformers=={CANDIDATE_TRANSFORMERS}"])
    )
    base = interpreter.describe(overlay_env("baseline", ["tinyops-1.0"]))
    python = overlay_environment(base, candidate, ["tinyops"], cache / "overlays")
    probe = "import tinyops, transformers, importlib.metadata as m; print(m.version('tinyops'), transformers.__version__, tinyops.scale.__code__.co_filename)"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == [
        "2.0",
        importlib.metadata.version("transformers"),
    ]  # tinyops from the candidate, transformers from the base
    assert os.path.realpath(out[2]).startswith(str(Path(candidate.python).parents[1]))
    assert overlay_environment(base, candidate, ["tinyops"], cache / "overlays") == python  # made once


def test_an_interpreter_without_pt2flow_is_a_usage_error(tmp_path: Path, cache: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    with pytest.raises(UsageError, match="pt2flow is not importable.*install it into that environment"):
        interpreter.describe(tmp_path / "bare")
    with pytest.raises(UsageError, match="no such interpreter"):
        interpreter.describe(tmp_path / "missing" / "python")


def test_a_pt2flow_that_speaks_another_worker_protocol_is_a_usage_error(tmp_path: Path, cache: Path) -> None:
    venv = tmp_path / "old"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    package = Path(site, "pt2flow", "flows", "engine")
    package.mkdir(parents=True)
    for folder in (package.parents[1], package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "protocol.py").write_text("WORKER_PROTOCOL = 999\n")  # a pt2flow whose messages are not ours
    with pytest.raises(UsageError, match="speaks worker protocol 999.*install the same pt2flow into both environments"):
        interpreter.describe(venv)
