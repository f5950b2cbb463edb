"""Every shipped config (configs/*.yaml) run into two fresh stores: `pt2flow audit` passes on the
first with every record rebuilt in a fresh worker (each source built again into the recorded
eager model; each program's stored blob loaded back and the stage run again give the recorded
fingerprint), and both stores hold the same archive (serialize sha256), the same source records
and the same program fingerprints for every model (the second store's read from its index: an
audit of it would check the same programs again). An identity that depended on the
process (an address, a counter, a program kept in memory instead of read back from the store)
fails here (issue 29: tiny-encoder's blobs, multi-head's and residual-regressor-train's rebuilt
functionalize/decompose, a training archive with another ID in every store).

The first store of configs/generative.yaml and configs/targets.yaml is the session's shared fleet
(tests/fleets.py), built from a copy of the config in the fleet's folder (targets as shipped, every
stage and the benchmark stage too; generative: every model to archives and ONNX in its cold run,
then Llama and T5 compiled and lowered too); its cold run is audited, and the second store is run from the same copy (an archive's node metadata holds the
path of the model's source file, so both stores must build from the same folder). The second store, and both stores of the
other configs, run only the stages audit covers (of trace, functionalize, decompose, serialize,
those the config has): audit rebuilds no aot_compile, onnx, executorch or validate record
(docs/architecture.md §5, "Audit"), and an archive depends only on the stages before it.
configs/generative.yaml's second store holds tiny Llama and tiny T5 (a decoder and an
encoder-decoder, SECOND_STORE_ONLY): what a second store adds to the audit, which rebuilds every
record of all five models in fresh workers, is another path for the store, and Qwen2, Gemma and Phi3
go through the same component code as Llama (each cost about 15 s of the suite here).

A model that a shared fleet's config also has, with every field that reaches an audited stage's key
equal (factory, kwargs, weights, inputs, dynamic shapes and dims, the audited stages' options:
`_audit_entry`), is built and audited with that fleet's config only: the same keys, the same
programs (configs/demo.yaml's mlp, small-cnn, tiny-encoder and multi-head are configs/targets.yaml's;
in fc33 both stores held the same key and fingerprint for every one of their audited records).
demo.yaml's two stores and its audit hold its other models (the running normalizer, the training
model): about 100 s of the suite less. `test_a_config_builds_every_model_no_fleet_audits` keeps the
rule honest: a model changed in one config is no longer covered by the other and is built again."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from pt2flow.flows.config.load import load_config
from pt2flow.flows.config.models import ResolvedModel
from pt2flow.stages.serialize import load_archive, pickled_classes
from tests.conftest import ROOT, run_in_process, run_json
from tests.fleets import GENERATIVE_FULL, Fleet

pytestmark = pytest.mark.integration

AUDITED = ("trace", "functionalize", "decompose", "serialize")
SHIPPED = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
# the configs whose first store is a shared fleet (their session fixture; tests/fleets.py MEMBERS
# puts these parametrizations in the fleet's xdist group, and each other one in a group of its own)
FLEETS = {"generative.yaml": "_generative_fleet", "targets.yaml": "_targets_fleet"}
# the models a config's second store builds, where not all of them (the module docstring says why)
SECOND_STORE_ONLY = {"generative.yaml": GENERATIVE_FULL}
CONFIGS = [pytest.param(name, marks=pytest.mark.compile) if name in FLEETS else name for name in SHIPPED]


def test_every_shipped_config_is_covered() -> None:
    assert SHIPPED == ["demo.yaml", "failures.yaml", "generative.yaml", "quantized.yaml", "targets.yaml"]


def _audit_entry(model: ResolvedModel) -> tuple[Any, ...]:
    """What of a model reaches the keys of its audited records (source and AUDITED): its factory
    and what builds it, its example inputs and dynamic shapes, the audited stages' options."""
    options = {stage: model.options[stage].model_dump(mode="json") for stage in AUDITED if stage in model.options}
    return (
        model.name,
        model.factory,
        repr(model.kwargs),
        model.weights,
        model.checkpoint,
        repr(model.inputs),
        model.inputs_factory,
        model.inputs_file,
        repr(model.dynamic_shapes),
        repr(model.dims),
        repr(model.generate),
        repr(model.data),  # its data's identity is the source's (the int8 stages' calibration)
        repr(options),
    )


def _fleet_entries() -> set[tuple[Any, ...]]:
    """The `_audit_entry` of every model of the shared fleets' configs."""
    return {_audit_entry(m) for other in FLEETS for m in load_config(ROOT / "configs" / other).models}


def audited_by_a_fleet(name: str) -> set[str]:
    """The models of configs/NAME that a shared fleet's config has with the same `_audit_entry`
    (none for a fleet's own config): built and audited in that fleet's parametrization only."""
    if name in FLEETS:
        return set()
    fleets = _fleet_entries()
    return {m.name for m in load_config(ROOT / "configs" / name).models if _audit_entry(m) in fleets}


