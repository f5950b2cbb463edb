"""The stages pt2flow knows: its own (each module of flows/builtin/ that declares a `STAGE`), those
other distributions declare under the entry point group `pt2flow.stages`, and those `register`
is given.

Everything that lists stages reads it here: the pipeline order (a topological sort of the
declared inputs, ties kept in registration order), each stage's parents in a given stage list,
the config's default stage list and option sections, the artifact kinds `get` offers, the
candidates validate checks and the versions in the keys. Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from importlib.metadata import entry_points
from collections.abc import Iterable, Mapping, Sequence

from pt2flow.flows.pipeline.stage import Input, Stage

ENTRY_POINT_GROUP = "pt2flow.stages"
# pt2flow's own stages: one module each, found by listing the package (adding a stage adds a
# module and changes no list); imported by name, as entry points are
BUILTIN_PACKAGE = "pt2flow.flows.builtin"
SOURCE_NAME = "source"

# what the config, the weights and the model's code are: the model's first record, not a stage of
# a stage list. Its key comes from the planner's manifest (flows/engine/orchestrator/planner.py), not a key function.
# 3: the dependency manifest no longer depends on the worker's history (stages/deps.py)
# 4: the data files the build reads, the declared ones (checkpoint, depends_on) and the eager
# model's digest are part of it; imports resolve against the start-up sys.path
SOURCE = Stage(SOURCE_NAME, 4, compute="pt2flow.flows.engine.worker.compute:source", publishes=SOURCE_NAME)

_lock = threading.RLock()
_declared: dict[str, Stage] = {}  # registration order
_ordered: tuple[Stage, ...] | None = None
_plugins_loaded = False
_plugin_problems: list[str] = []

log = logging.getLogger("pt2flow")


class StageRegistrationError(ValueError):
    """A stage declaration that cannot join the pipeline (a name taken, an input nobody makes, a cycle)."""


def register(stage: Stage, *, replace: bool = False) -> Stage:
    """Add `stage` to the pipeline (a stage defined outside pt2flow: docs/architecture.md,
    "Adding a stage"). Its inputs must name known stages; the order is recomputed."""
    global _ordered
    if stage.origin == "pt2flow":  # registered from outside: named after the module of its compute function
        stage = dataclasses.replace(stage, origin=stage.compute.split(":", 1)[0])
    with _lock:
        _load_plugins()
        if stage.name in _declared and not replace and _declared[stage.name] != stage:
            raise StageRegistrationError(
                f"a stage named {stage.name!r} is already registered (by {_declared[stage.name].origin})"
            )
        if stage.name == SOURCE_NAME:
            raise StageRegistrationError("'source' is the model's own record, not a stage that can be declared")
        candidate = {**_declared, stage.name: stage}
        _sort(candidate)  # raises on unknown inputs and cycles, before anything changes
        _declared[stage.name] = stage
        _ordered = None
        return stage


def unregister(name: str) -> None:
    """Remove a stage registered with `register` (tests; a plugin being replaced)."""
    global _ordered
    with _lock:
        if name in _declared and _declared[name].origin == "pt2flow":
            raise StageRegistrationError(f"{name} is one of pt2flow's own stages")
        _declared.pop(name, None)
        _ordered = None


def stages() -> tuple[Stage, ...]:
    """Every registered stage, in pipeline order (the source is not a stage of a stage list)."""
    global _ordered
    with _lock:
        _load_plugins()
        if _ordered is None:
            _ordered = _sort(_declared)
        return _ordered


def names() -> tuple[str, ...]:
    return tuple(s.name for s in stages())


def get(name: str) -> Stage:
    """The stage named `name` (the source included); KeyError naming the known ones."""
    if name == SOURCE_NAME:
        return SOURCE
    for stage in stages():
        if stage.name == name:
            return stage
    raise KeyError(f"unknown stage {name!r}; stages are {list(names())}")


def default_stages() -> tuple[str, ...]:
    return tuple(s.name for s in stages() if s.default)


def versions() -> dict[str, int]:
    """Each stage's version (the source's too): part of every derivation key."""
    return {SOURCE_NAME: get(SOURCE_NAME).version, **{s.name: s.version for s in stages()}}


def candidates() -> tuple[str, ...]:
    """The stages whose artifact validate checks against eager (and check-compat re-checks)."""
    return tuple(s.name for s in stages() if s.candidate)


def artifact_kinds() -> dict[str, str]:
    """`get --artifact` kind -> the stage that makes it, in pipeline order."""
    return {s.artifact: s.name for s in stages() if s.artifact}


def document_slots() -> dict[str, str]:
    """The run document's `artifacts` keys -> their stage: the deliverables (the candidates)."""
    return {s.artifact: s.name for s in stages() if s.artifact and s.candidate}


