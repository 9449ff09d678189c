"""A process's path to its first new step, in named parts (issue 52: what a replacement node pays
at every preemption before it trains again).

Each process keeps one clock (`clock()`), whose origin is the process's own start as the kernel
recorded it, so the interpreter's start and the imports count too. A part is an interval on the
wall clock (`time.time()`): the supervisor and the trainer are two processes, and parts that
overlap (the trainer loading its model while the supervisor fetches the checkpoint) are shown as
they ran, each with its start and its length, never summed into the total. The trainer sends its
parts in its `Started` event; the supervisor merges them with its own and records the whole path
(runner.supervisor.startup). Stdlib only: the trainer imports it before torch.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator, TypedDict


class Part(TypedDict):
    part: str        # what ran (see runner.supervisor.startup.PARTS for the names)
    start: float     # wall clock (time.time()) when it began
    end: float       # ... and when it ended


def process_start() -> float:
    """When this process started, on the wall clock: the kernel's start time (Linux's
    /proc/self/stat, field 22, in clock ticks since boot) against the boot time. Elsewhere (no
    /proc) the time of the first call, so the interpreter's start and the first imports go
    uncounted there."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])     # after "pid (comm)": field 3 is index 0
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    """The parts of one process's start, as intervals from `origin` (its start)."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_start() if origin is None else origin
        self._parts: list[Part] = []
        self._lock = threading.Lock()         # parts end on several threads (a fetch beside a load)

    def add(self, part: str, start: float, end: float | None = None) -> None:
        with self._lock:
            self._parts.append({"part": part, "start": start, "end": time.time() if end is None else end})

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as part `name` (kept when it raises too: the time was spent)."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start)

    def first_start(self) -> float | None:
        """When the first part began (None before any): the process's imports end there."""
        with self._lock:
            return min((p["start"] for p in self._parts), default=None)

    def parts(self) -> list[Part]:
        with self._lock:
            return sorted(self._parts, key=lambda p: p["start"])


_CLOCK: StartupClock | None = None


def clock() -> StartupClock:
    """This process's clock (made at the first call, its origin the process's start)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = StartupClock()
    return _CLOCK
