"""How much of this host other work took while a measurement ran.

A measured profile is this host's time for a chip type's programs. Taken while other
processes keep cores busy, it is slower than the chip alone would be, and the planner,
which compares it with other chip types' profiles, splits the model away from it (a plan
built so was seen at a 52.7 % HeteroSpeedupRatio against ~93 % on a quiet host). The
kernel counts every core's busy time (``/proc/stat``); this process counts its own
(``time.process_time``, all its threads); the difference over the wall time is the cores
other work kept busy. Off Linux nothing is counted (``None``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_STAT = Path("/proc/stat")
# a measurement is "on a loaded host" when other work kept at least this share of the
# host's cores busy on average (on 2 cores: half a core)
LOADED_SHARE = 0.25


def _host_busy_s() -> float | None:
    """Seconds every core of the host has been busy since boot (user, nice, system, irq,
    softirq, steal), or None where the kernel does not say."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherWork:
    """``with OtherWork() as w: ...`` then ``w.cores``: the host cores other processes kept
    busy on average while the block ran (None where the host does not say, or the block took
    no time)."""

    def __enter__(self) -> OtherWork:
        self.cores: float | None = None
        self._host = _host_busy_s()
        self._own = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        host = _host_busy_s()
        wall = time.perf_counter() - self._wall
        if host is None or self._host is None or wall <= 0:
            return
        own = time.process_time() - self._own
        self.cores = max(0.0, (host - self._host - own) / wall)


def loaded(other_cores: float | None, host_cores: int) -> bool:
    """Whether other work took at least :data:`LOADED_SHARE` of the host's cores."""
    return other_cores is not None and other_cores >= LOADED_SHARE * host_cores
