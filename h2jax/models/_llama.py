"""A decoder-only transformer in the stageable form: Embed, a list of Blocks, Head.

Every parameter is a float32 `nnx.Param` created through `_param`, which attaches the
Megatron-style tensor-parallel layout as Flax NNX `out_sharding` metadata (logical names =
mesh axis names, here only "tensor"). Construction never places arrays: the runtime reads
the layout back with `partition_specs` and puts each stage's state on its own mesh.

Layout on the "tensor" axis (t = tensor degree):
- wq, wk, wv, w_gate, w_up: column-parallel (None, "tensor") -- each device owns
  n_heads/t heads (or d_ff/t hidden units); attention and the SwiGLU product are local.
- wo, w_down: row-parallel ("tensor", None) -- partial sums, one all-reduce per sub-layer.
- embedding [vocab, d_model]: (None, "tensor"), sharded on d_model. The lookup is a gather
  along vocab, which GSPMD partitions as a pure pass-through when the gathered dim is
  unsharded: every device looks up its own columns, then one all-gather of [b, s, d] feeds
  the replicated RMSNorm. Vocab-sharding ("tensor", None) works too, but GSPMD then emits a
  masked gather plus an all-reduce of [b, s, d] (twice the bytes of the all-gather), and it
  buys nothing at this size since the table is small next to the blocks.
- lm_head [d_model, vocab]: (None, "tensor") -- vocab-parallel logits; GSPMD reduces the
  log-sum-exp and the target-logit pick across the axis, so full logits never exist on one
  device.
- RMSNorm scales: replicated (None,).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from h2jax.models._config import GPTConfig

TENSOR = "tensor"
"""Mesh axis name that tensor parallelism shards over (stage meshes are ("data", "tensor"))."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, sharding: tuple[str | None, ...]) -> nnx.Param:
    """A float32 normal(std) parameter annotated with its tensor-parallel layout.

    `eager_sharding=False`: the model is built on the host without a mesh; the runtime
    places the state onto each stage mesh from `partition_specs`.
    """
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=sharding, eager_sharding=False)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32 and returned in the input dtype."""

    def __init__(self, dim: int, *, eps: float):
        self.eps = eps
        ones = jnp.ones((dim,), jnp.float32)
        self.scale = nnx.Param(ones, out_sharding=(None,), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        # explicit broadcast: jax_numpy_rank_promotion="raise" forbids the implicit one
        scale = self.scale[...].reshape((1,) * (x.ndim - 1) + (-1,))
        return (x32 * inv_rms * scale).astype(x.dtype)


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary positions on x [b, s, heads, head_dim], rotate-half convention, math in float32."""
    seq_len, half = x.shape[1], x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [half]
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [s, half]
    cos = jnp.cos(angles)[None, :, None, :]  # [1, s, 1, half]
    sin = jnp.sin(angles)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary positions; no biases."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.rope_theta, self.dtype = cfg.rope_theta, jnp.dtype(cfg.dtype)
        inner = cfg.n_heads * cfg.head_dim
        self.wq = _param(rngs, (cfg.d_model, inner), cfg.init_std, (None, TENSOR))
        self.wk = _param(rngs, (cfg.d_model, inner), cfg.init_std, (None, TENSOR))
        self.wv = _param(rngs, (cfg.d_model, inner), cfg.init_std, (None, TENSOR))
        self.wo = _param(rngs, (inner, cfg.d_model), cfg.init_std, (TENSOR, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        dt = self.dtype

        def heads(w: nnx.Param) -> jax.Array:  # [b, s, d] @ [d, h*hd] -> [b, s, h, hd]
            return (x @ w[...].astype(dt)).reshape(b, s, self.n_heads, self.head_dim)

        q = _rope(heads(self.wq), self.rope_theta)
        k = _rope(heads(self.wk), self.rope_theta)
        v = heads(self.wv)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(self.head_dim))
        # the causal mask as an additive [s, s] bias (0 or the fp32 minimum), not a `where` on the
        # scores: `where` keeps a broadcast [b, h, s, s] mask and the masked scores for the
        # backward (5 B per score, left unsharded under tensor parallelism), an add keeps
        # nothing. Same numbers: score + 0 is the score, score + min rounds to min, and exp
        # underflows to exactly 0 there either way (a finite minimum, not -inf: no row is all-masked)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = scores + jnp.where(causal, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)[None, None]
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        out = out.reshape(b, s, self.n_heads * self.head_dim)
        return out @ self.wo[...].astype(dt)


class MLP(nnx.Module):
    """SwiGLU: (silu(x @ w_gate) * (x @ w_up)) @ w_down; no biases."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        self.w_gate = _param(rngs, (cfg.d_model, cfg.d_ff), cfg.init_std, (None, TENSOR))
        self.w_up = _param(rngs, (cfg.d_model, cfg.d_ff), cfg.init_std, (None, TENSOR))
        self.w_down = _param(rngs, (cfg.d_ff, cfg.d_model), cfg.init_std, (TENSOR, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        hidden = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (x @ self.w_up[...].astype(dt))
        return hidden @ self.w_down[...].astype(dt)


class Embed(nnx.Module):
    """Token embedding: int32 tokens [b, s] -> h [b, s, d_model] in the compute dtype."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, (None, TENSOR))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class Block(nnx.Module):
    """Pre-norm transformer block: h + attn(norm(h)), then h + mlp(norm(h)). [b, s, d] -> same."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class Head(nnx.Module):
    """Final RMSNorm, untied lm_head, mean token cross-entropy in float32 -> scalar loss."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, (None, TENSOR))

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 logits [b, s, vocab] (inference helper; the loss path uses the same math)."""
        w = self.lm_head[...].astype(self.dtype)
        return jnp.einsum("bsd,dv->bsv", self.norm(h), w, preferred_element_type=jnp.float32)

    def __call__(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        losses = optax.softmax_cross_entropy_with_integer_labels(self.logits(h), targets)
        return jnp.mean(losses)


class GPT(nnx.Module):
    """Decoder-only transformer: `embed`, `blocks` (nnx.List of n_layers Block), `head`."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.head = Head(cfg, rngs=rngs)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """Hidden states after the last block, before the final norm: [b, s, d_model]."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def __call__(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy (float32 scalar) of int32 tokens/targets [b, s]."""
        return self.head(self.hidden(tokens), targets)


def build_model(cfg: GPTConfig, *, seed: int) -> GPT:
    """A freshly initialised GPT; the same (cfg, seed) gives bit-identical parameters."""
    return GPT(cfg, rngs=nnx.Rngs(seed))
