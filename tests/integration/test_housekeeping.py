"""Housekeeping (issue 31): `make clean` stops the Prefect server that a `pt2flow run` outside make
started under Prefect's default home (~/.prefect), unless a run still holds it; it removes every
store the shipped configs write into the repository, which .gitignore names; a shipped config's
"Run with" comment names the store the config writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, ROOT, cli_env, stop_shared_server, write_config


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped yet) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _repository_stores() -> dict[str, str]:
    """config name -> the folder of the repository its `store:` names (the shipped configs')."""
    from pt2flow.flows.config import read_store_settings

    found = {}
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        url, _ = read_store_settings(config)
        path = Path(url)
        if path.parent == ROOT:
            found[config.name] = path.name
    return found


def test_the_stores_shipped_configs_write_are_ignored_and_cleaned() -> None:
    stores = _repository_stores()
    assert stores["failures.yaml"] == "pt2-store-failures" and stores["demo.yaml"] == "pt2-store"
    ignored = set((ROOT / ".gitignore").read_text().split())
    clean = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.strip().startswith("rm -rf"))
    for config, folder in stores.items():
        assert f"{folder}/" in ignored, f"{config} writes ./{folder}, which .gitignore does not name"
        assert folder in clean.split() or (folder == "pt2-store" and "$(STORE)" in clean.split()), (
            f"make clean leaves ./{folder} ({config})"
        )
    # each "Run with" comment runs the config into its own store: no --store naming another
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        command = config.read_text().splitlines()[1]
        assert command.startswith("# Run with: pt2flow run configs/") and "--store" not in command, (
            config.name,
            command,
        )
    assert "./pt2-store-failures" in (ROOT / "configs" / "failures.yaml").read_text().splitlines()[1]
    assert yaml.safe_load((ROOT / "configs" / "failures.yaml").read_text())["store"] == "../pt2-store-failures"


@pytest.mark.integration
def test_make_clean_stops_the_server_a_run_outside_make_started(tmp_path: Path) -> None:
    home = tmp_path / "home"  # the user's home: Prefect's default PREFECT_HOME is ~/.prefect
    home.mkdir()
    clone = tmp_path / "clone"  # what `make clean` sees in a checkout (it deletes .venv and the stores there)
    (clone / "flows" / "engine" / "services").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", clone / "Makefile")
    shutil.copy(
        ROOT / "flows" / "engine" / "services" / "prefect_server.py",
        clone / "flows" / "engine" / "services" / "prefect_server.py",
    )
    (clone / "pt2-store-failures" / "index").mkdir(parents=True)
    config = write_config(
        tmp_path / "fleet.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [4, 8]}}}],
        stages=["trace"],
        store=str(tmp_path / "store"),
    )
    env = cli_env({"HOME": str(home)})
    env.pop("PREFECT_HOME", None)  # outside make: nothing sets it
    env.pop("PT2FLOW_PREFECT_SERVER", None)
    proc = subprocess.run(
        [str(BIN / "pt2flow"), "run", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefect = home / ".prefect"
    pid = int(json.loads((prefect / "pt2flow-server.json").read_text())["pid"])
    try:
        assert _alive(pid)
        make_env = {k: v for k, v in env.items() if not k.startswith("MAKE")}
        # a run still holds the server (a lease of a live process, this one): clean leaves it running
        lease = prefect / "pt2flow-server.leases" / str(os.getpid())
        lease.write_text("")
        done = subprocess.run(
            ["make", "-s", "clean"], cwd=clone, capture_output=True, text=True, timeout=120, env=make_env
        )
        assert done.returncode == 0, done.stderr
        assert f"pt2flow's Prefect server of {prefect} serves a run: left running" in done.stdout, done.stdout
        time.sleep(1)
        assert _alive(pid) and not (clone / "pt2-store-failures").exists()
        lease.unlink()
        done = subprocess.run(
            ["make", "-s", "clean"], cwd=clone, capture_output=True, text=True, timeout=120, env=make_env
        )
        assert done.returncode == 0 and f"stopped pt2flow's Prefect server of {prefect}" in done.stdout, (
            done.stdout,
            done.stderr,
        )
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), "the server of ~/.prefect still runs after make clean"
        # a third clean finds nothing to stop, and says nothing about it
        done = subprocess.run(
            ["make", "-s", "clean"], cwd=clone, capture_output=True, text=True, timeout=120, env=make_env
        )
        assert done.returncode == 0 and "Prefect server" not in done.stdout
    finally:
        stop_shared_server(prefect)
