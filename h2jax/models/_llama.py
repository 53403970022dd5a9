"""A LLaMA-family decoder-only transformer in the stageable form: Embed, a list of Blocks, Head.

Pre-norm RMSNorm, rotary positions (optionally scaled: LLaMA 3.1's or linear), grouped-query
attention through `jax.nn.dot_product_attention` (causal; within `document_segments`, also
same-document: packed data), SwiGLU MLP, no
biases, optionally an lm_head tied to the embedding, optional dropout (``model.dropout``: on
the embedding output and on the attention and MLP outputs before each residual add, with
keys from (seed, step, microbatch, layer): `h2jax.models._dropout`). h2jax's default GPT is this model with
n_kv_heads = n_heads, unscaled RoPE and an untied head. The maths is Hugging Face's
``LlamaForCausalLM`` (rotate-half RoPE, float32 norms and softmax), so converted weights give
its logits (tests/convert).

Every parameter is a float32 `nnx.Param` created through `_param`, which attaches the
Megatron-style tensor-parallel layout as Flax NNX `out_sharding` metadata (logical names =
mesh axis names, here only "tensor"). Construction never places arrays: the runtime reads
the layout back with `partition_specs` and puts each stage's state on its own mesh.

Layout on the "tensor" axis (t = tensor degree):
- wq, w_gate, w_up: column-parallel (None, "tensor") -- each device owns n_heads/t query
  heads (or d_ff/t hidden units); attention and the SwiGLU product are local.
- wk, wv: column-parallel like wq when t divides n_kv_heads (each device owns the key/value
  heads its query heads read), else replicated: the Param carries ``tensor_units`` =
  n_kv_heads, and `partition_specs(module, tensor=t)` drops the axis when t does not divide it.
- wo, w_down: row-parallel ("tensor", None) -- partial sums, one all-reduce per sub-layer.
- embedding [vocab, d_model], untied: (None, "tensor"), sharded on d_model. The lookup is a
  gather along vocab, which GSPMD partitions as a pure pass-through when the gathered dim is
  unsharded: every device looks up its own columns, then one all-gather of [b, s, d] feeds
  the replicated RMSNorm.
- embedding, tied: ("tensor", None), sharded on vocab, so that the logits it also computes
  stay vocab-parallel (a masked gather plus an all-reduce of [b, s, d] for the lookup).
- lm_head [d_model, vocab]: (None, "tensor") -- vocab-parallel logits; GSPMD reduces the
  log-sum-exp and the target-logit pick across the axis, so full logits never exist on one
  device.
- RMSNorm scales: replicated (None,).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from h2jax.models._config import GPTConfig, RopeScaling
from h2jax.models._dropout import EMBED_LAYER, Dropout
from h2jax.models._segments import current_segments

TENSOR = "tensor"
"""Mesh axis name that tensor parallelism shards over (stage meshes are ("data", "tensor"))."""


def _param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    std: float,
    sharding: tuple[str | None, ...],
    *,
    tensor_units: int | None = None,
) -> nnx.Param:
    """A float32 normal(std) parameter annotated with its tensor-parallel layout.

    `eager_sharding=False`: the model is built on the host without a mesh; the runtime
    places the state onto each stage mesh from `partition_specs`. `tensor_units`: how many
    indivisible units (heads) the "tensor" dim holds, when a degree may not divide them.
    """
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    extra = {} if tensor_units is None else {"tensor_units": tensor_units}
    return nnx.Param(value, out_sharding=sharding, eager_sharding=False, **extra)


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


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The rotary angular frequencies [head_dim / 2] (radians per token), float32.

    theta ** (-2i / head_dim), then the scaling variant (Hugging Face's
    ``_compute_llama3_parameters`` / ``linear``), computed in float64 and rounded once.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: long wavelengths / factor, short ones kept, a smooth blend between
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def _rope(x: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary positions on x [b, s, heads, head_dim], rotate-half convention, math in float32."""
    seq_len, half = x.shape[1], x.shape[-1] // 2
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [s, half]
    cos = jnp.cos(angles)[None, :, None, :]  # [1, s, 1, half]
    sin = jnp.sin(angles)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