def test_a_config_builds_every_model_no_fleet_audits() -> None:
    """demo.yaml's inference models are targets.yaml's (audited there); its training model and
    running normalizer are its own. A model whose entry differs in one field is its config's again."""
    assert audited_by_a_fleet("demo.yaml") == {"mlp", "small-cnn", "tiny-encoder", "multi-head"}
    assert audited_by_a_fleet("failures.yaml") == set() and audited_by_a_fleet("targets.yaml") == set()
    demo = load_config(ROOT / "configs" / "demo.yaml")
    fleets = _fleet_entries()
    mlp = demo.model("mlp")
    assert _audit_entry(mlp) in fleets
    from dataclasses import replace

    for changed in (
        replace(mlp, kwargs={**mlp.kwargs, "hidden": 33}),
        replace(mlp, dims={"batch": (1, 31)}),
        replace(mlp, options={**mlp.options, "trace": mlp.options["trace"].model_copy(update={"strict": True})}),
    ):
        assert _audit_entry(changed) not in fleets


def _identities(records: list[dict[str, Any]], models: set[str]) -> dict[tuple[str, str], str]:
    """(model, stage) -> fingerprint of the ok source and audited records of `models` (a
    generative model's components, `M/prefill`, included)."""
    return {
        (r["model"], r["stage"]): r["fingerprint"]
        for r in records
        if r.get("status", "ok") == "ok"
        and r["stage"] in ("source", *AUDITED)
        and r["model"].split("/", 1)[0] in models
    }


def _audited_states(run: dict[str, Any]) -> dict[tuple[str, str], str]:
    """(model or MODEL/component, stage) -> status of every audited stage a run document shows."""
    states = {}
    for model in run["models"]:
        for stage, view in model["stages"].items():
            if stage in AUDITED:
                states[(model["name"], stage)] = view["status"]
        for component, part in (model.get("components") or {}).items():
            for stage, view in part["stages"].items():
                if stage in AUDITED:
                    states[(f"{model['name']}/{component}", stage)] = view["status"]
    return states


