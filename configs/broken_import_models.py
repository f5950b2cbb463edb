"""A factory module whose import fails: it depends on a package that is not installed."""

from __future__ import annotations

import pt2flow_missing_dependency  # noqa: F401  (deliberately absent)

from torch import nn


def model() -> nn.Module:
    return nn.Linear(4, 4)
