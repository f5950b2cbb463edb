"""Turns on this machine's cores: a stage that times the machine (Stage.quiet, the benchmark)
runs while no other stage work of pt2flow does, on this machine, in any run.

Two lock files under the cache folder (fcntl.flock; nothing where there is no fcntl):
- `work.lock`: every stage holds it shared while it runs; a quiet stage holds it exclusively;
- `turnstile.lock`: a quiet stage holds it exclusively from before it asks for `work.lock` until
  it is done, and every other stage passes it (shared, released at once) before it asks for
  `work.lock`, so a quiet stage waiting for the running stages to finish is not passed by the
  next ones: they wait at the turnstile, then go on.

A stage waiting at the turnstile waits for the quiet stage to finish: its time counts towards
its own time limit, as any wait of a worker does. A worker that dies releases its locks (the
kernel closes its files). Where the lock files cannot be made (no fcntl, a cache folder the
worker may not write), stages run side by side, and the benchmark still measures and reports
the load of everything else (stages/timing.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO

from pt2flow.flows.engine.environment.interpreter import cache_dir


def _open(name: str) -> IO[str]:
    folder = os.path.join(cache_dir(), "turns")
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, name), "a")


@contextlib.contextmanager
def machine_turn(quiet: bool) -> Iterator[None]:
    """Within the block, this process's stage work has its turn: shared with other stage work
    (quiet False), or alone on the machine (quiet True)."""
    files = contextlib.ExitStack()
    try:
        import fcntl

        turnstile = files.enter_context(_open("turnstile.lock"))
        work = files.enter_context(_open("work.lock"))
    except (ImportError, OSError):  # no flock here, or a cache folder it cannot write: side by side
        files.close()
        yield
        return
    with files:
        if quiet:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(work, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_SH)
            fcntl.flock(work, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(work, fcntl.LOCK_UN)
            if quiet:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
