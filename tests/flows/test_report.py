"""`pt2flow report`: drift between two runs, by model name.

Unit tests build synthetic indexes (make_chain's record shapes plus the facts each stage records)
and check every compared field and every regression rule with values; the integration test runs a
real two-model fleet twice with one model changed in between and checks the JSON and the HTML page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pt2flow.flows import report
from pt2flow.flows.report import compare_runs, regressions, resolve_run, to_html, to_markdown
from pt2flow.storage import AmbiguousId, ArtifactStore, RecordNotFound
from tests.conftest import ROOT, run_cli, run_in_process, run_json, write_config
from tests.records import h, make_chain

HIST = {"aten.addmm.default": 2, "aten.permute.default": 2, "aten.relu.default": 1}


def signature(out: int = 4, batch: str = "s0") -> dict[str, Any]:
    return {
        "counts": {"in.PARAMETER": 4, "in.USER_INPUT": 1, "out.USER_OUTPUT": 1},
        "inputs": [{"dtype": "float32", "name": "x", "shape": [batch, "8"]}],
        "outputs": [{"dtype": "float32", "kind": "USER_OUTPUT", "shape": [batch, str(out)], "target": None}],
    }


class _Capture:
    """Stands in for a store so that make_chain's rows can be completed before they are appended."""

    def __init__(self) -> None:
        self.index = self
        self.rows: list[dict] = []

    def append(self, rows: list[dict]) -> None:
        self.rows.extend(rows)


def chain(
    store: ArtifactStore,
    model: str,
    run: str,
    *,
    salt: str = "v1",
    offset: int = 0,
    cached: bool = False,
    torch: str = "2.13.0+cpu",
    fail: tuple[str, str] | None = None,
    **stages: dict[str, Any],
) -> dict[str, dict]:
    """One model's records for one run, with realistic facts; `stage={...}` overrides fields and
    `fail=(stage, error_class)` fails that stage (the later stages then have no record)."""
    rows = make_chain(_Capture(), model, run, None, salt=salt, offset=offset, cached=cached)
    facts: dict[str, dict[str, Any]] = {
        "source": {"kwargs": "{}", "code_hash": h("models.py"), "seconds": 0.01},
        "serialize": {"size": 18_000, "seconds": 0.05},
        "aot_compile": {"size": 50_000, "seconds": 10.0},
        "validate": {
            "passed": True,
            "max_abs_err": 1e-6,
            "max_rel_err": 1e-5,
            "seconds": 0.3,
            "validation": json.dumps({"passed": True, "max_abs_err": 1e-6, "max_rel_err": 1e-5, "samples": 3}),
        },
    }
    for stage in ("trace", "functionalize", "decompose"):
        facts[stage] = {
            "op_histogram": json.dumps(HIST),
            "node_count": 11,
            "signature": json.dumps(signature()),
            "range_constraints": json.dumps({"s0": [1, 16]}),
            "fingerprint": h(f"fp/{model}/{salt}"),
            "seconds": 0.2,
        }
    out: dict[str, dict] = {}
    for stage, row in rows.items():
        row.update(facts.get(stage, {}), torch_version=torch, started_at=row["ended_at"] - timedelta(milliseconds=500))
        if fail and stage == fail[0]:
            row.update(
                status="failed", error_class=fail[1], error_message=f"{fail[1]} in {stage}", sha256=None, size=None
            )
        for key, value in stages.get(stage, {}).items():
            row[key] = (
                json.dumps(value)
                if key in ("op_histogram", "signature", "range_constraints", "validation", "kwargs")
                else value
            )
        out[stage] = row
        if fail and stage == fail[0]:
            break
    store.index.append(list(out.values()))
    return out


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "store"))


def by_model(comparison: dict) -> dict[str, dict]:
    return {m["model"]: m for m in comparison["models"]}


def assert_fields(actual: dict, expected: dict) -> None:
    """The fields of `actual` that `expected` names have the expected values."""
    assert {key: actual.get(key) for key in expected} == expected


def rules(comparison: dict) -> set[tuple[str, str]]:
    return {(r["model"], r["rule"]) for r in regressions(comparison)}


# ---------------------------------------------------------------------------------------------
# runs


def test_runs_are_ordered_by_time_not_by_id(store: ArtifactStore) -> None:
    chain(store, "alpha", "zz-first", offset=0)
    chain(store, "alpha", "mm-second", offset=10)
    chain(store, "alpha", "aa-third", offset=20)
    assert [r["run_id"] for r in report.list_runs(store.index)] == ["zz-first", "mm-second", "aa-third"]
    assert resolve_run(store.index, "mm") == "mm-second"
    chain(store, "alpha", "mm-fourth", offset=30)
    with pytest.raises(AmbiguousId):
        resolve_run(store.index, "mm")
    with pytest.raises(RecordNotFound):
        resolve_run(store.index, "qq")
    with pytest.raises(RecordNotFound, match="no records of run 'qq'"):
        compare_runs(store.index, "zz-first", "qq")
    assert report.compare_with_previous(store.index, "zz-first") is None
    assert report.compare_with_previous(store.index, "aa-third")["runs"]["a"]["run_id"] == "mm-second"


