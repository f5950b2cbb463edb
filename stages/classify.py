"""Assign an error class (docs/architecture.md §7) to an exception torch raised.

The rules look at the exception's type first and its message second: torch raises plain
RuntimeErrors for several distinct failures, and its messages are the only stable signal.
"""

from __future__ import annotations

import re

from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import ErrorClass

_DATA_DEPENDENT = re.compile(
    r"data[- ]dependent|GuardOnDataDependentSymNode|Could not guard on data-dependent|"
    r"Could not extract specialized integer from data-dependent",
    re.IGNORECASE,
)
_DYNAMIC_SHAPE = re.compile(
    r"Constraints violated|ConstraintViolation|specialized it to be a constant|"
    r"marked .* as dynamic|Dim\(|dynamic_shapes",
    re.IGNORECASE,
)
_PYTREE = re.compile(
    r"register a pytree|not a known type|pytree|unrecognized type UserDefinedObjectVariable|"
    r"UserDefinedObjectVariable|treespec",
    re.IGNORECASE,
)
_UNSUPPORTED = re.compile(
    r"not supported|Unsupported|no fake impl|doesn't support|does not support|"
    r"Could not run '.*' with arguments from the '(Meta|Fake)' backend|"
    r"NotImplementedError|cannot be traced|Tracing .* is not supported",
    re.IGNORECASE,
)


def _type_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def classify_trace_error(exc: BaseException) -> str:
    """Error class of a failed torch.export.export call."""
    if isinstance(exc, StageError):
        return exc.error_class
    names = _type_names(exc)
    message = f"{type(exc).__name__}: {exc}"
    error_type = str(getattr(exc, "error_type", ""))
    if "GuardOnDataDependentSymNode" in names or "DYNAMIC_CONTROL_FLOW" in error_type:
        return ErrorClass.DATA_DEPENDENT
    if "ConstraintViolationError" in names or "CONSTRAINT_VIOLATION" in error_type:
        return ErrorClass.DYNAMIC_SHAPE
    if "Unsupported" in names and _DATA_DEPENDENT.search(message):
        return ErrorClass.DATA_DEPENDENT
    if _PYTREE.search(message):
        return ErrorClass.PYTREE
    if _DATA_DEPENDENT.search(message):
        return ErrorClass.DATA_DEPENDENT
    if "Unsupported" in names or "UNSUPPORTED" in error_type or _UNSUPPORTED.search(message):
        return ErrorClass.UNSUPPORTED_OP
    if "UserError" in names and ("INVALID_INPUT" in error_type or _DYNAMIC_SHAPE.search(message)):
        return ErrorClass.DYNAMIC_SHAPE
    return ErrorClass.RUNTIME


def classify_compile_error(exc: BaseException) -> str:
    """Error class of a failed AOTInductor compile: a compile error unless torch says otherwise."""
    if isinstance(exc, StageError):
        return exc.error_class
    if isinstance(exc, MemoryError):
        return ErrorClass.OUT_OF_MEMORY
    return ErrorClass.COMPILE


def classify_target_error(exc: BaseException) -> str:
    """Error class of a failed deployment-target export (ONNX, ExecuTorch): the library refused
    the program (`lowering`) unless it is a StageError already or the process ran out of memory."""
    if isinstance(exc, StageError):
        return exc.error_class
    if isinstance(exc, MemoryError):
        return ErrorClass.OUT_OF_MEMORY
    return ErrorClass.LOWERING


def short_message(exc: BaseException, limit: int = 2000) -> str:
    """The first meaningful part of an exception's message, without torch's boilerplate tail."""
    text = str(exc).strip() or type(exc).__name__
    for marker in (
        "\n\nThe error above occurred when calling torch.export.export",
        "\nFor more information about this error, see:",
        "\n\nfrom user code:",
        "\n\nSet TORCHDYNAMO_VERBOSE=1",
    ):
        cut = text.find(marker)
        if cut > 0:
            text = text[:cut]
    text = text.strip()
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """`text` without terminal escape sequences (torch colours some of its messages and reports)."""
    return _ANSI.sub("", text)
