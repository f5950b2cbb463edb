"""Failures grouped by root cause (`pt2flow failures`, the run summary, the drift report).

A fleet that breaks on a new torch or library release fails dozens of models for a handful of
causes. Each failure gets a root-cause signature, the same in every model and every run that
meets the cause:

    class · stage · subject · where

- subject: what the message names, normalised: the operator (`op aten.foo.default`,
  `op mylib::bar`), the data-dependent expression a guard could not decide (`data-dependent
  Eq(u, 1)`), the dims a dynamic shape lost, else the message's first line. No addresses, no
  sizes or shapes, no symbol numbers (u0, s12), no paths, no model name.
- where: the first stack frame in the model's own code (`module:Qualified.function`, recorded by
  the worker as the failure's `origin`, stages/classify.py failure_origin), else the library frame
  that raised, else a frame named in the message or the worker's stderr.

Groups are compared with another run (default: the run `report` would pair it with,
runs.report_pair) by signature: new, persisting, or gone. A trace failure's draft_export report
(its report blob) is split into its issues and grouped the same way.

Pure functions over the metadata index (and report blobs): no torch, no Prefect.
"""

from __future__ import annotations

import hashlib
import shlex
import re
from datetime import datetime, UTC
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from pt2flow.flows import pipeline
from pt2flow.flows.report.runs import NotEnoughRuns, report_pair
from pt2flow.flows.report.text import decoded
from pt2flow.stages.classify import FRAMEWORK_PACKAGES
from pt2flow.storage.errors import RecordNotFound

FAILURES_VERSION = 1

# a subject taken from a message's first line is cut to this many characters (part of the signature:
# the views cut it again at a word boundary, flows/report/failure_views.py shown_subject)
SUBJECT_CHARS = 160

# failures a torch-only script cannot show (flows/engine/maintenance/repro.py BEFORE_TORCH): no repro command
_BEFORE_TORCH = frozenset({"import", "config", "weights"})

# ---------------------------------------------------------------------------------------------
# normalising text: what varies per model or per process goes


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\w.~-]*[/\\])+([\w.-]+)")
_SIZE = re.compile(r"torch\.Size\(\[[^\]]*\]\)|\[(?:\s*-?\d+\s*,)*\s*-?\d+\s*\]|\((?:\s*-?\d+\s*,)+\s*-?\d*\s*\)")
_SYMBOL = re.compile(r"\b([usqfcz]+)\d+\b")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
_SPACE = re.compile(r"\s+")


def normalise(text: str, model: str | None = None) -> str:
    """`text` without what differs between models hitting one cause: terminal colours, addresses,
    paths (their last part stays), shapes and sizes, symbol numbers (u0 -> u), numbers other than
    0 and 1, and the model's own name."""
    text = _ANSI.sub("", text)
    if model:
        text = re.sub(rf"(?<![\w.]){re.escape(model)}(?![\w])", "<model>", text)
    text = _URL.sub("<url>", text)
    text = _ADDRESS.sub("0x…", text)
    text = _PATH.sub(r"\1", text)
    text = _SIZE.sub("[…]", text)
    text = _SYMBOL.sub(r"\1", text)
    text = _NUMBER.sub(lambda m: m.group(0) if m.group(0) in ("0", "1") else "N", text)
    return _SPACE.sub(" ", text).strip()


# ---------------------------------------------------------------------------------------------
# the subject: what the message names


