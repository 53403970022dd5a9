"""Launcher detection from environment fixtures (no process is launched)."""

from __future__ import annotations

import pytest

from h2jax.launch import LauncherError, LaunchInfo, detect_launch

OMPI5 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "PMIX_RANK": "1",
    "PRTE_LAUNCHED": "1",
}
OMPI4 = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "PMIX_RANK": "2",
    "OMPI_MCA_orte_ess_num_procs": "4",
}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42"}
MPICH = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}


@pytest.mark.parametrize(
    "env,want",
    [
        (OMPI5, LaunchInfo("openmpi-5", 1, 3, 1)),
        (OMPI4, LaunchInfo("openmpi-4", 2, 4, 0)),
        (SLURM, LaunchInfo("slurm", 5, 8, 1)),
        (MPICH, LaunchInfo("mpich", 0, 2, 0)),
        ({"HOME": "/root"}, None),
        # an allocation without a job step (e.g. sbatch's batch shell) is a plain process
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"}, None),
    ],
)
def test_detect(env, want):
    assert detect_launch(env) == want


def test_unrecognised_launcher_lists_what_was_looked_for():
    with pytest.raises(LauncherError) as e:
        detect_launch({"PMIX_RANK": "0"})
    msg = str(e.value)
    for key in ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK", "PMIX_RANK"):
        assert key in msg


def test_bad_rank_value_is_named():
    with pytest.raises(LauncherError, match="OMPI_COMM_WORLD_SIZE"):
        detect_launch({**OMPI5, "OMPI_COMM_WORLD_SIZE": "x"})
