"""The six export stages as plain functions on real torch APIs.

Each stage takes its input and its options and returns a StageResult; none does I/O, logging
or orchestration. `STAGES` is the contract order (docs/architecture.md §2).
"""

from __future__ import annotations

from pt2flow.stages.vocabulary import STAGES  # noqa: F401  (the contract order; defined with the rest of the shared words)

# Bump a stage's version when its output for the same input changes: it is part of every
# derivation key, so artifacts made by an older pt2flow are rebuilt instead of reused.
STAGE_VERSIONS: dict[str, int] = {
    "source": 2,  # 2: the dependency manifest of the model's code is part of the source key
    "trace": 1,
    "functionalize": 1,
    "decompose": 1,
    "serialize": 2,  # 2: the archive's metadata names the modules its pytree types need (check-compat)
    "aot_compile": 1,
    "validate": 1,
}