_OP_PATTERNS = (
    re.compile(r"no fake impl registered for <CustomOpDef\(([\w.]+::[\w.]+)\)>"),
    re.compile(r"(?:torch\.ops\.)?([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)? is missing a fake kernel"),
    re.compile(r"Could not run '([\w.]+::[\w.]+)' with arguments"),
    re.compile(r"No decomposition (?:found )?for ([\w.]+)"),
)
_DATA_DEPENDENT = (
    re.compile(r"Could not guard on data-dependent expression (.+?) \(unhinted"),
    re.compile(r"Could not extract specialized integer from data-dependent expression (.+?) \(unhinted"),
    re.compile(r"data-dependent expression (.+?)(?: \(unhinted|\.|$)", re.M),
    re.compile(r"unable to evaluate the value of `(.+?)`"),
)
_ANY_OP = re.compile(
    r"\b(aten\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?|[a-z_][\w]*::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?|torch\.ops\.[a-z_]\w*\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)"
)
_EXC_PREFIX = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Unsupported|Node|Violation|Failure)\w*: )+")
_TRIED = re.compile(r"\s*\(tried: [^)]*\)\s*$")


def _op_name(text: str) -> str:
    name = text.removeprefix("torch.ops.")
    if "::" not in name and name.count(".") >= 1 and not name.startswith("aten."):
        namespace, _, rest = name.partition(".")
        name = f"{namespace}::{rest}"
    return name.removesuffix(".default")


def subject_of(message: str, model: str | None = None) -> str:
    """What a failure's message names, normalised (module docstring)."""
    text = _ANSI.sub("", message or "")
    for pattern in _OP_PATTERNS:
        found = pattern.search(text)
        if found:
            name = "::".join(found.groups()) if len(found.groups()) == 2 else found.group(1)
            return f"op {_op_name(name)}"
    for pattern in _DATA_DEPENDENT:
        found = pattern.search(text)
        if found:
            return f"data-dependent {normalise(found.group(1), model)}"
    if "Data-dependent branching" in text:
        return "data-dependent branch"
    if re.search(r"ops outside core ATen remain", text):
        listed = text.split("for them:", 1)[-1].split("(", 1)[0]
        ops = sorted({_op_name(o) for o in re.findall(r"\b([A-Za-z_]\w*\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)", listed)})
        return "no decomposition for " + ", ".join(ops)
    if re.search(r"Constraints violated|specialized it to be a constant|marked .* as dynamic", text):
        return "dynamic dim specialized"
    compared = re.match(r"(outputs differ beyond [^:]+|the eager model disagrees with itself[^:,]*)", text)
    if compared:  # validation: the verdict and which candidates, not each output's numbers
        candidates = sorted(set(re.findall(r"(\w+) on (?:example|random|min|max)", text)))
        return normalise(compared.group(1), model) + (f" ({', '.join(candidates)})" if candidates else "")
    found = _ANY_OP.search(text)
    if found:
        return f"op {_op_name(found.group(1))}"
    first = _TRIED.sub("", text.strip().splitlines()[0] if text.strip() else "")
    first = _EXC_PREFIX.sub("", first)
    return normalise(first, model)[:SUBJECT_CHARS] or "-"


# ---------------------------------------------------------------------------------------------
# where: a stack frame


_TEXT_FRAME = re.compile(r'File "?([^",\n]+?)"?, (?:line|lineno) (\d+), in ([\w<>.]+)')
_LIBRARY_PATH = re.compile(r"[/\\](?:site-packages|dist-packages|lib[/\\]python\d[\d.]*)[/\\]")


def _is_library(path: str) -> bool:
    """A frame of the framework (the standard library, torch and what it calls: stages/classify.py
    FRAMEWORK_PACKAGES, and the libraries the stages declare) or pt2flow, not of the model: an installed model library is the model's."""
    parts = re.split(r"[/\\]", path)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            package = parts[parts.index(marker) + 1].removesuffix(".py")
            return package in FRAMEWORK_PACKAGES or package in pipeline.libraries() or package == "pt2flow"
    return bool(_LIBRARY_PATH.search(path)) or "/pt2flow/" in path


def _module_of_path(path: str) -> str:
    """A library file's dotted module (from site-packages on), else the file's stem."""
    parts = re.split(r"[/\\]", path)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1 :]
            return ".".join(rest).removesuffix(".py").removesuffix(".__init__")
    return parts[-1].removesuffix(".py")


