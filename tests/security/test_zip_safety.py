"""storage.safety.check_archive on hand-built hostile zips, on real torch archives, and wired into the
pipeline so that torch's loaders never see an unsafe zip."""

from __future__ import annotations

import io
import struct
import warnings
import zipfile
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore, UnsafeArchive
from pt2flow.storage.safety import MAX_ENTRIES, MAX_TOTAL_UNCOMPRESSED, check_archive, declared_entry_count
from tests.security.conftest import record


def make_zip(entries: list[tuple[str, bytes]], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names
        with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
            for name, data in entries:
                archive.writestr(zipfile.ZipInfo(name), data, compress_type=compression)
    return buffer.getvalue()


def central_header_offsets(data: bytes) -> list[int]:
    """Offsets of the central directory headers, in order."""
    at = data.rfind(b"PK\x05\x06")
    count, _size, start = struct.unpack_from("<HLL", data, at + 10)
    offsets = []
    pos = start
    for _ in range(count):
        assert data[pos : pos + 4] == b"PK\x01\x02"
        offsets.append(pos)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        pos += 46 + name_len + extra_len + comment_len
    return offsets


def patch(data: bytes, offset: int, fmt: str, *values: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# entry names

BAD_NAMES = {
    "../evil": "'..' component",
    "a/../../evil": "'..' component",
    "archive/data/..": "'..' component",
    "..": "'..' component",
    "/etc/passwd": "absolute entry name",
    "//server/share/x": "absolute entry name",
    "C:/Windows/evil.dll": "drive letter",
    "c:evil": "drive letter",
    "C:\\Windows\\evil.dll": "backslash",
    "..\\evil": "backslash",
    "\\\\server\\share\\x": "backslash",
    "archive\\..\\..\\x": "backslash",
}


@pytest.mark.parametrize("name", sorted(BAD_NAMES))
def test_escaping_entry_names_are_rejected(name: str) -> None:
    data = make_zip([("archive/ok.json", b"{}"), (name, b"payload")])
    with pytest.raises(UnsafeArchive) as info:
        check_archive(data)
    assert BAD_NAMES[name] in str(info.value)
    assert repr(name) in str(info.value)


def test_a_nul_byte_in_an_entry_name_is_rejected_although_zipfile_hides_it() -> None:
    data = make_zip([("archive/okXx/../../../evil", b"payload")]).replace(b"okXx", b"ok\x00x")
    assert zipfile.ZipFile(io.BytesIO(data)).namelist() == ["archive/ok"]  # what Python's zipfile shows
    with pytest.raises(UnsafeArchive, match="NUL byte"):
        check_archive(data)


def test_an_empty_entry_name_is_rejected() -> None:
    with pytest.raises(UnsafeArchive, match="empty entry name"):
        check_archive(make_zip([("archive/ok", b"1"), ("", b"x")]))


def test_duplicate_entry_names_are_rejected() -> None:
    data = make_zip([("archive/data.pkl", b"first"), ("archive/data.pkl", b"second")])
    with pytest.raises(UnsafeArchive, match="duplicate entry name 'archive/data.pkl'"):
        check_archive(data)


def test_a_local_header_naming_another_file_than_the_directory_is_rejected() -> None:
    data = make_zip([("archive/aaaa", b"payload")])
    first_local = data.index(b"archive/aaaa")  # the local header's name comes first in the file
    tampered = data[:first_local] + b"archive/../a" + data[first_local + len(b"archive/aaaa") :]
    assert zipfile.ZipFile(io.BytesIO(tampered)).namelist() == ["archive/aaaa"]
    with pytest.raises(UnsafeArchive, match="in its local header"):
        check_archive(tampered)


# ---------------------------------------------------------------------------------------------
# counts and sizes


def test_more_entries_than_the_cap_are_rejected() -> None:
    data = make_zip([(f"archive/{i}", b"") for i in range(MAX_ENTRIES + 1)])
    with pytest.raises(UnsafeArchive, match=f"{MAX_ENTRIES + 1} entries, more than the cap of {MAX_ENTRIES}"):
        check_archive(data)
    assert check_archive(make_zip([(f"archive/{i}", b"") for i in range(50)]), max_entries=50).entries == 50
    with pytest.raises(UnsafeArchive):
        check_archive(make_zip([(f"archive/{i}", b"") for i in range(51)]), max_entries=50)


def test_the_entry_count_cap_holds_when_the_end_record_lies() -> None:
    data = make_zip([(f"archive/{i}", b"") for i in range(60)])
    at = data.rfind(b"PK\x05\x06")
    lying_low = patch(data, at + 8, "<HH", 1, 1)  # "1 entry" although the directory holds 60
    assert declared_entry_count(lying_low) == 1
    with pytest.raises(UnsafeArchive, match="60 entries, more than the cap of 50"):
        check_archive(lying_low, max_entries=50)
    lying_high = patch(data, at + 8, "<HH", 0xFFFE, 0xFFFE)  # refused before the directory is parsed
    with pytest.raises(UnsafeArchive, match="65534 entries"):
        check_archive(lying_high, max_entries=50)


def test_total_uncompressed_size_beyond_the_default_cap_is_rejected() -> None:
    """Three entries whose directory declares ~4 GiB each: more than the 8 GiB cap in all."""
    data = make_zip([(f"archive/w{i}", b"x" * 16) for i in range(3)])
    for offset in central_header_offsets(data):
        data = patch(data, offset + 24, "<L", 0xFFFFFFF0)  # uncompressed size field
    assert 3 * 0xFFFFFFF0 > MAX_TOTAL_UNCOMPRESSED
    with pytest.raises(UnsafeArchive, match=f"more than {MAX_TOTAL_UNCOMPRESSED} bytes"):
        check_archive(data, max_ratio=float("inf"))  # the size cap alone, not the ratio cap
    with pytest.raises(UnsafeArchive):
        check_archive(data)


def test_total_uncompressed_size_cap_on_real_bytes() -> None:
    data = make_zip([(f"archive/w{i}", b"\x01" * 1024 * 1024) for i in range(3)])
    assert check_archive(data).total_uncompressed == 3 * 1024 * 1024
    with pytest.raises(UnsafeArchive, match="more than 2097152 bytes"):
        check_archive(data, max_total_uncompressed=2 * 1024 * 1024)


def test_a_zip_bomb_entry_is_rejected_by_its_compression_ratio() -> None:
    bomb = make_zip([("archive/data/weights/w0", bytes(20 * 1024 * 1024))], compression=zipfile.ZIP_DEFLATED)
    assert len(bomb) < 100_000
    with pytest.raises(UnsafeArchive, match="a zip bomb"):
        check_archive(bomb)
    # small compressible entries (json, code) are fine
    assert check_archive(make_zip([("archive/x.json", b" " * 100_000)], compression=zipfile.ZIP_DEFLATED)).entries == 1


def test_overlapping_entries_are_rejected() -> None:
    """A directory entry whose data runs into the next entry's header: the overlapping-files zip bomb."""
    data = make_zip([("archive/a", b"A" * 100), ("archive/b", b"B" * 100)])
    first = central_header_offsets(data)[0]
    data = patch(data, first + 20, "<LL", 200, 200)  # compressed and uncompressed size of archive/a
    with pytest.raises(UnsafeArchive, match="overlap"):
        check_archive(data)


@pytest.mark.parametrize(
    "data",
    [b"", b"not a zip at all", b"PK\x03\x04" + b"\x00" * 100, b"\x00" * 1000 + b"PK\x05\x06" + b"\x00" * 18],
    ids=["empty", "text", "truncated-local-header", "empty-directory-garbage"],
)
def test_garbage_is_rejected(data: bytes) -> None:
    with pytest.raises(UnsafeArchive):
        check_archive(data)


def test_a_truncated_real_zip_is_rejected() -> None:
    data = make_zip([("archive/a", b"A" * 1000), ("archive/b", b"B" * 1000)])
    with pytest.raises(UnsafeArchive):
        check_archive(data[: len(data) // 2])


# ---------------------------------------------------------------------------------------------
# real archives pass


@pytest.fixture(scope="module")
def real_archives() -> dict[str, bytes]:
    import torch

    from pt2flow.stages.serialize import program_bytes, serialize
    from tests.models import tiny_mlp

    ep = torch.export.export(tiny_mlp().eval(), (torch.randn(3, 8),))
    return {"serialized": serialize(ep, {"pt2flow": "test"}).output, "program": program_bytes(ep)}


@pytest.mark.parametrize("kind", ["serialized", "program"])
def test_real_torch_archives_pass(real_archives: dict[str, bytes], kind: str) -> None:
    summary = check_archive(real_archives[kind])
    assert summary.entries > 5
    assert summary.total_uncompressed > 0


# ---------------------------------------------------------------------------------------------
# the pipeline checks before torch loads


HOSTILE_ZIPS = {
    "dotdot": [("archive/../../evil.so", b"\x7fELF")],
    "absolute": [("/tmp/evil.so", b"\x7fELF")],
    "duplicate": [("archive/data.pkl", b"1"), ("archive/data.pkl", b"2")],
}


@pytest.mark.parametrize("name", sorted(HOSTILE_ZIPS))
@pytest.mark.parametrize("stage", ["serialize", "aot_compile", "trace"])
def test_load_artifact_refuses_an_unsafe_zip_that_the_index_vouches_for(
    tmp_path: Path, no_torch_loads: list[str], name: str, stage: str
) -> None:
    from pt2flow.flows.engine.worker.artifacts import load_artifact

    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_blob(make_zip(HOSTILE_ZIPS[name]))
    record(store, ref.digest, ref.size, stage)
    with pytest.raises(UnsafeArchive):
        load_artifact(store, ref.digest, ref.size, (stage,), "archive")
    assert no_torch_loads == []


def test_validate_task_fails_with_a_storage_error_before_torch_sees_an_unsafe_package(
    tmp_path: Path, no_torch_loads: list[str], real_archives: dict[str, bytes]
) -> None:
    from tests.security.conftest import call_validate

    store_url = str(tmp_path / "store")
    store = ArtifactStore(store_url)
    archive = store.put_blob(real_archives["serialized"])
    record(store, archive.digest, archive.size, "serialize")
    package = store.put_blob(make_zip([("package/../../../../tmp/evil.so", b"\x7fELF")]))
    record(store, package.digest, package.size, "aot_compile")
    failure = call_validate(
        store_url,
        archive={"artifact": archive.digest, "size": archive.size, "key": "s"},
        package={"artifact": package.digest, "size": package.size, "key": "c"},
    )
    assert failure["error_class"] == "storage"
    assert f"unsafe package {package.digest}: '..' component in entry name" in failure["error"]
    assert no_torch_loads == []
