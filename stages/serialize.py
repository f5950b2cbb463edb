"""serialize: torch.export.save to bytes, with pt2flow metadata in extra_files; round trip checked."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import re
import sys
import zipfile
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping

import torch
from torch.export import ExportedProgram

from pt2flow.stages import program
from pt2flow.stages.archive_meta import METADATA_FILE, PYTREE_MODULES, archive_metadata, recorded_pytree_modules  # noqa: F401  (re-exported)
from pt2flow.stages.classify import short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.vocabulary import MODULE_NAME_PATTERN
from pt2flow.stages.vocabulary import ErrorClass

_TORCH_PYTREE_HOMES = ("builtins", "collections", "torch", "typing")


class _SchemaTypeHints:
    """The `typing` module as torch's program deserializer sees it, with `get_type_hints`
    memoized for the classes of torch's export schema (torch._export.serde.schema).

    torch.export.load turns the archive's JSON into those dataclasses field by field, asking
    `typing.get_type_hints` for the class at every object it makes: about 190 calls for a tiny
    MLP's program, 4.3 ms of a 17 ms load (5.5 ms -> 1.3 ms for the conversion with the answers
    kept). A program stage saves and loads back every program it publishes, so that is 17 ms a
    model. The schema's dataclasses are defined once, at import, and never change, so their hints
    are too; any other class, or a call with its own local namespace, gets the real function.
    Every other attribute is typing's own."""

    def __init__(self, real: Any, schema_module: str) -> None:
        self._real = real
        self._schema_module = schema_module
        self._hints: dict[tuple[type, int, bool], dict[str, Any]] = {}
        self.hits = 0

    def __getattr__(self, name: str) -> Any:
        # typing's attributes never change: kept on the instance, the next lookup of `name` does
        # not come here (the deserializer reads typing.get_origin and the like about 10,000 times
        # a small model)
        value = getattr(self._real, name)
        setattr(self, name, value)
        return value

    def get_type_hints(self, obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False) -> Any:
        if localns is not None or not isinstance(obj, type) or obj.__module__ != self._schema_module:
            return self._real.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns), include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = self._real.get_type_hints(obj, globalns, None, include_extras)
        else:
            self.hits += 1
        return hints  # torch reads it (`hints[field]`), never changes it


def _memoize_schema_type_hints() -> _SchemaTypeHints | None:
    """Install _SchemaTypeHints as torch's deserializer's `typing`; the installed one, or None
    where this torch's deserializer does not look hints up through its module's `typing` (it then
    runs as torch wrote it)."""
    import typing

    try:
        from torch._export.serde import schema as serde_schema
        from torch._export.serde import serialize as serde
    except ImportError:  # pragma: no cover - another torch
        return None
    current = getattr(serde, "typing", None)
    if isinstance(current, _SchemaTypeHints):
        return current
    if current is not typing:
        return None
    memo = _SchemaTypeHints(typing, serde_schema.__name__)
    serde.typing = memo
    return memo


SCHEMA_TYPE_HINTS = _memoize_schema_type_hints()


def load_archive(data: bytes, *, import_pytree_modules: bool = False) -> tuple[ExportedProgram, dict[str, Any]]:
    """Load a .pt2 archive from bytes; returns the program and its pt2flow metadata.

    A program whose inputs or outputs hold pytree types registered outside torch (transformers'
    ModelOutput classes, a user's dataclass) loads only in a process that has imported the modules
    registering them. import_pytree_modules: first import those the archive's metadata names
    (program_bytes_checked records them); only for archives from a store trusted to name modules.

    Every global the archive's pickles name is vetted first (`pickled_classes`) and those classes
    are allowed to torch's weights_only unpickler: a program whose inputs hold a transformers cache
    loads with no fallback to an unsafe unpickle, and an archive whose pickle names anything else
    (a function that would run as it is unpickled) is refused before torch reads it.
    Raises StageError('serialization') naming torch's reason when the archive does not load, or
    what a pickle names that is refused."""
    if import_pytree_modules:
        import_archive_modules(data)
    allowed = pickled_classes(data)
    extra = {METADATA_FILE: ""}
    with quiet_torch(), _load_failures() as causes, torch.serialization.safe_globals(allowed):
        try:
            ep = torch.export.load(io.BytesIO(data), extra_files=extra)
        except Exception as exc:
            reason = short_message(causes[-1] if causes else exc)
            raise StageError(ErrorClass.SERIALIZATION, f"the saved program does not load: {reason}") from exc
    raw = extra.get(METADATA_FILE) or "{}"
    return ep, json.loads(raw)


