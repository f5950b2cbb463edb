"""The version of the orchestrator <-> worker protocol (flows/engine/common/messages.py: the messages and the
worker's control messages). An orchestrator starts workers under another interpreter (`run
--python`) only when that interpreter's pt2flow speaks the same protocol: bump this whenever a
message changes shape. The fork server's (flows/engine/worker/forkserver.py) protocol and the lock
on its socket's name are here too, for both sides. Imports nothing but the standard library, so an
interpreter can be asked for it without torch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

WORKER_PROTOCOL = 4  # 2: the engine's modules moved into subpackages (the worker's entry point and the pickled messages' classes); 3: every message a dataclass of engine/common/messages.py; 4: workers forked from a fork server (flows/engine/worker/forkserver.py)

# the fork server's messages (flows/engine/worker/forkserver.py): part of a server's socket name,
# so a process of another pt2flow version never talks to a server lingering there
FORK_SERVER_PROTOCOL = "pt2flow-forkserver-2"


@contextlib.contextmanager
def fork_server_lock(path: str) -> Iterator[None]:
    """The lock on the fork server socket named `path`: held by a process that finds no server
    there and binds and starts one, and by a server that unlinks it as it retires or exits."""
    import fcntl

    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
