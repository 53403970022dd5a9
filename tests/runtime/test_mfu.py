"""MFU in the metrics: the model's FLOPs (PaLM's 6N + 12 L d s per token, N the matmul weights)
over the declared peak of the plan's devices, overall and per chip type."""

from __future__ import annotations

import pytest

from h2jax.config import load_config
from h2jax.runtime import mfu


def test_mfu_is_palms_model_flops_over_the_declared_peak():
    cfg = load_config(None, ["model.n_kv_heads=2"], check_files=False)  # the default job, with GQA
    m = cfg.model
    kv = 2 * m.d_model // m.n_heads
    block = 2 * m.d_model**2 + 2 * m.d_model * kv + 3 * m.d_model * m.d_ff  # wq, wo; wk, wv; SwiGLU
    head = m.d_model * m.vocab_size
    per_token = 6 * (m.n_layers * block + head) + 12 * m.n_layers * m.d_model * m.seq_len
    peak = {c: cfg.cluster.chips[c].peak_tflops * 1e12 for c in cfg.cluster.chips}
    devices = {s.chip: s.num_devices for s in cfg.plan.stages}
    got = mfu(cfg, 1000.0)
    assert got["mfu"] == pytest.approx(1000.0 * per_token / sum(devices[c] * peak[c] for c in devices), rel=1e-12)
    # per chip type: the layers its stage holds (the last stage also the head) over its own devices
    s0, s1 = cfg.plan.stages
    f0 = s0.num_layers * (6 * block + 12 * m.d_model * m.seq_len)
    f1 = s1.num_layers * (6 * block + 12 * m.d_model * m.seq_len) + 6 * head
    assert got[f"mfu/{s0.chip}"] == pytest.approx(1000.0 * f0 / (s0.num_devices * peak[s0.chip]), rel=1e-12)
    assert got[f"mfu/{s1.chip}"] == pytest.approx(1000.0 * f1 / (s1.num_devices * peak[s1.chip]), rel=1e-12)
