"""The ucx engine under the in-program FFI ops: built where UCX is found, one UCX version per
job, the same ops and error lines as the MPI engine (in one process and, under mpirun, between
two), and deadlock freedom for 1F1B's send-first exchange of large tensors.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from h2jax.comm import _ffi as hc
from h2jax.comm import _ucx
from h2jax.launch import find_mpirun
from tests.comm import worker_common

WORKER = Path(__file__).with_name("ucx_worker.py")
needs_ucx = pytest.mark.skipif(not _ucx.is_available(), reason="the ucx engine is not built here (no UCX found)")


def test_version_mismatch_is_refused_naming_ranks_and_versions():
    _ucx.check_versions(["1.22.0", "1.22.0", "1.22.0"])
    _ucx.check_versions([])
    with pytest.raises(RuntimeError) as e:
        _ucx.check_versions(["1.22.0", "1.20.1", "1.22.0", "1.20.1"])
    msg = str(e.value)
    assert "\n" not in msg
    assert "ranks 0,2: 1.22.0" in msg and "ranks 1,3: 1.20.1" in msg, msg


def test_unavailable_engine_says_how_to_get_it(monkeypatch):
    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(_ucx, "_ext", None)
    monkeypatch.setattr(_ucx.importlib, "import_module", missing)
    with pytest.raises(_ucx.UcxUnavailableError, match=r"pip install libucx-cu12.*H2JAX_UCX") as e:
        _ucx._load()
    assert isinstance(e.value, hc.FfiUnavailableError) and "\n" not in str(e.value)
    assert not _ucx.is_available()


@pytest.mark.ffi
@needs_ucx
def test_extension_registers_the_ucx_targets_and_names_ucx_by_soname():
    ext = _ucx._load()
    assert set(ext.registrations()) == {
        "h2jax_ucx_send",
        "h2jax_ucx_bsend",
        "h2jax_ucx_recv",
        "h2jax_ucx_recv_into",
        "h2jax_ucx_sendrecv",
    }
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", ext.__file__], capture_output=True, text=True).stdout
        assert "libucp.so.0" in dyn, dyn
        # no RPATH into the build environment (UCX is the one _ucx loaded); built with CUDA
        # handlers, the CUDA toolkit's library folder alone, as for the MPI engine's CUDA module
        paths = [
            p
            for found in re.findall(r"\(R(?:UN)?PATH\)\s+Library r(?:un)?path: \[(.*)\]", dyn)
            for p in found.split(":")
        ]
        want = ["cuda"] if hasattr(ext, "cuda_registrations") else []
        assert [("cuda" if "cuda" in p and "ucx" not in p else p) for p in paths] == want, dyn


@pytest.mark.ffi
@needs_ucx
def test_defaults_apply_only_where_the_environment_sets_none():
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_TLS"] = "self,sm"
    code = "from h2jax.comm import _ucx; print(dict(_ucx.applied_defaults()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    applied = eval(out)
    assert "TLS" not in applied and applied == {k: v for k, v in _ucx.DEFAULTS if k != "TLS"}, out


@pytest.mark.ffi
@needs_ucx
def test_self_send_and_recv_on_one_rank():
    from mpi4py import MPI

    comm = _ucx.UcxComm(MPI.COMM_SELF)
    x = jnp.arange(10, dtype=jnp.bfloat16)
    big = jnp.arange(1 << 20, dtype=jnp.float32)  # 4 MiB: rendezvous, stashed while our send waits

    @jax.jit
    def loop(x, big):
        tok = hc.send(x, peer=0, tag=3, comm=comm)
        y, tok = hc.recv(x.shape, x.dtype, peer=0, tag=3, comm=comm, token=tok)
        z, tok = hc.sendrecv(y * 2, x.shape, x.dtype, dest=0, source=0, send_tag=4, recv_tag=4, comm=comm, token=tok)
        tok = hc.send(z + 1, peer=0, tag=5, comm=comm, token=tok)
        w, tok = hc.recv(x.shape, x.dtype, peer=0, tag=5, comm=comm, token=tok, into=jnp.zeros_like(x))
        tok = hc.send(big, peer=0, tag=6, comm=comm, token=tok)
        b, tok = hc.recv(big.shape, big.dtype, peer=0, tag=6, comm=comm, token=tok)
        tok = hc.send(big + 1, peer=0, tag=7, comm=comm, token=tok, buffered=True)  # returns before the recv
        c, _ = hc.recv(big.shape, big.dtype, peer=0, tag=7, comm=comm, token=tok)
        return z, w, b, c

    before = _ucx.stash_stats()
    z, w, b, c = loop(x, big)
    assert (z == x * 2).all() and (w == x * 2 + 1).all() and (b == big).all() and (c == big + 1).all()
    hc.flush_sends(comm=comm)
    after = _ucx.stash_stats()
    assert after["buffered_sends"] == before["buffered_sends"] + 1 and after["sends_in_flight"] == 0, after
    with pytest.raises(
        jax.errors.JaxRuntimeError, match="DEADLINE_EXCEEDED.*timed out after 0.2 s: no message from peer 0 with tag 9"
    ):
        jax.jit(lambda: hc.recv((3,), jnp.float32, peer=0, tag=9, comm=comm, timeout_s=0.2)[0])().block_until_ready()


@pytest.mark.ffi
@needs_ucx
def test_arguments_are_checked_before_tracing():
    from mpi4py import MPI

    comm = _ucx.UcxComm(MPI.COMM_SELF)
    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="peer 5 is not a rank"):
        hc.send(x, peer=5, tag=0, comm=comm)
    with pytest.raises(ValueError, match=r"tag -1 is outside 0..2147483647 \(the ucx engine"):
        hc.recv((3,), jnp.float32, peer=0, tag=-1, comm=comm)
    with pytest.raises(TypeError, match="UcxComm needs an mpi4py communicator"):
        _ucx.UcxComm(0)


def _run_worker(scenarios: str, out: Path, timeout_s: float = 120, **extra_env: str) -> list[dict]:
    return worker_common.run_worker(WORKER, scenarios, out, timeout_s, **extra_env)


@pytest.mark.multiproc
@pytest.mark.ffi
@needs_ucx
@pytest.mark.skipif(find_mpirun() is None, reason="mpirun not installed")
def test_two_ranks_dtypes_large_1f1b_and_error_lines(tmp_path):
    # dtypes: 49 (dtype, shape) cases each way in one jitted program, 0 bytes, recv into;
    # shard_map: two devices per process each exchanging 4 MiB with its own traced tag;
    # big: 256 MiB sendrecv, both ranks sending 64 MiB first (1F1B) twice;
    # buffered: 1F1B's send-first with buffered sends; one returns while its receiver sleeps, where a
    # plain one waits; one nobody receives fails the next call, naming it, and closes its endpoint;
    # errors: timeout line (with what did arrive), wrong sizes (smaller, larger, rendezvous-sized),
    # a send nobody receives (times out, its endpoint closed, later sends fail at once)
    results = _run_worker("dtypes,shard_map,big,buffered,errors", tmp_path)
    for r, res in enumerate(results):
        assert "<scenario>" not in res["errors"], f"rank {r}:\n{res['errors']['<scenario>']}"
        bad = {k: res["errors"].get(k, "") for k, ok in res["checks"].items() if not ok}
        assert not bad, f"rank {r}: {len(bad)} failed checks: {bad}"
        assert len(res["checks"]) >= 69 + 5 * (r == 0)


@pytest.mark.multiproc
@pytest.mark.ffi
@needs_ucx
@pytest.mark.skipif(find_mpirun() is None, reason="mpirun not installed")
def test_a_dead_peer_fails_the_wait_at_once_naming_it(tmp_path):
    # peer failure detection needs a transport that reports it (tcp here; UCX's shared memory
    # cannot): rank 1 exits without a word while rank 0 waits on it with a 60 s timeout, and while
    # a buffered send of rank 0 to it is in flight
    results = _run_worker("peer_death", tmp_path, UCX_TLS="sm,self,tcp")
    assert results[1]["checks"] == {"detection_on": True, "alive_first": True}
    res = results[0]
    assert all(res["checks"].values()) and len(res["checks"]) == 5, res
    assert "peer 1 is unreachable" in res["errors"]["dead_peer"]
