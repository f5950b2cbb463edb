"""serialize: torch.export.save to bytes, with pt2flow metadata in extra_files; round trip checked."""

from __future__ import annotations

import io
import json
from typing import Any, Mapping

import torch
from torch.export import ExportedProgram

from stages import program
from stages.classify import short_message
from stages.errors import StageError
from stages.quiet import quiet_torch
from stages.result import StageResult

METADATA_FILE = "pt2flow.json"


def load_archive(data: bytes) -> tuple[ExportedProgram, dict[str, Any]]:
    """Load a .pt2 archive from bytes; returns the program and its pt2flow metadata."""
    extra = {METADATA_FILE: ""}
    with quiet_torch():
        ep = torch.export.load(io.BytesIO(data), extra_files=extra)
    raw = extra.get(METADATA_FILE) or "{}"
    return ep, json.loads(raw)


def serialize(ep: ExportedProgram, metadata: Mapping[str, Any]) -> StageResult:
    """Output: the archive's bytes. Reloads them and checks that the program came back unchanged."""
    text = json.dumps(dict(metadata), sort_keys=True)
    buffer = io.BytesIO()
    with quiet_torch() as sink:
        try:
            torch.export.save(ep, buffer, extra_files={METADATA_FILE: text})
        except Exception as exc:
            raise StageError("serialization", f"torch.export.save failed: {short_message(exc)}") from exc
    data = buffer.getvalue()
    try:
        reloaded, meta_back = load_archive(data)
    except Exception as exc:
        raise StageError("serialization", f"the saved archive does not load: {short_message(exc)}") from exc
    if meta_back != json.loads(text):
        raise StageError("serialization", "pt2flow metadata did not survive the round trip")
    changed = roundtrip_differences(ep, reloaded)
    if changed:
        raise StageError("serialization", f"the reloaded program differs from the saved one: {'; '.join(changed)}")
    result_meta = {**program.describe(ep), "size": len(data)}
    return StageResult(output=data, metadata=result_meta, warnings=sink.items)


def roundtrip_differences(saved: ExportedProgram, loaded: ExportedProgram) -> list[str]:
    """What differs between a program and its reloaded copy, ignoring what serialization may
    legitimately change: getitem nodes (the loader unpacks every output of multi-output ops)."""
    problems = []
    before = {k: v for k, v in program.op_histogram(saved).items() if k != "operator.getitem"}
    after = {k: v for k, v in program.op_histogram(loaded).items() if k != "operator.getitem"}
    if before != after:
        diff = {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}
        problems.append(f"op histogram {diff}")
    if program.signature_summary(saved) != program.signature_summary(loaded):
        problems.append("graph signature")
    if program.range_constraints(saved) != program.range_constraints(loaded):
        problems.append("range constraints")
    for label, a, b in (("state_dict", saved.state_dict, loaded.state_dict), ("constants", saved.constants, loaded.constants)):
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
