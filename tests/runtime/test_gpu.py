"""A real GPU and an emulated chip type in one pipeline (runs only where a CUDA device is present).

The foundation test (test_pipeline_equivalence.py) on a real accelerator: stage 0 on the
GPU (chip type ``cuda:H200``-style names are checked against the device kind, so the chip
type here is named after whatever GPU is present), stage 1 on the emulated CPU chip
``sim_a``; the loss and every gradient of one step equal a single-device
``jax.value_and_grad`` within 1e-5 (fp32, matmul precision "highest" from conftest).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from h2jax.config import load_config
from h2jax.models import build_model
from h2jax.runtime import Trainer, flatten, reference_loss_and_grads

pytestmark = pytest.mark.gpu
TOL = 1e-5


def _gpu():
    try:
        devs = jax.devices("cuda")
    except RuntimeError:
        return None
    return devs[0] if devs else None


def test_gpu_stage_and_emulated_stage_equal_sequential(tmp_path):
    dev = _gpu()
    if dev is None:
        pytest.skip("no CUDA device")
    kind = dev.device_kind.split()[-1]  # "NVIDIA H200" -> H200
    chip = f"cuda:{kind}"
    plan = {
        "global_batch": 16,
        "num_microbatches": 4,
        "schedule": "1f1b",
        "stages": [
            {"chip": chip, "layers": [0, 2], "data": 1, "tensor": 1},
            {"chip": "sim_a", "layers": [2, 4], "data": 2, "tensor": 1},
        ],
    }
    cfg = load_config(
        None,
        [
            "model.vocab_size=256",
            "model.seq_len=16",
            "model.d_model=32",
            "model.n_heads=4",
            "model.d_ff=64",
            "model.n_layers=4",
            f'cluster.chips={{"{chip}": {{profile: h200, nodes: 1, devices_per_node: 1, '
            f"memory_gib: 100}}, sim_a: {{nodes: 1}}}}",
            f"plan={plan}",
            "train.progress=false",
            "train.tensorboard=false",
        ],
    )
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert trainer.stages[0].mesh.devices.flat[0].platform == "gpu"
    assert trainer.stages[1].mesh.devices.flat[0].platform == "cpu"
    tokens, targets = trainer.batch(0)
    ref_loss, ref_grads = reference_loss_and_grads(build_model(cfg.model, seed=cfg.seed), tokens, targets)
    loss = float(trainer.forward_backward(0))
    assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
    got, want = trainer.grads_by_layer(), flatten(ref_grads)
    assert sorted(got) == sorted(want)
    diff = {k: float(np.max(np.abs(np.asarray(got[k], np.float64) - np.asarray(want[k], np.float64)))) for k in want}
    assert max(diff.values()) <= TOL, {k: v for k, v in diff.items() if v > TOL}
    print(f"{chip} + sim_a: loss {loss:.6f} vs {ref_loss:.6f}, max grad diff {max(diff.values()):.2e}")
    trainer.close()
