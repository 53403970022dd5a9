"""Which launcher started this process, and its rank: Open MPI 4/5, SLURM, MPICH/Hydra.

JAX's own cluster detection misses Open MPI 5 (RECIPES.md), so h2jax reads the launchers'
environment itself. A plain ``h2jax train`` (no launcher) is the single-controller mode.

This module imports nothing heavy: the CLI uses it before JAX (and its threads) exist.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class LauncherError(RuntimeError):
    """Started by something that looks like a launcher h2jax does not know, or inconsistently."""


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "openmpi-5", "openmpi-4", "slurm", "mpich"
    rank: int
    size: int
    local_rank: int


# launcher -> (rank, size, local rank) variables
KNOWN = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
}
# variables that say "some launcher started me" even when it is none of the above
HINTS = ("PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "MPI_LOCALRANKID", "ALPS_APP_PE",
         "PALS_RANKID")  # SLURM_PROCID alone (sbatch's batch shell, no srun step) is a plain process


def _int(env: Mapping[str, str], key: str, launcher: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise LauncherError(f"{launcher}: expected an integer in ${key}, got {env.get(key)!r}") from None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """The launch of this process, or None for a plain single process.

    Raises LauncherError when launcher variables are present but match no known launcher,
    naming everything that was looked for.
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        rank_k, size_k, local_k = KNOWN["openmpi"]
        # Open MPI 5 runs on PRRTE (PRTE_* variables); Open MPI 4 on ORTE (OMPI_MCA_orte_*)
        v5 = any(k.startswith("PRTE_") for k in env) or "OMPI_MCA_prte_launch_agent" in env or (
            "PMIX_RANK" in env and not any(k.startswith("OMPI_MCA_orte") for k in env))
        return LaunchInfo("openmpi-5" if v5 else "openmpi-4", _int(env, rank_k, "openmpi"),
                          _int(env, size_k, "openmpi"), int(env.get(local_k, "0")))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return LaunchInfo("slurm", _int(env, "SLURM_PROCID", "slurm"), _int(env, "SLURM_NTASKS", "slurm"),
                          int(env.get("SLURM_LOCALID", "0")))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return LaunchInfo("mpich", _int(env, "PMI_RANK", "mpich"), _int(env, "PMI_SIZE", "mpich"),
                          int(env.get("MPI_LOCALRANKID", "0")))
    hints = [k for k in HINTS if k in env]
    if hints:
        looked = "; ".join(f"{name}: ${', $'.join(keys)}" for name, keys in KNOWN.items())
        raise LauncherError(
            f"started by an unrecognised launcher (found ${', $'.join(hints)}); h2jax recognises "
            f"{looked} (SLURM inside a job step, i.e. srun). Launch with mpirun (Open MPI 4/5), srun or "
            "mpiexec (MPICH/Hydra)")
    return None


def find_mpirun() -> str | None:
    """The ``mpirun`` of the ``openmpi`` package h2jax installs (beside this Python), else from PATH."""
    import shutil
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.is_file() else shutil.which("mpirun")


class FailFast:
    """One line and a non-zero exit when the launcher ends this process (SIGTERM).

    When one rank dies, the launcher SIGTERMs the others. A Python signal handler runs
    only when the main thread is between bytecodes -- never while it waits inside XLA or
    MPI -- so SIGTERM is blocked in every thread and a dedicated thread waits for it with
    ``sigwait``. Call :meth:`start` before JAX creates its thread pools (they inherit the
    mask).
    """

    def __init__(self, launch: LaunchInfo, *, stage: int | None = None):
        self.launch = launch
        self.stage = launch.rank if stage is None else stage
        self.last_completed_step = -1

    def line(self, why: str) -> str:
        lc = self.launch
        return (f"h2jax: stage {self.stage} (rank {lc.rank}/{lc.size}, {lc.launcher}) {why}; "
                f"last completed step {self.last_completed_step}")

    def start(self) -> None:
        import signal
        import threading

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=self._wait, name="h2jax-failfast", daemon=True).start()

    def _wait(self) -> None:
        import signal
        import sys

        signum = signal.sigwait({signal.SIGTERM})
        sys.stderr.write(self.line(f"stopped by {signal.Signals(signum).name} (another process of the job "
                                   "failed, or the job was cancelled)") + "\n")
        sys.stderr.flush()
        os._exit(1)
