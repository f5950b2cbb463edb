"""A run is named by its full ID or by a unique prefix or suffix of it: `pt2flow check-compat
d559a4ad` with the random tail of `20261130T173000Z-d559a4ad` finds that run; a part several runs
share is refused, naming them (flows/report/runs.py resolve_run, behind every RUN argument)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pt2flow.flows.report import resolve_run
from pt2flow.storage import AmbiguousId, ArtifactStore, RecordNotFound
from tests.conftest import run_cli, run_in_process, run_json, write_config
from tests.records import make_chain


def test_a_prefix_or_a_suffix_names_one_run(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    first, second = "20261124T150000Z-aaaa1111", "20261125T150000Z-bbbb1111"
    make_chain(store, "alpha", first, None, salt="v1", offset=0)
    make_chain(store, "alpha", second, None, salt="v2", offset=10)
    assert resolve_run(store.index, "aaaa1111") == first  # the tail the summary's run ID ends in
    assert resolve_run(store.index, "20261125") == second
    with pytest.raises(AmbiguousId, match=f"run suffix '1111' matches 2 runs: {first}, {second}"):
        resolve_run(store.index, "1111")
    with pytest.raises(AmbiguousId, match="run prefix '2026112' matches 2 runs"):
        resolve_run(store.index, "2026112")
    for middle in ("T15", "bbbb"):  # a part from the middle of an ID names no run
        with pytest.raises(
            RecordNotFound, match=f"no run '{middle}' in the index: give a run ID or a unique prefix or suffix"
        ):
            resolve_run(store.index, middle)


@pytest.mark.integration  # a real run (worker processes), then check-compat's checker
def test_check_compat_takes_the_tail_of_a_run_id(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "c.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}],
        stages=["trace", "serialize", "validate"],
    )
    store = str(tmp_path / "store")
    code, document = run_in_process(config, store=store)
    assert code == 0, document
    run_id = document["run_id"]
    tail = run_id.rsplit("-", 1)[1]
    assert len(tail) == 8 and not run_id.startswith(tail)
    code, compat, stderr = run_json(["check-compat", tail, "--store", store])
    assert code == 0, stderr[-3000:]
    assert compat["run_id"] == run_id and compat["summary"] == {"ok": 1, "failed": 0, "unchecked": 0}
    assert [m["name"] for m in compat["models"]] == ["mlp"]
    proc = run_cli(["check-compat", "0" + tail, "--store", store])  # no run ends so
    assert proc.returncode == 1 and f"no run '0{tail}' in the index" in proc.stderr, proc.stderr[-2000:]
