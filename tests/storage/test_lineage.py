"""Lineage over a synthetic record graph: ID resolution, ancestors, descendants, weights queries."""

from __future__ import annotations

import pytest

from pt2flow.storage import AmbiguousId, ArtifactStore, InvalidId, RecordNotFound
from pt2flow.storage import lineage
from tests.records import CHAIN, T0, h, make_chain

# the order the caller gives (flows passes the pipeline's: storage knows no stage)
ORDER = ("source", "trace", "functionalize", "decompose", "serialize", "aot_compile", "validate")


@pytest.fixture
def graph(store: ArtifactStore) -> dict:
    w = h("checkpoint-1")
    a1 = make_chain(store, "alpha", "run-1", w, salt="v1", offset=0)
    a2 = make_chain(store, "alpha", "run-2", w, salt="v1", offset=10, cached=True)  # unchanged re-run
    b1 = make_chain(store, "beta", "run-1", h("checkpoint-2"), salt="v1", offset=0)
    return {"w": w, "a1": a1, "a2": a2, "b1": b1}


def test_resolve_by_full_id_and_prefix(store: ArtifactStore, graph: dict) -> None:
    digest = graph["a1"]["aot_compile"]["sha256"]
    newest = lineage.resolve(store.index, digest)
    assert newest["sha256"] == digest and newest["run_id"] == "run-2"  # newest of the two records
    assert lineage.resolve(store.index, digest[:8])["sha256"] == digest
    assert len(lineage.records_for_id(store.index, digest[:10])) == 2


def test_bad_ids(store: ArtifactStore, graph: dict) -> None:
    with pytest.raises(InvalidId, match="at least 8"):
        lineage.resolve(store.index, graph["a1"]["trace"]["sha256"][:7])
    with pytest.raises(InvalidId, match="not a hex"):
        lineage.resolve(store.index, "zzzzzzzzzz")
    with pytest.raises(RecordNotFound):
        lineage.resolve(store.index, "0" * 64)


def test_ambiguous_prefix_names_the_candidates(store: ArtifactStore) -> None:
    base = {"run_id": "r", "status": "ok", "stage": "trace", "ended_at": T0}
    store.index.append([{**base, "record_id": "1", "model": "x", "key": "k1", "sha256": "abcdef01" + "1" * 56}])
    store.index.append([{**base, "record_id": "2", "model": "y", "key": "k2", "sha256": "abcdef01" + "2" * 56}])
    with pytest.raises(AmbiguousId) as info:
        lineage.resolve(store.index, "abcdef01")
    assert "2 artifacts" in str(info.value) and "x/trace" in str(info.value) and "y/trace" in str(info.value)
    assert lineage.resolve(store.index, "abcdef011")["model"] == "x"


def test_ancestors_run_from_source_to_the_artifact(store: ArtifactStore, graph: dict) -> None:
    record = lineage.resolve(store.index, graph["a1"]["aot_compile"]["sha256"])
    chain = lineage.ancestors(store.index, record, ORDER)
    assert [r["stage"] for r in chain] == ["source", "trace", "functionalize", "decompose", "aot_compile"]
    assert chain[0]["factory"] == "zoo:net" and chain[0]["weights_digest"] == graph["w"]
    assert {r["run_id"] for r in chain} == {"run-2"}  # the same run's records are preferred


def test_validate_has_all_its_parents(store: ArtifactStore, graph: dict) -> None:
    record = lineage.resolve(store.index, graph["b1"]["validate"]["sha256"])
    stages = [r["stage"] for r in lineage.ancestors(store.index, record, ORDER)]
    assert stages == ["source", "trace", "functionalize", "decompose", "serialize", "aot_compile", "validate"]


def test_descendants(store: ArtifactStore, graph: dict) -> None:
    record = lineage.resolve(store.index, graph["a1"]["functionalize"]["sha256"])
    below = lineage.descendants(store.index, record, ORDER)
    assert [r["stage"] for r in below] == ["decompose", "serialize", "aot_compile", "validate"]
    assert all(r["model"] == "alpha" for r in below)


def test_everything_built_from_a_checkpoint(store: ArtifactStore, graph: dict) -> None:
    result = lineage.by_weights(store.index, graph["w"][:12], ORDER)
    assert result["weights"] == graph["w"]
    assert [s["model"] for s in result["sources"]] == ["alpha"]
    assert [r["stage"] for r in result["descendants"]] == list(CHAIN[1:])
    with pytest.raises(RecordNotFound):
        lineage.by_weights(store.index, "1" * 64)


def test_decode_parses_json_columns() -> None:
    out = lineage.decode({"op_histogram": '{"aten.mm.default": 3}', "ended_at": T0, "model": "m"})
    assert out == {"op_histogram": {"aten.mm.default": 3}, "ended_at": "2026-11-01T00:00:00+00:00", "model": "m"}
