"""The data files in a model's identity: recorded reads, a checkpoint folder, `depends_on` globs.

A recorded file is its content digest (in the source key) plus a stat signature (size, mtime,
inode: outside the key) taken when it was hashed. Re-checking a manifest trusts an unchanged
signature and re-hashes only what changed, as build tools do (make, ninja, git's index): an
unchanged re-run costs a `stat` per file, not a read. A signature whose mtime is within
`RACY_NS` of when it was taken is never trusted (git's "racily clean" rule: a write in the same
clock tick as the hash would not move the mtime).

Declared entries (a checkpoint folder, a `depends_on` glob) are re-expanded on every check, so
a file added to the folder or newly matching the glob is a change too; recorded reads are a
fixed list (a factory that would now read another file is seen when something it read changed,
or by the eager digest).
"""

from __future__ import annotations

import glob
import hashlib
import os
import time
from pathlib import Path
from collections.abc import Iterable, Mapping

RACY_NS = 2_000_000_000


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def is_inside(path: str, folders: Iterable[str]) -> bool:
    """Whether `path` is one of `folders` or lies under one."""
    return any(path == f or is_under(path, f) for f in folders)


def file_key(path: str, search_path: str | None) -> str:
    """A file's name in a manifest: relative to the config's folder when inside it (so a moved
    config folder keeps its cache), absolute otherwise; '/' separators either way."""
    if search_path and is_under(os.path.abspath(path), os.path.abspath(search_path)):
        return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(search_path))).as_posix()
    return Path(path).as_posix()


def file_path(key: str, search_path: str | None) -> str:
    if os.path.isabs(key) or not search_path:
        return key
    return os.path.join(os.path.abspath(search_path), *key.split("/"))


def signature(path: str) -> str | None:
    """size:mtime_ns:inode of a file, or None when it cannot be stat-ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def trusted(path: str, recorded: str | None, taken_ns: int | None) -> bool:
    """Whether `path` is unchanged by its stat signature alone (no read)."""
    if not recorded or not taken_ns:
        return False
    now = signature(path)
    if now is None or now != recorded:
        return False
    mtime_ns = int(now.split(":")[1])
    return mtime_ns < taken_ns - RACY_NS


def expand(spec: str) -> list[str]:
    """The files a declared entry names: every file under a folder (recursively), the files a
    glob matches (`**` recursive; a matched folder counts with all its files), or one file."""
    if glob.has_magic(spec):
        matched = sorted(glob.glob(spec, recursive=True))
    else:
        matched = [spec] if os.path.exists(spec) else []
    files: list[str] = []
    for path in matched:
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs.sort()
                files.extend(os.path.join(root, n) for n in sorted(names))
        elif os.path.isfile(path):
            files.append(path)
    return sorted(dict.fromkeys(os.path.abspath(f) for f in files))


class Hashed:
    """Digests and stat signatures of files, each file read at most once."""

    def __init__(self) -> None:
        self.taken_ns = time.time_ns()
        self.digests: dict[str, str] = {}
        self.signatures: dict[str, str] = {}

    def add(self, path: str, search_path: str | None) -> str:
        key = file_key(path, search_path)
        if key not in self.digests:
            self.signatures[key] = signature(path) or ""
            self.digests[key] = sha256_file(path)
        return key

    def table(self, paths: Iterable[str], search_path: str | None) -> dict[str, str]:
        keys = [self.add(p, search_path) for p in paths]
        return {k: self.digests[k] for k in sorted(keys)}


def changed_files(
    recorded: Mapping[str, str], search_path: str | None, stats: Mapping[str, str] | None, taken_ns: int | None
) -> list[str]:
    """What differs between recorded {file key: sha256} and the files now, one line each."""
    changes = []
    for key, digest in sorted(recorded.items()):
        path = file_path(key, search_path)
        if trusted(path, (stats or {}).get(key), taken_ns):
            continue
        try:
            now = sha256_file(path)
        except OSError:
            changes.append(f"{key}: file missing")
            continue
        if now != digest:
            changes.append(f"{key}: content changed")
    return changes


def changed_declared(
    recorded: Mapping[str, Mapping[str, str]],
    search_path: str | None,
    stats: Mapping[str, str] | None,
    taken_ns: int | None,
) -> list[str]:
    """Declared entries (spec -> {file key: sha256}) re-expanded and compared: files added or
    removed under a folder or glob, then each file's content."""
    changes = []
    for spec, files in sorted(recorded.items()):
        now = {file_key(p, search_path) for p in expand(file_path(spec, search_path))}
        added, removed = sorted(now - set(files)), sorted(set(files) - now)
        changes += [f"{spec}: {k} added" for k in added] + [f"{spec}: {k} removed" for k in removed]
        changes += changed_files({k: v for k, v in files.items() if k in now}, search_path, stats, taken_ns)
    return changes