def pickled_classes(data: bytes) -> list[type]:
    """The classes the pickles of an archive name, each vetted before anything is unpickled: its
    example inputs (torch.save: a transformers cache and its layers in a generative component's)
    and the tensors, weights and objects torch.export.save pickled instead of storing raw (a
    tensor subclass), which torch.export.load unpickles with weights_only=False. A class is
    allowed when a module the archive records as registering its program's pytree types (its
    treespecs' type names, for an archive that records none) defines it and is imported, or when
    it is a tensor subclass; torch's own rebuild functions are allowed by torch. load_archive lets
    torch's weights_only unpickler rebuild these classes.

    Raises StageError('serialization') naming the pickle and every global it names that is none
    of those (a function, a class of another module), or a pickle that uses more than the opcodes
    torch's weights_only unpickler reads: unpickled, it could run code (torch.export.load retries
    example inputs that fail weights_only with weights_only=False, logging "Fallback to
    weights_only=False succeeded"), and pt2flow never unpickles what it has not vetted. With every
    global vetted, that retry, where torch needs it, calls nothing but these classes and torch's
    rebuild functions: a transformers ModelOutput (an OrderedDict, as T5's encoder_outputs) is
    rebuilt item by item, which the weights_only unpickler refuses for any class but dict."""
    modules = recorded_pytree_modules(data)
    if modules is None:
        modules = sorted({name.rpartition(".")[0] for name in _spec_type_names(data)})
    allowed: list[type] = []
    for name, pickled in _pickles(data):
        try:
            named = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(pickled))
        except Exception as exc:  # noqa: BLE001 - any pickle the scan cannot read is refused
            raise StageError(
                ErrorClass.SERIALIZATION,
                f"the archive's {name} is not a pickle torch's weights_only unpickler reads "
                f"({short_message(exc)}); refused, as unpickling it could run code",
            ) from exc
        refused = []
        for global_name in named:
            found = _defined_class(global_name, modules)
            if found is None:
                refused.append(global_name)
            elif found not in allowed:
                allowed.append(found)
        if refused:
            raise StageError(
                ErrorClass.SERIALIZATION,
                f"the archive's {name} pickles {', '.join(sorted(refused))}: not a tensor subclass "
                f"nor a class of a module that registers the program's pytree types ({', '.join(modules) or 'none'}); "
                "refused, as unpickling it could run code (torch.load weights_only=False)",
            )
    return allowed


def _pickles(data: bytes) -> list[tuple[str, bytes]]:
    """The entries of an archive that torch.export.load unpickles in Python: its example inputs,
    and each weight or constant its payload configs mark `use_pickle` (a torchbind object, loaded
    by torch's C++ unpickler of registered classes, aside); none in bytes that are not a zip, of
    which torch.export.load says why."""
    found: list[tuple[str, bytes]] = []
    with contextlib.suppress(zipfile.BadZipFile), zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        for name in names:
            if "/data/sample_inputs/" in name and name.endswith(".pt"):
                found.append((name, archive.read(name)))
            elif re.search(r"/data/(weights|constants)/[^/]+_config\.json$", name):
                try:
                    config = json.loads(archive.read(name)).get("config") or {}
                except ValueError as exc:
                    raise StageError(
                        ErrorClass.SERIALIZATION, f"the archive's {name} is not JSON: {short_message(exc)}"
                    ) from exc
                folder = name.rpartition("/")[0]
                for meta in config.values():
                    path = f"{folder}/{meta.get('path_name')}"
                    if (
                        meta.get("use_pickle")
                        and not str(meta.get("path_name")).startswith("custom_obj_")
                        and path in names
                    ):
                        found.append((path, archive.read(path)))
    return found


def _defined_class(global_name: str, modules: list[str]) -> type | None:
    """The class `module.Qualified.Name` names, where module is one of `modules`, imported, and
    defines it (not a name it imported from elsewhere), or a tensor subclass; else None."""
    for module in sorted(modules, key=len, reverse=True):
        if not global_name.startswith(module + ".") or module not in sys.modules:
            continue
        found: Any = sys.modules[module]
        for part in global_name[len(module) + 1 :].split("."):
            found = getattr(found, part, None)
        if isinstance(found, type) and found.__module__ == module:
            return found
    module, _, qualified = global_name.rpartition(".")
    found = getattr(sys.modules.get(module), qualified, None) if "." not in qualified else None
    return found if isinstance(found, type) and issubclass(found, torch.Tensor) else None


