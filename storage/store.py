"""Content-addressed artifact store on any fsspec backend (local disk, memory://, s3://).

Layout (docs/architecture.md §5): <root>/blobs/sha256/<2 hex>/<64 hex>, immutable bytes named by
their sha256, and <root>/index/ for the Parquet metadata index.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any
from collections.abc import Iterable, Iterator, Mapping

from pt2flow.storage.errors import BlobNotFound, IntegrityError, InvalidId, StorageError
from pt2flow.storage.faults import crash_point
from pt2flow.storage.publish import atomic_write, is_temp_name, remove_file
from pt2flow.storage.urls import is_local, open_filesystem, redact_url
from pt2flow.storage.retry import DEFAULT_RETRY, RetryPolicy
from pt2flow.storage.index import MetadataIndex

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# Below this size a cache hit re-hashes the blob (cheap); from it on, an unchanged stat signature
# is trusted (the cost of an unchanged re-run must not grow with artifact size).
TRUST_STAT_MIN_BYTES = 8 * 2**20


@dataclass(frozen=True)
class BlobRef:
    """A published blob: its digest, size and URI."""

    digest: str
    size: int
    uri: str


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size: int
    modified: datetime | None


@dataclass(frozen=True)
class TempFile:
    path: str
    size: int
    modified: datetime | None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise InvalidId(f"{digest!r} is not a sha256 hex digest")
    return digest


class ArtifactStore:
    """Blobs by sha256 plus the metadata index, under one fsspec URL.

    storage_options go to fsspec and are never written anywhere (records hold `url`, which is
    the redacted URL).
    """

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, *, retry: RetryPolicy = DEFAULT_RETRY
    ) -> None:
        self.url = redact_url(str(url))
        self.fs, self.root = open_filesystem(str(url), storage_options)
        self.retry = retry
        self.index = MetadataIndex(self.fs, f"{self.root}/index", retry=retry)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    # -- paths ---------------------------------------------------------------------------
    def blob_path(self, digest: str) -> str:
        check_digest(digest)
        return f"{self.root}/blobs/sha256/{digest[:2]}/{digest}"

    def blob_uri(self, digest: str) -> str:
        return f"{self.url.rstrip('/')}/blobs/sha256/{digest[:2]}/{digest}"

    # -- writing -------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> BlobRef:
        """Publish bytes atomically; an existing blob of the same digest is verified, not trusted."""
        digest = sha256_hex(data)
        path = self.blob_path(digest)
        ref = BlobRef(digest, len(data), self.blob_uri(digest))
        try:
            if self.blob_status(digest, len(data)) == "ok":
                return ref
            written = self.retry.call("put", lambda: atomic_write(self.fs, path, data, exclusive=True))
            if not written:
                # lost a race to another writer, or a corrupt blob sits there: check, then replace
                if self.blob_status(digest, len(data)) != "ok":
                    self.retry.call("put", lambda: atomic_write(self.fs, path, data, exclusive=False))
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"cannot write blob {digest} to {self.url}: {type(exc).__name__}: {exc}") from exc
        crash_point("after_blob_upload")
        return ref

    # -- reading -------------------------------------------------------------------------
    def _read(self, digest: str) -> bytes:
        path = self.blob_path(digest)
        try:
            return self.retry.call("get", lambda: self.fs.cat_file(path))
        except FileNotFoundError as exc:
            raise BlobNotFound(f"blob {digest} is missing from {self.url}") from exc
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"cannot read blob {digest} from {self.url}: {type(exc).__name__}: {exc}") from exc

    def get_blob(self, digest: str, size: int | None = None, *, remove_corrupt: bool = False) -> bytes:
        """The blob's bytes, after checking their size and sha256 (IntegrityError otherwise;
        remove_corrupt: also delete a corrupt blob, so that lookups see it missing and the stage
        that made it runs again instead of being trusted by its unchanged stat signature)."""
        data = self._read(digest)
        problem = None
        if size is not None and len(data) != size:
            problem = f"blob {digest} is corrupt: {len(data)} bytes, the index records {size}"
        elif (actual := sha256_hex(data)) != digest:
            problem = f"blob {digest} is corrupt: its bytes hash to {actual}"
        if problem:
            if remove_corrupt:
                self.delete_blob(digest)
                problem += "; removed it, so that the next run rebuilds it"
            raise IntegrityError(problem)
        return data

    def blob_status(self, digest: str, size: int | None = None) -> str:
        """'ok', 'missing' or 'corrupt' (wrong size or hash)."""
        try:
            self.get_blob(digest, size)
        except BlobNotFound:
            return "missing"
        except IntegrityError:
            return "corrupt"
        return "ok"

    def blob_signature(self, digest: str) -> str | None:
        """What the backend says about the blob without reading it (size plus mtime and inode on
        local disk, the ETag on S3), or None if it is missing. Equal signatures mean the bytes
        were not rewritten since the signature was taken, as git's index trusts stat data."""
        path = self.blob_path(digest)
        try:
            self.fs.invalidate_cache(path)
            info = self.retry.call("stat", lambda: self.fs.info(path))
        except FileNotFoundError:
            return None
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"cannot stat blob {digest} in {self.url}: {type(exc).__name__}: {exc}") from exc
        parts = [f"size={info.get('size')}"]
        for field in ("ETag", "mtime", "ino", "LastModified", "created"):
            if info.get(field) is not None:
                parts.append(f"{field}={info[field]}")
        return ";".join(parts)

    def blob_status_trusting(self, digest: str, size: int | None, signature: str | None) -> tuple[str, str | None]:
        """(status, current signature): for a blob of TRUST_STAT_MIN_BYTES or more, 'ok' without
        reading it when its signature is `signature` (taken when it was last verified); otherwise
        a full blob_status (read and re-hash). Whoever reads a blob for use verifies it again
        (get_blob, which also removes a corrupt one so that the next run rebuilds it), so a blob
        corrupted under an unchanged signature never reaches a loader; `verify` re-hashes all."""
        current = self.blob_signature(digest)
        if current is None:
            return "missing", None
        if signature is not None and current == signature and (size or 0) >= TRUST_STAT_MIN_BYTES:
            return "ok", current
        return self.blob_status(digest, size), current

    def has_blob(self, digest: str) -> bool:
        try:
            path = self.blob_path(digest)
            self.fs.invalidate_cache(path)
            return bool(self.retry.call("exists", lambda: self.fs.exists(path)))
        except Exception as exc:
            raise StorageError(f"cannot check blob {digest} in {self.url}: {exc}") from exc

    def list_blobs(self) -> Iterator[BlobInfo]:
        """Every blob under blobs/sha256/ (names that are not digests, such as temp files, skipped)."""
        for path, info in self._find(f"{self.root}/blobs/sha256"):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if not _HEX64.match(name):
                continue
            yield BlobInfo(name, int(info.get("size") or 0), _modified(info))

    def delete_blob(self, digest: str) -> None:
        try:
            remove_file(self.fs, self.blob_path(digest))
        except Exception as exc:
            raise StorageError(f"cannot delete blob {digest} from {self.url}: {exc}") from exc

    def delete_blobs(self, digests: Iterable[str]) -> int:
        """Delete blobs one by one (gc); a crash between two deletions leaves whole blobs only."""
        count = 0
        for digest in digests:
            if count:
                crash_point("mid_gc")
            self.delete_blob(digest)
            count += 1
        return count

    def temp_files(self) -> list[TempFile]:
        """Named temp files of local writes that never finished (a writer was killed). Unnamed
        (O_TMPFILE) temp files never show up; object stores have none."""
        if not is_local(self.fs):
            return []
        found = []
        for base in (f"{self.root}/blobs", f"{self.root}/index"):
            for path, info in self._find(base):
                if is_temp_name(path.rstrip("/").rsplit("/", 1)[-1]):
                    found.append(TempFile(path, int(info.get("size") or 0), _modified(info)))
        return found

    def delete_temp_file(self, path: str) -> None:
        if not is_temp_name(path.rstrip("/").rsplit("/", 1)[-1]):
            raise StorageError(f"{path} is not a temp file")
        try:
            remove_file(self.fs, path)
        except Exception as exc:
            raise StorageError(f"cannot delete {path}: {exc}") from exc

    def _find(self, base: str) -> list[tuple[str, Mapping[str, Any]]]:
        """Every file under `base` with its details, sorted by path (none if `base` is absent);
        the listing is fresh, since other processes write to the store too."""
        try:
            self.fs.invalidate_cache(base)
            if not self.fs.exists(base):
                return []
            return sorted(self.fs.find(base, detail=True).items())
        except Exception as exc:
            raise StorageError(f"cannot list {base} in {self.url}: {exc}") from exc


def _modified(info: Mapping[str, Any]) -> datetime | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        try:
            return datetime.fromtimestamp(float(value), tz=UTC)
        except (TypeError, ValueError):
            continue
    return None
