"""The suite's report of what the machine did during a run (tests/session.py: cpu_times,
host_line), read from a /proc/stat written here and from the real one."""

from __future__ import annotations

from pathlib import Path

from tests.session import cpu_times, host_line

# user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
STAT = "cpu  1000 20 300 5000 40 0 10 70 0 0\ncpu0 500 10 150 2500 20 0 5 35 0 0\nintr 1 2 3\n"


def test_cpu_times_reads_the_machines_line(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert cpu_times(str(stat)) == {
        "user": 1000,
        "nice": 20,
        "system": 300,
        "idle": 5000,
        "iowait": 40,
        "irq": 0,
        "softirq": 10,
        "steal": 70,
    }
    stat.write_text("intr 1 2 3\n")
    assert cpu_times(str(stat)) is None
    assert cpu_times(str(tmp_path / "missing")) is None
    real = cpu_times()
    if Path("/proc/stat").exists():  # Linux: this machine's counters only grow
        assert real is not None and set(real) >= {"user", "idle", "steal"}
        assert all(later >= earlier for later, earlier in zip(cpu_times().values(), real.values()))  # type: ignore[union-attr]


def test_host_line_splits_the_time_into_busy_idle_and_steal() -> None:
    before = {"user": 100, "nice": 0, "system": 50, "idle": 1000, "iowait": 0, "irq": 0, "softirq": 0, "steal": 0}
    # 10 s of CPU time on 2 cores: 5 s of wall; 8 CPU-s busy (user 6, system 1, softirq 1), 1 idle (half of it iowait), 1 steal
    after = {"user": 700, "nice": 0, "system": 150, "idle": 1050, "iowait": 50, "irq": 0, "softirq": 100, "steal": 100}
    assert host_line(before, after, cores=2, ticks=100) == (
        "host: 2 cores for 5 s: busy 8 CPU-s (80 %), idle 1 (10 %), steal 1 (10 %: the VM's host running other work)"
    )
    assert host_line(after, after, cores=2, ticks=100) == "host: 2 cores, no CPU time passed"