@contextlib.contextmanager
def _load_failures() -> Iterator[list[BaseException]]:
    """What torch.export.load logs and swallows (it raises only "We ran into an error when
    deserializing the saved file. Please check the warnings above"): the real exceptions."""
    causes: list[BaseException] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                causes.append(record.exc_info[1])

    logger = logging.getLogger("torch.export")
    saved = (logger.level, logger.propagate, logger.handlers)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # kept here, never printed
    logger.handlers = [Keep(logging.WARNING)]
    try:
        yield causes
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers = saved[2]


def import_archive_modules(data: bytes) -> list[str]:
    """Import the modules registering the pytree types of an archive's program: those its
    metadata names, or for an archive that names none (from before serialize v2, or not from
    pt2flow) those its treespecs' type names point into. Returns the ones this call imported."""
    before = set(sys.modules)
    named = archive_metadata(data).get(PYTREE_MODULES)
    if named is None:
        _import_guessed(_spec_type_names(data))
    else:
        _import_modules(named)
    return sorted(set(sys.modules) - before)


def import_pytree_modules(names: Any) -> list[str]:
    """Import modules an archive's metadata named (for an AOTInductor package or a target of the
    same program, which records none itself); returns the ones this call imported. StageError
    `import` naming the module that does not import."""
    before = set(sys.modules)
    _import_modules(names)
    return sorted(set(sys.modules) - before)


def _import_modules(names: Any) -> None:
    for name in names if isinstance(names, list) else []:
        if not isinstance(name, str) or not MODULE_NAME_PATTERN.fullmatch(name):
            raise StageError(
                ErrorClass.SERIALIZATION, f"archive names {name!r} as a module to import; not a module name"
            )
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise StageError(
                ErrorClass.IMPORT,
                f"importing {name!r} (it registers a pytree type the program uses) failed: {short_message(exc)}",
            ) from exc
        if name == "transformers.cache_utils" or name.startswith("transformers.cache_utils."):
            # transformers' Cache classes are not pytree nodes on import: the export registered them
            # (transformers.exporters), and a process loading the program must do the same
            from pt2flow.stages.generation_export import register_cache_pytrees

            register_cache_pytrees()


def _spec_type_names(data: bytes) -> set[str]:
    """The serialized type names in an archive's treespecs (the in_spec/out_spec strings of its
    program JSON), read from the zip without loading the program."""
    names: set[str] = set()

    def walk(node: Any, in_spec: bool) -> None:
        if isinstance(node, dict):
            if in_spec and isinstance(node.get("type"), str):
                names.add(node["type"])
            for key, value in node.items():
                if key in ("in_spec", "out_spec") and isinstance(value, str):
                    with contextlib.suppress(ValueError):
                        walk(json.loads(value), True)
                else:
                    walk(value, in_spec)
        elif isinstance(node, list):
            for value in node:
                walk(value, in_spec)

    with contextlib.suppress(zipfile.BadZipFile, KeyError, ValueError), zipfile.ZipFile(io.BytesIO(data)) as archive:
        for name in archive.namelist():
            if "/models/" in name and name.endswith(".json"):
                walk(json.loads(archive.read(name)), False)
    return names


def _import_guessed(type_names: set[str]) -> None:
    """Import the module each non-torch type name points into, by the "module.Class" convention
    (transformers' ModelOutput classes follow it): the longest importable prefix. A guess that
    does not import is skipped; the load then fails with torch's own reason."""
    for type_name in sorted(type_names):
        parts = type_name.split(".")
        if parts[0] in _TORCH_PYTREE_HOMES or not MODULE_NAME_PATTERN.fullmatch(type_name):
            continue
        for end in range(len(parts) - 1, 0, -1):
            try:
                importlib.import_module(".".join(parts[:end]))
                break
            except Exception:  # noqa: BLE001 - not a module (a class path), or one that fails
                continue


def pytree_modules(ep: ExportedProgram) -> list[str]:
    """Modules defining the pytree node types of the program's call specs that torch does not
    register itself: what a process must import before this program's archive loads there."""
    specs = [ep.call_spec.in_spec, ep.call_spec.out_spec]
    for entry in ep.module_call_graph:
        if entry.signature is not None:
            specs += [entry.signature.in_spec, entry.signature.out_spec]
    found: set[str] = set()
    pending = [s for s in specs if s is not None]
    while pending:
        spec = pending.pop()
        kind = spec.type
        if kind is not None:
            module = getattr(kind, "__module__", "") or ""
            if module.partition(".")[0] not in _TORCH_PYTREE_HOMES:
                found.add(module)
        pending.extend(spec.children())
    return sorted(found)


@dataclass(frozen=True)
class StoredProgram:
    """A program as the store holds it: its bytes, the program they load back to (what every later
    stage is given, whether its parent was computed in this worker or read from the store) and
    that program's fingerprint (the identity its record carries, docs/architecture.md §5)."""

    data: bytes
    program: ExportedProgram
    fingerprint: str


