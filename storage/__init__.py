"""Where artifacts live: a content-addressed blob store and a Parquet metadata index on fsspec.

Knows fsspec and pyarrow only; never imports torch, Prefect or the stages.
"""

from pt2flow.storage.errors import (
    AmbiguousId,
    BlobNotFound,
    IntegrityError,
    InvalidId,
    RecordNotFound,
    StorageError,
    UnsafeArchive,
)
from pt2flow.storage.store import ArtifactStore, BlobRef, sha256_hex

__all__ = [
    "AmbiguousId",
    "ArtifactStore",
    "BlobNotFound",
    "BlobRef",
    "IntegrityError",
    "InvalidId",
    "RecordNotFound",
    "StorageError",
    "UnsafeArchive",
    "sha256_hex",
]
