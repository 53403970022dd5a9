"""One runtime: a user's model trains under mpirun exactly as in one process, every process gets
the trained model back, and one process and mpirun refuse the same inputs with the same line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h2jax.launch import find_mpirun
from tests._harness import cli_env as _env
from tests._harness import mpirun

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(find_mpirun() is None, reason="mpirun not installed")]

JOB = Path(__file__).with_name("user_model_job.py")
REPO = Path(__file__).resolve().parents[2]


def _mpirun(np_: int, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return mpirun(np_, argv, cwd, timeout=600)


def test_a_user_model_trains_under_mpirun_as_in_one_process(tmp_path):
    alone, spread = tmp_path / "alone", tmp_path / "spread"
    alone.mkdir(), spread.mkdir()
    proc = subprocess.run(
        [sys.executable, str(JOB), str(alone)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _mpirun(2, [sys.executable, str(JOB), str(spread)], tmp_path)  # train.transport: auto -> ffi
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = json.loads((alone / "rank0.json").read_text())["losses"]
    want_params = dict(np.load(alone / "rank0.npz"))
    for rank in (0, 1):  # every process gets the whole trained model back
        got = json.loads((spread / f"rank{rank}.json").read_text())["losses"]
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        params = dict(np.load(spread / f"rank{rank}.npz"))
        assert sorted(params) == sorted(want_params)
        for k in want_params:
            np.testing.assert_allclose(params[k], want_params[k], atol=1e-6, rtol=0, err_msg=k)


TINY = str(REPO / "configs" / "tiny.yaml")
REFUSALS = {
    # the memory check: every stage needs more than its chip's declared memory
    "memory": (
        ["cluster.chips={sim_a: {nodes: 1, memory_gib: 0.0001}, sim_b: {nodes: 1, memory_gib: 0.0001}}"],
        "plan.stages[0]: needs",
    ),
    # a vocabulary larger than model.vocab_size (the byte tokenizer needs 256)
    "vocabulary": (["model.vocab_size=128"], "model.vocab_size"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_one_process_and_mpirun_refuse_alike(case, tmp_path):
    extra, says = REFUSALS[case]
    args = [sys.executable, "-m", "h2jax.cli", "train", TINY, "train.progress=false", *extra]
    one = subprocess.run(
        [*args, "--run-dir", "one"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    many = _mpirun(2, [*args, "train.transport=host", "--run-dir", "many"], tmp_path)
    assert one.returncode == 2 and many.returncode == 2, (one.stderr[-2000:], many.stderr[-2000:])
    line = [ln for ln in one.stderr.splitlines() if ln.startswith("h2jax: config error:")]
    assert len(line) == 1 and says in line[0], one.stderr[-2000:]
    assert line[0] in many.stderr.splitlines(), many.stderr[-3000:]
    assert "Traceback" not in one.stderr + many.stderr


def test_process_transports_need_a_launcher_in_check_config_and_train(tmp_path):
    for command in ("check-config", "train"):
        proc = subprocess.run(
            [sys.executable, "-m", "h2jax.cli", command, TINY, "train.transport=ffi"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "train.transport" in proc.stderr and "Traceback" not in proc.stderr