def stored_program(ep: ExportedProgram) -> StoredProgram:
    """The program saved (with PYTREE_MODULES in its metadata, node provenance and stack traces
    free of process state) and loaded back. Its identity is the loaded program's: torch's loader
    re-derives what an export kept in memory only (symbolic strides it simplifies, storage
    offsets it drops, guards), so the in-memory program's fingerprint may differ from that of
    the same program read from the store, while a loaded program loads back to itself.
    Raises StageError('serialization') naming the failure when the program does not save or does
    not load back (it must never become a cache entry)."""
    text = json.dumps({PYTREE_MODULES: pytree_modules(ep)}, sort_keys=True)
    buffer = io.BytesIO()
    with quiet_torch(), stable_graph_ids(ep), stable_stack_traces(ep):
        try:
            torch.export.save(ep, buffer, extra_files={METADATA_FILE: text})
        except Exception as exc:
            raise StageError(ErrorClass.SERIALIZATION, f"torch.export.save failed: {short_message(exc)}") from exc
    data = buffer.getvalue()
    loaded = check_round_trip(data)
    return StoredProgram(data, loaded, program.fingerprint(loaded))


def program_bytes_checked(ep: ExportedProgram) -> bytes:
    """stored_program's bytes."""
    return stored_program(ep).data


def check_round_trip(data: bytes) -> ExportedProgram:
    """The program the bytes hold; StageError('serialization') naming the reason when they do not load."""
    return load_archive(data)[0]


def serialize(ep: ExportedProgram, metadata: Mapping[str, Any], *, identity: str | None = None) -> StageResult:
    """Output: the archive's bytes. Reloads them and checks that the program came back unchanged.

    identity: the fingerprint of `ep` when the caller has it (the serialize stage: its parent's,
    taken of the program as it loaded from the store). A loaded program loads back to itself
    (tests/stages/test_identity.py), so the archive's program has that identity, and it is not
    taken again; without it, the reloaded program is fingerprinted.

    The archive's pt2flow metadata is `metadata` plus, when the program's inputs or outputs hold
    pytree types registered outside torch, the modules that register them (PYTREE_MODULES): a
    process that loads the archive later (check-compat) imports them first."""
    modules = pytree_modules(ep)
    text = json.dumps({**metadata, **({PYTREE_MODULES: modules} if modules else {})}, sort_keys=True)
    buffer = io.BytesIO()
    with quiet_torch() as sink, stable_graph_ids(ep), stable_stack_traces(ep):
        try:
            torch.export.save(ep, buffer, extra_files={METADATA_FILE: text})
        except Exception as exc:
            raise StageError(ErrorClass.SERIALIZATION, f"torch.export.save failed: {short_message(exc)}") from exc
    data = buffer.getvalue()
    try:
        reloaded, meta_back = load_archive(data)
    except StageError:
        raise
    except Exception as exc:
        raise StageError(ErrorClass.SERIALIZATION, f"the saved archive does not load: {short_message(exc)}") from exc
    if meta_back != json.loads(text):
        raise StageError(ErrorClass.SERIALIZATION, "pt2flow metadata did not survive the round trip")
    changed = roundtrip_differences(ep, reloaded)
    if changed:
        raise StageError(
            ErrorClass.SERIALIZATION, f"the reloaded program differs from the saved one: {'; '.join(changed)}"
        )
    # the identity is the archive's program as it loads (stored_program): the same for a parent
    # computed in this worker and one read from the store
    described = program.describe(ep, identity_of=None if identity else reloaded)
    result_meta = {
        **described,
        **({"fingerprint": identity} if identity else {}),
        "size": len(data),
        "archive_version": archive_version(data),
    }
    return StageResult(output=data, metadata=result_meta, warnings=sink.items)


def _every_node(ep: ExportedProgram) -> Iterator[torch.fx.Node]:
    """Every node of the program's graphs, its submodules' (a cond branch) included: what torch
    serializes node metadata from."""
    for module in ep.graph_module.modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            yield from graph.nodes


