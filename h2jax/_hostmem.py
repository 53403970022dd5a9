"""Transparent huge pages for XLA's host buffers.

XLA's CPU client allocates its buffers with glibc ``malloc``, which (unlike numpy) never
asks the kernel for transparent huge pages. Where the kernel's THP mode is ``madvise``
(the common default), those buffers are backed by 4 KiB pages, and every large transfer
between processes pays for it: Open MPI's single-copy path (CMA) pins the peer's pages
one by one. Measured on the 2-core development host (``benchmarks/transport.py``, one-way
time of a 256 MiB stage-to-stage transfer inside a jitted program): 39-41 ms with 4 KiB
pages, 19.6 ms with huge pages, where mpi4py on numpy buffers (which numpy backs with huge
pages) takes 18.4 ms; mpi4py on numpy buffers *without* huge pages takes 40 ms.

glibc reads its tunables once, when a process starts, so the ``h2jax`` command re-executes
itself once with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` added (malloc then advises
huge pages for its memory). Nothing else changes; ``H2JAX_HUGEPAGES=0`` turns it off.
The library never re-executes anything: this happens in the console entry point only.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
ENV_SWITCH = "H2JAX_HUGEPAGES"  # "0": never re-execute
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP) -> str | None:
    """The kernel's transparent-huge-page mode (``always`` | ``madvise`` | ``never``), if known."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def hugepage_env(env: Mapping[str, str], *, mode: str | None, libc: str) -> dict[str, str] | None:
    """The environment to re-execute with, or None when there is nothing to gain.

    Nothing to gain: switched off, not glibc, THP ``always`` (malloc gets huge pages
    already) or ``never``/unknown, or the tunable is already set.
    """
    if env.get(ENV_SWITCH, "") == "0" or libc != "glibc" or mode != "madvise":
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return None
    new = dict(env)
    new["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    return new


def hugepages_active(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process's malloc advises huge pages (THP ``always``, or the tunable set)."""
    env = os.environ if env is None else env
    mode = thp_mode()
    return mode == "always" or (mode == "madvise" and TUNABLE in env.get("GLIBC_TUNABLES", ""))


def host_memory_line() -> str:
    """One line for users: does this process give XLA's host buffers huge pages?"""
    mode = thp_mode()
    if hugepages_active():
        how = "THP always" if mode == "always" else TUNABLE
        return f"host buffers: transparent huge pages ({how})"
    why = (
        "switched off by H2JAX_HUGEPAGES=0"
        if os.environ.get(ENV_SWITCH) == "0"
        else f"kernel THP mode {mode or 'unknown'}"
        if mode != "madvise"
        else "not started through the h2jax command"
    )
    return f"host buffers: 4 KiB pages ({why})"


def reexec_with_hugepages(argv: Sequence[str] | None = None) -> None:
    """Re-execute this Python program with the tunable set, when that gains anything.

    Call first thing in a console entry point (before MPI or JAX start threads). Returns
    only when nothing is re-executed.
    """
    if sys.platform != "linux":
        return
    new = hugepage_env(os.environ, mode=thp_mode(), libc=platform.libc_ver()[0])
    if new is None:
        return
    argv = list(sys.argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv], new)
    except OSError:
        return  # could not re-execute: run as we are (4 KiB pages)
