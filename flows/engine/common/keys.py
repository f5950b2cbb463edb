"""Identities: canonical JSON, derivation keys (the cache keys), the run environment, and the
request key that finds a model's recorded sources.

Derivation key = sha256(stage, stage version, parent identities, canonical options,
environment). Program stages take their parent's program fingerprint as identity, so a re-trace
that yields an identical program reuses everything downstream (docs/architecture.md §5).
"""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows import pipeline


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, tuples as lists."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_default, ensure_ascii=False)


def _default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Environment:
    """What changes results besides the inputs: torch version and device go into every key."""

    torch_version: str
    python_version: str
    pt2flow_version: str
    host: str

    def key_part(self, device: str) -> dict[str, str]:
        py = ".".join(self.python_version.split(".")[:2])
        return {"torch": self.torch_version, "python": py, "device": device}


def environment_of(python: Any) -> Environment:
    """The Environment of an interpreter (flows/engine/environment/interpreter.py's Interpreter:
    its versions and this host); `interpreter.current_environment()` is the workers'."""
    return Environment(
        torch_version=python.version("torch", "unknown"),
        python_version=python.python_version,
        pt2flow_version=python.version("pt2flow", "unknown"),
        host=socket.gethostname(),
    )


def derivation_key(stage: str, parents: Sequence[str | None], options: Any, env: Mapping[str, Any]) -> str:
    payload = {
        "stage": stage,
        "version": pipeline.versions()[stage],
        "parents": list(parents),
        "options": options,
        "env": dict(env),
    }
    return sha256_text(canonical_json(payload))


def request_key(static: Mapping[str, Any]) -> str:
    """What the config and the weights say about a model (the manifest without its code's
    dependencies): finds the source records whose dependency manifest a re-run checks."""
    # the source stage's version too: a pt2flow that records manifests differently never
    # reuses a manifest an older one recorded
    return sha256_text(f"source-request:v{pipeline.versions()['source']}:" + canonical_json(static))