def test_unchanged_cached_rerun_reports_nothing(store: ArtifactStore) -> None:
    chain(store, "alpha", "run-1", offset=0)
    chain(store, "alpha", "run-2", offset=10, cached=True, aot_compile={"seconds": 0.01}, validate={"seconds": 0.01})
    comparison = compare_runs(store.index, "run-1", "run-2")
    alpha = by_model(comparison)["alpha"]
    assert alpha["changes"] == [] and alpha["keys_changed"] == []
    assert alpha["status"]["change"] == "ok" and alpha["status"]["b"]["cached"] is True
    # the cached record's 0.01 s is a cache lookup: the compile time is the original record's
    assert alpha["compile_seconds"]["b"] == 10.0 and alpha["compile_seconds"]["b_cached"] is True
    assert alpha["compile_seconds"]["b_compiled_in"] == "run-1"
    assert comparison["regressions"] == [] and comparison["summary"]["unchanged"] == 1
    assert comparison["torch"] == {"a": "2.13.0+cpu", "b": "2.13.0+cpu", "change": "same", "changed": False}


# ---------------------------------------------------------------------------------------------
# each compared field


def test_status_changes_with_error_classes(store: ArtifactStore) -> None:
    chain(store, "breaks", "run-1")
    chain(store, "breaks", "run-2", salt="v2", offset=10, fail=("trace", "data_dependent"))
    chain(store, "heals", "run-1", fail=("aot_compile", "compile"))
    chain(store, "heals", "run-2", salt="v2", offset=10)
    chain(store, "stuck", "run-1", fail=("trace", "dynamic_shape"))
    chain(store, "stuck", "run-2", salt="v2", offset=10, fail=("validate", "numeric_mismatch"))
    comparison = compare_runs(store.index, "run-1", "run-2")
    models = by_model(comparison)

    breaks = models["breaks"]["status"]
    assert breaks["change"] == "newly_failing"
    assert breaks["a"]["status"] == "ok"
    assert (breaks["b"]["status"], breaks["b"]["failed_stage"], breaks["b"]["error_class"]) == (
        "failed",
        "trace",
        "data_dependent",
    )
    assert breaks["b"]["error"] == "data_dependent in trace"
    heals = models["heals"]["status"]
    assert heals["change"] == "newly_passing"
    assert (heals["a"]["failed_stage"], heals["a"]["error_class"]) == ("aot_compile", "compile")
    stuck = models["stuck"]
    assert stuck["status"]["change"] == "still_failing" and "failure" in stuck["changes"]
    assert stuck["status"]["b"]["error_class"] == "numeric_mismatch"
    assert_fields(comparison["summary"], {"newly_failing": 1, "newly_passing": 1, "still_failing": 1})
    assert comparison["runs"]["b"]["failed"] == 2 and comparison["runs"]["b"]["ok"] == 1

    found = regressions(comparison)
    assert [(r["model"], r["rule"]) for r in found] == [("breaks", "stopped_exporting")]
    assert "trace" in found[0]["message"] and "data_dependent" in found[0]["message"]


def test_graph_changes_after_decompose(store: ArtifactStore) -> None:
    chain(store, "mlp", "run-1")
    new_hist = {"aten.linear.default": 2, "aten.relu.default": 3}
    chain(
        store,
        "mlp",
        "run-2",
        salt="v2",
        offset=10,
        source={"kwargs": {"out": 6}},
        trace={"op_histogram": {"aten.linear.default": 2}},  # only decompose's histogram counts
        decompose={
            "op_histogram": new_hist,
            "node_count": 9,
            "signature": signature(out=6, batch="s1"),
            "range_constraints": {"s1": [1, 32]},
        },
    )
    mlp = by_model(compare_runs(store.index, "run-1", "run-2"))["mlp"]
    graph = mlp["graph"]
    assert graph["stage"]["b"] == "decompose"
    assert graph["op_histogram"]["added"] == {"aten.linear.default": 2}
    assert graph["op_histogram"]["removed"] == {"aten.addmm.default": 2, "aten.permute.default": 2}
    assert graph["op_histogram"]["changed"] == {"aten.relu.default": [1, 3]}
    assert graph["op_histogram"]["changed_ops"] == 4
    assert_fields(graph["node_count"], {"a": 11, "b": 9, "delta": -2, "changed": True})
    assert graph["signature"]["changed"] and graph["signature"]["b"]["outputs"][0]["shape"] == ["s1", "6"]
    assert graph["range_constraints"] == {"a": {"s0": [1, 16]}, "b": {"s1": [1, 32]}, "changed": True}
    assert graph["fingerprint"]["changed"]
    assert mlp["source"]["kwargs"] == {"a": {}, "b": {"out": 6}, "changed": True}
    assert mlp["keys_changed"] == [
        "source",
        "trace",
        "functionalize",
        "decompose",
        "serialize",
        "aot_compile",
        "validate",
    ]
    assert mlp["changes"] == ["kwargs", "fingerprint", "node_count", "signature", "range_constraints", "op_histogram"]


def test_graph_read_at_the_last_program_stage_when_decompose_did_not_run(store: ArtifactStore) -> None:
    chain(store, "m", "run-1", fail=("decompose", "decomposition"))
    chain(store, "m", "run-2", offset=10, fail=("decompose", "decomposition"), functionalize={"node_count": 12})
    m = by_model(compare_runs(store.index, "run-1", "run-2"))["m"]
    assert m["graph"]["stage"] == {"a": "functionalize", "b": "functionalize", "changed": False}
    assert m["graph"]["node_count"]["b"] == 12


