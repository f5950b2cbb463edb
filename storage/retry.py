"""Retries for transient backend errors: which errors are worth another try, and how often.

The only retry layer pt2flow adds; errors that mean "no room" or "not there" are never retried.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from typing import TypeVar
from collections.abc import Callable

from pt2flow.storage.errors import FULL_ERRNOS, StorageError, StorageFull, TransientStorageError

T = TypeVar("T")
_log = logging.getLogger(__name__)

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
    # a connection lost mid-request, as aiohttp, botocore and http.client name it
    "ClientConnectionError",
    "ClientConnectionResetError",
    "ConnectionClosedError",
    "RemoteDisconnected",
    "ConnectionAbortedError",
}
_TRANSIENT_TEXT = re.compile(
    r"\b(500|502|503|504)\b|InternalError|ServiceUnavailable|SlowDown|Throttl|RequestTimeout|"
    r"TooManyRequests|Connection reset|connection was closed|Server disconnected|Connection lost",
    re.IGNORECASE,
)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, (StorageFull, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS + (errno.EROFS,):
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TransientStorageError):
            return True
        if type(seen).__name__ in _TRANSIENT_NAMES or _TRANSIENT_TEXT.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RetryPolicy:
    """Bounded retries with exponential backoff and jitter for transient backend errors.

    The only retry layer pt2flow adds: `attempts` tries in all, then the error goes up. (botocore
    and s3fs retry on their own too unless storage_options turn that off; see README.) Each retry
    is logged (logger pt2flow.storage.retry, INFO, with `attempt` and `delay` on the record).
    """

    def __init__(self, attempts: int = 5, base_delay: float = 0.2, max_delay: float = 5.0) -> None:
        self.attempts = max(1, attempts)
        self.base_delay = base_delay
        self.max_delay = max_delay

    def call(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except StorageError as exc:
                if attempt >= self.attempts or not isinstance(exc, TransientStorageError):
                    raise
            except Exception as exc:
                if attempt >= self.attempts or not is_transient(exc):
                    raise
            delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            _log.info(
                "%s: attempt %d of %d failed with a transient error; retrying in %.2f s",
                what,
                attempt,
                self.attempts,
                delay,
                extra={"attempt": attempt, "delay": delay, "what": what},
            )
            time.sleep(delay)
        raise AssertionError("unreachable")


DEFAULT_RETRY = RetryPolicy()
