"""The pipeline config, schema version 1 (docs/architecture.md §3): torch- and Prefect-free.

    schema.py   the config document, its validation and the per-model view (ResolvedModel)
    inputs.py   the `inputs` and `dynamic_shapes` trees of a model
    limits.py   a model's time and memory limits
"""

from pt2flow.flows.config.schema import ConfigError, ResolvedModel, apply_overrides, load_config, resolve_store_url

__all__ = ["ConfigError", "ResolvedModel", "apply_overrides", "load_config", "resolve_store_url"]
