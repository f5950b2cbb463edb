"""`pt2flow get` writes a file with the mode `open()` would give it (0666 less the user's umask),
not the 0600 of a private temporary file: the artifact is the user's to share."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, cli_env
from tests.records import make_chain


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_get_writes_what_open_would_create(tmp_path: Path, umask: int) -> None:
    store = ArtifactStore(str(tmp_path / "store"))

    def blob(name: str) -> tuple[str, int]:
        ref = store.put_blob(json.dumps({"name": name, "passed": True}).encode())
        return ref.digest, ref.size

    make_chain(store, "alpha", "run-1", None, salt="v1", blob=blob)
    target = tmp_path / "out" / "report.json"
    target.parent.mkdir()
    proc = subprocess.run(
        [str(BIN / "pt2flow"), "get", "--model", "alpha", "--artifact", "report", "-o", str(target)]
        + ["--store", str(tmp_path / "store")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(umask),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(target.read_text())["name"] == "alpha/v1/validate"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~umask  # 0644 under 022, 0640 under 027
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json"]  # no temporary left beside it
