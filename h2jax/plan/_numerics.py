"""The numerics policy of a chip type: how it computes the model's arithmetic.

Vendors compute the same float32 program differently: NVIDIA's tensor cores run fp32
matmuls as TF32 (10-bit mantissa inputs) unless told otherwise, TPUs as bf16 passes,
CPUs in full fp32. A :class:`NumericsPolicy` states, per chip type, what its stage
programs do, so that ``h2jax align`` can measure the gap to a reference and the runtime can
close it by choosing another policy.

Pure data (no JAX import): the runtime and ``h2jax.align`` apply it
(:func:`h2jax.align.apply_policy`). Fields:

- ``matmul_precision``: the precision XLA is asked for on every fp32 matmul (the
  ``precision_config`` of each ``dot_general``): ``default`` (the backend's fastest: TF32
  on NVIDIA Ampere and later, one bf16 pass on TPU), ``high`` (bf16_3x / TF32_3x) or
  ``highest`` (true fp32). XLA's CPU backend computes fp32 whatever it is asked, so on the
  host and on emulated chips this changes the compiled program but not its numbers.
- ``matmul_input_rounding``: ``none``, ``bf16`` or ``tf32``: every floating matmul input is
  rounded to that many mantissa bits (round to nearest even; 7 for bf16, 10 for tf32)
  before an fp32-accumulated product. This is how an emulated chip type *declares* numerics
  that differ from the host's: the rounding ops are real ops in its compiled program.
- ``compute_dtype``: the dtype activations and matmuls run in (``model.dtype`` for that
  chip's stages); None: the experiment's ``model.dtype``.

The policy that computes exactly as the host CPU in fp32 is ``NumericsPolicy()``
(``highest``, no rounding, the model's dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MATMUL_PRECISIONS = ("default", "high", "highest")
INPUT_ROUNDINGS = ("none", "bf16", "tf32")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
MANTISSA_BITS = {"bf16": 7, "tf32": 10}
"""Explicit mantissa bits kept by each matmul input rounding (fp32 has 23)."""


class NumericsError(ValueError):
    """A numerics policy key or value is wrong; ``key`` is its dotted path."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


@dataclass(frozen=True)
class NumericsPolicy:
    """How one chip type computes: matmul precision, matmul input rounding, compute dtype."""

    matmul_precision: str = "highest"
    """XLA precision of fp32 matmuls: default (backend's fastest, e.g. TF32) | high | highest (fp32)."""
    matmul_input_rounding: str = "none"
    """Round matmul inputs before the fp32-accumulated product: none | bf16 (7 mantissa bits) | tf32 (10)."""
    compute_dtype: str | None = None
    """Activations and matmuls in this dtype (float32 | bfloat16 | float16); None: the experiment's model.dtype."""

    def __post_init__(self) -> None:
        check = (
            ("matmul_precision", self.matmul_precision, MATMUL_PRECISIONS),
            ("matmul_input_rounding", self.matmul_input_rounding, INPUT_ROUNDINGS),
        )
        for name, value, allowed in check:
            if value not in allowed:
                raise NumericsError(name, f"got {value!r}; expected one of {' | '.join(allowed)}")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise NumericsError(
                "compute_dtype", f"got {self.compute_dtype!r}; expected null or one of {' | '.join(COMPUTE_DTYPES)}"
            )

    @property
    def is_exact(self) -> bool:
        """True when the policy computes as the host does in the model's dtype (the fp32 reference policy)."""
        return (
            self.matmul_precision == "highest" and self.matmul_input_rounding == "none" and self.compute_dtype is None
        )

    @property
    def mantissa_bits(self) -> int | None:
        """Mantissa bits matmul inputs are rounded to; None: not rounded."""
        return MANTISSA_BITS.get(self.matmul_input_rounding)

    def describe(self) -> str:
        """One line for tables: e.g. ``highest, inputs bf16, model dtype``."""
        rounding = "inputs exact" if self.matmul_input_rounding == "none" else f"inputs {self.matmul_input_rounding}"
        return f"{self.matmul_precision}, {rounding}, {self.compute_dtype or 'model dtype'}"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_numerics(raw: Mapping[str, Any] | NumericsPolicy | None, *, key: str = "numerics") -> NumericsPolicy:
    """A policy from a YAML mapping; unknown keys and bad values raise NumericsError naming ``key.field``.

    ``None`` or ``{}`` is the exact policy. Keys: matmul_precision, matmul_input_rounding,
    compute_dtype (see :class:`NumericsPolicy`).
    """
    if raw is None:
        return NumericsPolicy()
    if isinstance(raw, NumericsPolicy):
        return raw
    if not isinstance(raw, Mapping):
        raise NumericsError(key, f"got {raw!r}; expected a mapping like {{matmul_input_rounding: bf16}}")
    names = [f.name for f in fields(NumericsPolicy)]
    unknown = sorted(str(k) for k in raw if k not in names)
    if unknown:
        raise NumericsError(f"{key}.{unknown[0]}", f"unknown key; expected one of {', '.join(names)}")
    for name, value in raw.items():
        if name == "compute_dtype" and value is None:
            continue
        if not isinstance(value, str):
            raise NumericsError(f"{key}.{name}", f"got {value!r} ({type(value).__name__}); expected a string")
    try:
        return NumericsPolicy(**dict(raw))
    except NumericsError as e:
        raise NumericsError(f"{key}.{e.key}", e.message) from None
