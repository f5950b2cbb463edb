"""The worker's process tree, as the memory limit sums it (flows/engine/orchestrator/supervisor.py
process_tree): every process under a real one, read from /proc, equal to psutil's own walk,
including a grandchild started by a thread other than the main one (the kernel lists a child
under the thread that forked it) and not a child that has exited."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from pt2flow.flows.engine.orchestrator.supervisor import process_tree

# a process that starts one child from its main thread and one from a second thread (which lives
# on), each child a shell with a child of its own; it prints READY when all are started
TREE = textwrap.dedent(
    """
    import subprocess, sys, threading
    children = [subprocess.Popen(["bash", "-c", "sleep 60 & wait"])]
    started, forever = threading.Event(), threading.Event()
    def second_thread():  # it stays alive: a thread's children move to another thread when it ends
        children.append(subprocess.Popen(["bash", "-c", "sleep 60 & wait"]))
        started.set()
        forever.wait()
    threading.Thread(target=second_thread, daemon=True).start()
    started.wait()
    short = subprocess.Popen(["true"]); short.wait()
    print("READY", flush=True)
    sys.stdin.read()
    """
)


def _psutil_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return sorted([pid, *(child.pid for child in root.children(recursive=True))])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/task/TID/children is Linux's")
def test_the_tree_is_every_process_under_the_worker_as_psutil_walks_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + 30
        while len(_psutil_tree(proc.pid)) < 5 and time.monotonic() < deadline:  # the shells start their sleeps
            time.sleep(0.05)
        expected = _psutil_tree(proc.pid)
        assert len(expected) == 5, expected  # the process, two shells, two sleeps (the exited `true` is not there)
        tree = process_tree(proc.pid)
        assert tree is not None and tree[0] == proc.pid and sorted(tree) == expected
    finally:
        for pid in reversed(_psutil_tree(proc.pid)):
            psutil.Process(pid).kill()
        proc.wait()
    assert process_tree(proc.pid) == [proc.pid]  # a process that is gone: itself alone, nothing read
