"""A stage's backward split into B (input gradient) and W (weight gradient), for any model.

Trace the stage function ``f(params, x, targets)`` to a jaxpr and sort its values: those
computed from the parameters alone ("param-only": the parameters, their casts, slices,
broadcasts) and those that involve the input ("activation"). An equation that reads both a
param-only and an activation value is a *mixing* equation (a matmul of an activation with
a weight, a norm's scale, the embedding gather). The parameters reach the output only
through mixing equations, so by the chain rule

    df/dparams = sum over mixing equations k of  J_k^T g_k

where ``g_k`` is the cotangent of equation k's output and ``J_k`` its derivative through
its param-only inputs, its activation inputs held fixed. Hence:

- **B** differentiates ``f`` with respect to the input and to a zero *probe* added to every
  mixing output (``g_k`` is the cotangent of probe k). The parameters are not
  differentiated, so no weight-gradient work is traced at all.
- **W** re-evaluates only the param-only chain and the mixing equations, with the
  activation inputs B (or the forward) kept, and transposes them against ``g_k``: one
  weight gradient per mixing equation and no chain through the activations. Its primal
  outputs are unused and XLA's dead-code elimination removes them.

A call equation (``pjit``, ``remat``, ``custom_vjp``) that takes both kinds of value is one
mixing equation: still exact, but W then backpropagates inside it, so the split is as fine
as the model's top-level equations (h2jax's blocks call their matmuls directly).

B and W are separate jitted programs, so each compiles only its own half (the tests
compare XLA's compiled FLOPs with the unsplit backward's). The split is exact, not an
approximation: B + W compute the same sums as ``jax.vjp`` of ``f``, in another order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from h2jax._jaxpr import bind_eqn

_CONST, _PARAM, _ACT = 0, 1, 2  # value classes: constant, param-only, involves the input


def _is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


@dataclass(frozen=True)
class SplitJaxpr:
    """The analysed jaxpr of one stage function at one set of input shapes."""

    closed: Any  # ClosedJaxpr of f(params, *inputs)
    num_params: int  # leading invars that are parameter leaves
    out_tree: Any
    classes: dict[Any, int]  # Var -> _CONST | _PARAM | _ACT
    mixing: tuple[int, ...]  # indices of mixing equations
    probed: tuple[tuple[int, int], ...]  # (eqn, output) that get a probe: float outputs of mixing eqns
    kept: tuple[tuple[int, int], ...]  # (eqn, input) activation inputs of mixing eqns: what W needs

    def probe_zeros(self) -> list[jax.Array]:
        eqns = self.closed.jaxpr.eqns
        return [jnp.zeros(eqns[e].outvars[o].aval.shape, eqns[e].outvars[o].aval.dtype) for e, o in self.probed]

    def forward(
        self, param_leaves: Sequence[Any], input_leaves: Sequence[Any], probes: Sequence[Any]
    ) -> tuple[Any, list[Any]]:
        """(f's output with probe k added to mixing output k, the activation inputs W needs)."""
        jaxpr = self.closed.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, self.closed.consts))
        env.update(zip(jaxpr.invars, [*param_leaves, *input_leaves]))
        probe_at = dict(zip(self.probed, probes))
        kept_at = set(self.kept)
        kept: dict[tuple[int, int], Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            for j, val in enumerate(invals):
                if (i, j) in kept_at:
                    kept[(i, j)] = val
            outs = bind_eqn(eqn, invals)
            for j, val in enumerate(outs):
                if (i, j) in probe_at:
                    val = val + probe_at[(i, j)]
                env[eqn.outvars[j]] = val
        out = [read(v) for v in jaxpr.outvars]
        return jax.tree.unflatten(self.out_tree, out), [kept[k] for k in self.kept]

    def mixing_outputs(self, param_leaves: Sequence[Any], kept: Sequence[Any]) -> list[Any]:
        """The probed outputs as functions of the parameters alone, every activation input of
        a mixing equation fixed to its kept value; activation-only equations are skipped."""
        jaxpr = self.closed.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, self.closed.consts))
        env.update(zip(jaxpr.invars[: self.num_params], param_leaves))
        fixed = dict(zip(self.kept, kept))
        mixing = set(self.mixing)
        outs_at: dict[tuple[int, int], Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for i, eqn in enumerate(jaxpr.eqns):
            if i in mixing:
                invals = [fixed[(i, j)] if (i, j) in fixed else read(v) for j, v in enumerate(eqn.invars)]
                for j, val in enumerate(bind_eqn(eqn, invals)):
                    outs_at[(i, j)] = val
            elif all(isinstance(v, jcore.Literal) or self.classes[v] != _ACT for v in eqn.invars):
                for v, val in zip(eqn.outvars, bind_eqn(eqn, [read(v) for v in eqn.invars])):
                    env[v] = val
        return [outs_at[k] for k in self.probed]


def analyse(fn: Callable[..., Any], params: Any, *inputs: Any) -> SplitJaxpr:
    """Trace ``fn(params, *inputs)`` and find its mixing equations (module docstring)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *inputs)
    jaxpr = closed.jaxpr
    num_params = len(jax.tree.leaves(params))
    classes: dict[Any, int] = {v: _CONST for v in jaxpr.constvars}
    for k, v in enumerate(jaxpr.invars):
        classes[v] = _PARAM if k < num_params else _ACT
    mixing, probed, kept = [], [], []
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [_CONST if isinstance(v, jcore.Literal) else classes[v] for v in eqn.invars]
        if _ACT in ins and _PARAM in ins:
            mixing.append(i)
            probed += [(i, j) for j, v in enumerate(eqn.outvars) if _is_float(v.aval)]
            kept += [(i, j) for j, c in enumerate(ins) if c == _ACT]
            cls = _ACT
        else:
            cls = max(ins, default=_CONST)
        for v in eqn.outvars:
            classes[v] = cls
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal) and classes[v] == _PARAM and _is_float(v.aval):
            raise ValueError(
                "a stage output depends on the parameters alone; the B/W split needs it to involve the input"
            )
    return SplitJaxpr(
        closed=closed,
        num_params=num_params,
        out_tree=jax.tree.structure(out_shape),
        classes=classes,
        mixing=tuple(mixing),
        probed=tuple(probed),
        kept=tuple(kept),
    )