def test_sizes_compile_time_validation_and_latency(store: ArtifactStore) -> None:
    latency_a = {"eager": 1.0, "archive": 1.2, "compiled": 0.5}
    latency_b = {"eager": 1.0, "archive": 1.1, "compiled": 0.8}
    chain(store, "m", "run-1", validate={"validation": {"passed": True, "max_abs_err": 1e-6, "latency_ms": latency_a}})
    chain(
        store,
        "m",
        "run-2",
        salt="v2",
        offset=10,
        serialize={"size": 20_000},
        aot_compile={"size": 40_000, "seconds": 12.0},
        validate={
            "max_abs_err": 3e-6,
            "max_rel_err": 2e-5,
            "validation": {"passed": True, "max_abs_err": 3e-6, "latency_ms": latency_b},
        },
    )
    m = by_model(compare_runs(store.index, "run-1", "run-2"))["m"]
    assert_fields(m["archive_size"], {"a": 18_000, "b": 20_000, "delta": 2_000, "changed": True})
    assert_fields(m["package_size"], {"a": 50_000, "b": 40_000, "delta": -10_000})
    assert m["package_size"]["ratio"] == pytest.approx(0.8)
    assert_fields(m["compile_seconds"], {"a": 10.0, "b": 12.0, "a_cached": False, "b_cached": False})
    assert m["compile_seconds"]["ratio"] == pytest.approx(1.2)
    assert_fields(m["validation"]["max_abs_err"], {"a": 1e-6, "b": 3e-6})
    assert_fields(m["validation"]["max_rel_err"], {"a": 1e-5, "b": 2e-5})
    assert m["validation"]["passed"] == {"a": True, "b": True, "changed": False}
    assert set(m["latency_ms"]) == {"eager", "archive", "compiled"}
    assert_fields(m["latency_ms"]["compiled"], {"a": 0.5, "b": 0.8})
    assert m["latency_ms"]["compiled"]["ratio"] == pytest.approx(1.6)
    assert {"archive_size", "package_size", "max_abs_err"} <= set(m["changes"])


def test_cached_compile_time_found_by_key_or_digest_or_marked_unknown(store: ArtifactStore) -> None:
    # the original compile happened in run-0, which run-1 reused
    chain(store, "by-key", "run-0", offset=0, aot_compile={"seconds": 9.0})
    chain(store, "by-key", "run-1", offset=10, cached=True, aot_compile={"seconds": 0.02})
    chain(store, "by-key", "run-2", offset=20, cached=True, aot_compile={"seconds": 0.03})
    # same package under another key (the key of the copy differs): found by sha256
    original = chain(store, "by-digest", "run-0", salt="old", offset=0, aot_compile={"seconds": 7.0})
    chain(store, "by-digest", "run-1", offset=10, aot_compile={"seconds": 6.0})
    chain(
        store,
        "by-digest",
        "run-2",
        salt="v3",
        offset=20,
        cached=True,
        aot_compile={"seconds": 0.02, "sha256": original["aot_compile"]["sha256"]},
    )
    # nothing in the index compiled it
    chain(store, "unknown", "run-1", offset=10, aot_compile={"seconds": 5.0})
    chain(store, "unknown", "run-2", salt="gone", offset=20, cached=True, aot_compile={"seconds": 0.02})
    comparison = compare_runs(store.index, "run-1", "run-2")
    models = by_model(comparison)
    assert_fields(
        models["by-key"]["compile_seconds"],
        {"a": 9.0, "b": 9.0, "a_cached": True, "b_cached": True, "a_compiled_in": "run-0"},
    )
    assert_fields(
        models["by-digest"]["compile_seconds"], {"a": 6.0, "b": 7.0, "b_cached": True, "b_compiled_in": "run-0"}
    )
    unknown = models["unknown"]["compile_seconds"]
    assert_fields(unknown, {"a": 5.0, "b": None, "b_cached": True, "ratio": None})
    assert ("unknown", "compile_time_up") not in rules(comparison)  # 0.02 s is not compared
    assert "cached, original unknown" in to_markdown(comparison)


def test_torch_upgrade_is_visible_as_such(store: ArtifactStore) -> None:
    for name in ("alpha", "beta"):
        chain(store, name, "nightly-1")
        # a new torch changes every derivation key; the source key does not depend on torch
        rows = chain(store, name, "nightly-2", salt="torch-2.14", offset=10, torch="2.14.0+cpu")
        assert rows["source"]["key"] != h(f"key/{name}/v1/source")
    store.index.append([])
    comparison = compare_runs(store.index, "nightly-1", "nightly-2")
    assert comparison["torch"] == {"a": "2.13.0+cpu", "b": "2.14.0+cpu", "change": "upgrade", "changed": True}
    assert comparison["runs"]["a"]["torch_versions"] == ["2.13.0+cpu"]
    assert comparison["runs"]["b"]["torch_versions"] == ["2.14.0+cpu"]
    assert comparison["summary"]["all_keys_changed"] == 2
    for entry in comparison["models"]:
        assert entry["torch_version"] == {"a": "2.13.0+cpu", "b": "2.14.0+cpu", "changed": True}
        assert "torch_version" in entry["changes"]
        assert set(entry["keys_changed"]) >= {
            "trace",
            "functionalize",
            "decompose",
            "serialize",
            "aot_compile",
            "validate",
        }
    text = to_markdown(comparison)
    assert "torch upgraded: 2.13.0+cpu → 2.14.0+cpu" in text and "2 of 2 model(s)" in text
    assert "torch upgraded" in to_html(comparison)
    chain(store, "alpha", "nightly-3", salt="back", offset=20, torch="2.12.1+cpu")
    assert compare_runs(store.index, "nightly-2", "nightly-3")["torch"]["change"] == "downgrade"


