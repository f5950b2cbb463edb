"""Run leases: <store>/leases/<run_id>.json, held by a run from before it reads the index until
its last record is written, renewed by a background thread. Retention (storage/retention.py)
drops records and their blobs only while no live lease exists, so a run never loses a record it
planned to reuse or a blob it found already stored (docs/architecture.md §5, "Retention").

A lease is live while it was renewed within its time to live (`ttl_seconds`, written in it); one
left by a run that was killed expires by itself, sooner on its own host where its process is
seen gone. Knows fsspec only (through the store's filesystem).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any

from pt2flow.storage.errors import StorageError
from pt2flow.storage.publish import atomic_write, remove_file

LEASE_DIR = "leases"
LEASE_TTL_SECONDS = 600.0  # a lease not renewed for this long belongs to a dead run
RENEW_SECONDS = 30.0


@dataclass(frozen=True)
class LeaseInfo:
    """A run's lease as another process reads it."""

    run_id: str
    host: str
    pid: int
    renewed_at: datetime
    ttl_seconds: float
    live: bool


def lease_root(store: Any) -> str:
    return f"{store.root}/{LEASE_DIR}"


def _lease_path(store: Any, run_id: str) -> str:
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise StorageError(f"{run_id!r} cannot name a run lease")
    return f"{lease_root(store)}/{run_id}.json"


class RunLease:
    """`with RunLease(store, run_id):` holds the run's lease for the block, renewing it every
    `renew_seconds`; the lease file is removed on exit (a failure to remove it only lets it
    expire). Writing it fails loudly (StorageError): a run that cannot announce itself must not
    start behind a retention's back."""

    def __init__(
        self, store: Any, run_id: str, *, ttl_seconds: float = LEASE_TTL_SECONDS, renew_seconds: float = RENEW_SECONDS
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.path = _lease_path(store, run_id)
        self.ttl_seconds = ttl_seconds
        self.renew_seconds = renew_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        body = {
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "renewed_at": datetime.now(UTC).isoformat(),
            "ttl_seconds": self.ttl_seconds,
        }
        data = json.dumps(body, sort_keys=True).encode()
        try:
            self.store.retry.call(
                "lease", lambda: atomic_write(self.store.fs, self.path, data, exclusive=False, kind="lease")
            )
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"cannot write run lease {self.path}: {type(exc).__name__}: {exc}") from exc

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_seconds):
            try:
                self._write()
            except StorageError:
                pass  # tried again at the next tick; a lease that lapses only makes a gc wait less

    def __enter__(self) -> RunLease:
        self._write()
        self._thread = threading.Thread(target=self._renew, name=f"pt2flow-lease-{self.run_id}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            remove_file(self.store.fs, self.path)
        except Exception:  # noqa: BLE001 - it expires after ttl_seconds
            pass


def _alive_here(host: str, pid: int) -> bool:
    """False only when the lease was written on this host by a process that no longer exists."""
    if host != socket.gethostname() or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def read_leases(store: Any, *, now: datetime | None = None) -> list[LeaseInfo]:
    """Every lease in the store, live or not, by run id."""
    root = lease_root(store)
    now = now or datetime.now(UTC)
    try:
        store.fs.invalidate_cache(root)
        if not store.fs.exists(root):
            return []
        names = sorted(store.fs.ls(root, detail=False))
    except Exception as exc:
        raise StorageError(f"cannot list run leases under {root}: {type(exc).__name__}: {exc}") from exc
    found = []
    for path in names:
        if not path.endswith(".json"):
            continue
        try:
            body = json.loads(store.fs.cat_file(path))
            renewed = datetime.fromisoformat(body["renewed_at"])
            ttl = float(body.get("ttl_seconds") or LEASE_TTL_SECONDS)
            host, pid = str(body.get("host") or ""), int(body.get("pid") or 0)
        except FileNotFoundError:
            continue  # its run ended meanwhile
        except (ValueError, KeyError, TypeError):
            # unreadable (a writer from elsewhere mid-write on a backend without atomic writes): live
            found.append(LeaseInfo(path.rsplit("/", 1)[-1][: -len(".json")], "?", 0, now, LEASE_TTL_SECONDS, True))
            continue
        except Exception as exc:
            raise StorageError(f"cannot read run lease {path}: {type(exc).__name__}: {exc}") from exc
        live = (now - renewed).total_seconds() < ttl and _alive_here(host, pid)
        found.append(LeaseInfo(str(body.get("run_id")), host, pid, renewed, ttl, live))
    return found


def live_leases(
    store: Any, *, exclude: frozenset[str] | set[str] = frozenset(), now: datetime | None = None
) -> list[LeaseInfo]:
    """The leases of runs that may be running now (other than `exclude`)."""
    return [lease for lease in read_leases(store, now=now) if lease.live and lease.run_id not in exclude]
