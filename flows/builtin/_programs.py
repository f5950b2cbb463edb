"""The program inputs the stages here share (a plugin names its own the same way)."""

from __future__ import annotations

from pt2flow.flows.pipeline.stage import Input

# a program consumer takes the newest program the run has
NEWEST_PROGRAM = Input("program", ("decompose", "functionalize", "trace"))
# the deployment targets take the functional program, before core ATen: their exporters run
# decomposition tables of their own that keep what their backends handle whole (docs/architecture.md §2)
FUNCTIONAL_PROGRAM = Input("program", ("functionalize", "trace"))
