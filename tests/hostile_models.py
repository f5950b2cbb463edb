"""Models that take their worker process down, each the way a real failure would: a segfault in
native code, a hard exit, a hang, a runaway allocation. They misbehave only when called (during
trace), so a fleet's healthy models before and after them show that nothing else is affected."""

from __future__ import annotations

import ctypes
import os
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


def memory_hog() -> nn.Module:
    return MemoryHog()
