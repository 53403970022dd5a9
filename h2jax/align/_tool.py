"""``h2jax align`` as functions: :func:`align` (op, layer and run levels) and :func:`replay`."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from h2jax._jaxpr import Fault, run_op
from h2jax.align._compare import Metrics, compare, compare_exact, op_status, tolerance
from h2jax.align._levels import DEFAULT_LAYER_GATE, layer_level, op_level, op_program
from h2jax.align._report import AlignReport
from h2jax.align._runlevel import DEFAULT_MRE_GATE, run_level
from h2jax.align._targets import HOST, AlignInputError, ChipTarget, load_experiment, plan_policy, resolve_chips
from h2jax.plan import NumericsPolicy

LEVELS = ("op", "layer", "run")
DEFAULT_STEPS = 300


def align(
    cfg: Any,
    *,
    chips: Sequence[str] | None = None,
    levels: Sequence[str] = ("op", "layer"),
    numerics: Sequence[str] = (),
    steps: int = DEFAULT_STEPS,
    layer_gate: float = DEFAULT_LAYER_GATE,
    mre_gate: float = DEFAULT_MRE_GATE,
    tolerances: Mapping[str, float] | None = None,
    microbatches: int = 1,
    plan: bool = True,
    out_dir: str | Path | None = None,
    faults: Mapping[str, Fault] | None = None,
    all_ops: bool = False,
    trainer: bool = False,
) -> AlignReport:
    """Compare ``chips`` (default: the cluster's chip types) against the float64 host reference.

    ``numerics`` are ``CHIP.KEY=VALUE`` policy overrides; ``faults`` (test only) perturb one
    primitive on a chip type; ``trainer`` adds the plan's run through the real trainer to the
    run level. The report is written to ``out_dir`` when given.
    """
    import jax

    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise AlignInputError(f"--levels {' '.join(levels)}: expected some of {' '.join(LEVELS)}")
    if steps < 1:
        raise AlignInputError(f"--steps {steps}: expected >= 1")
    if not 1 <= microbatches <= cfg.plan.num_microbatches:
        raise AlignInputError(
            f"--op-microbatches {microbatches}: expected 1..{cfg.plan.num_microbatches} (plan.num_microbatches)"
        )
    targets: list[ChipTarget] = resolve_chips(cfg, chips, numerics=numerics, faults=faults)
    exp = load_experiment(cfg)
    report = AlignReport({c.name: c.describe() for c in targets})
    config_yaml = _config_yaml(cfg)
    if "op" in levels:
        for c in targets:
            dtype = getattr(c.policy, "compute_dtype", None)
            if dtype not in (None, cfg.model.dtype):
                report.notes.append(
                    f"{c.name}: compute_dtype={dtype} is not applied at the op level (it traces the model in "
                    f"model.dtype={cfg.model.dtype}); the layer and run levels compute in {dtype}"
                )
        dump = Path(out_dir) if out_dir is not None else None
        report.op = op_level(
            exp,
            targets,
            microbatches=microbatches,
            tolerances=tolerances,
            dump_dir=dump,
            config_yaml=config_yaml,
            all_ops=all_ops,
        )
    scoped = plan_policy(cfg, targets) if plan else None
    if "layer" in levels:
        extra = [ChipTarget("plan", jax.devices(HOST)[0], scoped)] if scoped is not None else []
        report.layer = layer_level(exp, [*targets, *extra], gate=layer_gate)
    if "run" in levels:
        if trainer and out_dir is None:
            raise AlignInputError("--trainer needs a report folder (--out) for the trainer's run folder")
        trainer_dir = Path(out_dir) / "trainer_run" if trainer and out_dir is not None else None
        report.run = run_level(exp, targets, steps=steps, plan=scoped, gate=mre_gate, trainer_dir=trainer_dir)
    if out_dir is not None:
        report.write(out_dir)
    return report


def _config_yaml(cfg: Any) -> str:
    from h2jax.config import save_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "experiment.yaml"
        save_config(cfg, path)
        return path.read_text()


def replay(
    path: str | Path, chip: str, *, numerics: Sequence[str] = (), tolerances: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """Re-run the op dumped in ``path`` (by ``h2jax align``) on chip type ``chip`` with its policy
    (on the chip it was dumped from: the policy it had then; ``numerics`` on top). A test-only
    fault is not replayed: the op runs as the chip computes it.

    The op is found again by tracing the dumped experiment's step (its index and primitive
    must match); its dumped inputs are fed to it and its outputs compared with the dumped
    float64 reference outputs, and with the host's own result (the ratio rule's baseline).
    Returns the op, the metrics of its worst output and its status.
    """
    import jax

    from h2jax.config import load_config

    try:
        data = np.load(path, allow_pickle=False)
        meta = json.loads(str(data["meta"]))
        config = str(data["config"])
    except (OSError, KeyError, ValueError) as e:
        raise AlignInputError(f"--replay {path}: not a dump written by h2jax align ({e})") from None
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "experiment.yaml"
        cfg_path.write_text(config)
        cfg = load_config(cfg_path)
    dumped = meta.get("policy") if chip == meta["chip"] else None  # the dumped chip's policy, unless overridden
    remembered = [f"{chip}.{k}={'null' if v is None else v}" for k, v in (dumped or {}).items()]
    (target,) = resolve_chips(cfg, [chip], numerics=[*remembered, *numerics])
    exp = load_experiment(cfg)
    prog, _ = op_program(exp, meta["microbatches"])
    if meta["index"] >= len(prog.ops) or prog.ops[meta["index"]].name != meta["primitive"]:
        raise AlignInputError(
            f"--replay {path}: op #{meta['index']} ({meta['primitive']}) is not in this program any more "
            "(the model's code changed since the dump)"
        )
    import jax.numpy as jnp

    op = prog.ops[meta["index"]]
    ins = [data[f"in_{i}"] for i in range(meta["num_inputs"])]
    for i, atom in enumerate(op.invars):
        if not isinstance(atom, int):  # literals were dumped as values; feed the literal itself
            ins[i] = atom.value
    refs = [data[f"ref_{i}"] for i in range(meta["num_outputs"])]

    def worst(device: Any, policy: Any, fault: Any) -> Metrics:
        args = [jax.device_put(x, device) if isinstance(x, np.ndarray) else x for x in ins]
        outs = run_op(op, args, policy, fault)
        found = []
        for out, aval, ref in zip(outs, op.out_avals, refs):
            floating = jnp.issubdtype(aval.dtype, jnp.floating)
            found.append(compare(np.asarray(out), ref) if floating else compare_exact(np.asarray(out), ref))
        return max(found, key=lambda m: (m.nonfinite_mismatch, m.rel_l2))

    chip_m = worst(target.device, target.policy, target.fault)
    host_m = worst(jax.devices(HOST)[0], NumericsPolicy(), None)
    tol = tolerance(str(op.out_avals[0].dtype), op.name, tolerances)
    status, r = op_status(chip_m, host_m, tol)
    return {
        "op": op.label(),
        "chip": chip,
        "policy": target.describe(),
        "tolerance": tol,
        "status": status,
        "ratio_to_host": r,
        "metrics": chip_m.to_dict(),
        "host_metrics": host_m.to_dict(),
        "dumped_on": meta["chip"],
        "dumped_metrics": meta["metrics"],
    }
