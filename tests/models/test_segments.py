"""Packed documents: within `document_segments`, a document's outputs (and its loss) are the
ones it has alone, wherever it sits in the sequence; without segments attention crosses the
boundary (the test can fail); the pipeline with packed data equals the sequential model."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from h2jax.data import write_megatron
from h2jax.models import GPTConfig, build_model, document_segments
from h2jax.runtime import Trainer
from tests._harness import S, assert_pipeline_equals_sequential, plan_cfg

CFG = GPTConfig(vocab_size=64, seq_len=24, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64)


@nnx.jit
def _blocks(model, tokens, segments):
    with document_segments(segments):
        h = model.embed(tokens)
        for block in model.blocks:
            h = block(h)
    return h


@nnx.jit
def _loss(model, tokens, targets, segments):
    with document_segments(segments):
        return model(tokens, targets)


def _hidden(model, tokens, segments=None):
    return np.asarray(_blocks(model, jnp.asarray(tokens), None if segments is None else jnp.asarray(segments)))


def test_a_packed_document_computes_what_it_computes_alone():
    model = build_model(CFG, seed=0)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 64, size=n) for n in (7, 11, 6))
    packed = np.concatenate([a, b, c])[None]
    segments = np.repeat([1, 2, 3], [7, 11, 6])[None]
    got = _hidden(model, packed, segments)
    for doc, lo in ((a, 0), (b, 7), (c, 18)):
        alone = _hidden(model, doc[None])
        np.testing.assert_allclose(got[0, lo : lo + len(doc)], alone[0], atol=1e-5, rtol=0)
    crossing = _hidden(model, packed)  # causal only: the second document sees the first
    assert np.abs(crossing[0, 7:18] - _hidden(model, b[None])[0]).max() > 1e-3


def test_the_loss_of_a_packed_row_is_the_token_weighted_loss_of_its_documents():
    model = build_model(CFG, seed=1)
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 64, size=10), rng.integers(0, 64, size=14)
    row = np.concatenate([a, b])
    seg = np.repeat([1, 2], [10, 14])
    packed = float(_loss(model, jnp.asarray(row[None, :-1]), jnp.asarray(row[None, 1:]), jnp.asarray(seg[None, :-1])))
    # the same per-token losses: document a (9 next tokens and the first of b, predicted from a),
    # then b alone (13 next tokens)
    alone_a = float(_loss(model, jnp.asarray(row[None, :10]), jnp.asarray(row[None, 1:11]), None))
    alone_b = float(_loss(model, jnp.asarray(b[None, :-1]), jnp.asarray(b[None, 1:]), None))
    assert abs(packed - (10 * alone_a + 13 * alone_b) / 23) <= 1e-5


def test_a_padded_row_has_the_loss_of_its_document_alone():
    """Unpacked data (data.packing: false): targets of -1 carry no loss; the row's loss is its
    document's alone, and a batch's is the mean over its real targets."""
    model = build_model(CFG, seed=2)
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 64, size=9)
    row = np.concatenate([doc, np.zeros(15, int)])
    tgt = np.concatenate([doc[1:], np.full(16, -1)])
    padded = float(_loss(model, jnp.asarray(row[None, :-1]), jnp.asarray(tgt[None, :23]), None))
    alone = float(_loss(model, jnp.asarray(doc[None, :-1]), jnp.asarray(doc[None, 1:]), None))
    assert abs(padded - alone) <= 1e-6
    full = rng.integers(0, 64, size=24)  # a second row, no padding: 23 targets against 8
    both = float(
        _loss(model, jnp.asarray(np.stack([row, full])[:, :-1]), jnp.asarray(np.stack([tgt[:23], full[1:]])), None)
    )
    other = float(_loss(model, jnp.asarray(full[None, :-1]), jnp.asarray(full[None, 1:]), None))
    assert abs(both - (8 * alone + 23 * other) / 31) <= 1e-5


@pytest.fixture(scope="module")
def packed_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(2)
    write_megatron(d / "docs", [rng.integers(0, 256, size=int(rng.integers(2, 12))) for _ in range(400)])
    return str(d / "docs")


@pytest.mark.parametrize(
    "schedule, stages, packing",
    [
        pytest.param(  # the fast lane checks packing through the model tests above
            "1f1b",
            [S("sim_a", (0, 2), data=2), S("sim_b", (2, 4), tensor=2, recompute=True)],
            True,
            marks=pytest.mark.slow,
        ),
        pytest.param("zb-h1", [S("sim_c", (0, 2), tensor=2), S("sim_d", (2, 4), data=2)], True, marks=pytest.mark.slow),
        pytest.param(  # unpacked: a document per row, padded; the loss is over the real targets
            "gpipe", [S("sim_a", (0, 2), data=2), S("sim_b", (2, 4), tensor=2)], False, marks=pytest.mark.slow
        ),
    ],
)
def test_the_pipeline_on_packed_data_equals_the_sequential_model(packed_store, schedule, stages, packing, tmp_path):
    over = {"data.sources": json.dumps({packed_store: 1}), "data.packing": str(packing).lower()}
    cfg = plan_cfg(4, schedule, stages, **over)
    trainer = Trainer(cfg, run_dir=tmp_path)
    segs = trainer.segments(0)
    if packing:
        assert segs is not None and segs.max() > 2  # short documents: every row holds several
    else:
        _, targets = trainer.batch(0)
        real = (targets >= 0).sum(axis=(1, 2))
        assert segs is None and (targets < 0).any() and len(set(real.tolist())) > 1  # the microbatches differ
    assert_pipeline_equals_sequential(cfg, trainer, 2, check_norm=True)
    trainer.close()