def frames_in_text(text: str) -> list[dict[str, Any]]:
    """Stack frames named in a message or a traceback (`File "x.py", line 3, in forward`), in order."""
    frames = []
    for path, line, function in _TEXT_FRAME.findall(_ANSI.sub("", text or "")):
        library = _is_library(path)
        frames.append({"module": _module_of_path(path), "function": function, "line": int(line), "own": not library})
    return frames


def where_of(origin: Mapping[str, Any] | None, *texts: str | None) -> str:
    """`module:function` of the failure's own-code frame (the worker's `origin`), else the last
    own frame named in the texts, else the last library frame named there, else "-"."""
    if origin and origin.get("module"):
        return f"{origin['module']}:{origin.get('function') or '?'}"
    frames = [f for text in texts if text for f in frames_in_text(text)]
    own = [f for f in frames if f["own"]]
    chosen = own[-1] if own else (frames[-1] if frames else None)
    return f"{chosen['module']}:{chosen['function']}" if chosen else "-"


# ---------------------------------------------------------------------------------------------
# a failure and its signature


class Fact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Signature(Fact):
    """A failure's root cause: `id` is a short hash of the other fields."""

    id: str
    error_class: str
    stage: str
    subject: str
    where: str

    @property
    def text(self) -> str:
        return f"{self.error_class} · {self.stage} · {self.subject} · {self.where}"


def signature(
    error_class: str | None,
    stage: str | None,
    message: str | None,
    *,
    origin: Mapping[str, Any] | None = None,
    texts: Sequence[str | None] = (),
    model: str | None = None,
) -> Signature:
    """The signature of one failure: its class, stage, subject (from `message`) and where (the
    recorded `origin`, else frames named in the message or `texts`: a traceback, stderr)."""
    error_class, stage = error_class or "internal", stage or "setup"
    subject = subject_of(message or "", model)
    where = where_of(origin, message, *texts)
    digest = hashlib.sha256(f"{error_class}\0{stage}\0{subject}\0{where}".encode()).hexdigest()[:12]
    return Signature(id=digest, error_class=error_class, stage=stage, subject=subject, where=where)


def record_origin(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The frame a failed record's worker found (details.origin, else its trace attempt's)."""
    details = decoded(record.get("details")) or {}
    origin = details.get("origin") if isinstance(details, dict) else None
    attempts = (details.get("attempts") or []) if isinstance(details, dict) else []
    if not origin:
        origin = next(
            (
                a.get("origin")
                for a in attempts
                if a.get("origin") and a.get("error_class") == record.get("error_class")
            ),
            None,
        )
    return origin


def record_signature(record: Mapping[str, Any]) -> Signature:
    """The signature of a failed index record (its details as recorded: origin, attempts,
    traceback, stderr_tail)."""
    details = decoded(record.get("details")) or {}
    texts = [details.get("traceback"), details.get("stderr_tail")] if isinstance(details, dict) else []
    return signature(
        record.get("error_class"),
        record.get("stage"),
        record.get("error_message"),
        origin=record_origin(record),
        texts=texts,
        model=record.get("model"),
    )


# ---------------------------------------------------------------------------------------------
# draft_export's report, split into its issues


_DRAFT_ISSUE = re.compile(r"^(\d+)\. (.+?)\.?\s*$", re.M)
_DRAFT_COUNT = re.compile(r"This was encountered (\d+) times")
_DRAFT_FRAME = re.compile(r"File ([^,\n]+), lineno (\d+), in ([\w<>.]+)\n(?:[ \t]+(?!File )(\S.*))?")


class DraftIssue(Fact):
    """One distinct cause in a draft_export report: how often it was met, in how many of the
    report's numbered issues, and the first of them."""

    signature: str
    subject: str
    where: str
    title: str
    issues: int
    occurrences: int
    code: str | None = None


