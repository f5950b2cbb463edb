"""Storage errors. Backend exceptions are wrapped (`raise StorageError(...) from exc`)."""

from __future__ import annotations

import errno

# Errors that mean "no room": never retried, reported as StorageFull.
FULL_ERRNOS: tuple[int, ...] = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class StorageError(Exception):
    """The store or its index could not be read or written."""

    error_class = "storage"


class IntegrityError(StorageError):
    """A blob's bytes do not match its digest or recorded size."""


class BlobNotFound(StorageError):
    """No blob with this digest in the store."""


class RecordNotFound(StorageError, LookupError):
    """No index record matches the given ID."""


class IdError(Exception):
    """An ID given to the store that cannot be used: the caller's mistake (the CLI's exit 2), not
    the store's failure, so not a StorageError (whose exit is 1)."""


class AmbiguousId(IdError, LookupError):
    """An ID prefix matches more than one artifact."""


class InvalidId(IdError, ValueError):
    """Not a usable artifact ID (hex, at least 8 characters)."""


class UnsafeArchive(StorageError):
    """A zip artifact (.pt2 archive, AOTInductor package) that is not safe to hand to a loader:
    entry names escaping the folder, duplicates, too many entries, too large uncompressed."""


class StorageFull(StorageError):
    """The backend refused the bytes for lack of space (disk full, quota, file size limit)."""


class TransientStorageError(StorageError):
    """A failure worth retrying later (an injected fault in the reliability tests, a backend outage)."""
