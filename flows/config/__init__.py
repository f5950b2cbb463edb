"""The pipeline config, schema version 1 (docs/architecture.md §3): torch- and Prefect-free.

load.py       reading a config: load_config / parse_config, then the CLI's overrides
reading.py    the YAML before the schema, ${ENV}, store paths (against the config's folder), the store alone
models.py     the document as pydantic models, and the resolved form (Pipeline, ResolvedModel)
checks.py     the semantic checks after the schema pass (a model, a stage selection)
factories.py  `module:callable` references resolved without importing anything
problems.py   ConfigIssue / ConfigError: every problem with its file, line and key path
issues.py     those, and pydantic's errors as ConfigIssues
inputs.py     the `inputs` and `dynamic_shapes` trees of a model
limits.py     a model's time and memory limits
"""

from pt2flow.flows.config.issues import ConfigError
from pt2flow.flows.config.load import apply_overrides, load_config
from pt2flow.flows.config.reading import read_store_settings, resolve_store_url
from pt2flow.flows.config.models import ResolvedModel

__all__ = ["ConfigError", "ResolvedModel", "apply_overrides", "load_config", "read_store_settings", "resolve_store_url"]
