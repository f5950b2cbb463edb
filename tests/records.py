"""Synthetic index records shaped like the pipeline's (keys, parents, digests), for query tests."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime, timedelta, UTC
from collections.abc import Callable

T0 = datetime(2026, 11, 1, tzinfo=UTC)
CHAIN = ("source", "trace", "functionalize", "decompose", "serialize", "aot_compile", "validate")


def h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_chain(
    store,
    model: str,
    run: str,
    weights: str | None,
    salt: str = "",
    offset: int = 0,
    cached: bool = False,
    blob: Callable[[str], tuple[str, int]] | None = None,
) -> dict[str, dict]:
    """One model's records for one run; keys and digests derive from (model, salt) so that a
    cached re-run (same salt) repeats them, as the pipeline does. `blob(name)` may publish real
    bytes and return (sha256, size)."""
    rows: dict[str, dict] = {}
    keys = {stage: h(f"key/{model}/{salt}/{stage}") for stage in CHAIN}
    program = {
        "trace": "source",
        "functionalize": "trace",
        "decompose": "functionalize",
        "serialize": "decompose",
        "aot_compile": "decompose",
    }
    for i, stage in enumerate(CHAIN):
        if stage == "source":
            parents = []
        elif stage == "validate":
            parents = [keys["source"], keys["serialize"], keys["aot_compile"]]
        else:
            parents = [keys[program[stage]]]
        rows[stage] = {
            "record_id": uuid.uuid4().hex,
            "run_id": run,
            "model": model,
            "stage": stage,
            "status": "ok",
            "cached": cached and stage != "source",
            "key": keys[stage],
            "parent_keys": parents,
            "sha256": h(f"blob/{model}/{salt}/{stage}"),
            "size": 100 + i,
            **(dict(zip(("sha256", "size"), blob(f"{model}/{salt}/{stage}"))) if blob else {}),
            "ended_at": T0 + timedelta(minutes=offset, seconds=i),
            "factory": "zoo:net" if stage == "source" else None,
            "weights_digest": weights if stage == "source" else None,
        }
    store.index.append(list(rows.values()))
    return rows
