"""The load one concurrent writer puts on a store (a thread or a process runs write_load)."""

from __future__ import annotations

from typing import Any

SHARED_BLOBS = 3  # every writer publishes these same blobs
OWN_BLOBS = 2  # and these of its own


def shared_payload(i: int) -> bytes:
    return (f"shared blob {i} ".encode() * 40_000)[: 300_000 + i]


def own_payload(writer: str, i: int) -> bytes:
    return (f"writer {writer} blob {i} ".encode() * 20_000)[: 200_000 + i]


def record_id(writer: str, round_: int) -> str:
    return f"{writer}-r{round_:03d}"


def write_load(store: Any, writer: str, rounds: int) -> dict[str, Any]:
    """`rounds` index appends (one record each, pointing to a blob) interleaved with publishing
    the shared and own blobs; every blob is read back and verified right after publishing."""
    published: dict[str, int] = {}
    blobs = [shared_payload(i) for i in range(SHARED_BLOBS)] + [own_payload(writer, i) for i in range(OWN_BLOBS)]
    for round_ in range(rounds):
        data = blobs[round_ % len(blobs)]
        ref = store.put_blob(data)
        assert store.get_blob(ref.digest, ref.size) == data  # verified read, right after publishing
        published[ref.digest] = ref.size
        store.index.append(
            [
                {
                    "record_id": record_id(writer, round_),
                    "run_id": writer,
                    "model": writer,
                    "stage": "trace",
                    "status": "ok",
                    "sha256": ref.digest,
                    "size": ref.size,
                }
            ]
        )
    return {"writer": writer, "published": published}
