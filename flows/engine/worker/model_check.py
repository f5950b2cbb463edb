"""`pt2flow validate`'s worker side (message `preflight`, flows/engine/orchestrator/preflight.py
sends it): one model's factory and inputs_factory modules imported, the model built once (meta
device, else CPU) and the configured input names checked against its `forward()`.
"""

from __future__ import annotations

import inspect
from typing import Any
from collections.abc import Callable, Sequence

from pt2flow.flows.config import ResolvedModel

KeyPath = tuple[Any, ...]  # a key path inside the config, ("models", 0, "weights")


def inspect_model(model: ResolvedModel) -> tuple[str, dict[str, Any]]:
    """("ok", {"problems": [(path, message)], "notes": [...]}) for one model, paths inside it:
    its modules imported, the model built once (meta device, else CPU), its inputs factory called
    (likewise), the input names bound to the built model's forward()."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.source import import_factory

    problems: list[tuple[KeyPath, str]] = []
    notes: list[tuple[KeyPath, str]] = []
    imported: dict[str, Any] = {}
    for key in ("factory", "inputs_factory"):
        reference = getattr(model, key)
        if reference is None:
            continue
        try:
            imported[key] = import_factory(reference, model.search_path)
        except StageError as exc:
            problems.append(((key,), exc.message))
    factory = imported.get("factory")
    names: list[str] | None = list(model.inputs) if model.inputs else None
    positional = 0
    where: KeyPath = ("inputs",)
    if "inputs_factory" in imported:
        where = ("inputs_factory",)
        names, positional, problem = _factory_inputs(imported["inputs_factory"], model.inputs_factory)
        if problem:
            problems.append((where, problem))
    if factory is None:
        return "ok", {"problems": problems, "notes": notes}
    signature, problem = _forward_signature(factory, model.kwargs)
    if problem:
        problems.append((("factory",), problem))
    elif signature is not None and names is not None:
        found = argument_problems(signature, names, positional=positional)
        problems.extend(found if where == ("inputs",) else [(where, message) for _path, message in found])
    return "ok", {"problems": problems, "notes": notes}


def _built(make: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """`make()` on the meta device (shapes without storage: any size costs nothing), else on the
    CPU (what refuses meta: a checkpoint read, `.item()` in `__init__`); (result, None), or
    (None, what the CPU attempt raised): the run's source stage would raise it too."""
    import torch

    try:
        with torch.device("meta"):
            return make(), None
    except Exception:  # noqa: BLE001 - the CPU attempt decides
        pass
    torch.manual_seed(0)  # as the source stage builds it (stages/source.py)
    try:
        return make(), None
    except Exception as exc:  # noqa: BLE001 - reported as the model's problem, with its message
        return None, exc


def _raised(what: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{what} raised {type(exc).__name__}: {text[0][:300] if text else '(no message)'}"


def _factory_inputs(make: Any, reference: str | None) -> tuple[list[str] | None, int, str | None]:
    """(keyword names, how many positional arguments, a problem) of what an inputs factory gives,
    called on the meta device, else on the CPU; one that raises on both is a problem."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.example_inputs import check_inputs_call

    what = f"inputs_factory {reference}"
    result, error = _built(make)
    if error is not None:
        return None, 0, _raised(what, error)
    try:
        args, kwargs = check_inputs_call(result, what)
    except StageError as exc:
        return None, 0, exc.message
    return list(kwargs), len(args), None


def _forward_signature(factory: Any, kwargs: Any) -> tuple[inspect.Signature | None, str | None]:
    """(the built model's forward() signature, a problem): built on the meta device, else on the
    CPU; a factory that raises on both, or returns no nn.Module, is a problem."""
    import torch

    module, error = _built(lambda: factory(**dict(kwargs)))
    if error is not None:
        return None, _raised("the factory", error)
    if not isinstance(module, torch.nn.Module):
        return None, f"the factory returned {type(module).__name__}, expected a torch.nn.Module"
    return inspect.signature(module.forward), None


_NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def argument_problems(
    signature: inspect.Signature, names: Sequence[str], positional: int = 0
) -> list[tuple[KeyPath, str]]:
    """Input names forward() cannot take (none when it takes **kwargs), and forward()'s required
    parameters the inputs leave out: as stages/binding.py binds inputs, by name (a `*args`
    parameter takes its list by its name). `positional` arguments (an inputs factory's args)
    fill forward()'s first parameters before the names are bound."""
    parameters = list(signature.parameters.values())
    if positional:
        slots = [p for p in parameters if p.kind in _NAMED[:2]]
        if positional > len(slots) and not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters):
            return [((), f"forward() takes {len(slots)} positional argument(s), the inputs give {positional}")]
        names = [*(p.name for p in slots[:positional]), *names]  # the rest, if any, go to *args
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)
    known = [p.name for p in parameters if p.kind != inspect.Parameter.VAR_KEYWORD]
    found: list[tuple[KeyPath, str]] = []
    if not takes_any:
        for name in names:
            if name not in known:
                found.append(
                    (("inputs", name), f"forward() has no parameter {name!r} (it takes {', '.join(known) or 'none'})")
                )
    missing = [
        p.name for p in parameters if p.kind in _NAMED and p.default is inspect.Parameter.empty and p.name not in names
    ]
    if missing:
        found.append((("inputs",), f"forward() requires {', '.join(map(repr, missing))}, which the inputs do not give"))
    return found