@pytest.fixture(scope="module", params=CONFIGS)
def two_stores(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The config in two fresh stores (a shared fleet's store first, where it has one); the first
    audited (every record of its first run, --sample 1.0)."""
    config = ROOT / "configs" / request.param
    folder = tmp_path_factory.mktemp(config.stem)
    shipped = yaml.safe_load(config.read_text())
    stages = ",".join(s for s in shipped["stages"] if s in AUDITED)
    covered = audited_by_a_fleet(request.param)  # built and audited with a fleet's config
    models = {m["name"] for m in shipped["models"]} - covered
    only = SECOND_STORE_ONLY.get(request.param)
    found: dict[str, Any] = {
        "config": request.param,
        "runs": [],
        "records": [],
        "models": models,
        "compared": set(only or models),
    }
    first, second = folder / "first", folder / "second"
    audit = ["audit", "--store", str(first), "--config", str(config), "--sample", "1.0"]
    to_build = [first, second]
    if request.param in FLEETS:
        fleet: Fleet = request.getfixturevalue(FLEETS[request.param])
        assert fleet.cold.returncode in (0, 1) and "Traceback" not in fleet.cold.stderr, fleet.cold.stderr[-3000:]
        found["runs"].append(fleet.cold.document)
        first, to_build = Path(fleet.store), [second]
        audit = [
            "audit",
            fleet.cold.document["run_id"],
            "--store",
            fleet.store,
            "--config",
            str(fleet.config),
            "--sample",
            "1.0",
        ]
        # the fleet's copy of the shipped config, beside the fleet's copy of its factories: an
        # archive's node metadata holds the path of the model's source file
        config = fleet.shipped
    for store in to_build:  # the fleet run from this process, its stages in fresh worker processes
        chosen = only if only and store == second else sorted(models) if covered else ()
        code, run = run_in_process(config, store=str(store), stages=stages.split(","), only=chosen)
        assert code in (0, 1), run
        found["runs"].append(run)
    for store in (first, second):
        code, records, stderr = run_json(["ls", "--store", str(store), "--limit", "0"])
        assert code == 0, stderr[-2000:]
        found["records"].append(records)
    found["store"] = str(first)
    found["audit"] = run_json(audit, timeout=1500)
    return found


def test_audit_rebuilds_every_record_of_a_fresh_store(two_stores: dict[str, Any]) -> None:
    code, audit, stderr = two_stores["audit"]
    failed = [(r["model"], r["stage"], r["problem"]) for r in audit.get("records", []) if r["status"] != "ok"]
    assert code == 0 and failed == [], (two_stores["config"], failed, stderr[-3000:])
    records = audit["sample"]["records"]
    # a model whose factory cannot be built (failures.yaml's missing dependency) has a source
    # record, noted as not building then nor now; every other record is rebuilt
    unbuildable = [e for e in audit["records"] if e["stage"] == "source" and e["rebuilt"] is None]
    assert all("did not build when recorded" in e["note"] and "does not now" in e["note"] for e in unbuildable), (
        unbuildable
    )
    assert len(unbuildable) == (1 if two_stores["config"] == "failures.yaml" else 0), unbuildable
    assert records > 0 and audit["sample"]["checked"] == records
    assert audit["summary"] == {"ok": records, "failed": 0, "rebuilt": records - len(unbuildable)}
    for entry in audit["records"]:
        if entry in unbuildable:
            continue
        if entry["stage"] == "source":  # built again: the same eager model
            assert entry["stored"] == entry["rebuilt"] and entry["rebuilt"], entry
        else:
            assert entry["stored"] == entry["rebuilt"] == entry["fingerprint"], entry


def test_two_fresh_stores_hold_the_same_archives_and_programs(two_stores: dict[str, Any]) -> None:
    first, second = two_stores["runs"]
    models, compared = two_stores["models"], two_stores["compared"]  # the first store's, and both stores'
    archives = [
        {
            m["name"]: m["artifacts"].get("serialized") or _component_archives(m)
            for m in run["models"]
            if m["name"] in models
        }
        for run in (first, second)
    ]
    assert set(archives[1]) == compared, archives[1]
    states = [
        {k: v for k, v in _audited_states(run).items() if k[0].split("/", 1)[0] in compared} for run in (first, second)
    ]
    assert states[0] == states[1] and states[1], states
    if two_stores["config"] not in FLEETS:  # both stores built the same stages: the same outcomes
        statuses = [{m["name"]: (m["status"], m["failed_stage"]) for m in run["models"]} for run in (first, second)]
        assert statuses[0] == statuses[1]
    ok = sorted(name for name in compared if archives[1].get(name))  # the models serialize stored
    assert ok and all(archives[0][name] for name in ok), archives[0]
    assert {name: archives[0][name] for name in compared} == archives[1]
    identities = [_identities(records, compared) for records in two_stores["records"]]
    assert identities[0] == identities[1]
    recorded = _identities(two_stores["records"][0], models)  # the first store: every model, audited
    audited = _identities(two_stores["audit"][1]["records"], models)
    assert audited == {k: v for k, v in recorded.items() if k in audited}
    # every model's source was audited; the program records of every model that ran ok (the
    # shipped failures fail at trace: no program record)
    # (a generative model's programs are its components', recorded as `MODEL/prefill`, `MODEL/decode`)
    built = {name for name in models if archives[0].get(name)}
    assert set(ok) <= built
    assert {model.split("/", 1)[0] for model, stage in audited if stage != "source"} == built
    assert {model for model, stage in audited if stage == "source"} == models


def test_every_archive_loads_with_every_pickled_global_vetted_and_weights_only_where_torch_can(
    two_stores: dict[str, Any],
) -> None:
    """Every archive of the first store (each model's, each component's) loads through pt2flow's
    loader, which vets every global its pickles name before torch unpickles anything
    (tests/stages/test_serialize.py: a pickle that would run code is refused). The classes allowed
    besides tensors and plain containers are transformers' cache and output classes, in the
    components of a generative model only; with them allowed, torch's weights_only unpickler
    rebuilds every example input with no fallback, except an input holding a ModelOutput (an
    OrderedDict: T5's encoder_outputs), which it refuses item by item."""
    from pt2flow.storage.store import ArtifactStore

    records = [
        r for r in two_stores["records"][0] if r["stage"] == "serialize" and r["status"] == "ok" and not r.get("cached")
    ]
    generative = {r["model"].split("/", 1)[0] for r in records if "/" in r["model"]}
    if generative:
        from pt2flow.stages.generation import register_cache_pytrees

        register_cache_pytrees()  # as pt2flow's worker does before it loads a component's program
    store = ArtifactStore(two_stores["store"])
    allowed: dict[str, list[type]] = {}
    refused_items: list[str] = []
    for record in records:
        data = store.get_blob(record["sha256"])
        program, _ = load_archive(data, import_pytree_modules=True)
        assert program.example_inputs is not None, record["model"]
        allowed[record["model"]] = classes = pickled_classes(data)
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            (inputs,) = [archive.read(n) for n in archive.namelist() if "/sample_inputs/" in n]
        try:
            with torch.serialization.safe_globals(classes):
                torch.load(io.BytesIO(inputs), weights_only=True)
        except pickle.UnpicklingError as exc:
            assert "Can only SETITEM for dict" in str(exc) and any(issubclass(c, dict) for c in classes), (
                record["model"],
                exc,
            )
            refused_items.append(record["model"])
    assert records, two_stores["config"]
    for model, classes in allowed.items():
        names = [f"{c.__module__}.{c.__qualname__}" for c in classes]
        assert ("/" in model) or names == [], (model, names)  # only components pickle classes
        assert all(n.startswith(("transformers.cache_utils.", "transformers.modeling_outputs.")) for n in names), (
            model,
            names,
        )
    for name in generative:  # a decode step takes the cache: its classes were vetted and allowed
        assert any(classes for model, classes in allowed.items() if model.startswith(name + "/")), (name, allowed)
    assert {m.split("/", 1)[0] for m in refused_items} <= {"tiny-t5"}, refused_items


def _component_archives(model: dict[str, Any]) -> tuple[str | None, ...] | None:
    """A generative model's archives: one per component (None for a model without components)."""
    components = model.get("components")
    if not components:
        return None
    return tuple(c["artifacts"].get("serialized") for c in components.values())
