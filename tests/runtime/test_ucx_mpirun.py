"""The ucx engine under mpirun: a pipeline over UCX equals the same plan in one process (which
equals the sequential model: test_pipeline_equivalence.py, test_interleaved.py), and every link
names its engine, UCX version and the protocols UCX chose."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from h2jax.config import load_config
from h2jax.runtime import Trainer
from tests._harness import MP_BASE as BASE
from tests._harness import MP_PLANS as PLANS
from tests._harness import MPIRUN, final_params
from tests._harness import mpirun_train as _mpirun

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")]

ZBV = [  # zb-v over two ranks: the V's turn on rank 1, tensor 2 on rank 0's chunks, data 2 on rank 1's
    "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
    "plan.schedule=zb-v",
    "plan.stages=[{chip: sim_a, data: 1, tensor: 2, chunks: [[0, 1], [3, 4]]}, "
    "{chip: sim_b, data: 2, tensor: 1, chunks: [[1, 2], [2, 3]], recompute: true}]",
]
CASES = {
    "2st": (2, PLANS["2st"]),  # 1f1b, 2x2 -> 4x1: pieces and an all-gather each way
    "zb-v": (2, ZBV),
    "2st-per-device": (4, PLANS["2st-per-device"]),  # one process per device
}


def _one_process(plan: list[str], tmp_path: Path) -> tuple[list[float], dict[str, np.ndarray]]:
    trainer = Trainer(load_config(None, BASE + plan), run_dir=tmp_path / "single")
    losses = [h.loss for h in trainer.run()]
    params = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    trainer.close()
    return losses, params


@pytest.mark.parametrize(
    "case,transport",
    [
        ("2st", "ffi"),
        ("zb-v", "ffi"),
        pytest.param("2st-per-device", "ffi", marks=pytest.mark.long),
        pytest.param("2st", "ffi-call", marks=pytest.mark.long),
    ],
)
def test_pipeline_over_ucx_equals_one_process(case, transport, tmp_path):
    nproc, plan = CASES[case]
    want_losses, want_params = _one_process(plan, tmp_path)
    run = tmp_path / "run"
    args = [*BASE, *plan, f"train.transport={transport}", "comm.engine=ucx", "comm.require_device_direct=true"]
    proc = _mpirun(nproc, [*args, "--run-dir", str(run)], tmp_path)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    np.testing.assert_allclose(summary["losses"], want_losses, atol=1e-6, rtol=0)
    got = final_params(run)
    assert sorted(got) == sorted(want_params)
    for k, v in want_params.items():
        np.testing.assert_allclose(got[k], v, atol=1e-6, rtol=0, err_msg=k)
    # every link: the ucx engine, its version and settings, the protocols UCX chose for host memory
    links = summary["links"]
    assert links and all(lk["engine"] == "ucx" and lk["path"] == "host" for lk in links), links
    assert all(lk["library"].startswith("UCX 1.") and lk["large_gbps"] > 0 for lk in links), links
    assert all("8 B eager short over" in lk["protocols"] and "4194304 B" in lk["protocols"] for lk in links), links
    assert "(engine ucx, UCX 1." in err and "[UCX: 8 B eager short over" in err


def test_engine_auto_on_cpu_stages_is_mpi_and_a_bad_engine_is_one_line(tmp_path):
    """auto: emulated stages hold host memory, so the MPI engine (nothing to gain from UCX);
    a value that is no engine is refused naming the key before anything starts."""
    from h2jax.config import ConfigError
    from h2jax.runtime._links import resolve_engine

    cfg = load_config(None, [*BASE, *PLANS["2st"]])  # one process: local (a launcher's job would have ffi)
    assert resolve_engine(cfg, None) == ""  # local: no engine to choose
    ffi = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, transport="ffi"))
    assert resolve_engine(ffi, None) == "mpi"  # no device stage: asks no rank anything
    ucx = dataclasses.replace(ffi, comm=dataclasses.replace(ffi.comm, engine="ucx"))
    assert resolve_engine(ucx, None) == "ucx"
    with pytest.raises(ConfigError, match=r"comm.engine: engine='nccl'; expected one of \['auto', 'mpi', 'ucx'\]"):
        load_config(None, [*BASE, *PLANS["2st"], "comm.engine=nccl"])


@pytest.mark.parametrize(
    "error,says",
    [
        ("unavailable", "comm.engine: h2jax ucx: the ucx engine is unavailable (no module); `python3 -m pip install"),
        ("versions", "comm.engine: h2jax ucx: the ranks run different UCX versions (ranks 0: 1.22.0; ranks 1: 1.20.1)"),
    ],
)
def test_a_ucx_engine_that_cannot_start_is_one_line_naming_the_key(error, says, monkeypatch):
    """UCX that does not load on a rank, or ranks on different UCX versions: the channel's set-up
    raises a ConfigError naming comm.engine (exit 2, one line), before any step."""
    from mpi4py import MPI

    from h2jax.comm import _ucx
    from h2jax.config import ConfigError
    from h2jax.runtime._wiring import _channel

    def refuse(comm, **kw):
        if error == "versions":
            _ucx.check_versions(["1.22.0", "1.20.1"])
        raise _ucx.UcxUnavailableError(
            "h2jax ucx: the ucx engine is unavailable (no module); `python3 -m pip install libucx-cu12` and rebuild"
        )

    monkeypatch.setattr(_ucx, "UcxComm", refuse)
    cfg = load_config(None, [*BASE, *PLANS["2st"]])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, transport="ffi"))
    with pytest.raises(ConfigError) as e:
        _channel(cfg, None, MPI.COMM_SELF, None, "sim_a", shared={}, engine="ucx")
    assert str(e.value).startswith(says), str(e.value)
