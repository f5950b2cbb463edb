"""Keep torch's log chatter off the user's terminal and turn Python warnings into stage warnings.

Stages never print. torch logs compile and guard failures at ERROR level through its own
stderr handler; pt2flow reports those failures itself, with their class, so they are muted
while a stage runs. Python warnings are recorded and returned in the StageResult.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

# torch's own deprecation chatter (not about the user's model) is dropped from stage warnings.
_NOISE = (
    re.compile(r"LeafSpec"),
    re.compile(r"TypedStorage is deprecated"),
    re.compile(r"torch\.export\.experimental"),
)


class WarningSink:
    """Collects de-duplicated warning texts."""

    def __init__(self) -> None:
        self._seen: dict[str, None] = {}

    def add(self, text: str) -> None:
        text = " ".join(text.split())
        if len(text) > 500:
            text = text[:497] + "..."
        self._seen.setdefault(text, None)

    @property
    def items(self) -> tuple[str, ...]:
        return tuple(self._seen)


# torch's structured-trace logger: it never prints (no propagation; its handler writes files only
# under TORCH_TRACE), but torch.export.draft_export builds its report from the records it receives.
_STRUCTURED_TRACE = "torch.__trace"


@contextlib.contextmanager
def quiet_torch(sink: WarningSink | None = None, *, structured_trace: bool = False) -> Iterator[WarningSink]:
    """Mute torch loggers and record warnings raised inside the block into `sink`.

    structured_trace: keep torch's structured-trace records flowing (draft_export needs them;
    muted, its report always reads "no issues found").
    """
    sink = sink if sink is not None else WarningSink()
    saved: list[tuple[logging.Logger, int]] = []
    manager = logging.root.manager
    for name in ["torch", *[n for n in list(manager.loggerDict) if n.startswith("torch.")]]:
        logger = logging.getLogger(name)
        if name == _STRUCTURED_TRACE and structured_trace:
            saved.append((logger, logger.level))
            logger.setLevel(logging.DEBUG)
        elif name == "torch" or logger.level != logging.NOTSET:
            saved.append((logger, logger.level))
            logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield sink
            finally:
                for w in caught:
                    message = str(w.message)
                    noise = issubclass(w.category, (DeprecationWarning, FutureWarning))
                    if noise and any(p.search(message) for p in _NOISE):
                        continue
                    sink.add(f"{w.category.__name__}: {message}")
    finally:
        for logger, level in saved:
            logger.setLevel(level)
