"""Zip safety checks for .pt2 archives and AOTInductor packages, run on the bytes before any loader.

Both artifact kinds are zip files that torch opens with its own reader (and AOTInductor extracts
to disk). A blob that verifies against its digest is only as trustworthy as whoever published it,
so before torch sees one, `check_archive` rejects what a hostile or broken zip could do:

- entry names that escape the extraction folder: `..` components, absolute paths, Windows drive
  letters, backslashes, NUL bytes, empty names;
- duplicate names (two readers may pick different copies);
- more entries than MAX_ENTRIES (read from the end-of-central-directory record, before parsing);
- more than MAX_TOTAL_UNCOMPRESSED bytes in all, or an entry that inflates more than
  MAX_COMPRESSION_RATIO times (zip bombs);
- local headers that do not match the central directory, or entries whose data overlap
  (the "overlapping files" zip bomb that reuses one compressed stream many times).

Stdlib only (zipfile, struct); raises UnsafeArchive, a StorageError.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
from dataclasses import dataclass

from pt2flow.storage.errors import UnsafeArchive

MAX_ENTRIES = 10_000
MAX_TOTAL_UNCOMPRESSED = 8 * 1024**3  # 8 GiB
MAX_COMPRESSION_RATIO = 100  # uncompressed / compressed, per entry
RATIO_FLOOR = 1024**2  # entries that inflate to less than 1 MiB are not ratio-checked

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_LOCAL = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature .. file name length, extra field length
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class ArchiveSummary:
    entries: int
    total_uncompressed: int


def declared_entry_count(data: bytes) -> int:
    """The entry count the end-of-central-directory record declares (zip64 aware), without
    parsing the central directory (which a hostile zip can make huge)."""
    tail_start = max(0, len(data) - (22 + 0xFFFF))
    at = data.rfind(_EOCD, tail_start)
    if at < 0 or at + 22 > len(data):
        raise UnsafeArchive("not a zip archive: no end-of-central-directory record")
    count = struct.unpack_from("<H", data, at + 10)[0]
    locator = at - 20
    if locator >= 0 and data[locator : locator + 4] == _EOCD64_LOCATOR:
        offset = struct.unpack_from("<Q", data, locator + 8)[0]
        if offset + 56 <= len(data) and data[offset : offset + 4] == _EOCD64:
            count = max(count, struct.unpack_from("<Q", data, offset + 32)[0])
    return int(count)


def unsafe_name_reason(name: str) -> str | None:
    """Why an entry name could escape an extraction folder, or None if it is a plain relative path."""
    if not name:
        return "empty entry name"
    if "\x00" in name:
        return "NUL byte in entry name"
    if "\\" in name:
        return "backslash in entry name (a Windows path separator)"
    if name.startswith("/"):
        return "absolute entry name"
    if _DRIVE.match(name):
        return "entry name with a drive letter"
    if any(part == ".." for part in name.split("/")):
        return "'..' component in entry name"
    return None


def check_archive(
    data: bytes,
    *,
    what: str = "archive",
    max_entries: int = MAX_ENTRIES,
    max_total_uncompressed: int = MAX_TOTAL_UNCOMPRESSED,
    max_ratio: float = MAX_COMPRESSION_RATIO,
    ratio_floor: int = RATIO_FLOOR,
) -> ArchiveSummary:
    """Raise UnsafeArchive unless `data` is a zip that is safe to hand to torch's loaders."""
    declared = declared_entry_count(data)
    if declared > max_entries:
        raise UnsafeArchive(f"unsafe {what}: {declared} entries, more than the cap of {max_entries}")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, NotImplementedError, EOFError, struct.error) as exc:
        raise UnsafeArchive(f"unsafe {what}: not a readable zip archive: {exc}") from exc
    if not infos:
        raise UnsafeArchive(f"unsafe {what}: a zip archive with no entries")
    if len(infos) > max_entries:
        raise UnsafeArchive(f"unsafe {what}: {len(infos)} entries, more than the cap of {max_entries}")

    seen: set[str] = set()
    total = 0
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        name = info.orig_filename  # zipfile cuts names at a NUL byte; the original is what torch sees
        reason = unsafe_name_reason(name)
        if reason:
            raise UnsafeArchive(f"unsafe {what}: {reason}: {name!r}")
        if name in seen:
            raise UnsafeArchive(f"unsafe {what}: duplicate entry name {name!r}")
        seen.add(name)
        total += info.file_size
        if total > max_total_uncompressed:
            raise UnsafeArchive(
                f"unsafe {what}: entries inflate to more than {max_total_uncompressed} bytes (the cap on uncompressed size)"
            )
        if info.file_size >= ratio_floor and info.file_size > max_ratio * max(info.compress_size, 1):
            raise UnsafeArchive(
                f"unsafe {what}: entry {name!r} inflates {info.file_size} bytes from {info.compress_size} "
                f"(more than {max_ratio:g}x; a zip bomb?)"
            )
        spans.append((*_data_span(data, info, what), name))

    spans.sort()
    for (_start, end, name), (next_start, _next_end, next_name) in zip(spans, spans[1:]):
        if next_start < end:
            raise UnsafeArchive(f"unsafe {what}: entries {name!r} and {next_name!r} overlap")
    return ArchiveSummary(len(infos), total)


def _data_span(data: bytes, info: zipfile.ZipInfo, what: str) -> tuple[int, int]:
    """(start of the local header, end of the compressed data) of one entry, checked against the
    central directory: the local header must exist there and name the same file."""
    offset = info.header_offset
    if offset < 0 or offset + _LOCAL_HEADER.size > len(data):
        raise UnsafeArchive(f"unsafe {what}: entry {info.orig_filename!r} points outside the file")
    fields = _LOCAL_HEADER.unpack_from(data, offset)
    if fields[0] != _LOCAL:
        raise UnsafeArchive(f"unsafe {what}: entry {info.orig_filename!r} has no local header where the directory says")
    name_len, extra_len = fields[-2], fields[-1]
    name_start = offset + _LOCAL_HEADER.size
    local_name = data[name_start : name_start + name_len]
    expected = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", errors="replace")
    if local_name != expected:
        raise UnsafeArchive(f"unsafe {what}: entry {info.orig_filename!r} is named {local_name!r} in its local header")
    end = name_start + name_len + extra_len + info.compress_size
    if end > len(data):
        raise UnsafeArchive(f"unsafe {what}: entry {info.orig_filename!r} runs past the end of the file")
    return offset, end
