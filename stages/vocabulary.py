"""The words every layer shares, defined once: error classes and which of them a derivation key
fully determines, dtype names, the module-name and `module:callable` patterns
(docs/architecture.md §2, §3, §7). Imports nothing, so configs, stages, storage queries and the
CLI can all use it without torch."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal


class ErrorClass(StrEnum):
    """The failure classes of docs/architecture.md §7: every failure carries exactly one."""

    CONFIG = "config"
    IMPORT = "import"
    WEIGHTS = "weights"
    DATA_DEPENDENT = "data_dependent"
    DYNAMIC_SHAPE = "dynamic_shape"
    UNSUPPORTED_OP = "unsupported_op"
    PYTREE = "pytree"
    DECOMPOSITION = "decomposition"
    SERIALIZATION = "serialization"
    COMPILE = "compile"
    LOWERING = "lowering"  # a deployment target (ONNX, ExecuTorch) refuses an op of the program
    QUANTIZATION = "quantization"  # PT2E refuses the program (prepare, calibration, convert, export again)
    NUMERIC_MISMATCH = "numeric_mismatch"
    NONDETERMINISTIC = "nondeterministic"
    RUNTIME = "runtime"
    STORAGE = "storage"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    CRASH = "crash"
    OUT_OF_MEMORY = "out_of_memory"
    INCOMPATIBLE = "incompatible"


ERROR_CLASSES: tuple[str, ...] = tuple(c.value for c in ErrorClass)

# Failure classes that the same key always reproduces (the inputs, the code and the environment
# that produced them are all in the key): reported again from the index instead of re-run.
# The others depend on things outside the key (a file appearing, a busy machine, a flaky store,
# a pt2flow fix) and always re-run.
DETERMINISTIC_FAILURES: frozenset[str] = frozenset(
    {
        ErrorClass.DATA_DEPENDENT,
        ErrorClass.DYNAMIC_SHAPE,
        ErrorClass.UNSUPPORTED_OP,
        ErrorClass.PYTREE,
        ErrorClass.DECOMPOSITION,
        ErrorClass.SERIALIZATION,
        ErrorClass.COMPILE,
        ErrorClass.LOWERING,
        ErrorClass.QUANTIZATION,
        ErrorClass.NUMERIC_MISMATCH,
        ErrorClass.NONDETERMINISTIC,
    }
)

DTYPE_NAMES: tuple[str, ...] = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
# the values the narrow integer dtypes hold (inclusive): a config's value, low and high must fit
# (random values are drawn from [low, high), so high may be one past the largest)
INTEGER_RANGES: dict[str, tuple[int, int]] = {"int16": (-(2**15), 2**15 - 1), "int8": (-128, 127), "uint8": (0, 255)}

# a dotted module path (or attribute path): identifiers joined by dots
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
MODULE_NAME_PATTERN = re.compile(_DOTTED)
# dotted module path, a colon, dotted attribute path: nothing else (no calls, no '..', no slashes)
FACTORY_PATTERN = re.compile(f"{_DOTTED}:{_DOTTED}")
