"""fsspec filesystems for the store: opening a URL, atomic writes, redaction, retries."""

from __future__ import annotations

import errno
import os
import random
import re
import time
import uuid
from typing import Any, Callable, Mapping, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage.errors import StorageError

T = TypeVar("T")

_CREDENTIALS_IN_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def redact_url(url: str) -> str:
    """A URL safe to print and record: user:secret@ removed."""
    return _CREDENTIALS_IN_URL.sub(r"\1", url)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) for a local path, file://, memory:// or s3://bucket/prefix URL."""
    options = dict(storage_options or {})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except Exception as exc:
        raise StorageError(f"cannot open store {redact_url(url)!r}: {type(exc).__name__}: {_scrub(str(exc), options)}") from exc
    if is_local(fs):
        root = os.path.abspath(root)
    return fs, root.rstrip("/") or "/"


def _scrub(text: str, options: Mapping[str, Any]) -> str:
    """Remove any secret-looking option value from an error text."""
    for key, value in options.items():
        if isinstance(value, str) and value and any(w in key.lower() for w in ("secret", "key", "token", "password")):
            text = text.replace(value, "***")
    return text


# Errors worth retrying: the backend was reachable before and may be again.
_TRANSIENT_NAMES = {
    "ConnectionError",
    "ConnectTimeoutError",
    "EndpointConnectionError",
    "ReadTimeoutError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ClientPayloadError",
    "ResponseStreamingError",
    "TimeoutError",
    "ConnectionResetError",
    "BrokenPipeError",
    "IncompleteRead",
}
_TRANSIENT_TEXT = re.compile(
    r"\b(500|502|503|504)\b|InternalError|ServiceUnavailable|SlowDown|Throttl|RequestTimeout|"
    r"TooManyRequests|Connection reset|connection was closed|Server disconnected",
    re.IGNORECASE,
)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS):
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in _TRANSIENT_NAMES or _TRANSIENT_TEXT.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RetryPolicy:
    """Bounded retries with exponential backoff and jitter for transient backend errors."""

    def __init__(self, attempts: int = 5, base_delay: float = 0.2, max_delay: float = 5.0) -> None:
        self.attempts = max(1, attempts)
        self.base_delay = base_delay
        self.max_delay = max_delay

    def call(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except StorageError:
                raise
            except Exception as exc:
                if attempt >= self.attempts or not is_transient(exc):
                    raise
                delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")


DEFAULT_RETRY = RetryPolicy()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{uuid.uuid4().hex}")


def crash_point(name: str) -> None:
    """Die here, without cleanup, when PT2FLOW_CRASH_AT names this point (crash-consistency tests)."""
    armed = os.environ.get("PT2FLOW_CRASH_AT")
    if armed and armed == name:
        os.kill(os.getpid(), 9)


def _local_write(path: str, data: bytes, exclusive: bool) -> bool:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = _temp_name(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            crash_point("mid_write")
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            try:
                os.link(tmp, path)  # atomic create-if-absent
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
        _fsync_dir(directory)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, exclusive: bool) -> bool:
    """Publish `data` at `path` so that no reader ever sees part of it.

    exclusive: create only if absent; returns False when something is already there.
    Local: temp file in the same directory, fsync, link/replace. S3: one PUT (If-None-Match: *
    when exclusive) or a completed multipart upload. Memory: a single dict assignment.
    """
    if is_local(fs):
        return _local_write(path, data, exclusive)
    if exclusive:
        try:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except Exception as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                return False
            raise
    fs.pipe_file(path, data)
    return True


def read_url(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The bytes at any fsspec URL or local path (a checkpoint, a config). FileNotFoundError passes through."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        return DEFAULT_RETRY.call("read", lambda: fs.cat_file(path))
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise StorageError(f"cannot read {redact_url(url)}: {type(exc).__name__}: {_scrub(str(exc), storage_options or {})}") from exc
