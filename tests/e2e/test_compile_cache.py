"""The commands keep XLA's compiled programs between runs (h2jax/_compile_cache.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from h2jax import _compile_cache
from h2jax.runtime import read_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "env,want",
    [
        ({}, "HOME/.cache/h2jax/xla"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/h2jax/xla"),
        ({"H2JAX_COMPILATION_CACHE": "~/progs"}, "HOME/progs"),
        ({"H2JAX_COMPILATION_CACHE": "OFF"}, None),
        ({"H2JAX_COMPILATION_CACHE": "0", "XDG_CACHE_HOME": "/xdg"}, None),
        # JAX's own variable wins, set (a folder) or empty (no cache)
        ({"JAX_COMPILATION_CACHE_DIR": "/mine", "H2JAX_COMPILATION_CACHE": "/other"}, "/mine"),
        ({"JAX_COMPILATION_CACHE_DIR": "", "H2JAX_COMPILATION_CACHE": "/other"}, None),
    ],
)
def test_the_folder_follows_the_environment(env, want, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    got = _compile_cache.cache_dir(env)
    assert got == (want.replace("HOME", "/home/u") if want else None)


def test_a_folder_that_cannot_be_made_turns_the_cache_off_with_a_line(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("H2JAX_COMPILATION_CACHE", str(blocker / "xla"))
    path, note = _compile_cache.enable()
    assert path is None and str(blocker / "xla") in note and "compilation cache off" in note
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == ""  # JAX's "no cache", inherited by child processes
    assert _compile_cache.describe() == "XLA compilation cache: off"


@pytest.mark.slow
def test_a_second_run_compiles_nothing_new(tmp_path):
    """`h2jax train` fills the folder; the same job again finds every program there (no entry
    added), trains the same losses, and says where the cache is."""
    cache = tmp_path / "cache"
    # the suite's own cache settings dropped: the command's defaults are what is tested
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "XLA_FLAGS")
        and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    env["H2JAX_COMPILATION_CACHE"] = str(cache)
    env["COLUMNS"] = "400"  # the header line unwrapped
    entries, losses = [], []
    for run in ("a", "b"):
        proc = subprocess.run(
            [sys.executable, "-m", "h2jax.cli", "train", str(REPO / "configs" / "tiny.yaml"), "train.steps=2"]
            + ["checkpoint.enabled=false", "--run-dir", str(tmp_path / run)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"XLA compilation cache: {cache} (programs compiled once" in proc.stderr, proc.stderr[-3000:]
        entries.append(sorted(p.name for p in cache.iterdir()))
        losses.append([r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl")])
    assert len(entries[0]) >= 10, entries[0]  # the stage programs, the update, ...
    assert entries[1] == entries[0]
    assert len(losses[0]) == 2 and losses[1] == losses[0]  # the cached programs compute what compiled ones did
