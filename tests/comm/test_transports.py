"""FFI and host transports between two processes (mpirun -np 2) against jax.device_put (the local channel).

Each scenario runs tests/comm/mp_worker.py on 2 ranks; the ranks record every check in a
JSON file and the test asserts on those. A hang is a failure (subprocess timeout).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from h2jax.launch import find_mpirun
from tests.comm import worker_common

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.ffi,
    pytest.mark.skipif(find_mpirun() is None, reason="mpirun not installed"),
]

WORKER = Path(__file__).with_name("mp_worker.py")


def run_worker(scenario: str, out: Path, timeout_s: float = 150) -> list[dict]:
    return worker_common.run_worker(WORKER, scenario, out, timeout_s)


def assert_all_ok(results: list[dict], at_least: int) -> None:
    for r, res in enumerate(results):
        assert "<scenario>" not in res["errors"], f"rank {r}:\n{res['errors']['<scenario>']}"
        bad = {k: res["errors"].get(k, "") for k, ok in res["checks"].items() if not ok}
        assert not bad, f"rank {r}: {len(bad)} failed checks: {bad}"
    assert sum(len(res["checks"]) for res in results) >= at_least


def test_equal_to_local_on_dtypes_and_shapes(tmp_path):
    # 56 (shape, dtype) cases in one jitted program each way, FfiTransport and HostTransport,
    # sharded source/destination, per-device transfers under shard_map, sendrecv
    assert_all_ok(run_worker("equivalence", tmp_path), at_least=250)


def test_1f1b_large_tensors_never_deadlock(tmp_path):
    # both ranks send 64 MiB to each other at once, send-first on both sides, repeatedly, with
    # plain sends (the stash) and buffered ones
    assert_all_ok(run_worker("deadlock", tmp_path), at_least=20)


def test_mismatched_tag_times_out_with_message(tmp_path):
    results = run_worker("mismatch", tmp_path)
    for r, res in enumerate(results):
        for name in ("ffi_tag", "ffi_size", "ffi_size_larger", "ffi_send_timeout", "host_tag"):
            assert res["checks"].get(name), f"rank {r} {name}: {res['errors'].get(name)}"
    assert "timed out after 1.5 s: no message from peer 1 with tag 6" in results[0]["errors"]["ffi_tag"]


def _have_cuda() -> bool:
    import jax

    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@pytest.mark.gpu
def test_cuda_handlers_move_device_buffers_between_processes(tmp_path, monkeypatch):
    if not _have_cuda():
        pytest.skip("no CUDA device")
    # two processes share the one GPU here: neither may take most of its memory up front
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    results = run_worker("cuda", tmp_path, timeout_s=300)
    assert_all_ok(results, at_least=12)
    print({k: v for k, v in results[0]["errors"].items() if k.startswith("cuda")})


@pytest.mark.gpu
def test_ucx_cuda_handlers_move_device_buffers_between_processes(tmp_path, monkeypatch):
    """The same checks over the ucx engine's CUDA handlers; prints the 64 MiB one-way time and the
    path UCX took (direct over cuda_ipc expected: the engine's GPU claim, never run on CPU hosts)."""
    if not _have_cuda():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    results = run_worker("cuda_ucx", tmp_path, timeout_s=300)
    assert_all_ok(results, at_least=12)
    print({k: v for k, v in results[0]["errors"].items() if k.startswith(("cuda", "ucx"))})
