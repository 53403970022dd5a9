"""A converted checkpoint trains: a LLaMA-family Hugging Face directory made here is
converted, trained for 2 steps by the real ``h2jax train --init-from`` under a plan over two
chip types (sim_a, sim_b; tensor 2 on the second splits the kv heads), and exported back.

The first step's loss is the converted model's own loss on that step's batch, so the run
started from the converted weights (a fresh init would give ~ln 256)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("safetensors")

from h2jax.convert import load_model  # noqa: E402
from h2jax.models import GPTConfig  # noqa: E402
from tests._harness import hand_made_hf as _hand_made  # noqa: E402
from tests._harness import models_cli as _run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2, d_ff=128, n_kv_heads=2)


@pytest.mark.slow
def test_convert_train_export(tmp_path):
    src = _hand_made(tmp_path, CFG)
    (src / "tokenizer.json").unlink()  # the byte tokenizer of the tiny job
    assert _run("convert", str(src), str(tmp_path / "ckpt"), "--seq-len", "32") == 0

    exp = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    exp["model"] = yaml.safe_load((tmp_path / "ckpt" / "model.yaml").read_text())["model"]
    exp["train"].update(steps=2, out_dir=str(tmp_path / "runs"), progress=False, timeline=False, tensorboard=False)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    # this interpreter's h2jax (as the other CLI tests): a bare "h2jax" is whichever one PATH
    # finds, maybe another Python's, whose pydoc corpus (so the step-0 batch) differs
    args = ["train", str(tmp_path / "exp.yaml"), "--init-from", str(tmp_path / "ckpt")]
    cmd = [sys.executable, "-m", "h2jax.cli", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "initialised the weights from" in proc.stdout + proc.stderr

    from h2jax.data import get_global_batch, load_dataset

    data = load_dataset(corpus="pydoc", token_file=None, tokenizer="byte", token_dtype="uint16")
    plan = exp["plan"]
    micro = plan["global_batch"] // plan["num_microbatches"]
    tokens, targets = get_global_batch(
        data, seed=0, step=0, num_microbatches=plan["num_microbatches"], microbatch_size=micro, seq_len=32
    )
    _, model = load_model(tmp_path / "ckpt")
    expected = float(model(tokens.reshape(-1, 32), targets.reshape(-1, 32)))
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert expected > 10  # far from a fresh init's ~ln(256) = 5.5: the weights are the converted ones
    np.testing.assert_allclose(rows[0]["loss"], expected, rtol=1e-5)

    assert _run("convert", str(tmp_path / "runs" / "tiny" / "checkpoints"), str(tmp_path / "hf_out")) == 0
    hf = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert hf["num_key_value_heads"] == 2 and (tmp_path / "hf_out" / "model.safetensors").is_file()
    _, trained = load_model(tmp_path / "runs" / "tiny" / "checkpoints")
    assert not np.array_equal(np.asarray(trained.blocks[0].attn.wk[...]), np.asarray(model.blocks[0].attn.wk[...]))
