"""The words every layer shares, defined once: stage names and order, error classes and which of
them a derivation key fully determines, dtype names, the module-name and `module:callable` patterns
(docs/architecture.md §2, §3, §7). Imports nothing, so configs, stages, storage queries and the
CLI can all use it without torch."""

from __future__ import annotations

import re
from typing import Literal

# the contract order of the stages (docs/architecture.md §2); "source" precedes them in records
STAGES: tuple[str, ...] = ("trace", "functionalize", "decompose", "serialize", "aot_compile", "validate")
RECORD_STAGES: tuple[str, ...] = ("source", *STAGES)
# stages whose output is an ExportedProgram: the next program stage takes the newest of them
PROGRAM_STAGES: tuple[str, ...] = ("trace", "functionalize", "decompose")

ERROR_CLASSES: tuple[str, ...] = (
    "config",
    "import",
    "weights",
    "data_dependent",
    "dynamic_shape",
    "unsupported_op",
    "pytree",
    "decomposition",
    "serialization",
    "compile",
    "numeric_mismatch",
    "nondeterministic",
    "runtime",
    "storage",
    "timeout",
    "internal",
    "crash",
    "out_of_memory",
    "incompatible",
)

# Failure classes that the same key always reproduces (the inputs, the code and the environment
# that produced them are all in the key): reported again from the index instead of re-run.
# The others depend on things outside the key (a file appearing, a busy machine, a flaky store,
# a pt2flow fix) and always re-run.
DETERMINISTIC_FAILURES: frozenset[str] = frozenset({
    "data_dependent", "dynamic_shape", "unsupported_op", "pytree", "decomposition",
    "serialization", "compile", "numeric_mismatch", "nondeterministic",
})

DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
# the values the narrow integer dtypes hold (inclusive): a config's value, low and high must fit
# (random values are drawn from [low, high), so high may be one past the largest)
INTEGER_RANGES: dict[str, tuple[int, int]] = {"int16": (-(2**15), 2**15 - 1), "int8": (-128, 127), "uint8": (0, 255)}

# a dotted module path (or attribute path): identifiers joined by dots
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
MODULE_NAME_PATTERN = re.compile(_DOTTED)
# dotted module path, a colon, dotted attribute path: nothing else (no calls, no '..', no slashes)
FACTORY_PATTERN = re.compile(f"{_DOTTED}:{_DOTTED}")
