"""Huge pages for XLA's host buffers: when the h2jax command re-executes itself, and that it does."""

import os
import subprocess
import sys

import pytest

from h2jax._hostmem import TUNABLE, hugepage_env, thp_mode


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f) == "always"
    assert thp_mode(tmp_path / "missing") is None


@pytest.mark.parametrize(
    "env, mode, libc, expected",
    [
        ({}, "madvise", "glibc", TUNABLE),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", "glibc", f"glibc.malloc.arena_max=2:{TUNABLE}"),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", "glibc", None),  # the user chose
        ({"H2JAX_HUGEPAGES": "0"}, "madvise", "glibc", None),
        ({}, "always", "glibc", None),  # malloc gets huge pages already
        ({}, "never", "glibc", None),
        ({}, None, "glibc", None),
        ({}, "madvise", "", None),  # not glibc (musl)
    ],
)
def test_hugepage_env_only_when_it_gains_something(env, mode, libc, expected):
    new = hugepage_env(env, mode=mode, libc=libc)
    if expected is None:
        assert new is None
    else:
        assert new["GLIBC_TUNABLES"] == expected
        assert {k: v for k, v in new.items() if k != "GLIBC_TUNABLES"} == {
            k: v for k, v in env.items() if k != "GLIBC_TUNABLES"
        }


def _check_config(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "H2JAX_HUGEPAGES")}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "h2jax.cli", "check-config"], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(thp_mode() != "madvise", reason="the kernel's THP mode is not madvise: nothing to re-execute")
def test_the_command_reexecutes_with_huge_pages_and_can_be_switched_off():
    on = _check_config({})
    assert on.returncode == 0, on.stderr
    assert f"host buffers: transparent huge pages ({TUNABLE})" in on.stdout + on.stderr
    off = _check_config({"H2JAX_HUGEPAGES": "0"})
    assert off.returncode == 0, off.stderr
    assert "host buffers: 4 KiB pages (switched off by H2JAX_HUGEPAGES=0)" in off.stdout + off.stderr
