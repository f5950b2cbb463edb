"""Second Python environments for the tests of `run --python` and `upgrade-check`, made with the
standard tools (venv, pip) and cached between test runs under .cache/test-envs/ (named by what
they are made of; a changed recipe makes a new one).

Each is a virtualenv whose site-packages adds the test runner's own site-packages after itself
(a .pth line calling site.addsitedir), so the one local torch build and pt2flow's editable
install are shared, and whatever is pip-installed into it (`--no-deps`) shadows the runner's
copy: a different transformers release from the package registry, a fixture distribution.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from collections.abc import Sequence

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "test-envs"
FIXTURES = ROOT / "tests" / "fixtures"
CANDIDATE_TRANSFORMERS = "5.24.0"  # the runner has 5.23.0 (requirements.lock)


def _fingerprint(requirements: Sequence[str]) -> str:
    digest = hashlib.sha256(json.dumps([sys.executable, list(requirements)]).encode())
    for requirement in requirements:
        folder = FIXTURES / requirement
        if folder.is_dir():
            for path in sorted(folder.rglob("*")):
                if path.is_file() and "egg-info" not in str(path) and "build" not in path.parts:
                    digest.update(path.relative_to(FIXTURES).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def overlay_env(name: str, requirements: Sequence[str]) -> str:
    """The python executable of the environment `name`: the runner's site-packages plus
    `requirements` (a fixture folder under tests/fixtures, or a registry requirement such as
    transformers==5.24.0), installed with pip --no-deps. Made once, under a lock."""
    folder = CACHE / f"{name}-{_fingerprint(requirements)}"
    python = folder / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "ready").is_file():
            return str(python)
        shutil.rmtree(folder, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=300)
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(site, "_runner_site.pth").write_text(
            f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
        )
        for requirement in requirements:
            source = FIXTURES / requirement
            spec = [str(source), "--no-build-isolation"] if source.is_dir() else [requirement]
            build = Path(os.environ.get("TMPDIR", "/tmp"))
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "--python",
                    str(python),
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--no-deps",
                    *spec,
                ],
                check=True,
                timeout=600,
                cwd=build,
            )
        (folder / "ready").write_text("ok\n")
    return str(python)
