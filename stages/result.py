"""The small frozen value every stage returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping


@dataclass(frozen=True)
class StageResult:
    """What a stage produced.

    output: the stage's product (an ExportedProgram, archive bytes, a package's bytes, a report).
    metadata: JSON-able facts about it (op histogram, node count, signature, range constraints...).
    warnings: human-readable warnings raised while the stage ran, de-duplicated.
    side: bytes to store beside the output, by name (validate's inputs and eager outputs, "io").
    """

    output: Any
    metadata: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    side: Mapping[str, bytes] = field(default_factory=dict)
