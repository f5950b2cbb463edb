"""Store URLs: opening one as an fsspec filesystem, reading the bytes behind one, and keeping
credentials out of what gets printed or recorded."""

from __future__ import annotations

import os
import re
from typing import Any
from collections.abc import Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pt2flow.storage.errors import StorageError
from pt2flow.storage.retry import DEFAULT_RETRY

_CREDENTIALS_IN_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def redact_url(url: str) -> str:
    """A URL safe to print and record: user:secret@ removed."""
    return _CREDENTIALS_IN_URL.sub(r"\1", url)


def holds_credentials(url: str) -> bool:
    """Whether `url` names a user or secret (user:secret@), which must not be printed or recorded."""
    return redact_url(url) != url


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def open_filesystem(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) for a local path, file://, memory:// or s3://bucket/prefix URL."""
    options = dict(storage_options or {})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except Exception as exc:
        raise StorageError(
            f"cannot open store {redact_url(url)!r}: {type(exc).__name__}: {_scrub(str(exc), options)}"
        ) from exc
    if is_local(fs):
        root = os.path.abspath(root)
    return fs, root.rstrip("/") or "/"


def _scrub(text: str, options: Mapping[str, Any]) -> str:
    """Remove any secret-looking option value from an error text."""
    for key, value in options.items():
        if isinstance(value, str) and value and any(w in key.lower() for w in ("secret", "key", "token", "password")):
            text = text.replace(value, "***")
    return text


def url_exists(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether a file is at an fsspec URL (one metadata request: a HEAD on S3). StorageError when
    the backend cannot be asked (no credentials, no network)."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        return bool(DEFAULT_RETRY.call("exists", lambda: fs.isfile(path)))
    except Exception as exc:
        raise StorageError(
            f"cannot ask {redact_url(url)}: {type(exc).__name__}: {_scrub(str(exc), storage_options or {})}"
        ) from exc


def read_url(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The bytes at any fsspec URL or local path (a checkpoint, a config). FileNotFoundError passes through."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        return DEFAULT_RETRY.call("read", lambda: fs.cat_file(path))
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise StorageError(
            f"cannot read {redact_url(url)}: {type(exc).__name__}: {_scrub(str(exc), storage_options or {})}"
        ) from exc