def program_stages() -> tuple[str, ...]:
    return tuple(s.name for s in stages() if s.program)


def inputs_of(stage: Stage) -> tuple[Input, ...]:
    """A stage's inputs; validate's optional candidates are every candidate stage registered."""
    return _inputs(stage, {s.name: s for s in stages()})


def _inputs(stage: Stage, declared: Mapping[str, Stage]) -> tuple[Input, ...]:
    if stage.checks_candidates:
        return stage.inputs + tuple(Input.of(name, optional=True) for name, s in declared.items() if s.candidate)
    return stage.inputs


def choose_inputs(stage: Stage, selected: Iterable[str]) -> dict[str, str]:
    """Input name -> the stage that provides it in a run of `selected` stages (the source always
    runs). A required input with no provider is left out: check_stage_list reports it."""
    have = {SOURCE_NAME, *selected}
    chosen: dict[str, str] = {}
    for item in inputs_of(stage):
        provider = next((s for s in item.stages if s in have), None)
        if provider is not None:
            chosen[item.name] = provider
    return chosen


def parents(name: str, selected: Iterable[str]) -> list[str]:
    """The stages `name` consumes in a run of `selected` stages."""
    return list(dict.fromkeys(choose_inputs(get(name), selected).values()))


def check_stage_list(selected: Sequence[str]) -> list[str]:
    """Problems with a stage selection: unknown names, repeats, order, inputs nobody makes."""
    known = names()
    unknown = [s for s in selected if s not in known]
    if unknown:
        return [f"unknown stage(s) {unknown}; stages are {list(known)}"]
    problems = []
    if len(set(selected)) != len(selected):
        problems.append("a stage is listed twice")
    if list(selected) != [s for s in known if s in selected]:
        problems.append(f"stages must keep the pipeline order {list(known)}")
    first = entry().name
    if first not in selected:
        problems.append(f"{first} is required: every other stage starts from its program")
        return problems
    for name in dict.fromkeys(selected):
        stage = get(name)
        chosen = choose_inputs(stage, selected)
        for item in inputs_of(stage):
            if not item.optional and item.name not in chosen:
                problems.append(f"{name} needs {' or '.join(item.stages)} before it")
        if stage.checks_candidates and not any(c in selected for c in candidates()):
            problems.append(f"{name} needs {' or '.join(candidates())} (it compares their artifacts with eager)")
    return problems


def missing_libraries(selected: Iterable[str]) -> dict[str, tuple[str, list[str]]]:
    """Stage -> (its extra, the distributions it needs that are not installed), torch-free."""
    from pt2flow.stages.distributions import installed_version

    missing = {}
    for name in selected:
        stage = get(name)
        absent = [lib for lib in stage.libraries if installed_version(lib, None) is None]
        if absent:
            missing[name] = (stage.extra or "", absent)
    return missing


def entry() -> Stage:
    """The stage every other starts from: the program stage made from the source alone (trace)."""
    return next(s for s in stages() if s.program and [i.stages for i in s.inputs] == [(SOURCE_NAME,)])