def draft_issues(report: str) -> list[DraftIssue]:
    """draft_export's report split into its numbered issues, grouped by signature (subject and
    the user frame), most occurrences first."""
    text = _ANSI.sub("", report or "")
    starts = list(_DRAFT_ISSUE.finditer(text))
    grouped: dict[tuple[str, str], DraftIssue] = {}
    for i, start in enumerate(starts):
        body = text[start.end() : starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        user = body.split("framework stacktrace", 1)[0].split("Locals:", 1)[0]
        frames = [(path, function, (code or "").strip()) for path, _line, function, code in _DRAFT_FRAME.findall(user)]
        own = [f for f in frames if not _is_library(f[0])]
        frame = own[-1] if own else (frames[-1] if frames else None)
        if frame is not None:
            where = f"{_module_of_path(frame[0])}:{frame[1]}"
        else:  # torch left the frames out (structured tracing on): the user's line of code is what is left
            lines = (
                [line.strip() for line in user.split("user stacktrace:", 1)[-1].splitlines() if line.strip()]
                if "user stacktrace:" in user
                else []
            )
            frame = ("", "", lines[-1]) if lines else None
            where = f"`{normalise(lines[-1])}`" if lines else "-"
        subject = subject_of(body) if subject_of(body) != "-" else normalise(start.group(2))
        if subject == normalise(body.strip().splitlines()[0] if body.strip() else "")[:SUBJECT_CHARS]:
            subject = normalise(start.group(2))
        count = _DRAFT_COUNT.search(body)
        occurrences = int(count.group(1)) if count else 1
        key = (subject, where)
        if key in grouped:
            grouped[key].issues += 1
            grouped[key].occurrences += occurrences
        else:
            digest = hashlib.sha256(f"{subject}\0{where}".encode()).hexdigest()[:12]
            grouped[key] = DraftIssue(
                signature=digest,
                subject=subject,
                where=where,
                title=start.group(2).strip(),
                issues=1,
                occurrences=occurrences,
                code=frame[2] or None if frame else None,
            )
    return sorted(grouped.values(), key=lambda d: (-d.occurrences, d.subject))


# ---------------------------------------------------------------------------------------------
# one run's failures, grouped


class Representative(Fact):
    model: str
    run_id: str
    record_id: str | None
    report: str | None  # the failure's report blob (sha256), when it left one
    cached: bool


class FailureGroup(Fact):
    """Failures with one signature: the models of this run (and of the other run), one message,
    a repro command of a representative, and the change against the other run."""

    id: str
    signature: str
    error_class: str
    stage: str
    subject: str
    where: str
    code: str | None  # the representative's line of code at `where` (`line N: ...`), when the worker saw it
    status: str  # new | persisting | gone
    count: int
    models: list[str]
    models_against: list[str]
    message: str
    representative: Representative
    repro: str | None
    repro_note: str | None = None
    draft_report: list[DraftIssue] | None = None


class FailureSummary(Fact):
    failures: int
    groups: int
    new: int
    persisting: int
    gone: int
    fixed_models: int


class FailureReport(Fact):
    """`pt2flow failures --json` (docs/architecture.md §4, contract)."""

    failures_version: int
    run_id: str
    against: str | None
    selection: str
    summary: FailureSummary
    groups: list[FailureGroup] = Field(default_factory=list)
    store: str | None = None  # the store read (added compatibly: an empty answer names where it looked)


def first_failures(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """model -> the record of its first failed stage (pipeline order, source first), from one
    run's records (the newest record of each stage counts)."""
    floor = datetime.min.replace(tzinfo=UTC)
    newest: dict[str, dict[str, dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r.get("ended_at") or floor):
        newest.setdefault(row["model"], {})[row["stage"]] = dict(row)
    order = ("source", *pipeline.names())
    out = {}
    for model, stages in newest.items():
        failed = [s for s in order if s in stages and stages[s].get("status") != "ok"]
        failed += [s for s in stages if s not in order and stages[s].get("status") != "ok"]
        if failed:
            out[model] = stages[failed[0]]
    return out


def _run_rows(index: Any, run_id: str) -> list[dict[str, Any]]:
    import pyarrow.compute as pc

    columns = [
        "record_id",
        "run_id",
        "model",
        "stage",
        "status",
        "cached",
        "sha256",
        "error_class",
        "error_message",
        "details",
        "ended_at",
    ]
    return index.scan(columns, filter=pc.field("run_id") == run_id).to_pylist()


def repro_command(record: Mapping[str, Any], store_url: str | None = None) -> tuple[str | None, str | None]:
    """(`pt2flow repro` command line for a failed record, or None and why not): the failure's
    report blob by ID when it left one (that exact failure), else the model's newest failure."""
    model, stage = record.get("model") or "?", record.get("stage")
    if record.get("error_class") in _BEFORE_TORCH:
        return None, "failed before torch was reached: `pt2flow validate` names the problem"
    try:
        reproducible = bool(pipeline.get(stage).repro) if stage else False
    except KeyError:
        reproducible = False
    if not reproducible:
        return None, f"repro has no script for {stage or 'setup'}: `pt2flow show` has its report"
    target = (record.get("sha256") or "")[:16] or model
    store = f" --store {shlex.quote(store_url)}" if store_url else ""
    return f"pt2flow repro {shlex.quote(target)} -o {shlex.quote('repro/' + model)}{store}", None


def _message(record: Mapping[str, Any], limit: int = 400) -> str:
    text = _ANSI.sub("", record.get("error_message") or "").strip()
    return text if len(text) <= limit else text[: limit - 2] + " …"


def failure_report(
    index: Any,
    run_id: str,
    against: str | None = None,
    *,
    pick_against: bool = True,
    blobs: Any = None,
    store_url: str | None = None,
) -> FailureReport:
    """Run `run_id`'s failures grouped by signature, largest first, each marked new or persisting
    against `against` (default with pick_against: runs.report_pair's partner; none: all new),
    then the groups only `against` had (gone). `blobs`: a store to read trace failures'
    draft_export reports from (a report that cannot be read is left out)."""
    rows = _run_rows(index, run_id)
    if not rows:
        raise RecordNotFound(f"no records of run {run_id!r} in the index")
    selection = "named by the caller"
    if against is None and pick_against:
        try:
            chosen = report_pair(index, run_id)
            against, selection = chosen.runs[0], chosen.reason
        except NotEnoughRuns:
            selection = f"{run_id} is the first run in the index: every group is new"
    mine = first_failures(rows)
    theirs: dict[str, dict[str, Any]] = {}
    if against is not None:
        other = _run_rows(index, against)
        if not other:
            raise RecordNotFound(f"no records of run {against!r} in the index")
        # only the models both runs covered are compared: a model this run did not cover (an
        # `--only` run) was not fixed, so its group is not "gone"
        covered = {r["model"] for r in rows}
        theirs = {model: record for model, record in first_failures(other).items() if model in covered}
        left_out = sorted({r["model"] for r in other} - covered)
        if left_out and selection == "named by the caller":
            selection += f"; {len(left_out)} model(s) of {against} that {run_id} did not cover are not compared"
    groups = _groups(mine, theirs, blobs, store_url)
    summary = FailureSummary(
        failures=len(mine),
        groups=sum(1 for g in groups if g.status != "gone"),
        new=sum(1 for g in groups if g.status == "new"),
        persisting=sum(1 for g in groups if g.status == "persisting"),
        gone=sum(1 for g in groups if g.status == "gone"),
        fixed_models=len([m for m in theirs if m not in mine]),
    )
    return FailureReport(
        failures_version=FAILURES_VERSION,
        run_id=run_id,
        against=against,
        selection=selection,
        summary=summary,
        groups=groups,
    )


def _groups(
    mine: Mapping[str, dict[str, Any]], theirs: Mapping[str, dict[str, Any]], blobs: Any, store_url: str | None
) -> list[FailureGroup]:
    by_sig: dict[str, list[tuple[Signature, dict[str, Any]]]] = {}
    for record in mine.values():
        sig = record_signature(record)
        by_sig.setdefault(sig.id, []).append((sig, record))
    before: dict[str, list[tuple[Signature, dict[str, Any]]]] = {}
    for record in theirs.values():
        sig = record_signature(record)
        before.setdefault(sig.id, []).append((sig, record))
    groups = []
    for sig_id, members in by_sig.items():
        groups.append(
            _group(members, before.get(sig_id, []), "persisting" if sig_id in before else "new", blobs, store_url)
        )
    groups.sort(key=lambda g: (-g.count, g.error_class, g.subject))
    gone = [_group(members, members, "gone", None, None) for sig_id, members in before.items() if sig_id not in by_sig]
    gone.sort(key=lambda g: (-len(g.models_against), g.error_class, g.subject))
    return groups + gone


def _group(
    members: Sequence[tuple[Signature, dict[str, Any]]],
    against: Sequence[tuple[Signature, dict[str, Any]]],
    status: str,
    blobs: Any,
    store_url: str | None,
) -> FailureGroup:
    sig = members[0][0]
    records = sorted((r for _, r in members), key=lambda r: r["model"])
    representative = records[0]
    repro, note = repro_command(representative, store_url)
    shown = [] if status == "gone" else [r["model"] for r in records]
    origin = record_origin(representative) or {}
    code = f"line {origin.get('line')}: {origin['code']}" if origin.get("code") else None
    return FailureGroup(
        id=sig.id,
        signature=sig.text,
        error_class=sig.error_class,
        stage=sig.stage,
        subject=sig.subject,
        where=sig.where,
        code=code,
        status=status,
        count=len(shown),
        models=shown,
        models_against=sorted(r["model"] for _, r in against),
        message=_message(representative),
        representative=Representative(
            model=representative["model"],
            run_id=representative["run_id"],
            record_id=representative.get("record_id"),
            report=representative.get("sha256"),
            cached=bool(representative.get("cached")),
        ),
        repro=repro if status != "gone" else None,
        repro_note=note if status != "gone" else None,
        draft_report=_draft(representative, blobs) if status != "gone" else None,
    )


def _draft(record: Mapping[str, Any], blobs: Any) -> list[DraftIssue] | None:
    """The representative's draft_export report, grouped (trace failures that left one)."""
    if blobs is None or record.get("stage") != pipeline.entry().name or not record.get("sha256"):
        return None
    try:
        text = blobs.get_blob(record["sha256"]).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - a report that cannot be read leaves the group without its issues
        return None
    issues = draft_issues(text)
    return issues or None


def failures_of(store: Any, run: str | None = None, against: str | None = None) -> dict[str, Any]:
    """`pt2flow failures --json` of an ArtifactStore: `run` and `against` as IDs or unique
    prefixes (default run: the newest; default against: runs.report_pair's partner)."""
    from pt2flow.flows.report.runs import list_runs, resolve_run

    if run:
        run_id = resolve_run(store.index, run)
    else:
        runs = list_runs(store.index)
        if not runs:
            raise RecordNotFound(f"the index of {store.url} holds no run")
        run_id = runs[-1]["run_id"]
    other = resolve_run(store.index, against) if against else None
    if other == run_id:
        other = None
    report = failure_report(store.index, run_id, other, blobs=store, store_url=store.url)
    report.store = store.url
    return report.model_dump(mode="json")


def run_groups(
    index: Any, run_id: str, against: str | None = None, store_url: str | None = None
) -> list[dict[str, Any]]:
    """The groups of a run as the run document and the fleet's markdown carry them (no draft
    reports, no messages): against `against`, else the run `report` pairs it with."""
    report = failure_report(index, run_id, against, pick_against=against is None, store_url=store_url)
    keep = ("id", "status", "count", "error_class", "stage", "subject", "where", "models", "models_against", "repro")
    return [{k: v for k, v in g.model_dump(mode="json").items() if k in keep} for g in report.groups]
