"""What a power cut would leave, which no killed process can show (tests/reliability kills
processes: the kernel still writes their page cache out). On a local store a blob's bytes and an
index file's are fsynced before their name appears, and their folder after it, so a name never
points at bytes that were not on disk (storage/publish.py).

os.fsync is watched, not replaced: every call goes through to the kernel; the spy notes which
file or folder each one synced and whether the final name existed at that moment."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore
from tests.records import make_chain


@dataclass(frozen=True)
class Synced:
    folder: bool  # the fd was a directory
    target: str  # what /proc/self/fd says the fd is
    names: frozenset[str]  # the entries of the watched folder at that moment


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Synced], list[Path]]:
    """The fsyncs made, each with a listing of the watched folders (append a folder to watch it)."""
    calls: list[Synced] = []
    watched: list[Path] = []
    real = os.fsync

    def spy(fd: int) -> None:
        names = frozenset(p.name for folder in watched if folder.exists() for p in folder.iterdir())
        calls.append(Synced(stat.S_ISDIR(os.fstat(fd).st_mode), os.readlink(f"/proc/self/fd/{fd}"), names))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls, watched


def test_a_blobs_bytes_are_on_disk_before_its_name_and_its_folder_after(
    tmp_path: Path, synced: tuple[list[Synced], list[Path]]
) -> None:
    calls, watched = synced
    store = ArtifactStore(str(tmp_path / "store"))
    data = b"a blob that must survive a power cut" * 100
    digest = hashlib.sha256(data).hexdigest()
    folder = tmp_path / "store" / "blobs" / "sha256" / digest[:2]
    watched.append(folder)
    store.put_blob(data)
    files = [c for c in calls if not c.folder]
    folders = [c for c in calls if c.folder and c.target == str(folder)]
    assert files and all(digest not in c.names for c in files), calls  # the bytes, before the name
    assert folders and digest in folders[-1].names, calls  # the folder's entry, after it
    assert calls.index(files[0]) < calls.index(folders[-1])


def test_an_index_files_bytes_are_on_disk_before_its_name_and_its_folder_after(
    tmp_path: Path, synced: tuple[list[Synced], list[Path]]
) -> None:
    calls, watched = synced
    store = ArtifactStore(str(tmp_path / "store"))
    make_chain(store, "warmup", "run-0", None)  # the index folder exists
    folder = tmp_path / "store" / "index"
    watched.append(folder)
    before = {p.name for p in folder.iterdir()}
    calls.clear()
    make_chain(store, "mlp", "run-1", None)
    (new,) = {p.name for p in folder.iterdir()} - before - {p.name for p in folder.iterdir() if p.name.startswith(".")}
    files = [c for c in calls if not c.folder]
    folders = [c for c in calls if c.folder and c.target == str(folder)]
    assert files and all(new not in c.names for c in files), calls
    assert folders and new in folders[-1].names, calls
