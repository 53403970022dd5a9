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


STOP_GUARD_JOB = """
import os, sys, time
from h2jax import cli, launch

def load(args):  # stand in for the config load right after FailFast.start: report and leave
    threads = len(os.listdir("/proc/self/task"))
    for _ in range(500):  # the waiter takes the signals once it sits in sigwait (it may not yet)
        taking = launch.threads_taking(launch.FailFast.signals())
        if taking:
            break
        time.sleep(0.01)
    print("threads", threads, "taking", taking)
    raise SystemExit(0)

cli._load = load
cli.main(["train"])
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_train_under_a_launcher_blocks_the_stop_signals_before_any_thread_starts(tmp_path):
    """Seen in CI: numpy's BLAS pool, started by an import while the CLI built its parser,
    took the launcher's SIGTERM and ended a rank without its line. Every thread but the
    FailFast waiter (in sigwait, which unblocks what it waits for) blocks the stop signals."""
    import subprocess
    import sys

    from tests._harness import cli_env

    env = cli_env(**{k: v for k, v in OMPI5.items()}, OPENBLAS_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", STOP_GUARD_JOB], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning" not in out.stderr, out.stderr
    threads, taking = out.stdout.split("taking")
    assert int(threads.split()[1]) >= 3, out.stdout  # main, the waiter and the BLAS pool: the guard matters
    assert len(eval(taking)) == 1, out.stdout  # the waiter only


def test_the_default_transport_is_local_alone_and_ffi_under_a_launcher(monkeypatch):
    from h2jax import load_config

    for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    assert load_config(None, []).train.transport == "local"
    for k, v in OMPI5.items():
        monkeypatch.setenv(k, v)
    assert load_config(None, []).train.transport == "ffi"  # what config.yaml records
    assert load_config(None, ["train.transport=host"]).train.transport == "host"


def test_setup_backends_of_a_cluster_alone_is_refused_under_a_launcher(monkeypatch):
    """Under mpirun each process holds its stage's chip type only: registering every chip type
    of the cluster (the one-process form) would give the stage's backend the wrong devices."""
    from h2jax import load_config, setup_backends
    from h2jax.config import ConfigError

    cfg = load_config(None, [])
    for k, v in OMPI5.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"setup_backends.*pass the experiment config"):
        setup_backends(cfg.cluster)
