"""How the benchmark stage times a call and watches the machine while it does (stages/benchmark.py).

time_calls: warm-up calls for at least `warmup` calls and `warmup_s` seconds, then timed samples
(a sample: one call, or a batch of calls lasting at least SAMPLE_MIN_S when a call takes
microseconds; its time per call) with the garbage collector off, until the median of the samples
taken at full speed moves by less than `stable_fraction` over the last `window` and they have
gone on for `min_seconds` (at least `min_runs`, at most `max_runs` and `max_seconds`): a Timing,
whose spread and drift say whether it can be trusted. Canary: the machine's own speed beside
each sample (a sample counts only when it was full). PeakMemory: the resident memory a block
adds. OtherWork and wait_for_quiet: the cores the rest of the machine keeps busy (Linux
/proc/stat).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from pt2flow.stages.options import BenchmarkOptions


@dataclass(frozen=True)
class Timing:
    """The timed samples of one artifact at one size (milliseconds per call, in call order) and,
    when a Canary watched them, how much slower than its fastest the machine ran beside each
    (`slowed`: 1.0 is full speed). Its figures are those of the samples taken at full speed
    (`kept`: slowed at most `full_speed`); every sample's when none was watched."""

    times_ms: tuple[float, ...]
    stable: bool
    slowed: tuple[float, ...] = ()
    full_speed: float = math.inf

    @property
    def kept(self) -> tuple[float, ...]:
        """The samples the figures are of: those taken at full speed (all, if none was)."""
        if not self.slowed:
            return self.times_ms
        kept = tuple(t for t, s in zip(self.times_ms, self.slowed) if s <= self.full_speed)
        return kept or self.times_ms

    @property
    def slow_samples(self) -> int:
        """Samples left out: taken while the machine ran below full speed."""
        return sum(s > self.full_speed for s in self.slowed)

    @property
    def p50(self) -> float:
        return percentile(self.kept, 50)

    @property
    def p90(self) -> float:
        return percentile(self.kept, 90)

    @property
    def spread(self) -> float | None:
        """p90 / p50 (None when the p50 is 0)."""
        return self.p90 / self.p50 if self.p50 > 0 else None

    @property
    def drift(self) -> float | None:
        """How far apart the medians of the first and the second half of the samples are, as a
        fraction of the median of all (None under 4 samples)."""
        kept = self.kept
        if len(kept) < 4:
            return None
        half = len(kept) // 2
        first, second = statistics.median(kept[:half]), statistics.median(kept[half:])
        median = statistics.median(kept)
        return abs(first - second) / median if median > 0 else None

    def noise(self, options: BenchmarkOptions) -> str | None:
        """Why this measurement cannot be trusted (too few samples at full speed, its own spread
        or drift), else None."""
        slow = self.slow_samples
        if slow and len(self.times_ms) - slow < options.min_runs:
            return (
                f"{slow} of {len(self.times_ms)} samples taken below full speed "
                f"(the canary past {self.full_speed:g}x its fastest; max_slowdown {options.max_slowdown:g})"
            )
        if self.spread is not None and self.spread > options.max_spread:
            return f"p90 {self.spread:.1f}x p50 (max_spread {options.max_spread:g})"
        if self.drift is not None and self.drift > options.max_drift:
            return f"first and second half {self.drift:.0%} apart (max_drift {options.max_drift:g})"
        return None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values`, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def time_calls(
    call: Callable[[], Any],
    options: BenchmarkOptions,
    clock: Callable[[], float] = time.perf_counter,
    canary: Canary | None = None,
) -> Timing:
    """Warm up, then time `call` until the median is stable (see the module's docstring); with a
    canary (and options.max_slowdown set), the canary is timed between samples, and a sample
    counts only when the canary before and after it ran within max_slowdown of its fastest."""
    warm_from = clock()
    warm_until = warm_from + options.warmup_s
    calls = 0
    while calls < options.warmup or (calls and clock() < warm_until):
        call()
        calls += 1
    # a call of microseconds is timed in batches of `number` calls, each batch at least
    # SAMPLE_MIN_S (as timeit does): one call alone is mostly the clock's own jitter
    per_call = (clock() - warm_from) / calls if calls else 0.0
    number = max(1, min(MAX_BATCH, math.ceil(SAMPLE_MIN_S / per_call))) if per_call > 0 else 1
    watch = canary if options.max_slowdown is not None else None
    full_speed = 1.0 + options.max_slowdown if options.max_slowdown is not None else math.inf
    times: list[float] = []
    beside: list[float] = []  # per sample: the slower of the canaries before and after it (s)
    kept: list[float] = []
    medians: list[float] = []
    started = clock()
    deadline = started + options.max_seconds
    stable = False
    with _no_gc():
        before = watch() if watch else 0.0
        while len(kept) < options.max_runs:
            start = clock()
            for _ in range(number):
                call()
            end = clock()
            times.append((end - start) * 1000.0 / number)
            if watch:
                after = watch()
                beside.append(max(before, after))
                before = after
            # a sample taken while the machine ran slow is not this artifact's speed
            if not watch or beside[-1] <= full_speed * watch.fastest:
                kept.append(times[-1])
                medians.append(statistics.median(kept))
                if len(kept) >= options.min_runs and len(medians) > options.window:
                    before_median, now = medians[-1 - options.window], medians[-1]
                    stable = abs(now - before_median) <= options.stable_fraction * now
                    # a stable median of a few milliseconds of calls is one moment of a shared VM
                    # (its slow stretches last hundreds of them): the calls go on for min_seconds
                    if stable and end - started >= options.min_seconds:
                        break
            if end >= deadline:
                break
    if not watch:
        return Timing(tuple(times), stable)
    # against the fastest canary of the whole measurement (and of the benchmark before it)
    fastest = watch.fastest
    slowed = tuple(b / fastest if fastest > 0 else 1.0 for b in beside)
    return Timing(tuple(times), stable, slowed, full_speed)


SAMPLE_MIN_S = 0.001  # one timed sample lasts at least this long (a batch of short calls)
MAX_BATCH = 10000


class Canary:
    """How fast this machine runs at a moment: a fixed piece of work (`work`, the sum of
    range(500) unless given), timed twice, the faster kept (a single run can take a timer interrupt). Its
    cost never changes, so its time says how fast the CPU gave this process its cycles then;
    `fastest` is the lowest it has taken since this Canary was made (one per benchmark).

    Why (docs/benchmarks.md, twenty-ninth session): on this project's shared 2-core VMs the host
    runs a process at full speed or 1.5-2.4x slower, in stretches of 0.1 s to several seconds,
    with nothing else running in the VM and no steal time: /proc/stat does not see it, and a
    measurement that lies inside a slow stretch has a clean spread and drift. Samples taken
    while a canary beside them ran within 25 % of its fastest gave p50s that two fresh processes
    reproduced within 20 % at 71 of 72 (artifact, size) pairs in an hour when a median 11 % of
    the calls ran at full speed; all samples, at 37 of 72."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, work: Callable[[], Any] | None = None) -> None:
        self.clock = clock
        self.work = work or _spin
        self.fastest = math.inf

    def __call__(self) -> float:
        """Time the work (seconds, the faster of two runs), and remember the fastest."""
        best = math.inf
        for _ in range(2):
            start = self.clock()
            self.work()
            best = min(best, self.clock() - start)
        self.fastest = min(self.fastest, best)
        return best


def _spin() -> int:
    """The canary's work: the sum of range(500), a loop in the interpreter's C code, about 4.7 µs
    at full speed here. Not a loop in bytecode: 300 additions in a Python `for` loop ran slower
    after an exported program's calls (torch's dispatcher, in Python) than after ONNX Runtime's,
    interleaved, in the same seconds (full speed 7 % of the time against 21 %), and left out
    most of the program's samples; this loop ran at full speed as often after either (23 % and
    24 %: docs/benchmarks.md, twenty-ninth session)."""
    return sum(range(500))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The timed calls run with Python's garbage collector off, after a collection (as timeit
    does): a worker holds many objects, and a collection inside a call of microseconds is what
    its timing would measure."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class PeakMemory:
    """The peak resident memory a block adds, in MiB: Linux's high-water mark (VmHWM) reset
    through /proc/self/clear_refs before it, read after it; None where that is not possible."""

    def __enter__(self) -> PeakMemory:
        self.start = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
        except OSError:
            self.start = None
        self.peak_mb: float | None = None
        return self

    def __exit__(self, *exc: Any) -> None:
        peak = _status_kib("VmHWM")
        if self.start is not None and peak is not None:
            self.peak_mb = max(0.0, (peak - self.start) / 1024.0)


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


# below this, /proc/stat's clock ticks (10 ms) make a load figure meaningless
LOAD_WINDOW_S = 0.2
QUIET_SAMPLE_S = 0.25


def machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has used since boot (Linux /proc/stat: user,
    nice, system, irq, softirq; None where there is no such file)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        ticks = [int(v) for v in fields[1:8]]
        user, nice, system, _idle, _iowait, irq, softirq = ticks
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class OtherWork:
    """The cores that processes other than this one kept busy during a block: the machine's CPU
    time less this process's (all its threads), over the block's wall time. `cores` is None where
    the machine's CPU time is unknown or the block was shorter than LOAD_WINDOW_S."""

    def __enter__(self) -> OtherWork:
        self.cores: float | None = None
        self._start = (time.perf_counter(), machine_busy_s(), time.process_time())
        return self

    def __exit__(self, *exc: Any) -> None:
        wall0, busy0, own0 = self._start
        seconds = time.perf_counter() - wall0
        busy = machine_busy_s()
        if busy0 is None or busy is None or seconds < LOAD_WINDOW_S:
            return
        self.cores = max(0.0, (busy - busy0 - (time.process_time() - own0)) / seconds)


def wait_for_quiet(options: BenchmarkOptions) -> dict[str, Any]:
    """Sample the other work on the machine (QUIET_SAMPLE_S at a time) until it uses at most
    `max_load` cores, for at most `quiet_wait_s`: the seconds waited and the last sample's load."""
    started = time.perf_counter()
    while True:
        with OtherWork() as other:
            time.sleep(QUIET_SAMPLE_S)
        waited = time.perf_counter() - started
        if other.cores is None or other.cores <= options.max_load or waited >= options.quiet_wait_s:
            return {"waited_s": round(waited, 3), "before": rounded(other.cores)}


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
