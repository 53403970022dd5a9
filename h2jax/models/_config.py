"""GPTConfig: the shape of the decoder-only transformer, and the sizes tensor parallelism splits."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer (pre-norm RMSNorm, RoPE attention, SwiGLU MLP)."""

    vocab_size: int = 256
    """Number of token ids (rows of the embedding, columns of the untied lm_head)."""

    seq_len: int = 128
    """Training context length, in tokens. The model itself accepts any length up to this."""

    d_model: int = 128
    """Width of the residual stream (hidden size), in elements per token."""

    n_heads: int = 4
    """Attention heads per layer; head_dim = d_model / n_heads. The tensor degree must divide it."""

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
        try:
            dtype = np.dtype(getattr(ml_dtypes, self.dtype, self.dtype))
            ml_dtypes.finfo(dtype)  # raises for integer, bool and non-numeric dtypes
        except (TypeError, ValueError) as e:
            raise ValueError(f"model.dtype={self.dtype!r} is not a floating dtype name") from e

    @property
    def head_dim(self) -> int:
        """Width of one attention head, in elements: d_model // n_heads."""
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Exact number of parameters (scalars) of `GPT(self)`, by arithmetic alone."""
        d, inner = self.d_model, self.n_heads * self.head_dim
        attention = 3 * d * inner + inner * d  # wq, wk, wv, wo
        mlp = 3 * d * self.d_ff  # w_gate, w_up, w_down
        block = attention + mlp + 2 * d  # + two RMSNorm scales
        embed = self.vocab_size * d
        head = d + d * self.vocab_size  # final RMSNorm scale + untied lm_head
        return embed + self.n_layers * block + head


def tensor_divisible_dims(cfg: GPTConfig) -> dict[str, int]:
    """Sizes that a stage's tensor degree must divide, keyed by their config key.

    Heads are split across the "tensor" axis (wq/wk/wv columns, wo rows), so are the SwiGLU
    hidden units (d_ff) and the vocabulary columns of lm_head. d_model (embedding columns)
    is n_heads * head_dim, so it is divisible whenever n_heads is.
    """
    return {
        "model.n_heads": cfg.n_heads,
        "model.d_ff": cfg.d_ff,
        "model.vocab_size": cfg.vocab_size,
    }
