"""Loading artifacts for torch: only what the index vouches for, verified, zip-checked."""

from __future__ import annotations

from typing import Any

# artifacts this process published itself, (store URL, digest) -> stage (a worker's own
# outputs, handed to the model's next stages): the index vouches for what other processes wrote;
# for these, the process that computed the digest does
_OWN: dict[tuple[str, str], str] = {}


def vouch(store: Any, digest: str, stage: str) -> None:
    """Record that this process published `digest` into `store` as `stage`'s output."""
    _OWN[(store.url, digest)] = stage


def load_artifact(
    store: Any, digest: str, size: int | None, stages: tuple[str, ...], what: str, *, zipped: bool | None = True
) -> bytes:
    """The bytes of an artifact about to go to a loader: only a digest the index records as an
    ok output of one of `stages`, read with its size and sha256 verified; a zip artifact
    (program, .pt2 archive, AOTInductor package) also passes the zip safety check
    (storage.safety) before torch opens it; zipped=None: checked if it is a zip (an ONNX model
    with external data). A digest this process published as one of `stages` (vouch) needs no
    index query: the blob is still read with its size and sha256 verified."""
    import pyarrow.compute as pc

    from pt2flow.storage.errors import RecordNotFound
    from pt2flow.storage.safety import check_archive

    if size is None or _OWN.get((store.url, digest)) not in stages:
        condition = (pc.field("sha256") == digest) & (pc.field("status") == "ok") & pc.field("stage").isin(list(stages))
        rows = store.index.read(["size"], filter=condition).to_pylist()
        if not rows:
            raise RecordNotFound(
                f"{what} {digest} has no ok {'/'.join(stages)} record in the index of {store.url}: not loading it"
            )
        size = size if size is not None else rows[0]["size"]
    data = store.get_blob(digest, size, remove_corrupt=True)
    if zipped or (zipped is None and data[:4] == b"PK\x03\x04"):
        check_archive(data, what=f"{what} {digest}")
    return data
