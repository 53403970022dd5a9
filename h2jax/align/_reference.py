"""The float64 reference of ``h2jax align``: a program's mathematics without its rounding.

The reference is the flat program of :mod:`h2jax._jaxpr` evaluated with every
float32/float16/bfloat16 value and dtype parameter widened to float64
(:func:`run_op_reference`, under ``jax.enable_x64``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from h2jax._jaxpr import Op, evaluate, run_op, trace
from h2jax.plan import NumericsPolicy

_NARROW_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _widen_dtype(value: Any) -> Any:
    if isinstance(value, np.dtype) and value in _NARROW_FLOATS:
        return np.dtype(np.float64)
    return value


def widen(x: Any) -> Any:
    """float32/float16/bfloat16 -> float64; anything else unchanged."""
    if _is_float(x) and jnp.result_type(x) in _NARROW_FLOATS:
        return jnp.asarray(x, jnp.float64)
    return x


def run_op_reference(op: Op, invals: Sequence[Any]) -> list[Any]:
    """Evaluate ``op`` in float64 (call under ``jax.enable_x64(True)``).

    Inputs are widened, and so is every floating dtype parameter (a convert_element_type
    to float32 becomes one to float64, a dot_general's preferred_element_type float64, ...):
    the reference computes the model's mathematics without its roundings. Ops with a body
    (scan, cond) run as traced and their outputs are widened.
    """
    if op.opaque:
        narrowed = [jnp.asarray(x, a.dtype) if hasattr(a, "dtype") else x for x, a in zip(invals, op.in_avals)]
        return [widen(o) for o in run_op(op, narrowed, NumericsPolicy())]
    params = {k: _widen_dtype(v) for k, v in op.params.items()}
    if op.name == "dot_general":
        params["precision"] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    outs = op.primitive.bind(*[widen(x) for x in invals], **params)
    outs = list(outs) if op.primitive.multiple_results else [outs]
    return [widen(o) for o in outs]


def reference(fn: Callable, *example_args: Any) -> Callable:
    """``fn`` evaluated in float64: traced now (in the dtypes of ``example_args``), evaluated with
    inputs, constants and dtype parameters widened. Call the result (or ``jax.jit`` of it)
    under ``jax.enable_x64(True)``; it takes the same arguments as ``fn``."""
    prog = trace(fn, *example_args)

    def wrapped(*args: Any) -> Any:
        leaves = [widen(x) for x in jax.tree.leaves(args)]
        outs = evaluate(prog, leaves, run_op_reference, const=widen)
        return jax.tree.unflatten(prog.out_tree, outs)

    return wrapped
