"""``h2jax align``: numerical alignment of chip types against a float64 reference.

Three levels (see docs/ALIGN.md): every operator of one training step with the reference's
inputs (:func:`op_level`), every layer's output and gradient of one step
(:func:`layer_level`), and the loss curve over N steps (:func:`run_level`); :func:`align`
runs them and :func:`replay` re-runs a dumped failing operator. :func:`apply_policy` (defined in
:mod:`h2jax._jaxpr`, below the runtime, which compiles a chip type's programs with it) applies a
:class:`~h2jax.plan.NumericsPolicy`; :func:`reference` is the float64 program it is measured against.
"""

from h2jax._jaxpr import (
    Fault,
    FlatProgram,
    Op,
    PolicyError,
    ScopedPolicy,
    apply_policy,
    module_scopes,
    run_op,
    trace,
)
from h2jax.align._compare import DTYPE_RTOL, Metrics, compare, op_status, ratio_status
from h2jax.align._levels import DEFAULT_LAYER_GATE, LayerLevel, OpLevel, layer_level, op_level
from h2jax.align._reference import reference
from h2jax.align._report import AlignReport, plot_run
from h2jax.align._runlevel import DEFAULT_MRE_GATE, RunLevel, run_level, train_losses
from h2jax.align._targets import AlignInputError, ChipTarget, load_experiment, plan_policy, resolve_chips
from h2jax.align._tool import DEFAULT_STEPS, LEVELS, align, replay
from h2jax.plan import NumericsError, NumericsPolicy, parse_numerics

__all__ = [
    "DEFAULT_LAYER_GATE",
    "DEFAULT_MRE_GATE",
    "DEFAULT_STEPS",
    "DTYPE_RTOL",
    "LEVELS",
    "AlignInputError",
    "AlignReport",
    "ChipTarget",
    "Fault",
    "FlatProgram",
    "LayerLevel",
    "Metrics",
    "NumericsError",
    "NumericsPolicy",
    "Op",
    "OpLevel",
    "PolicyError",
    "RunLevel",
    "ScopedPolicy",
    "align",
    "apply_policy",
    "compare",
    "layer_level",
    "load_experiment",
    "module_scopes",
    "op_level",
    "op_status",
    "parse_numerics",
    "plan_policy",
    "plot_run",
    "ratio_status",
    "reference",
    "replay",
    "resolve_chips",
    "run_level",
    "run_op",
    "trace",
    "train_losses",
]