@functools.cache
def _have_cudnn() -> bool:
    """Whether this process can trace cuDNN's fused attention (a CUDA backend with cuDNN)."""
    from xla_plugins import cudnn_fused_attention_available

    try:
        return cudnn_fused_attention_available() and any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:  # no backend could be made: use XLA's attention
        return False


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str, segments: jax.Array | None = None) -> jax.Array:
    """Causal attention of q [b, s, n_heads, hd] over k, v [b, s, n_kv_heads, hd]; with
    ``segments`` (int32 [b, s], packed documents) a token attends only to its own document's
    tokens (XLA's implementation, a [b, 1, s, s] mask).

    `impl` "auto": on NVIDIA, in bfloat16/float16, when this process has cuDNN, the program
    lowers to cuDNN's fused kernel (chosen per platform at lowering, so a CPU stage of the same
    process still lowers to XLA's); everywhere else XLA's implementation.

    XLA's implementation masks the float32 [s, s] scores with a `where`, and left to itself
    the backward would keep, per score, the broadcast bool mask, the masked scores, their exp
    and the probabilities (9 + dtype bytes: 13 in bf16, 3x a fused kernel's whole footprint at
    seq 4096 for a LLaMA-7B shape). It runs under `jax.checkpoint` saving nothing, so the
    backward keeps q, k, v (its inputs) and recomputes the scores and softmax, as a fused
    kernel does: one extra q.k^T matmul per backward, activation memory linear in seq_len.
    """

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    if segments is not None:

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        def masked(q, k, v, segments):
            same = (segments[:, :, None] == segments[:, None, :])[:, None]  # [b, 1, s, s]
            return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, implementation="xla")

        return masked(q, k, v, segments)

    fused_ok = q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0
    if impl == "auto" and fused_ok and _have_cudnn():

        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=xla)
    return xla(q, k, v)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions; no biases."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.dtype, self.impl = jnp.dtype(cfg.dtype), cfg.attention
        inner, kv_inner = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = _param(rngs, (cfg.d_model, inner), cfg.init_std, (None, TENSOR))
        self.wk = _param(rngs, (cfg.d_model, kv_inner), cfg.init_std, (None, TENSOR), tensor_units=cfg.kv_heads)
        self.wv = _param(rngs, (cfg.d_model, kv_inner), cfg.init_std, (None, TENSOR), tensor_units=cfg.kv_heads)
        self.wo = _param(rngs, (inner, cfg.d_model), cfg.init_std, (TENSOR, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        dt = self.dtype

        def heads(w: nnx.Param, n: int) -> jax.Array:  # [b, s, d] @ [d, n*hd] -> [b, s, n, hd]
            return (x @ w[...].astype(dt)).reshape(b, s, n, self.head_dim)

        inv_freq = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        q = _rope(heads(self.wq, self.n_heads), inv_freq)
        k = _rope(heads(self.wk, self.n_kv_heads), inv_freq)
        v = heads(self.wv, self.n_kv_heads)
        out = attend(q, k, v, impl=self.impl, segments=current_segments()).reshape(b, s, self.n_heads * self.head_dim)
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

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, seed: int = 0):
        self.dtype = jnp.dtype(cfg.dtype)
        layout = (TENSOR, None) if cfg.tie_embeddings else (None, TENSOR)
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, layout)
        if cfg.dropout:  # no layer at all at rate 0: the default model's program is unchanged
            self.dropout = Dropout(cfg.dropout, seed=seed, layer=EMBED_LAYER, site=0)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
        return self.dropout(h) if hasattr(self, "dropout") else h


