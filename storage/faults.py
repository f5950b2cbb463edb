"""Named crash and fault points for the crash-consistency and retry tests.

Inert unless PT2FLOW_CRASH_AT or PT2FLOW_FAULT_AT names a point (see CRASH_POINTS).
"""

from __future__ import annotations

import os
import signal

from pt2flow.storage.errors import TransientStorageError

# Every named point in the publish, index, compaction and gc paths. PT2FLOW_CRASH_AT=<point>
# SIGKILLs the process there (no cleanup, no finally blocks, no atexit); <point>@N waits for the
# Nth time this process reaches it. PT2FLOW_FAULT_AT=<point>[@N] raises a TransientStorageError
# there instead, once per process (what a retried Prefect task must survive). With
# PT2FLOW_CRASH_ONCE=<file>, only the first process to reach the armed point dies (it creates
# the file): a replacement worker process, counting from zero again, does not.
CRASH_POINTS: tuple[str, ...] = (
    "mid_blob_write",  # local: half of a blob's bytes are in its (unnamed) temp file
    "before_blob_publish",  # local: a blob's bytes are complete and fsynced, not yet linked at their name
    "after_blob_upload",  # a blob is published; the record that points to it is not written
    "before_index_append",  # an index file is serialized in memory; nothing written
    "mid_index_write",  # local: half of an index file's bytes are in its temp file
    "before_index_publish",  # local: an index file is complete and fsynced, not yet linked
    "after_index_append",  # an index file is published; its writer has not returned
    "mid_compaction",  # the merged index file (and its sidecar) is written; no small file deleted
    "mid_compaction_delete",  # some of the merged small index files are deleted, not all
    "mid_gc",  # gc deleted some unreferenced blobs, not all
    "mid_multipart_upload",  # S3: some parts of a multipart upload are sent; it is not completed
)

# Points outside storage that use the same switches: "before_compat_check" (a check-compat
# worker, flows/engine/worker/process.py, as it starts checking an artifact: a loader that crashes).

_hits: dict[str, int] = {}
_faults_fired: set[str] = set()


def _armed(variable: str, name: str) -> str | None:
    """The spec of `variable` if it names this point and this hit is the one it waits for."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    point, _, nth = spec.partition("@")
    if point != name or not (nth.isdigit() or nth == ""):
        return None
    count = _hits.get(f"{variable}:{name}", 0) + 1
    _hits[f"{variable}:{name}"] = count
    return spec if count == (int(nth) if nth else 1) else None


def crash_point(name: str) -> None:
    """Die here, without cleanup, when PT2FLOW_CRASH_AT arms this point; raise a transient
    storage error here, once, when PT2FLOW_FAULT_AT does."""
    if _armed("PT2FLOW_CRASH_AT", name) and _first_crash():
        os.kill(os.getpid(), signal.SIGKILL)
    spec = _armed("PT2FLOW_FAULT_AT", name)
    if spec and spec not in _faults_fired:
        _faults_fired.add(spec)
        raise TransientStorageError(f"injected transient fault at {name} (PT2FLOW_FAULT_AT={spec})")


def _first_crash() -> bool:
    marker = os.environ.get("PT2FLOW_CRASH_ONCE")
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def reset_points() -> None:
    """Forget how often each point was reached (tests that arm points in-process)."""
    _hits.clear()
    _faults_fired.clear()
