"""Op level and layer level: one training step, against the float64 reference.

Op level: the step's forward and backward (``jax.value_and_grad`` of the loss) flattened to
primitives; the reference evaluates them in float64 on the host, and every op is also run,
*with the reference's inputs* (rounded to the op's own dtypes), on the host in the traced
dtype (the baseline) and on each chip type with its policy. So each op's error is its own,
not the sum of everything before it. The first failing op's inputs and reference outputs
are written to an ``.npz`` for ``h2jax align --replay``.

Layer level: the whole step run end to end on each chip type (errors compound, as in
training): the relative L2 error of the embedding's and every block's output (fwd) and of
every parameter's gradient (bwd); the first divergent layer is named -- in forward order
for outputs, in backward order (head first) for gradients.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from h2jax._jaxpr import FlatProgram, Op, apply_policy, evaluate, run_op, trace
from h2jax.align._compare import DTYPE_RTOL, Metrics, compare, compare_exact, op_status, ratio, tolerance, worst
from h2jax.align._reference import reference, run_op_reference
from h2jax.align._reference import widen as widen_value
from h2jax.align._targets import HOST, ChipTarget, Experiment, graphdef_for, step_hiddens, step_loss
from h2jax.plan import NumericsPolicy

EXACT_PRIMITIVES = frozenset(
    {
        "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice", "dynamic_slice",
        "dynamic_update_slice", "concatenate", "pad", "split", "copy", "copy_p", "select_n", "gather", "rev", "iota",
    }
)  # fmt: skip
"""Primitives that only move or pick elements: exact on every IEEE backend, so the op level
skips them unless asked for all ops (``all_ops=True``; a backend bug would show there)."""

DEFAULT_LAYER_GATE = 2e-3
BASELINE = "<host baseline>"  # the host run with no policy; `cpu` itself may be a compared chip
"""Per-layer relative L2 gate (outputs and parameter gradients), marin's gate for JaxPP parity."""


@dataclass
class OpRow:
    """One op of the step compared on every chip type."""

    op: Op
    dtype: str
    tol: float
    baseline: Metrics
    chips: dict[str, Metrics] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)  # chip error / host baseline error
    pair: tuple[str, float] | None = None  # (status, chip B error / chip A error)

    def to_dict(self) -> dict[str, Any]:
        op = self.op
        return {
            "index": op.index,
            "primitive": op.name,
            "module": op.module,
            "direction": op.direction,
            "source": op.source,
            "dtype": self.dtype,
            "shape": list(op.out_avals[0].shape) if op.out_avals else [],
            "tolerance": self.tol,
            "baseline": self.baseline.to_dict(),
            "chips": {
                n: {**m.to_dict(), "status": self.status[n], "ratio_to_host": self.ratio[n]}
                for n, m in self.chips.items()
            },
            "pair": {"status": self.pair[0], "ratio": self.pair[1]} if self.pair else None,
        }


@dataclass
class OpLevel:
    rows: list[OpRow]
    chips: list[str]
    num_ops: int
    first_fail: dict[str, OpRow]  # chip -> its first failing op
    dumps: dict[str, str]  # chip -> replay file
    seconds: float = 0.0

    def passed(self) -> bool:
        return not self.first_fail and all(r.pair is None or r.pair[0] != "fail" for r in self.rows)

    def divergent(self, chip: str) -> list[OpRow]:
        return [r for r in self.rows if r.status.get(chip) == "fail"]


def _worst_output(outs: Sequence[Any], refs: Sequence[Any], avals: Sequence[Any]) -> Metrics:
    best: Metrics | None = None
    for out, ref, aval in zip(outs, refs, avals):
        if not hasattr(aval, "dtype"):
            continue
        a, r = np.asarray(out), np.asarray(ref)
        m = compare(a, r) if jnp.issubdtype(aval.dtype, jnp.floating) else compare_exact(a, r)
        if best is None or (m.nonfinite_mismatch, m.rel_l2) > (best.nonfinite_mismatch, best.rel_l2):
            best = m
    return best if best is not None else compare(np.zeros(0), np.zeros(0))


def _narrow(values: Sequence[Any], op: Op) -> list[Any]:
    """Reference inputs as the op saw them: rounded to the traced dtypes (host numpy)."""
    out = []
    for x, aval in zip(values, op.in_avals):
        if hasattr(aval, "dtype") and hasattr(x, "dtype"):
            out.append(np.asarray(x).astype(aval.dtype))
        else:
            out.append(x)
    return out


