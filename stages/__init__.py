"""The six export stages as plain functions on real torch APIs.

Each stage takes its input and its options and returns a StageResult; none does I/O, logging
or orchestration. `STAGES` is the contract order (docs/architecture.md §2).
"""

from __future__ import annotations

from pt2flow.stages.vocabulary import STAGES  # noqa: F401  (the contract order; defined with the rest of the shared words)

# Bump a stage's version when its output for the same input changes: it is part of every
# derivation key, so artifacts made by an older pt2flow are rebuilt instead of reused.
STAGE_VERSIONS: dict[str, int] = {
    # 3: the dependency manifest no longer depends on the worker's history (stages/deps.py)
    "source": 3,
    # 2 (trace, functionalize, decompose, serialize, aot_compile): the program fingerprint covers
    # every node's tensor metadata (stages/program.py); no record keyed by the old one is reused
    "trace": 2,
    "functionalize": 2,
    "decompose": 2,
    # 2: the archive names the modules its pytree types need; 3: the new fingerprint; 4: the
    # same program saves to the same bytes (graph ids of the pass provenance numbered, not addresses)
    "serialize": 4,
    "aot_compile": 2,
    "validate": 2,  # 2: the candidates' signatures are checked against the configured inputs
}
