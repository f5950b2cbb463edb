"""`pt2flow repro`: a failed stage as a self-contained script that needs torch alone, the kind of
reproducer torch's maintainers ask for in a bug report (docs/architecture.md §4).

Everything comes from the store, not from a config: the failed record names the stage, the
strategy and the options; its source record holds the factory, kwargs, inputs, dynamic shapes and
weights. The folder written holds repro.py, the example inputs (inputs.pt, torch.save of the
exact arguments the stage used), the weights (weights.pt) for trace, and for a later stage the
program it was given (program.pt2). The script imports the model's code from where the run found
it, and makes the same call that failed, so it raises the same exception:

    trace          torch.export.export with the first strategy of the ladder (the configured
                   strictness and dynamic shapes), whose error is the one recorded
    functionalize  run_decompositions({}) on the traced program (training: the joint program)
    decompose      run_decompositions(core ATen table minus `preserve`), then the check that no
                   op outside core ATen is left
    serialize      torch.export.save, then torch.export.load of the bytes
    aot_compile    torch._inductor.aoti_compile_and_package (after move_to_device_pass for a
                   GPU target)

A generative model's component (`M/decode`) is exported by transformers' DynamoExporter, not the
ladder: its trace's script (repro_component.py) decomposes the model as the run did and makes
DynamoExporter's call, with torch and transformers; a later stage's script loads the component's
program after registering transformers' cache classes as pytrees.

Each stage names its template (Stage.repro, a function in the stage's own module, flows/builtin/); the program a later stage was given is its parent record's, found through the record's
parent keys, so any valid stage list reproduces (`[trace, serialize]` loads trace's program).

A program stage that failed with `serialization` failed the store's round trip of its program,
not its own call: its script then also saves the program and loads it back. Every script ends
by printing that nothing was raised, should the failure not reproduce.

A failure before torch was reached (class import, config or weights: the model's code, its config,
its weights) has no torch-only reproducer: repro refuses it in one line (ReproError, exit 1) before
making the folder. Whatever stops a reproducer half-way removes what it wrote, and the folder if
repro made it.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from pt2flow.flows import pipeline
from pt2flow.storage.errors import RecordNotFound
from pt2flow.storage.lineage import ancestors, decode, records_for_id


def reproducible() -> tuple[str, ...]:
    """The stages with a repro template, in pipeline order."""
    return tuple(s.name for s in pipeline.stages() if s.repro)


# failures that happen before torch is reached: the model's code, its config or its weights, which
# a torch-only script cannot show (the fix is the user's, and `pt2flow validate` names it)
BEFORE_TORCH = {
    "import": "the model's code does not import",
    "config": "the config does not fit the model",
    "weights": "the weights do not load into the model",
}


class ReproError(RecordNotFound):
    """Nothing to reproduce: no failure of that model or ID, or a stage repro does not cover."""


class ReproOutputError(ValueError):
    """The folder to write into cannot be made or written (a file of that name, no permission)."""


# ---------------------------------------------------------------------------------------------
# finding the failure and what it was made from


def find_failure(index: Any, target: str) -> dict[str, Any]:
    """The failed record `target` names: an artifact ID (prefix) of a failure report, else a
    model's newest failed record."""
    import pyarrow.compute as pc

    rows: list[dict[str, Any]] = []
    if len(target) >= 8 and all(c in "0123456789abcdefABCDEF" for c in target):
        try:
            rows = records_for_id(index, target)
        except RecordNotFound:
            rows = []
    if not rows:
        # a generative model's failures are its components' (`M/prefill`, `M/decode`) too
        condition = (pc.field("model") == target) | pc.starts_with(pc.field("model"), f"{target}/")
        rows = index.scan(None, filter=condition).to_pylist()
        if not rows:
            raise ReproError(f"no model and no artifact ID {target!r} in the index")
    failed = [r for r in rows if r.get("status") == "failed" and r.get("stage") != "source"]
    if not failed:
        raise ReproError(f"{target!r} has no failed stage in the index: repro writes scripts for failures")
    record = decode(max(failed, key=lambda r: r.get("ended_at") or ""))
    if record.get("error_class") in BEFORE_TORCH:
        first = ((record.get("error_message") or "").strip().splitlines() or [""])[0]
        raise ReproError(
            f"{record['model']} failed at {record['stage']} with {record['error_class']} before torch was reached "
            f"({BEFORE_TORCH[record['error_class']]}: {first}): a torch-only script cannot reproduce that; fix it and run again"
        )
    if record["stage"] not in reproducible():
        raise ReproError(
            f"{record['model']} failed at {record['stage']} ({record.get('error_class')}); repro covers "
            f"{', '.join(reproducible())}: a validation failure is a comparison, `pt2flow show` has its report"
        )
    return record


