"""The export stages as plain functions on real torch APIs (and the deployment targets on their
libraries).

Each stage takes its input and its options and returns a StageResult; none does I/O, logging
or orchestration. Each stage's declaration (name, version, inputs, options...) is in
flows/pipeline (docs/architecture.md §2, §8).
"""

from __future__ import annotations
