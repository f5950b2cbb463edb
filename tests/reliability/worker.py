"""Child-process entry points for the reliability tests (run as `python -m tests.reliability.worker CMD JSON`).

Each prints one JSON line on stdout describing what happened; crash points kill it outright.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback
from typing import Any


def _store(url: str) -> Any:
    from pt2flow.storage import ArtifactStore

    return ArtifactStore(url)


def multipart(args: dict[str, Any]) -> dict[str, Any]:
    """Publish one blob through the S3 multipart path (a crash point may kill us between parts)."""
    import pt2flow.storage.multipart as multipart

    multipart.MULTIPART_THRESHOLD = args["threshold"]
    multipart.MULTIPART_PART_SIZE = args["part_size"]
    data = _payload(args["seed"], args["size"])
    ref = _store(args["url"]).put_blob(data)
    return {"digest": ref.digest, "size": ref.size}


def put(args: dict[str, Any]) -> dict[str, Any]:
    """Publish one blob on a local store; named_temps forces the portable dot-named temp file
    (the path of filesystems without O_TMPFILE)."""
    import pt2flow.storage.publish as publish

    if args.get("named_temps"):
        publish.force_named_temp_files()
    ref = _store(args["url"]).put_blob(_payload(args["seed"], args["size"]))
    return {"digest": ref.digest}


def disk_full(args: dict[str, Any]) -> dict[str, Any]:
    """Publish a blob and an index file larger than RLIMIT_FSIZE (SIGXFSZ ignored, so write()
    fails with EFBIG), then a small blob under the limit, then the big one with the limit lifted."""
    from pt2flow.storage import StorageError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    store = _store(args["url"])
    big = _payload(1, args["limit"] * 3)
    out: dict[str, Any] = {}
    resource.setrlimit(resource.RLIMIT_FSIZE, (args["limit"], hard))
    for what, action in (
        ("blob", lambda: store.put_blob(big)),
        ("index", lambda: store.index.append([{"record_id": "big", "model": "m", "details": big.hex()}])),
    ):
        try:
            action()
            out[what] = {"raised": None}
        except StorageError as exc:
            out[what] = {"raised": type(exc).__name__, "message": str(exc), "is_storage_error": True}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out[what] = {"raised": type(exc).__name__, "message": str(exc), "is_storage_error": False}
    small = store.put_blob(b"fits under the limit")
    out["small"] = small.digest
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["big_after"] = store.put_blob(big).digest
    return out


def writer(args: dict[str, Any]) -> dict[str, Any]:
    """One of the concurrent writers (see test_concurrency.py)."""
    from tests.reliability.concurrency import write_load

    store = _store(args["url"])
    if args.get("go"):
        open(f"{args['go']}.ready-{args['writer']}", "w").close()
        while not os.path.exists(args["go"]):
            time.sleep(0.005)
    return write_load(store, args["writer"], args["rounds"])


def _payload(seed: int, size: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


COMMANDS = {"put": put, "multipart": multipart, "disk_full": disk_full, "writer": writer}


def main() -> None:
    command, raw = sys.argv[1], sys.argv[2]
    try:
        result = COMMANDS[command](json.loads(raw))
        print(json.dumps({"ok": True, **result}), flush=True)
    except BaseException as exc:  # noqa: BLE001
        print(
            json.dumps(
                {"ok": False, "error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
            ),
            flush=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