def _chain(index: Any, record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ok ancestors of a failed record: by stage, and its direct parent program (the record
    of a program stage whose key the failed record names) under "program"."""
    found = [decode(r) for r in ancestors(index, record, pipeline.lineage_order()) if r.get("status") == "ok"]
    chain = {r["stage"]: r for r in found}
    parents = set(record.get("parent_keys") or ())
    programs = set(pipeline.program_stages())
    direct = [r for r in found if r.get("key") in parents and r["stage"] in programs]
    if direct:
        chain["program"] = direct[0]
    return chain


def search_path_of(module: str, module_file: str | None) -> str | None:
    """The sys.path entry from which `module` imports as its file `module_file`."""
    if not module_file:
        return None
    path = Path(module_file).resolve()
    levels = module.count(".") + (2 if path.name == "__init__.py" else 1)
    return str(path.parents[levels - 1])


# ---------------------------------------------------------------------------------------------
# the bundle


def _resolved_model(source: Mapping[str, Any], manifest: Mapping[str, Any]) -> Any:
    """The model as the run resolved it, from its source record (no config needed)."""
    from pt2flow.flows.config.inputs import DICT_KEY, TUPLE_KEY, parse_input
    from pt2flow.flows.config import ResolvedModel
    from pt2flow.flows.config.models import DataConfig, GenerateConfig

    def problem(path: Any, message: str) -> None:
        raise ReproError(f"the recorded inputs of {source['model']} do not parse at {path}: {message}")

    def from_json(tree: Any) -> Any:  # the manifest's {dict: [[k, v], ...]} keeps keys' types
        if isinstance(tree, dict) and set(tree) == {DICT_KEY} and isinstance(tree[DICT_KEY], list):
            return {DICT_KEY: {k: from_json(v) for k, v in tree[DICT_KEY]}}
        if isinstance(tree, dict) and set(tree) == {TUPLE_KEY}:
            return {TUPLE_KEY: [from_json(v) for v in tree[TUPLE_KEY]]}
        if isinstance(tree, list):
            return [from_json(v) for v in tree]
        return tree

    details = source.get("details") or {}
    module = manifest["factory"].split(":", 1)[0]
    inputs = {
        k: parse_input(from_json(v), ("inputs", k), problem, lambda exc, path: problem(path, str(exc)))
        for k, v in manifest.get("inputs", {}).items()
    }
    inputs_file = (manifest.get("inputs_file") or {}).get("path")
    return ResolvedModel(
        name=source["model"],
        factory=manifest["factory"],
        kwargs=manifest.get("kwargs") or {},
        weights=None,
        inputs=inputs,
        dynamic_shapes={k: _int_keys(v) for k, v in (manifest.get("dynamic_shapes") or {}).items()},
        dims={k: (int(v[0]), int(v[1])) for k, v in (manifest.get("dims") or {}).items()},
        options={},
        search_path=search_path_of(module, details.get("module_file")) or os.getcwd(),
        inputs_factory=(manifest.get("inputs_factory") or {}).get("factory"),
        inputs_file=inputs_file,
        generate=GenerateConfig(**manifest["generate"]) if manifest.get("generate") else None,
        data=DataConfig(**{k: v for k, v in manifest["data"].items() if k not in ("code_hash", "sha256")})
        if manifest.get("data")
        else None,
    )


def _int_keys(dyn: Any) -> Any:
    """A dims tree from JSON: a tensor's {"0": name} back to {0: name}."""
    if isinstance(dyn, list):
        return [_int_keys(d) for d in dyn]
    if isinstance(dyn, dict):
        if dyn and all(isinstance(v, str) for v in dyn.values()) and all(str(k).lstrip("-").isdigit() for k in dyn):
            return {int(k): v for k, v in dyn.items()}
        return {k: _int_keys(v) for k, v in dyn.items()}
    return dyn


def recorded_weights(store: Any, details: Mapping[str, Any]) -> Any:
    from pt2flow.stages.source import load_state_dict

    weights = details.get("weights")
    if not weights:
        return None
    return load_state_dict(store.get_blob(weights["sha256"], weights["size"]), weights["filename"])


def dims_code(dynamic: Any) -> tuple[list[str], str]:
    """(Dim definitions, the dynamic_shapes expression) as Python source (a repro template's):
    a named Dim is defined once and named; a hint (Dim.AUTO, DYNAMIC, STATIC, with the min and max
    it was given) is written inline, as `torch.export.Dim.AUTO(max=64)`."""
    import dataclasses

    from torch.export.dynamic_shapes import _DimHint

    dims: dict[str, str] = {}

    def code(value: Any) -> str:
        if value is None:
            return "None"
        if isinstance(value, _DimHint):
            bounds = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name in ("min", "max")}
            given = ", ".join(f"{k}={v!r}" for k, v in bounds.items() if v is not None)
            return f"torch.export.Dim.{value.type.name}" + (f"({given})" if given else "")
        if isinstance(value, tuple):
            return "(" + "".join(code(v) + ", " for v in value) + ")"
        if isinstance(value, list):
            return "[" + ", ".join(code(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {code(v)}" for k, v in value.items()) + "}"
        name = value.__name__
        dims[name] = f"{name} = torch.export.Dim({name!r}, min={value.min}, max={value.max})"
        return name

    expression = code(dynamic)
    return list(dims.values()), expression


def write_repro(store: Any, target: str, out_dir: str) -> dict[str, Any]:
    """Write the reproducer of `target`'s failure into `out_dir`; returns what was written."""
    from pt2flow.stages.devices import MISSING_DEVICE_PREFIX

    record = find_failure(store.index, target)
    if (record.get("error_message") or "").startswith(MISSING_DEVICE_PREFIX):
        raise ReproError(
            f"{record['model']}'s {record['stage']} failed because that machine lacked the device "
            f"({record.get('error_message')}), not inside torch: there is nothing to reproduce"
        )
    chain = _chain(store.index, record)
    source = chain.get("source")
    if source is None:
        raise ReproError(f"the source record of {record['model']}'s failed {record['stage']} is not in the index")
    manifest = json.loads(store.get_blob(source["sha256"], source.get("size")))
    model = _resolved_model(source, manifest)
    if "/" in str(record["model"]):  # a generative model's component (`M/decode`): its template sees which one
        model = model.of_component(str(record["model"]).split("/", 1)[1])
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise ReproOutputError(f"{out_dir} is a file: give the folder to write into")
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReproOutputError(f"cannot write into {out_dir}: {exc.strerror or exc}") from exc
    files: list[str] = []
    try:
        return _write(store, record, chain, source, model, folder, files)
    except BaseException as exc:
        _remove_written(folder, files, created)  # nothing half-written is left behind, nor an empty folder
        from pt2flow.stages.errors import StageError

        if isinstance(exc, StageError):  # the model cannot be built here now (its code changed or moved since the run)
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ReproError(
                f"cannot rebuild {record['model']} to write its reproducer: {exc.error_class}: {first}"
            ) from None
        raise


def _remove_written(folder: Path, files: list[str], created: bool) -> None:
    """Undo a reproducer half-written into `folder`: the folder itself when repro made it, else
    the files it wrote there."""
    import shutil

    if created:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in files:
        (folder / name).unlink(missing_ok=True)


def _write(
    store: Any,
    record: Mapping[str, Any],
    chain: Mapping[str, Any],
    source: Mapping[str, Any],
    model: Any,
    folder: Path,
    files: list[str],
) -> dict[str, Any]:
    """Write the reproducer's files into `folder`, naming each in `files` as it is written."""
    import torch

    job = ReproJob(store, record, chain, source, model, folder, files)
    body = pipeline.resolve(pipeline.get(record["stage"]).repro)(job)
    if record.get("error_class") == "serialization" and record["stage"] in pipeline.program_stages():
        body += _ROUND_TRIP  # the program failed the store's round trip, not the stage's own call
    check = own_check(record)
    if check is not None:  # the library was never called: the script says so (_check_guard) unless asked to call it
        body += _library_accepted(check)
    else:
        body += "print('no error: the failure does not reproduce with this torch')\n"
    script = _script(record, model, body, torch.__version__, check)
    files.append("repro.py")
    (folder / "repro.py").write_text(script)
    return {
        "model": record["model"],
        "stage": record["stage"],
        "error_class": record.get("error_class"),
        "error": record.get("error_message"),
        "run_id": record.get("run_id"),
        "dir": str(folder.resolve()),
        "files": sorted(files),
        "check": check,
    }


# the exit status of a reproducer of a failure of pt2flow's own check (the library not called)
OWN_CHECK_EXIT = 3
CALL_LIBRARY = "--call-library"


def own_check(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """What pt2flow's own check that refused this stage checks (`details.check` of its record:
    `by`, `library`, `checks`), when the failure is such a refusal: the stage refused the program
    itself, before the library (ExecuTorch, ...) was called. None for the library's own failures."""
    check = (record.get("details") or {}).get("check")
    return dict(check) if isinstance(check, Mapping) and check.get("by") == "pt2flow" else None


def _check_guard(record: Mapping[str, Any], check: Mapping[str, Any]) -> str:
    """The script's lines before the library's call: say that pt2flow's own check refused the
    program and the library was not asked, and stop (OWN_CHECK_EXIT) unless CALL_LIBRARY is given."""
    library = check.get("library") or "the library"
    said = [
        f"This failure is pt2flow's own check, not an error of {library}: pt2flow refused the program itself,",
        f"before calling {library}, so {library} was not asked and there is no error of its to reproduce.",
        f"It checks {check.get('checks') or 'what the stage needs'}.",
    ]
    lines = [
        f"RECORDED = {(record.get('error_message') or '').strip()!r}",
        f"if {CALL_LIBRARY!r} not in sys.argv[1:]:",
        *(f"    print({line!r})" for line in said),
        '    print("Recorded: " + RECORDED)',
        f"    print({f'To see what {library} itself does with the program: python '!r} + os.path.basename(__file__) + {' ' + CALL_LIBRARY!r})",
        f"    print({'(what it writes goes into '!r} + HERE + ')')",
        f"    sys.exit({OWN_CHECK_EXIT})",
        "",
    ]
    return "\n".join(lines) + "\n"


def _library_accepted(check: Mapping[str, Any]) -> str:
    """The script's last line when the library's call (CALL_LIBRARY) raised nothing."""
    said = f"{check.get('library') or 'the library'} itself accepted the program: the refusal was pt2flow's own check alone (its output is in "
    return f"print({said!r} + HERE + ')')\n"


class ReproJob:
    """What a stage's repro template gets (Stage.repro): the failed record and its options, the
    model as the run resolved it, and the folder to write data files into. `program()` writes the
    program the stage was given to program.pt2 and returns the line that loads it as `ep`."""

    def __init__(
        self,
        store: Any,
        record: Mapping[str, Any],
        chain: Mapping[str, Any],
        source: Mapping[str, Any],
        model: Any,
        folder: Path,
        files: list[str],
    ) -> None:
        self.store, self.record, self.chain, self.source, self.model, self.folder, self.files = (
            store,
            record,
            chain,
            source,
            model,
            folder,
            files,
        )
        self.options: dict[str, Any] = dict(record.get("options") or {})

    def write(self, name: str, data: bytes) -> str:
        """Write a data file beside repro.py; the expression of its path in the script."""
        self.files.append(name)
        (self.folder / name).write_bytes(data)
        return f"os.path.join(HERE, {name!r})"

    def program(self) -> str:
        parent = self.chain.get("program")
        if parent is None:
            raise ReproError(
                f"the program that {self.record['model']}'s {self.record['stage']} was given is not in the index"
            )
        path = self.write("program.pt2", self.store.get_blob(parent["sha256"], parent.get("size")))
        return f"ep = torch.export.load({path})\n"


# pt2flow saves every program it stores and loads it back before it is used (docs/architecture.md §2)
_ROUND_TRIP = textwrap.dedent("""\
    import io
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)  # pt2flow stores each program and loads it back before use
    buffer.seek(0)
    torch.export.load(buffer)
    """)


def build_model_code(model: Any, weights: bool) -> str:
    module, _, attr = model.factory.partition(":")
    lines = [
        f"from {module} import {attr.split('.')[0]} as factory_root",
        "factory = factory_root" + "".join(f".{part}" for part in attr.split(".")[1:]),
        "torch.manual_seed(0)  # the factory's random init, as pt2flow builds it",
        f"model = factory(**{dict(model.kwargs)!r})",
    ]
    if weights:
        lines.append(
            "model.load_state_dict(torch.load(os.path.join(HERE, 'weights.pt'), weights_only=True), strict=True)"
        )
    lines.append("model.eval()")
    return "\n".join(lines) + "\n"


def _script(
    record: Mapping[str, Any], model: Any, body: str, torch_version: str, check: Mapping[str, Any] | None = None
) -> str:
    message = (record.get("error_message") or "").strip().splitlines()
    alone = (
        "torch and transformers" if getattr(model, "component", None) else "torch"
    )  # a component's program or export is transformers'
    if check is not None:
        library = check.get("library") or "the library"
        usage = [
            f"This failure is pt2flow's own check, not {library}'s: pt2flow refused the program before calling",
            f"{library}, which was not asked. `python repro.py` says so and exits {OWN_CHECK_EXIT};",
            f"`python repro.py {CALL_LIBRARY}` makes {library}'s own call, to see what it does with the program.",
        ]
    else:
        usage = ["Run it with the same Python environment: python repro.py"]
    head = [
        f'"""Reproduces the {record["stage"]} failure of model {record["model"]!r} with {alone} alone (no pt2flow).',
        "",
        f"Recorded by pt2flow in run {record.get('run_id')} with torch {record.get('torch_version') or torch_version}:",
        f"    {record.get('error_class')}: {message[0] if message else ''}",
        "",
        *usage,
        "Every file it writes goes into its own folder, whatever the current folder.",
        '"""',
        "import os",
        "import sys",
        "",
        "HERE = os.path.dirname(os.path.abspath(__file__))",
        "",
        *([_check_guard(record, check)] if check is not None else []),  # said before torch is imported
        "import torch",
        "",
        f"sys.path.insert(0, {model.search_path!r})  # where the run imported the model's code from",
        "",
    ]
    # a later stage's program may hold the model's own pytree types: importing its module registers them
    if record["stage"] != pipeline.entry().name:
        head += [f"import {model.factory.split(':', 1)[0]}  # noqa: F401  (registers the model's pytree types)", ""]
        if "/" in str(record["model"]):  # a generative model's component: its program names transformers' cache classes
            head += [
                "from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model",
                "",
                "register_cache_pytrees_for_model(torch.nn.Module())  # the Cache classes as pytrees, as the export had them",
                "",
            ]
    if (
        record["stage"] != pipeline.entry().name
    ):  # a target's call writes its output (model.pte, ...) by a relative name
        head += ["os.chdir(HERE)  # so that what the script writes goes beside it, not into the caller's folder", ""]
    return "\n".join(head) + "\n" + body