def op_program(exp: Experiment, microbatches: int = 1) -> tuple[FlatProgram, list[Any]]:
    """The flat program of one step's value_and_grad on ``microbatches`` microbatches, and its flat inputs."""
    tokens, targets = exp.tokens[:microbatches], exp.targets[:microbatches]
    fn = jax.value_and_grad(step_loss(exp.graphdef))
    prog = trace(fn, exp.params, tokens, targets)
    return prog, jax.tree.leaves((exp.params, tokens, targets))


def op_level(
    exp: Experiment,
    chips: Sequence[ChipTarget],
    *,
    microbatches: int = 1,
    tolerances: Mapping[str, float] | None = None,
    dump_dir: str | Path | None = None,
    config_yaml: str = "",
    all_ops: bool = False,
) -> OpLevel:
    """Every op of one step on every chip type with the reference's inputs; see the module doc."""
    import time

    start = time.perf_counter()
    prog, leaves = op_program(exp, microbatches)
    host = jax.devices(HOST)[0]
    exact = NumericsPolicy()
    rows: list[OpRow] = []
    first_fail: dict[str, OpRow] = {}
    dumps: dict[str, str] = {}

    def visit(op: Op, ref_in: list[Any], ref_out: list[Any]) -> None:
        float_out = [a for a in op.out_avals if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
        if not op.out_avals or not any(hasattr(a, "dtype") for a in op.out_avals):
            return
        if not all_ops and op.name in EXACT_PRIMITIVES:
            return
        ins = _narrow(ref_in, op)
        refs = [np.asarray(r) for r in ref_out]
        base_out = run_op(op, [jax.device_put(x, host) if isinstance(x, np.ndarray) else x for x in ins], exact)
        dtype = str(float_out[0].dtype) if float_out else str(op.out_avals[0].dtype)
        tol = tolerance(dtype, op.name, tolerances)
        row = OpRow(op, dtype, tol, _worst_output(base_out, refs, op.out_avals))
        for chip in chips:
            args = [jax.device_put(x, chip.device) if isinstance(x, np.ndarray) else x for x in ins]
            out = run_op(op, args, chip.policy, chip.fault)
            m = _worst_output(out, refs, op.out_avals)
            row.chips[chip.name] = m
            row.status[chip.name], row.ratio[chip.name] = op_status(m, row.baseline, tol)
            if row.status[chip.name] == "fail" and chip.name not in first_fail:
                first_fail[chip.name] = row
                if dump_dir is not None:
                    dumps[chip.name] = str(dump_op(dump_dir, chip, row, ins, refs, microbatches, config_yaml))
        if len(chips) >= 2:
            a, b = chips[0].name, chips[1].name
            status, r = op_status(row.chips[b], row.chips[a], tol)
            row.pair = (status, r)
        rows.append(row)

    with jax.enable_x64(True), jax.default_device(host):  # the reference is the host, even where a GPU is the default
        evaluate(prog, [widen_value(x) for x in leaves], run_op_reference, visit=visit, const=widen_value)
    return OpLevel(rows, [c.name for c in chips], len(prog.ops), first_fail, dumps, time.perf_counter() - start)


def dump_op(
    folder: str | Path, chip: ChipTarget, row: OpRow, ins: list[Any], refs: list[Any], microbatches: int, config: str
) -> Path:
    """Write ``<folder>/replay_<chip>_op<index>.npz``: the op's inputs (as it saw them), the
    reference outputs (float64), and what finds the op again (experiment YAML, op index)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    op = row.op
    meta = {
        "chip": chip.name,
        "index": op.index,
        "primitive": op.name,
        "module": op.module,
        "direction": op.direction,
        "source": op.source,
        "microbatches": microbatches,
        "metrics": row.chips[chip.name].to_dict(),
        "policy": chip.policy.to_dict() if isinstance(chip.policy, NumericsPolicy) else None,
        "num_inputs": len(ins),
        "num_outputs": len(refs),
    }
    arrays = {f"in_{i}": np.asarray(x) for i, x in enumerate(ins)}
    arrays.update({f"ref_{i}": np.asarray(r) for i, r in enumerate(refs)})
    safe = chip.name.replace(":", "_").replace("/", "_")
    path = folder / f"replay_{safe}_op{op.index}.npz"
    np.savez(path, meta=np.array(json.dumps(meta)), config=np.array(config), **arrays)
    return path


# -- layer level -------------------------------------------------------------------------------
@dataclass
class LayerRow:
    layer: str
    direction: str
    rel_l2: dict[str, float]  # chip -> worst rel L2 in this layer (gradients: over its parameters)
    ratio: dict[str, float]
    status: dict[str, str]
    params: dict[str, dict[str, float]] = field(default_factory=dict)  # bwd: parameter -> chip -> rel L2

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "direction": self.direction,
            "rel_l2": self.rel_l2,
            "ratio_to_host": self.ratio,
            "status": self.status,
            "params": self.params,
        }


@dataclass
class LayerLevel:
    rows: list[LayerRow]
    chips: list[str]
    gate: float
    loss: dict[str, float]
    first_divergent: dict[str, dict[str, str | None]]  # chip -> {"fwd": layer, "bwd": layer}
    seconds: float = 0.0

    def passed(self) -> bool:
        return all(s != "fail" for r in self.rows for s in r.status.values())


def _layer_of(path: str) -> str:
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def _flat_grads(grads: Any) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        key = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[key.removesuffix(".value")] = np.asarray(leaf, dtype=np.float64)
    return out


def layer_level(exp: Experiment, chips: Sequence[ChipTarget], *, gate: float = DEFAULT_LAYER_GATE) -> LayerLevel:
    """The whole step on each chip type, compared layer by layer; see the module doc.

    The step's global batch runs as one batch (the mean loss and its gradient are the same
    as the mean over equal microbatches; one copy of the model in the program instead of one
    per microbatch keeps the compile short).
    """
    import time

    start = time.perf_counter()
    args = (exp.params, *exp.whole_batch())

    def step_fn(graphdef: Any):
        return jax.value_and_grad(step_hiddens(graphdef), has_aux=True)

    ref_fn = jax.jit(reference(step_fn(exp.graphdef), *args))  # traced in the model's own dtypes
    with jax.enable_x64(True), jax.default_device(jax.devices(HOST)[0]):
        (ref_loss, ref_h), ref_g = jax.device_get(ref_fn(*jax.device_put(args, jax.devices(HOST)[0])))
    ref_grads = _flat_grads(ref_g)

    def run(device: Any, policy: Any, fault: Any, graphdef: Any):
        fn = jax.jit(apply_policy(step_fn(graphdef), policy, fault=fault))
        (loss, hiddens), grads = jax.device_get(fn(*jax.device_put(args, device)))
        return float(loss), [np.asarray(h) for h in hiddens], _flat_grads(grads)

    # the host baseline under a key no chip type can have: `cpu` is also a valid chip to compare
    results = {BASELINE: run(jax.devices(HOST)[0], NumericsPolicy(), None, exp.graphdef)}
    for chip in chips:
        results[chip.name] = run(chip.device, chip.policy, chip.fault, graphdef_for(exp, chip.policy))
    floor = DTYPE_RTOL.get(exp.cfg.model.dtype, DTYPE_RTOL["float32"])

    def row(layer: str, direction: str, errors: dict[str, float], params: dict | None = None) -> LayerRow:
        base = errors[BASELINE]
        r = {n: ratio(e, base, floor=floor) for n, e in errors.items() if n != BASELINE}
        status = {}
        for n, e in errors.items():
            if n == BASELINE:
                continue
            status[n] = "fail" if e > gate else ("warn" if r[n] > 2 else "pass")
        return LayerRow(layer, direction, {n: errors[n] for n in r}, r, status, params or {})

    rows: list[LayerRow] = []
    names = ["embed"] + [f"blocks.{i}" for i in range(len(ref_h) - 1)]
    for k, name in enumerate(names):
        ref = np.asarray(ref_h[k])
        rows.append(row(name, "fwd", {n: compare(res[1][k], ref).rel_l2 for n, res in results.items()}))
    layers: dict[str, list[str]] = {}
    for path in ref_grads:
        layers.setdefault(_layer_of(path), []).append(path)
    order = ["head"] + [f"blocks.{i}" for i in reversed(range(len(ref_h) - 1))] + ["embed"]
    order += [name for name in layers if name not in order]
    for name in order:
        if name not in layers:
            continue
        per_param = {
            p: {n: compare(res[2][p], ref_grads[p]).rel_l2 for n, res in results.items()} for p in layers[name]
        }
        errors = {n: max(v[n] for v in per_param.values()) for n in results}
        rows.append(
            row(name, "bwd", errors, {p: {n: e for n, e in v.items() if n != BASELINE} for p, v in per_param.items()})
        )
    first: dict[str, dict[str, str | None]] = {}
    for chip in chips:
        first[chip.name] = {
            d: next((r.layer for r in rows if r.direction == d and r.status[chip.name] != "pass"), None)
            for d in ("fwd", "bwd")
        }
    loss = {("host" if n == BASELINE else n): res[0] for n, res in results.items()}
    loss["reference"] = float(ref_loss)
    return LayerLevel(rows, [c.name for c in chips], gate, loss, first, time.perf_counter() - start)


def layer_status(level: LayerLevel, chip: str) -> str:
    return worst([r.status[chip] for r in level.rows])
