"""Identities: canonical JSON, derivation keys (the cache keys) and the run environment.

Derivation key = sha256(stage, stage version, parent identities, canonical options,
environment). Program stages take their parent's program fingerprint as identity, so a re-trace
that yields an identical program reuses everything downstream (docs/architecture.md §5).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pt2flow.flows import pipeline
from pt2flow.stages.distributions import installed_version


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

    @classmethod
    @functools.lru_cache(maxsize=1)
    def current(cls) -> "Environment":
        """Read once per process: installed versions do not change under a running interpreter."""
        return cls(
            torch_version=installed_version("torch", "unknown"),
            python_version=platform.python_version(),
            pt2flow_version=installed_version("pt2flow", "unknown"),
            host=socket.gethostname(),
        )

    def key_part(self, device: str) -> dict[str, str]:
        py = ".".join(self.python_version.split(".")[:2])
        return {"torch": self.torch_version, "python": py, "device": device}


def derivation_key(stage: str, parents: Sequence[str], options: Any, env: Mapping[str, str]) -> str:
    payload = {
        "stage": stage,
        "version": pipeline.versions()[stage],
        "parents": list(parents),
        "options": options,
        "env": dict(env),
    }
    return sha256_text(canonical_json(payload))


# ---------------------------------------------------------------------------------------------
# the stages' keys (flows/pipeline: Stage.key names the ones that are not the default)


def _env(device: str, libraries: Sequence[str] = ()) -> dict[str, str]:
    env = Environment.current().key_part(device)
    for name in libraries:  # a target's output depends on its library's version as much as on torch's
        env[name] = installed_version(name, "absent")
    return env


def default_key(stage: Any, model: Any, inputs: Mapping[str, Any]) -> str:
    """A stage's key by default: its name and version, the identity of each input (a program's
    fingerprint, else its blob's digest), its options, and the torch, Python and library versions
    (Stage.libraries), on the CPU."""
    from pt2flow.flows.engine.wiring import options_json

    parents = [inputs[item.name].fingerprint or inputs[item.name].artifact for item in pipeline.inputs_of(stage) if item.name in inputs]
    return derivation_key(stage.name, parents, options_json(model, stage.name), _env("cpu", stage.libraries))


def trace_key(stage: Any, model: Any, inputs: Mapping[str, Any]) -> str:
    """The source's key, the trace options, and the training-mode settings trace exports for."""
    from pt2flow.flows.engine.wiring import options_json
    from pt2flow.stages.options import FunctionalizeOptions
    from pt2flow.flows.engine.wiring import stage_options

    functionalize = stage_options(model, "functionalize", FunctionalizeOptions)
    options = {**options_json(model, "trace"), "mode": functionalize.mode}
    if model.training:
        options["loss_output"] = functionalize.loss_output
    return derivation_key("trace", [inputs["source"].key], options, _env("cpu"))


def compile_key(stage: Any, model: Any, inputs: Mapping[str, Any]) -> str:
    """A package is native code: its key also covers what that code was built for and with
    (CPU vector ISA, C++ compiler and version; for CUDA the GPU architecture and CUDA version),
    so a store shared by different machines never hands one a package built for another."""
    from pt2flow.flows.engine.toolchain import cache_dir, toolchain_identity
    from pt2flow.flows.engine.wiring import compile_device, options_json

    device = compile_device(model)
    options = options_json(model, "aot_compile")
    env = {**_env(device), "toolchain": toolchain_identity(device, cache_dir(), options.get("inductor_configs"))}
    return derivation_key("aot_compile", [inputs["program"].fingerprint], options, env)


def validate_key(stage: Any, model: Any, inputs: Mapping[str, Any]) -> str:
    """The source's key and every candidate's artifact, under the libraries of every candidate."""
    from pt2flow.flows.engine.wiring import compile_device, options_json

    candidates = [inputs[name].artifact for name in pipeline.candidates() if name in inputs]
    libraries = [lib for name in pipeline.candidates() if name in inputs for lib in pipeline.get(name).libraries]
    env = {**_env(compile_device(model)), **{lib: installed_version(lib, "absent") for lib in libraries}}
    return derivation_key("validate", [inputs["source"].key, *candidates], options_json(model, "validate"), env)