def publisher(kind: str) -> Stage | None:
    """The first stage (in pipeline order) whose blob is a `kind` (Stage.publishes): "archive",
    "package", "report"... None when no stage publishes one."""
    return next((s for s in stages() if s.publishes == kind), None)


def publisher_name(kind: str) -> str | None:
    found = publisher(kind)
    return found.name if found is not None else None


def configured_by(kind: type) -> str:
    """The stage whose options model is `kind` (a setting another part reads, like the
    training mode of the functional program)."""
    return next(s.name for s in stages() if s.options is kind)


def lineage_order() -> tuple[str, ...]:
    """The record kinds in the order lineage lists a model's records: the source, then the stages."""
    return (SOURCE_NAME, *names())


def libraries() -> frozenset[str]:
    """Every library a stage needs besides torch (their frames are framework, not the model's)."""
    return frozenset(lib for s in stages() for lib in s.libraries)


def plugin_problems() -> list[str]:
    """Entry points of the `pt2flow.stages` group that could not be loaded, one line each."""
    stages()
    return list(_plugin_problems)


# ---------------------------------------------------------------------------------------------


def _sort(declared: Mapping[str, Stage]) -> tuple[Stage, ...]:
    """Kahn's topological sort of the input edges, the ready stage of the lowest position first
    (Stage.position; then the earliest registered)."""
    position = {name: (stage.position, i) for i, (name, stage) in enumerate(declared.items())}
    needs: dict[str, set[str]] = {}
    for name, stage in declared.items():
        edges = set()
        for item in _inputs(stage, declared):
            for provider in item.stages:
                if provider == SOURCE_NAME:
                    continue
                if provider not in declared:
                    if item.optional:
                        continue
                    raise StageRegistrationError(
                        f"stage {name!r} consumes {provider!r}, which no registered stage makes"
                    )
                edges.add(provider)
        needs[name] = edges
    ordered: list[str] = []
    while len(ordered) < len(declared):
        ready = [n for n in declared if n not in ordered and needs[n] <= set(ordered)]
        if not ready:
            left = sorted(set(declared) - set(ordered))
            raise StageRegistrationError(f"the inputs of stages {left} form a cycle")
        ordered.append(min(ready, key=position.__getitem__))
    return tuple(declared[n] for n in ordered)


def _load_plugins() -> None:
    """The built-in stages (each module of BUILTIN_PACKAGE with a `STAGE`), then the entry points
    of `pt2flow.stages` (each names a Stage or an iterable of them). One that fails to load is reported (plugin_problems), never fatal: a
    query or a run without it still works, and a config naming its stage gets an unknown-stage
    error next to the reason."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for stage in _builtin():
        _declared[stage.name] = stage
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = point.load()
            declared = [loaded] if isinstance(loaded, Stage) else list(loaded)
            for stage in declared:
                if not isinstance(stage, Stage):
                    raise TypeError(f"{stage!r} is not a pt2flow Stage")
                origin = point.dist.name if point.dist is not None else point.value
                stage = Stage(**{**stage.__dict__, "origin": origin})
                if stage.name in _declared:
                    raise StageRegistrationError(
                        f"a stage named {stage.name!r} is already registered (by {_declared[stage.name].origin})"
                    )
                candidate = {**_declared, stage.name: stage}
                _sort(candidate)
                _declared[stage.name] = stage
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break pt2flow
            problem = f"the {ENTRY_POINT_GROUP} entry point {point.name!r} ({point.value}) failed to load: {type(exc).__name__}: {exc}"
            _plugin_problems.append(problem)
            log.warning("%s", problem)


def _builtin() -> list[Stage]:
    """pt2flow's own stages: the `STAGE` of every public module of BUILTIN_PACKAGE (imported
    torch-free: a stage module imports torch inside its functions)."""
    import importlib
    import pkgutil

    package = importlib.import_module(BUILTIN_PACKAGE)
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        declared = getattr(importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}"), "STAGE", None)
        if isinstance(declared, Stage):
            found.append(declared)
    return sorted(found, key=lambda s: s.position)