def test_models_in_only_one_run(store: ArtifactStore) -> None:
    chain(store, "kept", "run-1")
    chain(store, "dropped", "run-1")
    chain(store, "kept", "run-2", offset=10, cached=True)
    chain(store, "new", "run-2", offset=10)
    comparison = compare_runs(store.index, "run-1", "run-2")
    assert comparison["only_in_a"] == ["dropped"] and comparison["only_in_b"] == ["new"]
    models = by_model(comparison)
    assert models["dropped"]["status"]["change"] == "only_in_a" and models["dropped"]["status"]["b"] is None
    assert models["new"]["changes"] == ["only_in_b"]
    assert models["kept"]["changes"] == []
    assert comparison["regressions"] == []  # a model left out of a run (--only) did not stop exporting
    assert_fields(comparison["summary"], {"models": 3, "in_both": 1, "only_in_a": 1, "only_in_b": 1})


# ---------------------------------------------------------------------------------------------
# regression rules, at and around their thresholds


@pytest.mark.parametrize(
    ("field", "stage", "a", "b", "rule", "flagged"),
    [
        ("seconds", "aot_compile", 10.0, 12.6, "compile_time_up", True),
        ("seconds", "aot_compile", 10.0, 12.4, "compile_time_up", False),
        ("size", "serialize", 18_000, 22_600, "archive_size_up", True),
        ("size", "serialize", 18_000, 22_400, "archive_size_up", False),
        ("size", "aot_compile", 50_000, 62_600, "package_size_up", True),
        ("size", "aot_compile", 50_000, 62_400, "package_size_up", False),
        ("max_abs_err", "validate", 1e-6, 1.2e-5, "validation_error_grew", True),
        ("max_abs_err", "validate", 1e-6, 9e-6, "validation_error_grew", False),
        ("max_abs_err", "validate", 1e-4, 2e-3, "validation_error_grew", True),
        ("max_abs_err", "validate", 0.0, 5e-7, "validation_error_grew", False),  # float32 noise, not 10x
        ("max_abs_err", "validate", 0.0, 1e-4, "validation_error_grew", True),
        ("max_abs_err", "validate", 1e-3, 1e-5, "validation_error_grew", False),
    ],
)
def test_regression_rules(
    store: ArtifactStore, field: str, stage: str, a: float, b: float, rule: str, flagged: bool
) -> None:
    chain(store, "m", "run-1", **{stage: {field: a}})
    chain(store, "m", "run-2", salt="v2", offset=10, **{stage: {field: b}})
    comparison = compare_runs(store.index, "run-1", "run-2")
    found = regressions(comparison)
    assert (("m", rule) in rules(comparison)) is flagged
    assert len(found) == int(flagged)
    if flagged:
        assert (found[0]["a"], found[0]["b"]) == (a, b)
        assert comparison["regressions"] == found and comparison["summary"]["regressions"] == 1


def test_regression_thresholds_are_parameters(store: ArtifactStore) -> None:
    chain(store, "m", "run-1")
    chain(store, "m", "run-2", salt="v2", offset=10, aot_compile={"seconds": 11.0})
    comparison = compare_runs(store.index, "run-1", "run-2")
    assert regressions(comparison) == []
    assert [r["rule"] for r in regressions(comparison, cost_growth=1.05)] == ["compile_time_up"]


# ---------------------------------------------------------------------------------------------
# rendering


