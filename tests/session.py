"""The suite's own plumbing, loaded by tests/conftest.py (pytest and pytest-xdist hooks):

- one TORCHINDUCTOR_CACHE_DIR per test session, shared by the xdist workers and every process
  they start: a program compiled by one test is not compiled from scratch by the next, and no
  earlier session's kernels are reused (tests that must compile cold set their own);
- under `--dist loadgroup` (`make test`), every test of a group runs in one worker: a test's
  group is its file, or the fleet it reads (tests/fleets.py `group_of`), so a file's module-scoped
  fixtures and a session's fleet are each built once. xdist's own loadgroup (3.8) groups by
  `pytest.mark.xdist_group`, which it writes into the test's nodeid: pytest 9.2 no longer lets it,
  and every test became a group of its own (each worker built every fleet and module fixture).
  This scheduler asks `group_of` instead. The fleets' groups are sent first, as they are the
  longest, then the other groups with end-to-end tests, then the fast tier's;
- after every run, where the time went: each tier (fast, integration, compile: the markers of
  pyproject.toml) and the slowest files, summed over setup, call and teardown (`.ci/run` shows
  it for every landing, beside pytest's --durations);
- the reliability figures (tests/reliability/stats.py), gathered from every xdist worker;
- what the machine did meanwhile (/proc/stat, Linux): its busy and idle CPU and the time its VM's
  host gave to other work (`steal`); the same suite took 33 and 55 minutes on this project's
  machines, and the steal says which runs the host slowed;
- the objects a test process has kept once a file's tests have run (the modules it imported, the
  session's fixtures) are frozen out of Python's cyclic garbage collector (`gc.freeze()`, as
  flows/engine/common/heap.py does for a worker), after a collection that frees what that file
  left: a process that has imported torch, transformers, ExecuTorch, OpenVINO and ONNX Runtime holds
  about a million objects, and every full collection walked them all. In one process over the
  fast tier's tests/flows and tests/stages, 51 full collections took 25.9 s of 153 s; with the
  freezes 5.4 s of 132 s;
- an xdist worker runs without the COLUMNS/LINES xdist sets (a plain pytest run has none);
- under two or more xdist workers, a run given no --workers starts one worker process
  (PT2FLOW_WORKERS=1, unless it is set already): the xdist workers already take every core, and a
  second torch worker per run only adds its start (its torch import, its Inductor compile pool:
  8-10 s of CPU for a run with three AOTInductor compiles, 2.4 s for one without). A test of how
  many workers a run starts gives --workers, or the variable, itself.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections import defaultdict
from typing import Any
from collections.abc import Iterator

import pytest

from tests.fleets import group_of
from tests.reliability import stats

TIERS = ("fast", "integration", "compile")
FILES_SHOWN = 25
FIRST_GROUP_PREFIX = "fleet:"  # tests/fleets.py's groups: sent to the workers before any other
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
WORKERS = "PT2FLOW_WORKERS"  # flows/engine/orchestrator/pool.py default_workers


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_xdist_worker(config):
        # xdist gives its workers the controller's terminal size (COLUMNS=80), which no plain
        # pytest run has: the commands the tests start would wrap their tables at 80 columns
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)
        return
    config.stash[_HOST_KEY] = cpu_times()  # the controller's (or a plain run's) reading at the start
    xdist_workers = str(config.getoption("numprocesses", None) or 0)
    if xdist_workers.isdigit() and int(xdist_workers) >= 2:
        os.environ.setdefault(WORKERS, "1")  # inherited by the xdist workers and everything they start
    if os.environ.get(INDUCTOR_CACHE):
        return
    folder = tempfile.mkdtemp(prefix="pt2flow-tests-inductor-")
    os.environ[INDUCTOR_CACHE] = folder
    config.stash[_INDUCTOR_KEY] = folder


_INDUCTOR_KEY = pytest.StashKey[str]()
_HOST_KEY = pytest.StashKey["dict[str, int] | None"]()
CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: str = "/proc/stat") -> dict[str, int] | None:
    """The machine's CPU time per state since boot, in clock ticks: the first line of /proc/stat
    (None where there is none: not Linux)."""
    try:
        with open(stat) as file:
            fields = file.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return dict(zip(CPU_STATES, (int(x) for x in fields[1 : 1 + len(CPU_STATES)])))


def host_line(before: dict[str, int], after: dict[str, int], cores: int, ticks: int) -> str:
    """One line on what every core of the machine did between two cpu_times readings."""
    spent = {state: (after.get(state, 0) - before.get(state, 0)) / ticks for state in CPU_STATES}
    busy = spent["user"] + spent["nice"] + spent["system"] + spent["irq"] + spent["softirq"]
    idle = spent["idle"] + spent["iowait"]
    total = busy + idle + spent["steal"]
    if total <= 0:
        return f"host: {cores} cores, no CPU time passed"
    return (
        f"host: {cores} cores for {total / cores:.0f} s: busy {busy:.0f} CPU-s ({100 * busy / total:.0f} %), "
        f"idle {idle:.0f} ({100 * idle / total:.0f} %), steal {spent['steal']:.0f} "
        f"({100 * spent['steal'] / total:.0f} %: the VM's host running other work)"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_INDUCTOR_KEY, None)
    if folder:
        os.environ.pop(INDUCTOR_CACHE, None)
        shutil.rmtree(folder, ignore_errors=True)


def grouped(config: pytest.Config) -> bool:
    """Whether this session sends tests in groups (`--dist loadgroup`): on xdist's controller its
    option says so; a worker's `dist` is "no" and its `loadgroup` flag says so instead."""
    return config.getoption("dist", "no") == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a file: the objects the process keeps, frozen (this module's docstring)."""
    yield
    if nextitem is None or nextitem.module is not getattr(item, "module", None):
        gc.collect()  # what this file's tests and module fixtures left
        gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not grouped(config):  # (the workers' collection order is the order the groups are sent in)
        return
    # the longest work first, so that neither worker is left with a long group at the end: the
    # fleets' groups, then every group with an end-to-end test, then the fast tier's, each in
    # collection order (the scheduler keeps this order)
    slow = {
        group_of(item.nodeid)
        for item in items
        if item.get_closest_marker("integration") or item.get_closest_marker("compile")
    }

    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        return 0 if group.startswith(FIRST_GROUP_PREFIX) else 1 if group in slow else 2

    items.sort(key=rank)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's controller: `--dist loadgroup` as tests/fleets.py `group_of` groups the tests."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # the workers' collection order is the order to send
    return GroupScheduling(config, log)


def tier_of(keywords: Any) -> str:
    """compile outranks integration: a compile test is in the compile tier whatever else it is."""
    if "compile" in keywords:
        return "compile"
    return "integration" if "integration" in keywords else "fast"


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # an xdist worker: its figures go to the controller
        output["reliability"] = stats.as_json()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller, as each worker ends: add its reliability figures to the session's."""
    figures = getattr(node, "workeroutput", {}).get("reliability")
    if figures:
        stats.merge(figures)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _time_per_tier(terminalreporter)
    _host(terminalreporter)
    _reliability(terminalreporter)


def _host(terminalreporter: Any) -> None:
    before, after = terminalreporter.config.stash.get(_HOST_KEY, None), cpu_times()
    if before is None or after is None:
        return
    terminalreporter.write_line("")
    terminalreporter.write_line(host_line(before, after, os.cpu_count() or 1, os.sysconf("SC_CLK_TCK")))


def _time_per_tier(terminalreporter: Any) -> None:
    tiers: dict[str, float] = defaultdict(float)
    counts: dict[str, set[str]] = defaultdict(set)
    files: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            tier = tier_of(report.keywords)
            tiers[tier] += report.duration
            counts[tier].add(report.nodeid)
            files[report.nodeid.split("::", 1)[0]] += report.duration
    if not tiers:
        return
    write = terminalreporter.write_line
    terminalreporter.section(
        "time per tier and per file (setup + call + teardown; under xdist, summed over the workers)"
    )
    for tier in TIERS:
        if counts[tier]:
            write(f"{tier:<12} {len(counts[tier]):>5} tests {tiers[tier]:>9.1f} s")
    write(f"{'total':<12} {sum(len(c) for c in counts.values()):>5} tests {sum(tiers.values()):>9.1f} s")
    write("")
    for path, seconds in sorted(files.items(), key=lambda item: -item[1])[:FILES_SHOWN]:
        write(f"{seconds:>9.1f} s  {path}")


def _reliability(terminalreporter: Any) -> None:
    if not (stats.crash_points_tested or stats.faults_injected or stats.records_checked):
        return
    from pt2flow.storage.faults import CRASH_POINTS

    terminalreporter.write_sep("-", "reliability")
    terminalreporter.write_line(
        f"crash points tested: {len(stats.crash_points_tested)} of {len(CRASH_POINTS)} "
        f"({', '.join(p for p in CRASH_POINTS if p in stats.crash_points_tested)})"
    )
    terminalreporter.write_line(f"faults injected: {stats.faults_injected}")
    terminalreporter.write_line(f"index records checked: {stats.records_checked}; records lost: {stats.records_lost}")
