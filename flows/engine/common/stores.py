"""Storage options and stores, per process: what both the orchestrator and the workers open.

Storage options never go into Prefect parameters, results or the index; children (worker
processes) inherit them through the environment of the process that started them.
"""

from __future__ import annotations

import json
import os
from typing import Any
from collections.abc import Mapping

_OPTIONS_ENV = "PT2FLOW_STORAGE_OPTIONS"

_options: dict[str, dict[str, Any]] = {}


def set_storage_options(store_url: str, options: Mapping[str, Any]) -> None:
    _options[store_url] = dict(options)
    os.environ[_OPTIONS_ENV] = json.dumps(_options)


def storage_options(store_url: str) -> dict[str, Any]:
    if store_url in _options:
        return dict(_options[store_url])
    raw = os.environ.get(_OPTIONS_ENV)
    if raw:
        try:
            return dict(json.loads(raw).get(store_url, {}))
        except (ValueError, AttributeError):
            return {}
    return {}


_stores: dict[str, Any] = {}


def open_store(store_url: str) -> Any:
    """The process's ArtifactStore for a URL (one per process, so index file caches are shared)."""
    from pt2flow.storage import ArtifactStore

    store = _stores.get(store_url)
    if store is None:
        store = ArtifactStore(store_url, storage_options(store_url))
        _stores[store_url] = store
    return store
