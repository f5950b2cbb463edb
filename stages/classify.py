"""Assign an error class (docs/architecture.md §7) to an exception torch raised.

The rules look at the exception's type first and its message second: torch raises plain
RuntimeErrors for several distinct failures, and its messages are the only stable signal.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any

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


def classify_trace_error(exc: BaseException) -> ErrorClass:
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


def classify_compile_error(exc: BaseException) -> ErrorClass:
    """Error class of a failed AOTInductor compile: a compile error unless torch says otherwise."""
    if isinstance(exc, StageError):
        return exc.error_class
    if isinstance(exc, MemoryError):
        return ErrorClass.OUT_OF_MEMORY
    return ErrorClass.COMPILE


def classify_target_error(exc: BaseException) -> ErrorClass:
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


# ---------------------------------------------------------------------------------------------
# where a failure happened: the first frame in the model's own code (flows/report/failures.py)

_PT2FLOW_DIRS = tuple(
    str(Path(__file__).resolve().parents[1] / part) + os.sep for part in ("stages", "flows", "storage")
)
_LIBRARY_DIRS = tuple(
    sorted(
        {
            os.path.realpath(p) + os.sep
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))
        }
    )
)
_USER_FRAME = re.compile(r'File "([^"\n]+)", line (\d+), in ([\w<>.]+)\n\s+(\S.*)')


# the framework a failure is raised in, never the model's code: torch and what it calls into (and
# the libraries the stages declare, which the caller adds: Stage.libraries). A model's own code may
# be installed (transformers, timm): a frame there is the model's.
FRAMEWORK_PACKAGES = frozenset(
    {
        "torch",
        "functorch",
        "torchgen",
        "sympy",
        "mpmath",
        "triton",
        "numpy",
        "optree",
        "onnx_ir",
        "safetensors",
        "typing_extensions",
        "_pytest",
        "pluggy",
    }
)


def _distribution_package(path: str) -> str | None:
    """The top-level package of a file in site-packages (None: not in site-packages)."""
    parts = re.split(r"[/\\]", path)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    return None


def _is_own(filename: str, framework: frozenset[str] = frozenset()) -> bool:
    """A file of the model's own code: not the standard library, not torch's framework
    (FRAMEWORK_PACKAGES), not pt2flow; an installed model library (transformers) is the model's."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    if path.startswith(_PT2FLOW_DIRS):
        return False
    package = _distribution_package(path)
    if package is not None:
        return package not in FRAMEWORK_PACKAGES and package not in framework
    return not path.startswith(_LIBRARY_DIRS)


def _module_for_file(filename: str) -> str:
    path = os.path.realpath(filename)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.realpath(file) == path:
            return name
    return Path(filename).stem


def failure_origin(exc: BaseException, framework: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The frame nearest the raise in the model's own code, as {"module", "function", "line",
    "code", "own": True}; else the innermost library frame that raised ("own": False); None when
    there is no frame outside pt2flow. Follows the exception's cause chain to the first error, and
    reads the user frames torch names in its message (strict export, guards) when the traceback
    holds none. framework: packages besides FRAMEWORK_PACKAGES whose frames are not the model's
    (the libraries the stages need)."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    library: dict[str, Any] | None = None
    for error in reversed(chain):  # the first error first
        frames = _frames(error)
        own = [f for f in frames if _is_own(f["file"], framework)]
        named = [
            (path, int(line), function, code)
            for path, line, function, code in _USER_FRAME.findall(str(error))
            if _is_own(path, framework)
        ]
        if named:  # torch names the user frame it stopped at (the traceback of a strict export has none)
            path, line, function, code = named[-1]
            same = [f for f in own if os.path.realpath(f["file"]) == os.path.realpath(path) and f["line"] == line]
            if same:
                return {**_public(same[-1]), "own": True}
            return {
                "module": _module_for_file(path),
                "function": function,
                "line": line,
                "code": code.strip(),
                "own": True,
            }
        if own:
            return {**_public(own[-1]), "own": True}
        if library is None:
            outside = [f for f in frames if not os.path.realpath(f["file"]).startswith(_PT2FLOW_DIRS)]
            if outside:
                library = {**_public(outside[-1]), "own": False}
    return library


def _frames(error: BaseException) -> list[dict[str, Any]]:
    """The traceback's frames, outermost first: file, line, qualified function name, module, code."""
    import linecache

    out = []
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(
            {
                "file": code.co_filename,
                "line": tb.tb_lineno,
                "function": getattr(code, "co_qualname", code.co_name),
                "module": tb.tb_frame.f_globals.get("__name__"),
                "code": linecache.getline(code.co_filename, tb.tb_lineno).strip(),
            }
        )
        tb = tb.tb_next
    return out


def _public(frame: dict[str, Any]) -> dict[str, Any]:
    """A frame as a failure's origin records it: no file path (it differs between machines)."""
    return {
        "module": frame["module"] or _module_for_file(frame["file"]),
        "function": frame["function"],
        "line": frame["line"],
        "code": frame["code"],
    }
