"""What the 2-rank workers (mp_worker.py for the mpi engine, ucx_worker.py for the ucx engine)
share, and how their tests start them: the same arrays built from seeds on both ranks, compared
bit for bit. No MPI or UCX import here: the ucx worker must load UCX before mpi4py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]


def make(shape, dtype, seed: int) -> np.ndarray:
    """The array of (shape, dtype) that seed `seed` gives, the same on every rank."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt)
    return (rng.standard_normal(shape) * 100).astype(dt)


def same(got, want) -> bool:
    """Bit for bit: shape, dtype and bytes."""
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()


def run_worker(worker: Path, scenario: str, out: Path, timeout_s: float, **extra_env: str) -> list[dict]:
    """``mpirun -np 2 WORKER SCENARIO OUT``: each rank's OUT/rank<r>.json; a hang fails the test."""
    import pytest

    from h2jax.launch import find_mpirun

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")} | extra_env
    env["XLA_FLAGS"] = os.environ.get("H2JAX_TEST_XLA_FLAGS", "")  # the suite's compile flags (tests/conftest.py)
    cmd = [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(worker)]
    try:
        proc = subprocess.run([*cmd, scenario, str(out)], env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario}: mpirun did not finish within {timeout_s} s (a hang)\n{e.stderr}")
    results = []
    for r in (0, 1):
        f = out / f"rank{r}.json"
        assert f.is_file(), f"rank {r} wrote no result (rc={proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}"
        results.append(json.loads(f.read_text()))
    return results
