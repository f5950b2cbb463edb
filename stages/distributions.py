"""Installed distributions, read from the folders on sys.path: no imports, no METADATA parsing
where a folder name says enough (docs/architecture.md §5).

What stages.deps needs to tell a module of an installed distribution from a local file, and to
check a recorded manifest cheaply: which distribution an import would see and its version,
what it requires, and which top-level import names each ships. Cached per sys.path state (a
pip install or uninstall changes a folder's mtime). Also `installed_version`, the version
importlib.metadata reports, for the environment facts of the keys and the toolchain.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TypeVar

_Missing = TypeVar("_Missing")


def installed_version(dist: str, missing: _Missing) -> str | _Missing:
    """importlib.metadata's version of `dist`, or `missing` when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return missing


def normalize_name(name: str) -> str:
    """A distribution's canonical name (PEP 503): `Foo_Bar.baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class InstalledDistribution:
    """One installed distribution, as its metadata folder on sys.path names it."""

    name: str
    version: str
    base: str  # the sys.path entry holding the metadata folder
    path: str  # the metadata folder


_STARTUP_PATH: list[tuple[str, ...]] = []


def pin_import_path() -> None:
    """Take this moment's sys.path as the interpreter's start-up path (a worker calls it before
    it imports anything of a model): what is installed, and where a module is, are read from
    it, not from the live sys.path that later work changes. setuptools appends its vendored
    folder (`setuptools/_vendor`, with a `tomli` and its dist-info) when imported, as torch's C++
    build does during a compile: a worker that compiled would see distributions a fresh one
    does not, and record another manifest for the same model."""
    if not _STARTUP_PATH:
        _STARTUP_PATH.append(tuple(sys.path))


def replace_import_path_entry(old: str, new: str) -> None:
    """In the pinned start-up path, `new` where `old` was: a worker forked from a server started
    in another folder takes its own folder's place (flows/engine/worker/forkserver.py)."""
    if _STARTUP_PATH:
        _STARTUP_PATH[0] = tuple(new if entry == old else entry for entry in _STARTUP_PATH[0])


def import_path() -> tuple[str, ...]:
    """The folders imports and installed distributions are looked up in: the pinned start-up
    sys.path (pin_import_path), else the live one."""
    return _STARTUP_PATH[0] if _STARTUP_PATH else tuple(sys.path)


def path_state() -> tuple[tuple[str, int], ...]:
    """import_path() with each folder's mtime: a pip install or uninstall renames a *.dist-info folder,
    which changes its parent's mtime, so this tuple changes whenever an installed version does."""
    state = []
    for entry in import_path():
        folder = os.path.abspath(entry or os.curdir)
        try:
            state.append((folder, os.stat(folder).st_mtime_ns))
        except OSError:
            state.append((folder, -1))
    return tuple(state)


_dist_cache: dict[tuple[tuple[str, int], ...], dict[str, InstalledDistribution]] = {}


def installed_distributions() -> dict[str, InstalledDistribution]:
    """Canonical name -> the distribution an import would see (the first on sys.path).

    Built from folder listings: `name-version.dist-info` names carry both; egg-info folders fall
    back to their metadata. Cached per sys.path state, so repeated checks cost a stat per entry."""
    state = path_state()
    cached = _dist_cache.get(state)
    if cached is not None:
        return cached
    table: dict[str, InstalledDistribution] = {}
    for folder, _ in state:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            found = _dist_from_folder(folder, entry.name)
            if found is not None and normalize_name(found.name) not in table:
                table[normalize_name(found.name)] = found
    _dist_cache.clear()
    _requirements_cache.clear()
    _dist_cache[state] = table
    return table


def _dist_from_folder(base: str, name: str) -> InstalledDistribution | None:
    path = os.path.join(base, name)
    if name.endswith(".dist-info"):
        match = re.fullmatch(r"(.+?)-(\d.*)", name[: -len(".dist-info")])
        if match:
            return InstalledDistribution(match.group(1), match.group(2), base, path)
    elif not name.endswith(".egg-info"):
        return None
    try:
        meta = metadata.PathDistribution(Path(path)).metadata
    except Exception:
        return None
    if not meta or not meta["Name"]:
        return None
    return InstalledDistribution(meta["Name"], meta["Version"] or "unknown", base, path)


_requirements_cache: dict[str, list[str]] = {}


def requirements(dist: InstalledDistribution) -> list[str]:
    """Canonical names of what `dist` requires, extras left out. Read once per `dist-info` folder
    while installed_distributions' table holds (a reinstall changes its folder's listing, so the
    table and this cache are made again)."""
    cached = _requirements_cache.get(dist.path)
    if cached is None:
        cached = _requirements_cache[dist.path] = _read_requirements(dist)
    return list(cached)


def _read_requirements(dist: InstalledDistribution) -> list[str]:
    try:
        requires = metadata.PathDistribution(Path(dist.path)).requires or []
    except Exception:
        return []
    names = []
    for requirement in requires:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if match:
            names.append(normalize_name(match.group(1)))
    return names


_owners_cache: dict[tuple[tuple[str, int], ...], dict[tuple[str, str], list[str]]] = {}


def top_level_owners() -> dict[tuple[str, str], list[str]]:
    """(sys.path entry, top-level import name) -> canonical names of the distributions there that
    ship it: from top_level.txt, else from the first part of each RECORD path."""
    state = path_state()
    cached = _owners_cache.get(state)
    if cached is not None:
        return cached
    owners: dict[tuple[str, str], list[str]] = {}
    for dist in installed_distributions().values():
        for top in _top_levels(dist.path):
            owners.setdefault((os.path.abspath(dist.base), top), []).append(normalize_name(dist.name))
    _owners_cache.clear()
    _owners_cache[state] = owners
    return owners


def _top_levels(info: str) -> set[str]:
    try:
        return {line.strip() for line in Path(info, "top_level.txt").read_text().splitlines() if line.strip()}
    except OSError:
        pass
    try:
        record = Path(info, "RECORD").read_text()
    except OSError:
        return set()
    tops = set()
    for line in record.splitlines():
        first = line.split(",", 1)[0].split("/", 1)[0]
        if first and not first.endswith((".dist-info", ".data")) and first != "..":
            tops.add(
                first[:-3] if first.endswith(".py") else first.split(".", 1)[0] if first.endswith(".so") else first
            )
    return tops
