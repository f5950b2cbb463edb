"""Storage errors. Backend exceptions are wrapped (`raise StorageError(...) from exc`)."""

from __future__ import annotations


class StorageError(Exception):
    """The store or its index could not be read or written."""

    error_class = "storage"


class IntegrityError(StorageError):
    """A blob's bytes do not match its digest or recorded size."""


class BlobNotFound(StorageError):
    """No blob with this digest in the store."""


class RecordNotFound(StorageError, LookupError):
    """No index record matches the given ID."""


class AmbiguousId(StorageError, LookupError):
    """An ID prefix matches more than one artifact."""


class InvalidId(StorageError, ValueError):
    """Not a usable artifact ID (hex, at least 8 characters)."""