# how a Python object's repr names its address (`<function f at 0x7f3a...>`)
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@contextlib.contextmanager
def stable_graph_ids(ep: ExportedProgram) -> Iterator[None]:
    """Within the block, the graph ids in the program's pass provenance (node.meta["from_node"],
    torch.fx.traceback.NodeSource) are 0, 1, 2... in order of first appearance instead of the
    `id()` of graphs of the process that exported it (addresses, different in every process):
    what made two exports of the same model save to other bytes, with the addresses below, so the
    same program now saves to the same bytes (the zip's timestamps are fixed and its
    .data/serialization_id is derived from the records' contents by torch itself). A target that
    is a Python function is written by torch as its repr, `<function sym_float at 0x7f..>`: the
    address is left out (a joint program's archive had another ID in every process). Which nodes
    came from the same graph is kept. The original ids and targets are restored afterwards."""
    infos: list[Any] = []  # every NodeSource.NodeInfo once, in order of first appearance
    sources: list[Any] = []
    seen: set[int] = set()

    def visit(source: Any) -> None:
        if id(source) in seen:
            return
        seen.add(id(source))
        sources.append(source)
        info = getattr(source, "node_info", None)
        if info is not None and id(info) not in seen:
            seen.add(id(info))
            infos.append(info)
        for parent in getattr(source, "from_node", None) or []:
            visit(parent)

    for node in _every_node(ep):
        for source in node.meta.get("from_node") or []:
            visit(source)
    original = [(info.graph_id, info.target) for info in infos]
    numbers: dict[int, int] = {}
    try:
        for info, (graph_id, target) in zip(infos, original):
            info.graph_id = numbers.setdefault(graph_id, len(numbers))
            if isinstance(target, str):
                info.target = ADDRESS.sub("", target)
        _forget_cached_dicts(sources)
        yield
    finally:
        for info, (graph_id, target) in zip(infos, original):
            info.graph_id, info.target = graph_id, target
        _forget_cached_dicts(sources)


# FX names the code it generates for a graph `<eval_with_key>.N`, N counting every graph the
# process has compiled: a stack trace through such code names how much the worker did before
EVAL_KEY = re.compile(r"(<eval_with_key>)\.\d+")


@contextlib.contextmanager
def stable_stack_traces(ep: ExportedProgram) -> Iterator[None]:
    """Within the block, each node's stack_trace names generated FX code `<eval_with_key>`
    without the process's counter (the same model exported after other models, or in another
    worker, named it `<eval_with_key>.281` or `.603`). Restored afterwards."""
    changed: list[tuple[Any, str]] = []
    for node in _every_node(ep):
        trace = node.meta.get("stack_trace")
        if isinstance(trace, str) and "<eval_with_key>." in trace:
            changed.append((node, trace))
            node.meta["stack_trace"] = EVAL_KEY.sub(r"\1", trace)
    try:
        yield
    finally:
        for node, trace in changed:
            node.meta["stack_trace"] = trace


def _forget_cached_dicts(sources: list[Any]) -> None:
    """NodeSource caches its to_dict() (what torch serializes): drop it after changing ids."""
    for source in sources:
        if hasattr(source, "_dict"):
            source._dict = None


def archive_version(data: bytes) -> str | None:
    """The serializer schema version ("major.minor") an archive's program was written with: what
    a torch that reads it must support (torch._export.serde.schema.SCHEMA_VERSION when written)."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            name = next(n for n in sorted(archive.namelist()) if "/models/" in n and n.endswith(".json"))
            version = json.loads(archive.read(name)).get("schema_version") or {}
    except (zipfile.BadZipFile, StopIteration, ValueError, KeyError):
        return None
    if "major" not in version:
        return None
    return f"{version['major']}.{version.get('minor', 0)}"


def roundtrip_differences(saved: ExportedProgram, loaded: ExportedProgram) -> list[str]:
    """What differs between a program and its reloaded copy, ignoring what serialization may
    legitimately change: getitem nodes (the loader unpacks every output of multi-output ops)."""
    problems = []
    before = {k: v for k, v in program.op_histogram(saved).items() if k != "operator.getitem"}
    after = {k: v for k, v in program.op_histogram(loaded).items() if k != "operator.getitem"}
    if before != after:
        diff = {
            k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)
        }
        problems.append(f"op histogram {diff}")
    if program.signature_summary(saved) != program.signature_summary(loaded):
        problems.append("graph signature")
    if program.range_constraints(saved) != program.range_constraints(loaded):
        problems.append("range constraints")
    for label, a, b in (
        ("state_dict", saved.state_dict, loaded.state_dict),
        ("constants", saved.constants, loaded.constants),
    ):
        if set(a) != set(b):
            problems.append(f"{label} keys")
            continue
        for name in a:
            x, y = a[name], b[name]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.detach(), y.detach()):
                    problems.append(f"{label}[{name}]")
    return problems


def program_bytes(ep: ExportedProgram) -> bytes:
    """An intermediate program as torch.export.save bytes (what trace/functionalize/decompose store)."""
    buffer = io.BytesIO()
    with quiet_torch():
        torch.export.save(ep, buffer)
    return buffer.getvalue()