class PageChecker(HTMLParser):
    """Checks that every element is closed in order, and collects tags, attributes and table rows."""

    VOID = {
        "area",
        "base",
        "br",
        "col",
        "embed",
        "hr",
        "img",
        "input",
        "link",
        "meta",
        "param",
        "source",
        "track",
        "wbr",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: Counter[str] = Counter()
        self.attrs: list[tuple[str, str | None]] = []
        self.rows: list[list[str]] = []  # the first table's (the models')
        self.row_classes: list[str] = []
        self.tables: list[list[list[str]]] = []  # every table's rows, in page order
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.attrs.extend(attrs)
        if tag == "table":
            self.tables.append([])
        if tag == "tr" and "tbody" in self.stack:
            self.tables[-1].append([])
            if len(self.tables) == 1:
                self.rows = self.tables[0]
                self.row_classes.append(dict(attrs).get("class") or "")
        if tag == "td" and self.tables and self.tables[-1]:
            self._cell = []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.attrs.extend(attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def check_page(page: str) -> PageChecker:
    checker = PageChecker()
    checker.feed(page)
    checker.close()
    assert page.startswith("<!DOCTYPE html>")
    assert checker.errors == [] and checker.stack == [], (checker.errors, checker.stack)
    assert checker.tags["html"] == checker.tags["head"] == checker.tags["body"] == 1
    assert checker.tags["table"] == 1 + ("<h2>Artifacts</h2>" in page)  # the models, then every artifact kind's
    assert checker.tags["script"] == 0 and checker.tags["link"] == 0 and checker.tags["img"] == 0
    for name, value in checker.attrs:  # self-contained: nothing to fetch
        assert name != "src", (name, value)
        if name == "href":
            assert value and value.startswith("#"), value
    assert "url(" not in page and "@import" not in page
    return checker


def fleet(store: ArtifactStore) -> dict:
    chain(store, "steady", "run-1")
    chain(store, "steady", "run-2", offset=10, cached=True)
    chain(store, "slower", "run-1", aot_compile={"seconds": 8.0, "size": 40_000})
    chain(store, "slower", "run-2", salt="v2", offset=10, aot_compile={"seconds": 20.0, "size": 60_000})
    chain(store, "broken|pipe", "run-1")
    chain(store, "broken|pipe", "run-2", salt="v2", offset=10, fail=("trace", "unsupported_op"))
    chain(store, "noisy", "run-1", validate={"max_abs_err": 1e-6})
    chain(store, "noisy", "run-2", salt="v2", offset=10, validate={"max_abs_err": 5e-4})
    return compare_runs(store.index, "run-1", "run-2")


def test_markdown_lists_regressions_and_every_model(store: ArtifactStore) -> None:
    comparison = fleet(store)
    assert rules(comparison) == {
        ("slower", "compile_time_up"),
        ("slower", "package_size_up"),
        ("broken|pipe", "stopped_exporting"),
        ("noisy", "validation_error_grew"),
    }
    text = to_markdown(comparison)
    assert "## ⚠️ 4 regression(s)" in text
    assert "compile time 8.00 s → 20.00 s (+150 %" in text
    groups, models = text.split("## Models", 1)
    models, artifacts = models.split("## Artifacts", 1)  # then every model's archive and package, size and verdict
    kinds = [line for line in artifacts.splitlines() if line.startswith("| `")]
    assert (
        len(kinds) == 4 * 2 and "| `broken\\|pipe` | serialized | 17.6 KB → - | - |" in kinds
    )  # gone after: it fails at trace
    assert (
        "## Failure groups" in groups and "| new | 1: broken\\|pipe | unsupported_op @ trace |" in groups
    )  # its failure, by cause
    table = [line for line in models.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + one row per model
    assert table[1].startswith("| ⚠️ `broken\\|pipe`")  # regressions first, a | in a cell escaped
    assert all(row.count(" | ") == table[0].count(" | ") for row in table[1:])
    assert "newly failing" in text and "unsupported_op" in text
    steady = next(row for row in table if "`steady`" in row)
    assert "⚠️" not in steady
    assert "No regressions" in to_markdown(compare_runs(store.index, "run-2", "run-2"))


def test_html_is_one_self_contained_page_with_plots(store: ArtifactStore) -> None:
    comparison = fleet(store)
    page = to_html(comparison)
    checker = check_page(page)
    assert checker.tags["svg"] == 3  # compile time, archive size, package size
    assert checker.tags["rect"] >= 4 * 2 * 2  # before and after bars per model in the compile and size plots
    names = [row[0] for row in checker.rows]
    assert sorted(names) == ["broken|pipe", "noisy", "slower", "steady"]
    classes = dict(zip(names, checker.row_classes))
    assert classes["slower"] == classes["noisy"] == classes["broken|pipe"] == "regressed"
    assert classes["steady"] == ""
    slower = checker.rows[names.index("slower")]
    assert "8.00 s → 20.00 s (+150 %)" in slower and "39.1 KB → 58.6 KB (+50 %)" in slower
    assert "slower after: 20.00 s" in page  # the bar's tooltip
    assert 'fill="#d64545"' in page  # a regressed bar
    assert "broken|pipe" in page and "<b>broken|pipe</b>" in page


def test_html_escapes_and_plots_without_compile_records(store: ArtifactStore) -> None:
    chain(store, "m", "run-1", fail=("trace", "unsupported_op"))
    chain(
        store,
        "m",
        "run-2",
        offset=10,
        fail=("trace", "unsupported_op"),
        trace={"error_message": "<script>alert(1)</script> & more"},
    )
    page = to_html(compare_runs(store.index, "run-1", "run-2"))
    checker = check_page(page)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert checker.tags["svg"] == 3 and page.count("no records in either run") == 3


def test_plots_keep_the_models_that_moved_most(store: ArtifactStore) -> None:
    for i in range(6):
        chain(store, f"m{i}", "run-1", aot_compile={"seconds": 10.0})
        chain(store, f"m{i}", "run-2", salt="v2", offset=10, aot_compile={"seconds": 10.0 + i})
    page = to_html(compare_runs(store.index, "run-1", "run-2"), plot_models=2)
    check_page(page)
    assert "the 2 of 6 models that moved most" in page
    compile_plot = page.split("AOTInductor compile time per model", 1)[1].split("</figure>", 1)[0]
    assert "m5 after" in compile_plot and "m4 after" in compile_plot and "m1 after" not in compile_plot


def test_comparison_is_plain_json(store: ArtifactStore) -> None:
    comparison = fleet(store)
    assert json.loads(json.dumps(comparison)) == comparison


# ---------------------------------------------------------------------------------------------
# CLI


@pytest.mark.integration  # `pt2flow report` as a subprocess
def test_report_cli(store: ArtifactStore, tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    chain(store, "only", "run-1")
    proc = run_cli(["report", "--store", root])
    assert proc.returncode == 1 and "1 run(s)" in proc.stderr and "Traceback" not in proc.stderr
    fleet(store)
    code, doc, stderr = run_json(["report", "--store", root])
    assert code == 0, stderr
    assert (doc["runs"]["a"]["run_id"], doc["runs"]["b"]["run_id"]) == ("run-1", "run-2")
    assert len(doc["regressions"]) == 4
    # run-2 covered 4 of run-1's 5 models: the default compares those 4, and says so
    assert doc["selection"] == {
        "rule": "newest",
        "runs": ["run-1", "run-2"],
        "not_compared": ["only"],
        "models": {m: "run-2" for m in ("broken|pipe", "noisy", "slower", "steady")},
        "reason": "run-2 is the newest run (4 models); run-1 is the newest earlier run that covered all of them; "
        "1 model of run-1 that run-2 did not cover is not compared",
    }
    assert doc["only_in_a"] == [] and doc["summary"]["models"] == 4 and doc["runs"]["a"]["models"] == 5
    html_file = tmp_path / "out" / "report.html"
    html_file.parent.mkdir()
    code, doc2, _ = run_json(["report", "run-1", "run-2", "--store", root, "--html", str(html_file)])
    assert code == 0 and doc2["selection"] == {
        "rule": "given",
        "runs": ["run-1", "run-2"],
        "reason": "named by the caller",
        "models": {},
        "not_compared": [],
    }
    assert (
        doc2["only_in_a"] == ["only"] and doc2["models"][:2] + doc2["models"][3:] == doc["models"]
    )  # named runs: every model
    assert "Runs: named by the caller" in html_file.read_text()
    check_page(html_file.read_text())
    proc = run_cli(["report", "--store", root, "--fail-on-regression"])
    assert proc.returncode == 1
    for name in ("steady", "slower", "noisy", "regression"):
        assert name in proc.stdout
    for args, exit_code, message in (
        (["run-1"], 2, "give two runs"),
        (["run-1", "nope"], 1, "no run 'nope'"),
        (["run-1", "run-2", "--html", str(tmp_path / "missing" / "r.html")], 2, "cannot write"),
    ):
        proc = run_cli(["report", *args, "--store", root])
        assert proc.returncode == exit_code and message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    proc = run_cli(["report", "--store", str(tmp_path / "no-store")])
    assert proc.returncode == 2 and "no store" in proc.stderr


def test_report_imports_neither_torch_nor_prefect() -> None:
    code = (
        "import sys; from pt2flow.flows.cli import main; main.cli.get_command(None, 'report');"
        "import pt2flow.flows.report.compare, pt2flow.flows.report.runs, pt2flow.flows.report.terminal, pt2flow.flows.report.html;"
        "print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# two real runs of a small fleet, one model changed in between


def chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.mark.integration
def test_report_on_two_real_runs(tmp_path: Path) -> None:
    mlp = {
        "name": "mlp",
        "factory": "tests.models:tiny_mlp",
        "inputs": {"x": {"shape": [3, 8]}},
        "dynamic_shapes": {"x": {0: "batch"}},
        "dims": {"batch": {"min": 1, "max": 16}},
    }
    dict_out = {
        "name": "dict-out",
        "factory": "tests.models:dict_out",
        "inputs": {"x": {"shape": [2, 5, 6]}, "scale": {"shape": [2, 5, 6], "value": 0.5}},
    }
    top = dict(
        stages=["trace", "functionalize", "decompose", "serialize", "validate"],
        defaults={"validate": {"benchmark": True, "benchmark_runs": 3}},
    )
    store = tmp_path / "store"
    config = write_config(tmp_path / "fleet.yaml", [mlp, dict_out], **top)
    code, first = run_in_process(config, store=str(store))  # the fleet runs in this process
    assert code == 0, first

    # the change: another output width (a kwarg) and aten.linear kept whole by decompose
    changed = {**mlp, "kwargs": {"out": 6}, "stages": {"decompose": {"preserve": ["aten.linear.default"]}}}
    write_config(config, [changed, dict_out], **top)
    code, second = run_in_process(config, store=str(store))
    assert code == 0, second

    html_file = tmp_path / "report.html"
    code, doc, stderr = run_json(["report", "--store", str(store), "--html", str(html_file)])
    assert code == 0, stderr[-3000:]
    assert (doc["runs"]["a"]["run_id"], doc["runs"]["b"]["run_id"]) == (first["run_id"], second["run_id"])
    models = by_model(doc)
    assert sorted(models) == ["dict-out", "mlp"]

    untouched = models["dict-out"]
    assert untouched["changes"] == [] and untouched["keys_changed"] == []
    assert untouched["status"]["change"] == "ok" and untouched["status"]["b"]["cached"] is True

    m = models["mlp"]
    assert m["status"]["change"] == "ok"
    assert set(m["changes"]) == {"kwargs", "fingerprint", "node_count", "signature", "op_histogram", "archive_size"}
    assert m["source"]["kwargs"] == {"a": {}, "b": {"out": 6}, "changed": True}
    assert m["graph"]["stage"] == {"a": "decompose", "b": "decompose", "changed": False}
    assert m["graph"]["op_histogram"]["added"] == {"aten.linear.default": 2}
    assert m["graph"]["op_histogram"]["removed"] == {"aten.addmm.default": 2, "aten.permute.default": 2}
    assert m["graph"]["node_count"]["b"] < m["graph"]["node_count"]["a"]
    assert m["graph"]["signature"]["a"]["outputs"][0]["shape"][-1] == "4"
    assert m["graph"]["signature"]["b"]["outputs"][0]["shape"][-1] == "6"
    assert m["graph"]["range_constraints"]["changed"] is False
    assert m["validation"]["passed"] == {"a": True, "b": True, "changed": False}
    assert m["validation"]["max_abs_err"]["b"] < 1e-5
    assert set(m["latency_ms"]) == {"eager", "archive"} and m["latency_ms"]["eager"]["b"] > 0
    assert doc["torch"]["changed"] is False and doc["regressions"] == []
    assert_fields(doc["summary"], {"models": 2, "changed": 1, "unchanged": 1, "regressions": 0})

    page = html_file.read_text()
    checker = check_page(page)
    assert sorted(row[0] for row in checker.rows) == ["dict-out", "mlp"]
    assert checker.tags["svg"] == 3
    assert "aten.linear.default" in page and "&quot;out&quot;: 6" in page

    browser = chromium()
    if browser is None:
        return  # the HTML parser checks above stand in for the browser
    proc = subprocess.run(
        [browser, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", html_file.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout  # the page as the browser built it
    assert dom.count("<svg") == 3 and 'id="model-mlp"' in dom and 'id="model-dict-out"' in dom
    assert "aten.linear.default" in dom and "changed (below)" in dom


def test_a_model_that_newly_falls_back_to_static_shapes_is_a_regression_every_view_marks(store: ArtifactStore) -> None:
    chain(store, "m", "run-1", trace={"strategy": "configured"})
    chain(store, "m", "run-2", salt="v2", offset=10, trace={"strategy": "static"})
    comparison = compare_runs(store.index, "run-1", "run-2")
    assert ("m", "static_fallback") in rules(comparison)
    from pt2flow.flows.report import render_terminal
    from pt2flow.flows.report import to_html
    from pt2flow.flows.report import to_markdown
    from rich.console import Console

    assert "static!" in to_markdown(comparison)
    check_page(to_html(comparison))
    console = Console(record=True, width=200)
    render_terminal(comparison, console)
    assert "static!" in console.export_text()


def _with_onnx(store: ArtifactStore, run: str, *, salt: str, offset: int, size: int, onnx: dict[str, Any]) -> None:
    """Model m's chain plus an onnx record, validate judging each of its three kinds."""
    import uuid

    ok = {"passed": True, "error_class": None, "error": None}
    verdicts = {"serialized": ok, "compiled": ok, "onnx": onnx}
    rows = chain(
        store,
        "m",
        run,
        salt=salt,
        offset=offset,
        validate={"validation": {"passed": onnx["passed"], "max_abs_err": 1e-6, "verdicts": verdicts}},
    )
    store.index.append(
        [
            {
                **rows["serialize"],
                "record_id": uuid.uuid4().hex,
                "stage": "onnx",
                "key": h(f"onnx/{salt}"),
                "sha256": h(f"onnx-blob/{salt}"),
                "size": size,
            }
        ]
    )


def test_every_artifact_kind_has_its_size_and_verdict_and_a_lost_one_is_marked_in_every_view(
    store: ArtifactStore,
) -> None:
    """A deployment target is in the report beside the archive and the package (issue 41): its
    size and its own verdict before and after; one that passed and now fails is marked in the
    terminal, Markdown and HTML views. Before, the report knew only the archive and the package,
    and a failing target showed only as the model's status."""
    from rich.console import Console

    from pt2flow.flows.report import render_terminal
    from pt2flow.flows.report.text import format_size

    _with_onnx(
        store, "run-1", salt="v1", offset=0, size=9_000, onnx={"passed": True, "error_class": None, "error": None}
    )
    _with_onnx(
        store,
        "run-2",
        salt="v2",
        offset=10,
        size=9_500,
        onnx={"passed": False, "error_class": "numeric_mismatch", "error": "onnx: max abs err 0.5 > atol"},
    )
    comparison = compare_runs(store.index, "run-1", "run-2")
    kinds = by_model(comparison)["m"]["artifacts"]
    assert list(kinds) == ["serialized", "compiled", "onnx"]  # the pipeline's order
    assert_fields(kinds["onnx"]["size"], {"a": 9_000, "b": 9_500, "delta": 500, "changed": True})
    assert kinds["onnx"]["passed"] == {"a": True, "b": False, "changed": True}
    assert (kinds["onnx"]["error_class"]["a"], kinds["onnx"]["error_class"]["b"]) == (None, "numeric_mismatch")
    assert_fields(kinds["serialized"]["size"], {"a": 18_000, "b": 18_000, "changed": False})
    assert kinds["serialized"]["passed"] == {"a": True, "b": True, "changed": False}
    size = f"{format_size(9_000)} → {format_size(9_500)} (+6 %)"
    lost = "pass → FAIL (numeric_mismatch)"

    console = Console(record=True, width=200)
    render_terminal(comparison, console)
    (line,) = [row for row in console.export_text().splitlines() if " onnx " in row]
    assert size in line and lost in line, line

    markdown = to_markdown(comparison).split("## Artifacts", 1)[1]
    assert f"| `m` | onnx | {size} | **{lost}** ⚠️ |" in markdown
    assert "| `m` | serialized | " + format_size(18_000) + " | pass |" in markdown

    checker = check_page(to_html(comparison))
    assert checker.tables[1] == [
        ["m", "serialized", format_size(18_000), "pass"],
        ["m", "compiled", format_size(50_000), "pass"],
        ["m", "onnx", size, lost],
    ]
    assert f'<td class="bad">{lost}</td>' in to_html(comparison)


def test_the_drift_report_is_its_typed_model(store: ArtifactStore) -> None:
    """compare_runs() dumps the DriftReport model: the same keys in the same order, and the
    JSON validated back through the model dumps to itself."""
    from pt2flow.flows.report.drift import DriftReport

    comparison = fleet(store)
    assert list(comparison) == [
        "report_version",
        "runs",
        "torch",
        "summary",
        "models",
        "only_in_a",
        "only_in_b",
        "regressions",
        "selection",
        "failure_groups",
    ]  # failure_groups: added compatibly (issue 22)
    assert (
        list(comparison["summary"])[-1] == "regressions"
        and comparison["summary"]["regressions"] == len(comparison["regressions"]) > 0
    )
    assert list(comparison["models"][0]) == [
        "model",
        "presence",
        "status",
        "torch_version",
        "source",
        "static_fallback",
        "keys_changed",
        "graph",
        "archive_size",
        "package_size",
        "compile_seconds",
        "validation",
        "latency_ms",
        "changes",
        "timings",  # added compatibly (issue 33): the after run's benchmark summary
        "artifacts",  # added compatibly (issue 41): every artifact kind's size and verdict
    ]
    assert list(comparison["regressions"][0]) == ["model", "rule", "a", "b", "ratio", "message"]
    text = json.dumps(comparison)
    again = DriftReport.model_validate_json(text).model_dump(mode="json")
    assert json.dumps(again) == text


# ---------------------------------------------------------------------------------------------
# which runs report and check-compat take when none is named (issue 23, item 5)


def runs_of(store: ArtifactStore, *fleets: tuple[str, ...]) -> list[str]:
    """One run per tuple of models, in this order (run-1 oldest)."""
    names = []
    for i, models in enumerate(fleets, start=1):
        for model in models:
            chain(store, model, f"run-{i}", offset=20 * i)
        names.append(f"run-{i}")
    return names


def test_after_a_partial_run_report_pairs_it_with_the_run_that_covered_its_models(store: ArtifactStore) -> None:
    from pt2flow.flows.report import compare_default, compare_with_previous, fleet_runs, report_pair

    runs_of(store, ("a", "b", "c"), ("a",), ("b",))
    pair = report_pair(store.index)
    assert (pair.rule, pair.runs, pair.not_compared) == ("covering", ("run-1", "run-3"), ("a", "c"))
    assert pair.reason == (
        "run-3 is the newest run (1 model); run-1 is the newest earlier run that covered all of them "
        "(1 newer run covered fewer); 2 models of run-1 that run-3 did not cover are not compared"
    )
    report = compare_default(store.index)
    assert (
        [m["model"] for m in report["models"]] == ["b"]
        and report["only_in_a"] == []
        and report["selection"]["runs"] == ["run-1", "run-3"]
    )
    assert compare_with_previous(store.index, "run-2")["selection"]["runs"] == [
        "run-1",
        "run-2",
    ]  # the fleet's summary pairs runs alike
    assert compare_with_previous(store.index, "run-1") is None
    fleet = fleet_runs(store.index)
    assert (fleet.rule, fleet.runs, fleet.models) == (
        "fleet",
        ("run-3", "run-2", "run-1"),
        {"a": "run-2", "b": "run-3", "c": "run-1"},
    )


def test_a_grown_fleet_is_compared_with_the_run_sharing_most_and_checked_whole(store: ArtifactStore) -> None:
    from pt2flow.flows.report import fleet_runs, report_pair

    runs_of(store, ("a", "b", "c"), ("a",), ("a", "b", "c", "d"))
    pair = report_pair(store.index)
    assert (pair.rule, pair.runs, pair.not_compared) == ("most_shared", ("run-1", "run-3"), ())
    assert "no earlier run covered all of them, and run-1 shares the most (3)" in pair.reason
    fleet = fleet_runs(store.index)
    assert (fleet.rule, fleet.runs, set(fleet.models.values())) == ("newest", ("run-3",), {"run-3"})


def test_same_models_again_is_the_plain_last_two_and_one_run_is_not_enough(store: ArtifactStore) -> None:
    from pt2flow.flows.report import NotEnoughRuns, fleet_runs, report_pair

    runs_of(store, ("a", "b"))
    with pytest.raises(NotEnoughRuns):
        report_pair(store.index)
    assert fleet_runs(store.index).runs == ("run-1",)
    chain(store, "a", "run-2", offset=40)
    chain(store, "b", "run-2", offset=40)
    pair = report_pair(store.index)
    assert (pair.rule, pair.runs, pair.not_compared) == ("newest", ("run-1", "run-2"), ())
