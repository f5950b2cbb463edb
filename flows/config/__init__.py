"""The pipeline config, schema version 1 (docs/architecture.md §3): torch- and Prefect-free.

    load.py       reading a config: load_config / parse_config, then the CLI's overrides
    models.py     the document as pydantic models, and the resolved form (Pipeline, ResolvedModel)
    checks.py     the semantic checks after the schema pass (a model, a stage selection)
    factories.py  `module:callable` references resolved without importing anything
    issues.py     ConfigIssue / ConfigError: every problem with its file, line and key path
    inputs.py     the `inputs` and `dynamic_shapes` trees of a model
    limits.py     a model's time and memory limits
"""

from pt2flow.flows.config.issues import ConfigError
from pt2flow.flows.config.load import apply_overrides, load_config, resolve_store_url
from pt2flow.flows.config.models import ResolvedModel

__all__ = ["ConfigError", "ResolvedModel", "apply_overrides", "load_config", "resolve_store_url"]
