"""pt2flow from Python: what the CLI does, as functions that return values and raise the errors
the CLI turns into exit codes (docs/architecture.md §4).

    from pt2flow.flows import api

    doc = api.run("configs/demo.yaml", only=["mlp", "small-cnn"], workers=2)   # a RunDocument
    doc.summary.failed, [m.name for m in doc.models if m.status == "failed"]
    archive = {m.name: m for m in doc.models}["mlp"].artifacts.serialized

    store = api.open_store("./pt2-store")          # or s3://bucket/prefix, storage_options={...}; or config=CONFIG
    store.ls(model="mlp", stage="serialize")        # records, newest first
    store.show(archive)                             # every field, the validation report
    store.lineage(archive, descendants=True)
    store.diff(archive, other_id)
    store.get("mlp.pt2", model="mlp")               # a verified copy of the newest ok archive
    store.compare()                                 # drift: the newest run against the one that covered its models (two runs needed)
    store.verify()
    api.check_compat(store)                         # does the fleet's newest build still work here?
    api.repro(store, "data-dependent", "repro/")    # a torch-only script raising a failed model's error again
    api.audit(store, sample=0.1)                    # is the cache honest? (rebuild a sample)
    api.run("configs/demo.yaml", python="../venv-next/bin/python")   # workers under another environment
    report = api.upgrade_check("configs/demo.yaml", python="../venv-next")   # an UpgradeReport
    report.regressed, [(m.model, m.verdict) for m in report.models]

Errors: ConfigError (a bad config), UsageError / InvalidId / AmbiguousId (arguments that cannot be
used: the CLI's exit 2; InvalidId and AmbiguousId are no StorageError), RecordNotFound /
StorageError / IntegrityError (what the store does not hold or cannot give: exit 1). `run` reports failed models in its document; it raises only before
anything ran. `ls`, `show`, `lineage`, `diff`, `get`, `compare` and `verify` import neither torch
nor Prefect.
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping

from pt2flow.flows.api.running import run
from pt2flow.flows.api.upgrade import upgrade_check
from pt2flow.flows.api.store import Store, StoreLocation, locate_store
from pt2flow.flows.config import ConfigError
from pt2flow.flows.options import UsageError
from pt2flow.storage.errors import AmbiguousId, IntegrityError, InvalidId, RecordNotFound, StorageError


def open_store(
    url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
) -> Store:
    """A store to query: a local path, file://, memory:// or s3://bucket/prefix; without `url`,
    `config`'s store, else $PT2FLOW_STORE, else ./pt2-store (locate_store). UsageError for a
    local path that is not a folder (a typo would otherwise answer every query with nothing)."""
    where = locate_store(url, config=config, storage_options=storage_options)
    problem = where.absent()
    if problem:
        raise UsageError(problem)
    return Store(where.url, where.storage_options)


def check_compat(store: Store, run: str | None = None) -> dict[str, Any]:
    """`pt2flow check-compat --json`: every archive and package of `run` loaded, run and compared
    under the torch installed now, in a worker process (a loader that crashes fails that
    artifact, not the caller). Without `run`, the fleet (flows/report/runs.py fleet_runs): the
    newest run, or when it covered fewer models than an earlier run that covered all of its,
    that run's models, each from the newest run that built it. `selection` in the document says
    which runs and why."""
    from pt2flow.flows.engine.maintenance.compat import check_compat as check
    from pt2flow.flows.report.runs import fleet_runs, given

    if run:
        chosen = store.run_id(run)
        return check(store.artifacts, chosen, selection=given((chosen,)).as_json())
    selection = fleet_runs(store.artifacts.index)
    return check(store.artifacts, selection.runs[0], models_from=selection.models, selection=selection.as_json())


def validate(config: str | os.PathLike[str], *, imports: bool = True) -> dict[str, Any]:
    """`pt2flow validate --json`: every problem of the config in one pass. YAML syntax first
    (nothing else can be read before it is fixed); then together the config's own checks (the
    schema, factories, dims, ...: flows/config/load.py check_config, which checks what the schema
    let through) and what a run would otherwise meet only at its model (flows/engine/orchestrator/preflight.py):
    weights and inputs files exist, and unless `imports` is False each model's code is imported
    and its factories called once in a worker process, the input names matched against the built
    model's forward(). ConfigError listing every problem at its YAML path, in file order; else
    {"config", "valid", "models", "stages", "imported", "notes"}. Imports no torch here."""
    from pt2flow.flows.config.load import check_config
    from pt2flow.flows.config.problems import ConfigIssue, YamlLines, format_path
    from pt2flow.flows.config.reading import read_config_file
    from pt2flow.flows.engine.orchestrator.preflight import preflight

    checked = check_config(config)
    issues = list(checked.issues)

    def reported(path: str) -> bool:
        return any(i.path == path or i.path.startswith((path + ".", path + "[")) for i in issues)

    code = [
        i
        for i in checked.models
        if not any(reported(f"models[{i}].{key}") for key in ("factory", "inputs_factory", "inputs"))
    ]
    found = preflight(checked.models, imports=imports, code=code)
    lines = YamlLines(read_config_file(config)[0])
    # a key the config's checks already refused is not reported again (a malformed weights URL is not also "not found")
    issues += [lines.issue(f.path, f.message) for f in found.problems if not reported(format_path(f.path))]
    if issues or checked.pipeline is None:
        raise ConfigError(str(config), sorted(issues, key=lambda issue: issue.line or 0))
    valid = checked.pipeline
    notes: list[ConfigIssue] = [lines.issue(f.path, f.message) for f in found.notes]
    return {
        "config": str(config),
        "valid": True,
        "models": [m.name for m in valid.models],
        "stages": list(valid.stages),
        "imported": found.imported,
        "notes": [{"path": n.path, "line": n.line, "message": n.message} for n in notes],
    }


def audit(
    store: Store,
    run: str | None = None,
    *,
    sample: float = 1.0,
    seed: int = 0,
    config: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """`pt2flow audit --json`: a sample (`sample`, a fraction, drawn with `seed`) of `run`'s
    source and program records (default: the newest run) checked in fresh worker processes (of
    the config's `python:` when it names one), `workers` models at a time (default: as a run):
    each record's blob must hold the program its fingerprint names, and the stage run again on
    the recorded inputs must give that program again (source and trace too, for the models of
    `config`)."""
    from pt2flow.flows.config import load_config
    from pt2flow.flows.engine.maintenance.audit import audit as audit_run

    if not 0.0 < sample <= 1.0:
        raise UsageError(f"--sample must be a fraction in (0, 1], not {sample:g}")
    if workers is not None and workers < 1:
        raise UsageError("--workers must be at least 1")
    loaded = load_config(config) if config else None
    python = None
    if loaded is not None and loaded.python:  # the config's workers' interpreter rebuilds its models
        from pt2flow.flows.api.running import check_python

        python = check_python(loaded.python)
    models = loaded.models if loaded is not None else ()
    return audit_run(
        store.artifacts, store.run_id(run), fraction=sample, seed=seed, models=models, python=python, workers=workers
    )


def repro(store: Store, target: str, out_dir: str) -> dict[str, Any]:
    """`pt2flow repro --json`: write a torch-only script reproducing `target`'s failure (a model's
    newest, or a failure report's ID) into `out_dir`. Imports torch."""
    from pt2flow.flows.engine.maintenance.repro import ReproOutputError, write_repro

    try:
        return write_repro(store.artifacts, target, out_dir)
    except ReproOutputError as exc:
        raise UsageError(str(exc)) from None


def config_schema() -> dict[str, Any]:
    """The config's JSON Schema (`pt2flow schema`)."""
    from pt2flow.flows.config.jsonschema import config_json_schema

    return config_json_schema()


__all__ = [
    "AmbiguousId",
    "ConfigError",
    "IntegrityError",
    "InvalidId",
    "RecordNotFound",
    "StorageError",
    "Store",
    "UsageError",
    "StoreLocation",
    "check_compat",
    "config_schema",
    "locate_store",
    "open_store",
    "repro",
    "run",
    "upgrade_check",
]
