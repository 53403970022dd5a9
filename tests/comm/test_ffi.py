"""The FFI extension in one process: built by pip, registered once, checked arguments,
and the CUDA variant compiling wherever a CUDA toolkit is present."""

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

from h2jax import comm as hc

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ffi
def test_extension_is_built_and_registers_idempotently():
    hc.register()
    hc.register()
    assert hc.is_available("cpu")
    from h2jax.comm import _mpi_ffi_cpu

    assert set(_mpi_ffi_cpu.registrations()) == {
        "h2jax_send",
        "h2jax_bsend",
        "h2jax_recv",
        "h2jax_recv_into",
        "h2jax_sendrecv",
    }


@pytest.mark.ffi
def test_extension_uses_the_libmpi_that_mpi4py_loaded():
    # one libmpi in the process, and the extension carries no RPATH into a build environment
    code = (
        "from mpi4py import MPI; import h2jax.comm._mpi_ffi_cpu as m; "
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libmpi.so' in l}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert len(eval(out)) == 1, out
    from h2jax.comm import _mpi_ffi_cpu

    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", _mpi_ffi_cpu.__file__], capture_output=True, text=True).stdout
        assert "libmpi.so" in dyn and "RPATH" not in dyn and "RUNPATH" not in dyn, dyn


@pytest.mark.ffi
def test_self_send_and_recv_on_one_rank():
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    x = jnp.arange(10, dtype=jnp.bfloat16)

    @jax.jit
    def loop(x):  # a send to oneself is stashed while the send waits, then received
        tok = hc.send(x, peer=0, tag=3, comm=comm)
        y, tok = hc.recv(x.shape, x.dtype, peer=0, tag=3, comm=comm, token=tok)
        z, tok = hc.sendrecv(y * 2, x.shape, x.dtype, dest=0, source=0, send_tag=4, recv_tag=4, comm=comm, token=tok)
        tok = hc.send(z + 1, peer=0, tag=5, comm=comm, token=tok)
        w, _ = hc.recv(x.shape, x.dtype, peer=0, tag=5, comm=comm, token=tok, into=jnp.zeros_like(x))
        return z, w

    z, w = loop(x)
    assert (z == x * 2).all() and (w == x * 2 + 1).all()


@pytest.mark.ffi
def test_arguments_are_checked_before_tracing():
    from mpi4py import MPI

    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="peer 5 is not a rank"):
        hc.send(x, peer=5, tag=0, comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="tag -1 is outside"):
        hc.recv((3,), jnp.float32, peer=0, tag=-1, comm=MPI.COMM_SELF)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        hc.send(x, peer=0, tag=0, comm=0)


@pytest.mark.ffi
def test_cuda_variant_compiles_where_cuda_is_present(tmp_path):
    """Compile and link ffi/handlers_cuda.cc (no GPU needed); skipped without a CUDA toolkit."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc: the CUDA variant is not built here")
    cuda_home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    if not (cuda_home / "include" / "cuda_runtime_api.h").is_file():
        pytest.skip(f"nvcc found but no CUDA headers under {cuda_home}")
    mpicxx = shutil.which("mpicxx")
    if mpicxx is None:
        pytest.skip("no mpicxx")
    lib = next((d for d in ("lib64", "lib") if (cuda_home / d / "libcudart.so").exists()), "lib64")
    out = tmp_path / "libh2jax_cuda_handlers.so"
    cmd = [
        mpicxx,
        "-std=c++17",
        "-O1",
        "-fPIC",
        "-shared",
        str(REPO / "ffi" / "handlers_cuda.cc"),
        f"-I{REPO / 'ffi'}",
        f"-I{jax.ffi.include_dir()}",
        f"-I{cuda_home / 'include'}",
        f"-L{cuda_home / lib}",
        "-lcudart",
        "-Wl,--no-undefined",
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    syms = subprocess.run(["nm", "-D", "--defined-only", str(out)], capture_output=True, text=True).stdout
    assert {"H2SendCuda", "H2RecvCuda", "H2RecvIntoCuda", "H2SendRecvCuda"} <= set(re.findall(r"\bH2\w+Cuda\b", syms))
