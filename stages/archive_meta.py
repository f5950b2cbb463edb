"""pt2flow's metadata in a .pt2 archive (`extra/pt2flow.json`), read from the zip without torch:
check-compat's caller learns an archive's pytree modules (the modules a process must import
before the model's archive or AOTInductor package loads there) without importing torch."""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

from pt2flow.stages.classify import short_message
from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import MODULE_NAME_PATTERN, ErrorClass

METADATA_FILE = "pt2flow.json"
PYTREE_MODULES = "pytree_modules"  # metadata key: modules a loading process must have imported


def archive_metadata(data: bytes) -> dict[str, Any]:
    """The pt2flow metadata of an archive, read from the zip without loading the program."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/extra/" + METADATA_FILE)]
            return json.loads(archive.read(names[0])) if names else {}
    except (zipfile.BadZipFile, ValueError, KeyError) as exc:
        raise StageError(ErrorClass.SERIALIZATION, f"not a readable .pt2 archive: {short_message(exc)}") from exc


def recorded_pytree_modules(data: bytes) -> list[str] | None:
    """The module names an archive's metadata records as registering its pytree types ([] when it
    uses none outside torch; None when it records nothing: not pt2flow's, or from before serialize
    v2, or not readable). Only well-formed module names are returned."""
    try:
        named = archive_metadata(data).get(PYTREE_MODULES)
    except StageError:
        return None
    if named is None:
        return None
    return (
        [n for n in named if isinstance(n, str) and MODULE_NAME_PATTERN.fullmatch(n)]
        if isinstance(named, list)
        else None
    )
