"""Atomic publish: bytes appear at their name whole or not at all, on any fsspec backend.

Local disk: an unnamed (O_TMPFILE) temp file where the kernel and filesystem allow, otherwise a
dot-named temp file, in the same directory, fsynced, then linked into place. S3: one conditional
PUT, or a multipart upload (storage/multipart.py) for large blobs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from typing import Any

import fsspec

from pt2flow.storage.errors import FULL_ERRNOS, StorageFull
from pt2flow.storage.faults import crash_point
from pt2flow.storage.multipart import is_precondition_failed, s3_multipart_upload, wants_multipart
from pt2flow.storage.urls import is_local

# ---------------------------------------------------------------------------------------------
# local atomic publish


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


TEMP_MARKER = ".tmp-"


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}{TEMP_MARKER}{uuid.uuid4().hex}")


def is_temp_name(name: str) -> bool:
    """A named temp file of an unfinished (or killed) local write: never a blob or index file."""
    return name.startswith(".") and TEMP_MARKER in name


def _write_all(fd: int, data: bytes, kind: str) -> None:
    """Write every byte (os.write may write less than asked), then fsync. The crash points sit
    after the first half (a torn write) and after the fsync (complete but unpublished)."""
    view = memoryview(data)
    half = len(view) // 2
    for chunk, point in ((view[:half], f"mid_{kind}_write"), (view[half:], None)):
        while len(chunk):
            written = os.write(fd, chunk)
            chunk = chunk[written:]
        if point:
            crash_point(point)
    os.fsync(fd)
    crash_point(f"before_{kind}_publish")


class _NoUnnamedTemp(Exception):
    """This filesystem (or kernel) cannot link an O_TMPFILE file into place."""


_libc: Any = None
_unnamed_ok: bool | None = None  # learned on first use: O_TMPFILE + linkat works here


def _link_fd(fd: int, path: str) -> None:
    """Give the unnamed file behind `fd` the name `path` (create-if-absent: FileExistsError)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, at_empty_path = -100, 0x1000
    if _libc.linkat(fd, b"", at_fdcwd, os.fsencode(path), at_empty_path) == 0:
        return
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        raise FileExistsError(code, os.strerror(code), path)
    if code in FULL_ERRNOS:
        raise OSError(code, os.strerror(code), path)
    try:  # without CAP_DAC_READ_SEARCH on older kernels: the /proc route
        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise
        raise _NoUnnamedTemp(str(exc)) from exc


def _write_unnamed(path: str, data: bytes, exclusive: bool, kind: str) -> bool:
    """O_TMPFILE: the bytes live in a file with no name until linked, so a crash at any point
    leaves nothing behind (the kernel frees the inode with the last descriptor)."""
    directory = os.path.dirname(path)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOTSUP):
            raise _NoUnnamedTemp(str(exc)) from exc
        raise
    try:
        _write_all(fd, data, kind)
        if exclusive:
            try:
                _link_fd(fd, path)
            except FileExistsError:
                return False
        else:
            tmp = _temp_name(path)
            _link_fd(fd, tmp)
            try:
                os.replace(tmp, path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
    finally:
        os.close(fd)
    _fsync_dir(directory)
    return True


def _write_named(path: str, data: bytes, exclusive: bool, kind: str) -> bool:
    """The portable way: a dot-named temp file in the same directory, then link/replace. A crash
    can leave the temp file (never listed as a blob or index file; gc removes old ones)."""
    directory = os.path.dirname(path)
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            _write_all(fd, data, kind)
        finally:
            os.close(fd)
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
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _local_write(path: str, data: bytes, exclusive: bool, kind: str) -> bool:
    global _unnamed_ok
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if _unnamed_ok is not False and hasattr(os, "O_TMPFILE"):
            try:
                written = _write_unnamed(path, data, exclusive, kind)
                _unnamed_ok = True
                return written
            except _NoUnnamedTemp:
                _unnamed_ok = False
        return _write_named(path, data, exclusive, kind)
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise StorageFull(
                f"disk full: cannot write {path} ({len(data)} bytes): {os.strerror(exc.errno)} "
                f"(no space, quota or file size limit); nothing was published"
            ) from exc
        raise


def force_named_temp_files() -> None:
    """From now on, local writes in this process take the portable dot-named temp file path, as
    on a filesystem without O_TMPFILE (the reliability tests exercise that path this way)."""
    global _unnamed_ok
    _unnamed_ok = False


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete `path`; one that is already gone is fine (deletion is idempotent: another gc or
    compaction may have got there first). Other errors go up to the caller to name."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def unnamed_temp_files_supported(directory: str) -> bool:
    """Whether local writes under `directory` use unnamed (O_TMPFILE) temp files (tests ask)."""
    if not hasattr(os, "O_TMPFILE"):
        return False
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".probe{TEMP_MARKER}{uuid.uuid4().hex}")
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o644)
    except OSError:
        return False
    try:
        _link_fd(fd, probe)
        return True
    except (OSError, _NoUnnamedTemp):
        return False
    finally:
        os.close(fd)
        if os.path.lexists(probe):
            os.unlink(probe)


# ---------------------------------------------------------------------------------------------
# publish on any backend


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, exclusive: bool, kind: str = "blob") -> bool:
    """Publish `data` at `path` so that no reader ever sees part of it.

    exclusive: create only if absent; returns False when something is already there.
    kind ("blob" or "index") names the crash points on the way.
    Local: an unnamed (O_TMPFILE) or dot-named temp file in the same directory, fsync, then
    link/replace; ENOSPC/EFBIG/EDQUOT raise StorageFull. S3: one PUT (If-None-Match: * when
    exclusive) or, from MULTIPART_THRESHOLD bytes, a multipart upload that is visible only once
    completed. Memory: a single dict assignment.
    """
    if is_local(fs):
        return _local_write(path, data, exclusive, kind)
    if wants_multipart(fs, len(data)):
        if exclusive and fs.exists(path):
            return False
        return s3_multipart_upload(fs, path, data, exclusive)
    if exclusive:
        try:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data, mode="create")
            return True
        except Exception as exc:
            if is_precondition_failed(exc):
                return False
            raise
    fs.pipe_file(path, data)
    return True
