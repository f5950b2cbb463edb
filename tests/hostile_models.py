"""Models that take their worker process down, each the way a real failure would: a segfault in
native code, a hard exit, a hang, a runaway allocation. They misbehave only when called (during
trace), so a fleet's healthy models before and after them show that nothing else is affected."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import torch
from torch import nn


class _Misbehaving(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def misbehave(self) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.misbehave()
        return self.fc(x)


class Segfault(_Misbehaving):
    def misbehave(self) -> None:
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crashing kernel or compiler would


class HardExit(_Misbehaving):
    def misbehave(self) -> None:
        os._exit(3)  # no cleanup, no exception: the process is just gone


class Hang(_Misbehaving):
    def misbehave(self) -> None:
        while True:  # a forward that never returns (a stuck compile looks the same from outside)
            time.sleep(1)


class AnnouncedHang(Hang):
    """Hangs as Hang does, after creating the file named by $PT2FLOW_TEST_HANG_MARKER: a test
    then knows the model is inside its worker, not still on its way there."""

    def misbehave(self) -> None:
        marker = os.environ.get("PT2FLOW_TEST_HANG_MARKER")
        if marker:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
        super().misbehave()


class AnnouncedPause(nn.Module):
    """A healthy model whose forward first creates the file named by $PT2FLOW_TEST_PAUSE_MARKER
    (holding its process id and its orchestrator's: a worker's command line is `... FD PARENT`,
    a forked one's as if it were) and sleeps 4 s: a test can kill the Dask worker under it meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marker = os.environ.get("PT2FLOW_TEST_PAUSE_MARKER")
        if marker and not torch.compiler.is_compiling():
            with open(marker, "w") as f:
                f.write(f"{os.getpid()} {sys.argv[2]}")
            time.sleep(4)
        return self.fc(x)


class AnnouncedSlowTrace(nn.Module):
    """A healthy model that, while $PT2FLOW_TEST_SLOW_MARKER names a file not yet there, creates
    it (holding its process id) when traced and then sleeps 120 s: a test interrupts the run
    meanwhile. Without the variable (the next run) it is as quick as any."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marker = os.environ.get("PT2FLOW_TEST_SLOW_MARKER")
        if marker and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
        return self.fc(x)


class MemoryHog(_Misbehaving):
    def misbehave(self) -> None:
        hoard = []
        for _ in range(128):  # up to 8 GiB, touched page by page, 64 MiB at a time
            hoard.append(b"\x01" * (64 << 20))
            time.sleep(0.01)
        while True:
            time.sleep(1)


def segfault() -> nn.Module:
    return Segfault()


def hard_exit() -> nn.Module:
    return HardExit()


def hang() -> nn.Module:
    return Hang()


def announced_hang() -> nn.Module:
    return AnnouncedHang()


def announced_pause() -> nn.Module:
    return AnnouncedPause()


def announced_slow_trace() -> nn.Module:
    return AnnouncedSlowTrace()


def memory_hog() -> nn.Module:
    return MemoryHog()
