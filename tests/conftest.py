"""Test set-up: several CPU devices, and emulated chip types registered before JAX starts.

The emulated cluster registered here is a superset of every test's cluster, because a
process can register backends only before JAX initialises them.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

# the tests' shared helpers are imported as ``tests._harness``: the repository root on the path
# whether pytest runs as ``python -m pytest`` (which adds the working directory) or as ``pytest``
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# One persistent compilation cache for the whole run, this process and every process it starts
# (mpirun jobs, CLI runs inherit the environment): the many end-to-end tests compile the same
# small stage programs again and again, and compiling is about half of such a test's time. It is
# empty when the run starts and removed when it ends, so each run compiles every program once.
# Every program is kept (most compile in about 0.1 s here) and the cache has no size limit: a
# limit turns on JAX's LRU eviction, which lists the whole folder on every write (0.1 s per write
# at 2,000 entries, 0.5 s at 5,000). Without it JAX neither locks the folder nor evicts; a reader
# that meets an entry another process is still writing fails to decompress it, says so in a
# warning and compiles the program itself. Measured on tests/e2e, tests/checkpoint and
# test_profile (two workers, paired runs): 231 s and 247 s with a 0.2 s minimum and a 4 GiB
# limit, 196 s and 209 s like this. A user's own JAX_COMPILATION_CACHE_DIR is left as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.mkdtemp(prefix="h2jax-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
else:
    _CACHE_DIR = None

# The suite runs in two xdist workers (pyproject's addopts), so an mpirun job may share the two
# cores with the other worker's test. Open MPI binds each rank of a job of at most two ranks to
# its own core, knowing nothing of the other processes: two ranks from two jobs then sit on one
# core, each spinning in MPI's progress loop while the other computes. Unbound ranks that yield
# when idle share the cores fairly. Only the tests' jobs: a user's mpirun keeps its defaults.
os.environ.setdefault("PRTE_MCA_hwloc_default_binding_policy", "none")
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# XLA's CPU backend compiles without LLVM's optimisations in every JAX process of the suite
# (this one, and through tests/_harness.py's cli_env the CLI runs and mpirun jobs it starts):
# the tests' models are tiny, so a test is mostly compiling, and with LLVM's -O0 it takes less
# time (tests/runtime/test_pipelines.py, two cases, cold cache: 63 s -> 39 s; a test that mostly
# executes takes longer: the default job's 200 steps 34 s -> 50 s). The programs and their
# arithmetic are XLA's (no fast-math either way); only the machine code is less optimised. The
# README's commands get it too (their programs are the other tests' programs: one flag, one
# cache entry each); tests/e2e/test_compile_cache.py runs `h2jax train` with XLA's defaults, as
# a user runs it.
os.environ.setdefault("H2JAX_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] += " " + os.environ["H2JAX_TEST_XLA_FLAGS"]

from xla_plugins import register_emulated_chips  # noqa: E402

# chip type -> (nodes, devices per node)
TEST_CLUSTER = {"sim_a": (2, 4), "sim_b": (2, 4), "sim_c": (1, 4), "sim_d": (1, 4)}
register_emulated_chips(TEST_CLUSTER)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_sessionfinish(session, exitstatus):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under xdist's ``--dist loadgroup``: one group per test file (a module's shared compiles
    and fixtures stay in one worker) unless a test names its own, except that every mpirun test
    joins one group, so at most one mpirun job runs at a time beside the other worker's
    in-process tests.

    xdist hands the groups out in the order their first tests were collected (pyproject's
    ``--no-loadscope-reorder``: by default it sorts them by their number of tests, which put the
    README's sections, one long test each, last, and one worker ran them alone for the last 5-8
    minutes), each to the next free worker. The longest first leaves short ones to even out the
    two workers at the end: the mpirun group, the README's sections, the other groups with an
    end-to-end (``slow``) test, then the rest, each in collection order."""
    groups = {}
    for item in items:
        own = item.get_closest_marker("xdist_group")  # a test that names its own group
        if item.get_closest_marker("multiproc"):
            group = "mpirun"
        elif own is not None:
            group = own.args[0]
        else:
            group = item.nodeid.split("::", 1)[0]
        if group == "mpirun" or own is None:
            item.add_marker(pytest.mark.xdist_group(group))
        groups[item.nodeid] = group
    slow = {groups[item.nodeid] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        group = groups[item.nodeid]
        return 0 if group == "mpirun" else 1 if group.startswith("readme-") else 2 if group in slow else 3

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a run without xdist has no such hook
def pytest_xdist_node_collection_finished(node, ids):
    """xdist passes a test's group to its scheduler as a suffix of the test's id (``@group``).
    Where a pytest release ignores that (pytest 9.2 with pytest-xdist 3.8: pytest-dev/pytest-xdist
    issue 1386) every test is scheduled alone and two mpirun jobs share the two cores, which
    times tests out instead of failing them: end the run here, in one line."""
    lost = next((i for i in ids if "@" not in i), None)
    if node.config.getoption("dist") == "loadgroup" and lost is not None:
        pytest.exit(
            f"pytest {pytest.__version__} drops pytest-xdist's test groups (--dist loadgroup; "
            f"{lost} has none): install the pytest that pyproject's test extra names",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
