"""GPTConfig: the shape of a LLaMA-family decoder-only transformer, and the sizes tensor parallelism splits.

Pure Python (no JAX): the config tree validates, and the planner counts parameters, before
any device exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROPE_SCALING_TYPES = ("linear", "llama3")
ATTENTION_IMPLS = ("auto", "xla")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are stretched for contexts beyond the pre-training length.

    The published variants of Hugging Face's ``rope_scaling`` that h2jax computes exactly:
    ``linear`` (every frequency / factor: position interpolation) and ``llama3`` (LLaMA 3.1:
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided
    by factor, shorter than .../high_freq_factor kept, smooth blend between).
    """

    type: str = "llama3"
    """Variant: "linear" or "llama3"."""
    factor: float = 8.0
    """How much longer the new context is than the original (dimensionless, > 0; 1: no change)."""
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original_max_position_embeddings / this are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original_max_position_embeddings / this are kept (> low_freq_factor)."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the context length (tokens) the model was pre-trained with before scaling."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a LLaMA-family decoder-only transformer (pre-norm RMSNorm, RoPE attention with
    grouped-query heads, SwiGLU MLP, no biases). The defaults are h2jax's small GPT: plain
    multi-head attention, unscaled RoPE, untied head."""

    vocab_size: int = 256
    """Number of token ids (rows of the embedding, columns of the lm_head)."""

    seq_len: int = 128
    """Training context length, in tokens. The model itself accepts any length up to this."""

    d_model: int = 128
    """Width of the residual stream (hidden size), in elements per token."""

    n_heads: int = 4
    """Query heads per layer; head_dim = d_model / n_heads. The tensor degree must divide it."""

    n_layers: int = 4
    """Number of transformer blocks: the unit a pipeline stage's layer range counts."""

    d_ff: int = 512
    """SwiGLU hidden size, in elements per token (w_gate and w_up are [d_model, d_ff])."""

    rope_theta: float = 10000.0
    """RoPE base: the wavelength of the slowest rotary frequency is 2*pi*rope_theta tokens."""

    norm_eps: float = 1e-5
    """Added to the mean square in RMSNorm before the reciprocal square root (dimensionless)."""

    init_std: float = 0.02
    """Standard deviation of the normal initialiser of every weight matrix; norms start at 1."""

    dtype: str = "float32"
    """Compute dtype of matmuls and activations ("float32", "bfloat16", ...). Parameters
    are always stored in float32; softmax, norms and the loss always run in float32."""

    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention: n_heads / n_kv_heads query heads share one).
    None: n_heads (multi-head attention); 1: multi-query. Must divide n_heads. Fewer kv heads
    shrink wk/wv and the attention's key/value activations by n_heads / n_kv_heads. A stage's
    tensor degree splits them when it divides n_kv_heads, else every device holds them all."""

    rope_scaling: RopeScaling | None = None
    """Rotary frequency scaling for long contexts (LLaMA 3.1's "llama3", or "linear"). None: unscaled."""

    tie_embeddings: bool = False
    """True: the lm_head is the embedding table (transposed), as in GPT-2 and small LLaMAs:
    vocab_size * d_model fewer parameters. The table is then split over the vocabulary
    under tensor parallelism (the logits stay vocab-parallel)."""

    attention: str = "auto"
    """Attention kernel, through jax.nn.dot_product_attention (causal, no mask array):
    "auto" -- cuDNN's fused kernel on NVIDIA for bfloat16/float16 when this process has
    cuDNN (it keeps O(seq) softmax statistics for the backward, not the [seq, seq]
    probabilities), XLA's elsewhere; "xla" -- XLA's everywhere."""

    dropout: float = 0.0
    """Dropout probability (0 <= p < 1) on the embedding output and on each block's attention
    and MLP outputs before they join the residual stream (GPT-2's embd_pdrop and resid_pdrop;
    the fused attention has no dropout of its probabilities). 0: no dropout layers at all.
    Masks are a pure function of (seed, step, microbatch, layer), so pipelined, recomputed
    and resumed runs draw the masks the sequential model would; evaluation and alignment run
    without it. Typical: 0.1 for small models trained long on little data, 0 for pre-training."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = d_model / n_heads = {self.d_model} / {self.n_heads} = {self.head_dim} "
                "must be even for rotary positions"
            )
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"model.norm_eps={self.norm_eps}, model.init_std={self.init_std} and "
                f"model.rope_theta={self.rope_theta} must all be > 0"
            )
        if not _is_float_dtype(self.dtype):
            raise ValueError(f"model.dtype={self.dtype!r} is not a floating dtype name")
        check_llama_fields(self)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, in elements: d_model // n_heads."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def num_params(self) -> int:
        """Exact number of parameters (scalars) of the model built from this config, by arithmetic alone."""
        from h2jax.plan import ModelShape  # the planner's count is the one definition

        return ModelShape.from_config(self).num_params()


def check_llama_fields(cfg: GPTConfig) -> None:
    """Value checks of n_kv_heads, rope_scaling, tie_embeddings, dropout and attention; ValueError naming the key."""
    kv = cfg.n_kv_heads
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or cfg.n_heads % kv):
        raise ValueError(f"model.n_kv_heads={kv!r}; expected a positive int that divides model.n_heads={cfg.n_heads}")
    if not isinstance(cfg.tie_embeddings, bool):
        raise ValueError(f"model.tie_embeddings={cfg.tie_embeddings!r}; expected true or false")
    p = cfg.dropout
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
        raise ValueError(f"model.dropout={p!r}; expected a probability 0 <= dropout < 1")
    if cfg.attention not in ATTENTION_IMPLS:
        raise ValueError(f"model.attention={cfg.attention!r}; expected one of {list(ATTENTION_IMPLS)}")
    rs = cfg.rope_scaling
    if rs is None:
        return
    if not isinstance(rs, RopeScaling):
        raise ValueError(f"model.rope_scaling={rs!r}; expected a mapping with keys type, factor, ... or null")
    if rs.type not in ROPE_SCALING_TYPES:
        raise ValueError(f"model.rope_scaling.type={rs.type!r}; expected one of {list(ROPE_SCALING_TYPES)}")
    if not rs.factor > 0:
        raise ValueError(f"model.rope_scaling.factor={rs.factor}; expected > 0")
    if rs.type == "llama3":
        if not 0 < rs.low_freq_factor < rs.high_freq_factor:
            raise ValueError(
                f"model.rope_scaling.low_freq_factor={rs.low_freq_factor}, high_freq_factor="
                f"{rs.high_freq_factor}; expected 0 < low_freq_factor < high_freq_factor"
            )
        if rs.original_max_position_embeddings < 1:
            raise ValueError(
                f"model.rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings}; "
                "expected >= 1"
            )


def tensor_divisible_dims(cfg: GPTConfig) -> dict[str, int]:
    """Sizes that a stage's tensor degree must divide, keyed by their config key.

    Query heads are split across the "tensor" axis (wq columns, wo rows), so are the SwiGLU
    hidden units (d_ff) and the vocabulary columns of lm_head (rows of a tied embedding).
    d_model (embedding columns) is n_heads * head_dim, so it is divisible whenever n_heads
    is. Key/value heads are not listed: a degree that does not divide them replicates wk/wv.
    """
    return {
        "model.n_heads": cfg.n_heads,
        "model.d_ff": cfg.d_ff,
        "model.vocab_size": cfg.vocab_size,
    }


def _is_float_dtype(name: str) -> bool:
    """Whether ``name`` names a floating dtype: numpy's own (float32, float16, ...) or one of
    ml_dtypes' (bfloat16, float8_e4m3fn, ...). ml_dtypes is imported only for a name numpy does
    not know: its import takes most of a second, and commands that only read a config
    (check-config, plan) need none of it."""
    try:
        if np.issubdtype(np.dtype(name), np.floating):
            return True
    except TypeError:
        pass
    import ml_dtypes

    try:
        ml_dtypes.finfo(np.dtype(getattr(ml_dtypes, name, name)))  # raises for integer, bool and non-numeric dtypes
    except (TypeError, ValueError):
        return False
    return True