class Block(nnx.Module):
    """Pre-norm transformer block: h + drop(attn(norm(h))), then h + drop(mlp(norm(h))).
    [b, s, d] -> same. ``layer``: its index in the model (the dropout keys' layer); the
    dropouts exist only when ``cfg.dropout`` > 0 (site 0 after attention, 1 after the MLP)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, layer: int, seed: int = 0):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)
        if cfg.dropout:
            self.attn_dropout = Dropout(cfg.dropout, seed=seed, layer=layer, site=0)
            self.mlp_dropout = Dropout(cfg.dropout, seed=seed, layer=layer, site=1)

    def __call__(self, h: jax.Array) -> jax.Array:
        dropped = hasattr(self, "attn_dropout")
        a = self.attn(self.attn_norm(h))
        h = h + (self.attn_dropout(a) if dropped else a)
        m = self.mlp(self.mlp_norm(h))
        return h + (self.mlp_dropout(m) if dropped else m)


class Head(nnx.Module):
    """Final RMSNorm, lm_head (its own [d_model, vocab], or the embedding [vocab, d_model] when
    tied), mean token cross-entropy in float32 -> scalar loss. Negative targets (padding,
    h2jax.data.PAD) carry no loss: the mean is over the others."""

    masked_targets = True  # the runtime trains unpacked (padded) data only with a head that says so

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, embedding: nnx.Param | None = None):
        self.dtype = jnp.dtype(cfg.dtype)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if cfg.tie_embeddings:
            if embedding is None:
                raise ValueError("model.tie_embeddings=true: the head needs the embedding Param it shares")
            self.embedding = embedding  # the same Param object: one parameter, two uses
        else:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, (None, TENSOR))

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 logits [b, s, vocab] (inference helper; the loss path uses the same math)."""
        if hasattr(self, "embedding"):
            w = self.embedding[...].astype(self.dtype)
            return jnp.einsum("bsd,vd->bsv", self.norm(h), w, preferred_element_type=jnp.float32)
        w = self.lm_head[...].astype(self.dtype)
        return jnp.einsum("bsd,dv->bsv", self.norm(h), w, preferred_element_type=jnp.float32)

    def __call__(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        real = targets >= 0
        losses = optax.softmax_cross_entropy_with_integer_labels(self.logits(h), jnp.where(real, targets, 0))
        # the loss and the count of real targets in one reduction, after the losses: a reduction
        # of the targets alone could be scheduled anywhere in a stage program, and across the
        # processes of a data-parallel stage (one process per device) its collective then meets
        # the program's blocking transfers in another order on each process (a hang, measured)
        both = jnp.stack([jnp.where(real, losses, 0.0), real.astype(losses.dtype)])
        total, count = jnp.sum(both, axis=tuple(range(1, both.ndim)))
        return total / jnp.maximum(count, 1.0)


class GPT(nnx.Module):
    """The LLaMA-family decoder-only transformer: `embed`, `blocks` (nnx.List of n_layers
    Block), `head`. (GPT is its historical name in h2jax; the architecture is LLaMA's.)"""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, seed: int = 0):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs=rngs, seed=seed)
        self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=i, seed=seed) for i in range(cfg.n_layers)])
        self.head = Head(cfg, rngs=rngs, embedding=self.embed.embedding if cfg.tie_embeddings else None)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """Hidden states after the last block, before the final norm: [b, s, d_model]."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def logits(self, tokens: jax.Array) -> jax.Array:
        """float32 next-token logits [b, s, vocab] of int32 tokens [b, s]."""
        return self.head.logits(self.hidden(tokens))

    def __call__(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy (float32 scalar) of int32 tokens/targets [b, s]."""
        return self.head(self.hidden(tokens), targets)


def build_model(cfg: GPTConfig, *, seed: int) -> GPT:
    """A freshly initialised model; the same (cfg, seed) gives bit-identical parameters (and,
    with dropout, the same masks at every step)."""
    return GPT(cfg, rngs=nnx.Rngs(seed), seed=seed)
