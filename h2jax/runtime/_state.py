"""What a checkpoint holds, and the optimizer: shared by every trainer of every world.

Checkpoint step N is the state after N optimizer steps: parameters, optimizer state,
the data position (the next step; a batch is a pure function of (seed, step,
microbatch)), the seed, and the count of skipped steps -- all keyed by model path, never
by stage, so a checkpoint of any plan restores under any other. A parameter several stages
hold (a tied embedding table) is one entry, under its path in the whole model, with its
owner's optimizer state (h2jax.runtime._tied): the same entry a plan whose one stage holds
every use writes.

The helpers take the stages this process runs and the plan they belong to
(:func:`local_plan`: every stage in one process, one stage under mpirun), so every world
writes and reads the same plan-independent layout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import optax

from h2jax.checkpoint import CheckpointError, CheckpointStore
from h2jax.config import ExperimentConfig, config_to_dict
from h2jax.runtime._layout import flatten, model_layout, opt_state_names, to_model_key
from h2jax.runtime._metrics import METRICS_FILENAME, read_metrics
from h2jax.runtime._stage import StageProgram


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf (policy ``abort``)."""

    def __init__(self, message: str, *, step: int, stages: list[int]):
        super().__init__(message)
        self.step, self.stages = step, stages


def local_plan(plan: Any, stages: Any) -> Any:
    """A stand-in plan of the given stage indices, for mapping their trees to model paths."""
    return SimpleNamespace(stages=tuple(plan.stages[s] for s in stages))


@jax.jit
def poison(tree: Any) -> Any:
    """``train.inject_nonfinite_steps``: the tree made NaN, as a diverging step would."""
    return jax.tree.map(lambda a: a * jnp.float32(jnp.nan), tree)


def make_optimizer(cfg: ExperimentConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decay on matrices only) with linear warm-up and cosine decay."""
    o = cfg.optimizer
    steps = cfg.train.steps
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=max(steps, o.warmup_steps + 1),
        end_value=o.lr * o.min_lr_ratio,
    )
    tx = optax.adamw(
        schedule,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
    return tx, schedule


def clip_scale(grad_norm: float, clip_norm: float) -> float:
    """optax.clip_by_global_norm's factor, computed from the norm over all stages."""
    if clip_norm <= 0 or grad_norm < clip_norm:
        return 1.0
    return clip_norm / grad_norm


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    skipped: bool = False  # non-finite, policy "skip": nothing was updated
    extra: dict[str, float] = field(default_factory=dict)


CHECKPOINT_FORMAT = 1


def _no_ties(stage: int, key: str) -> tuple[str, bool]:
    return key, True


def _naming(ties: Any) -> Any:
    """(stage, model key) -> (model path, owned): a tied parameter's copies are all named by
    its path in the whole model, and one of them (its owner's) counts (h2jax.runtime._tied)."""
    return ties.name if ties else _no_ties


def param_names(stage: StageProgram, spec: Any, ties: Any = None) -> list[tuple[str, bool]]:
    """(model path, owned) of every parameter leaf of ``stage``, in leaf order."""
    name = _naming(ties)
    return [name(stage.position, to_model_key(key, spec)) for key in flatten(stage.params)]


def opt_names(stage: StageProgram, spec: Any, ties: Any = None) -> list[tuple[str, bool, bool]]:
    """(model-layout name, per-parameter, owned) of every optimizer-state leaf of ``stage``, in
    leaf order; stage-wide leaves (step counts) are not per-parameter."""
    name = _naming(ties)
    out = []
    for leaf_name, param in opt_state_names(stage.opt_state, stage.params, spec):
        if param is None:
            out.append((leaf_name, False, True))
            continue
        path, owned = name(stage.position, param)
        out.append((leaf_name[: len(leaf_name) - len(param)] + path, True, owned))
    return out


def by_model_path(stages: list[StageProgram], plan: Any, trees: list[Any], ties: Any = None) -> dict[str, Any]:
    """Per-stage trees shaped like the stages' parameters (the parameters, their gradients)
    as one dict keyed by model path; a tied parameter once, from its owner."""
    out: dict[str, Any] = {}
    for st, spec, tree in zip(stages, plan.stages, trees):
        for (name, owned), leaf in zip(param_names(st, spec, ties), jax.tree.leaves(tree)):
            if not owned:
                continue
            if name in out:
                raise ValueError(f"parameter {name} appears in two stages")
            out[name] = leaf
    return out


def stage_state_by_layer(
    stages: list[StageProgram], plan: Any, *, stage_wide: bool = True, ties: Any = None
) -> dict[str, jax.Array]:
    """Parameters and optimizer state of ``stages`` (the stages of ``plan``, in order), keyed by
    model path (plan-independent); a tied parameter and its optimizer state once, from its
    owner. ``stage_wide=False`` leaves out the optimizer leaves every stage holds alike (step
    counts): in a multi-process run stage 0 alone saves them."""
    out = {f"params/{k}": v for k, v in by_model_path(stages, plan, [st.params for st in stages], ties).items()}
    for st, spec in zip(stages, plan.stages):
        for (name, per_param, owned), leaf in zip(opt_names(st, spec, ties), jax.tree.leaves(st.opt_state)):
            key = f"opt_state/{name}"
            if per_param and owned:
                if key in out:
                    raise ValueError(f"optimizer state {name} appears in two stages")
                out[key] = leaf
            elif not per_param and stage_wide:
                out.setdefault(key, leaf)  # every stage updates on every step (or on none): they agree
    return out


def opt_state_shardings(stage: StageProgram, spec: Any) -> Any:
    """Where a stage's optimizer state belongs: per-parameter leaves (mu, nu) with their
    parameter's sharding, stage-wide leaves (counts) replicated over the stage mesh."""
    by_param = model_layout([stage.param_shardings], SimpleNamespace(stages=(spec,)))
    leaves = [
        by_param[p] if p is not None else stage.scalar_sharding
        for _, p in opt_state_names(stage.opt_state, stage.params, spec)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stage.opt_state), leaves)


def restore_targets(
    stages: list[StageProgram], plan: Any, *, params_only: bool, ties: Any = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """What a restore onto ``stages`` reads: every array with its shape, dtype and target
    sharding. An array several of ``stages`` hold (stage-wide optimizer leaves, a tied
    parameter's copies) is read once, onto the first of them; load_state_by_layer places it
    on the others."""
    out: dict[str, jax.ShapeDtypeStruct] = {}
    for st, spec in zip(stages, plan.stages):
        for (name, _), leaf, sh in zip(
            param_names(st, spec, ties), jax.tree.leaves(st.params), jax.tree.leaves(st.param_shardings)
        ):
            out.setdefault(f"params/{name}", jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh))
        if params_only:
            continue
        shardings = jax.tree.leaves(opt_state_shardings(st, spec))
        for (name, _, _), leaf, sh in zip(opt_names(st, spec, ties), jax.tree.leaves(st.opt_state), shardings):
            out.setdefault(f"opt_state/{name}", jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh))
    return out


def _tree_from(flat: dict[str, Any], template: Any, names: list[str], what: str) -> Any:
    missing = [n for n in names if n not in flat]
    if missing:
        raise KeyError(f"{what}: {len(missing)} entries missing from the model layout, e.g. {missing[:3]}")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), [flat[n] for n in names])


def load_state_by_layer(
    stages: list[StageProgram], plan: Any, flat: dict[str, jax.Array], *, params_only: bool = False, ties: Any = None
) -> None:
    """Place a model-layout state (``stage_state_by_layer``'s keys) onto ``stages`` (every
    copy of a tied parameter gets the same values); the accumulated gradients start from zero."""
    params = {k[len("params/") :]: v for k, v in flat.items() if k.startswith("params/")}
    opt = {k[len("opt_state/") :]: v for k, v in flat.items() if k.startswith("opt_state/")}
    new_params, new_opt = [], []  # every stage's trees first: a missing entry changes no stage
    for s, (st, spec) in enumerate(zip(stages, plan.stages)):
        names = [n for n, _ in param_names(st, spec, ties)]
        new_params.append(_tree_from(params, st.params, names, f"stage {s}"))
        if not params_only:
            names = [n for n, _, _ in opt_names(st, spec, ties)]
            new_opt.append(_tree_from(opt, st.opt_state, names, f"optimizer state of stage {s}"))
    for s, (st, spec) in enumerate(zip(stages, plan.stages)):
        st.params = jax.device_put(new_params[s], st.param_shardings)
        if not params_only:
            st.opt_state = jax.device_put(new_opt[s], opt_state_shardings(st, spec))
        st.acc = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=st.param_shardings)(st.acc)


def checkpoint_meta(cfg: ExperimentConfig, step: int, skipped_steps: int) -> dict[str, Any]:
    """What a checkpoint records besides the arrays (the same in every part)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "skipped_steps": skipped_steps,
        # a batch is a pure function of (seed, step, microbatch): the position is the next step
        "data": {
            "seed": cfg.seed,
            "next_step": step,
            "global_batch": cfg.plan.global_batch,
            "num_microbatches": cfg.plan.num_microbatches,
        },
        # the seed made the initial parameters, the data and every dropout mask (keys from seed, step,
        # microbatch, layer): nothing random is carried in the model
        "rng": {"seed": cfg.seed},
        "model": config_to_dict(cfg)["model"],
        "plan": cfg.plan.to_dict(),
        "config": config_to_dict(cfg),
    }


def check_checkpoint(
    store: CheckpointStore, step: int, cfg: ExperimentConfig, model_keys: Any, *, params_only: bool
) -> dict[str, Any]:
    """The meta of committed ``step`` after checking that it holds this run's model: the same
    shapes, and no arrays ``model_keys`` (every restore target of the whole model) lacks."""
    meta = store.read_meta(step)
    have, want = meta.get("model"), config_to_dict(cfg)["model"]
    shape_keys = ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff")
    if have is not None and any(have.get(k) != want.get(k) for k in shape_keys):
        diff = ", ".join(f"{k} {have.get(k)} vs {want.get(k)}" for k in shape_keys if have.get(k) != want.get(k))
        raise CheckpointError(f"{store.dir} step {step} holds another model (checkpoint vs this run: {diff})")
    model_keys = set(model_keys)
    extra = sorted(
        n for n in store.shapes(step) if n not in model_keys and (n.startswith("params/") or not params_only)
    )
    if extra:
        raise CheckpointError(f"{store.dir} step {step} holds {len(extra)} arrays this model lacks, e.g. {extra[:3]}")
    return meta


def data_position(meta: dict[str, Any], cfg: ExperimentConfig, where: str) -> tuple[int, int, str | None]:
    """(the step the run continues at, skipped steps so far, a warning or None) from a
    checkpoint's meta; a data stream that cannot continue (another seed) is an error."""
    step = int(meta["step"])
    data = meta.get("data", {})
    if data.get("seed", cfg.seed) != cfg.seed:
        raise CheckpointError(
            f"{where} was written with seed {data['seed']}, this run has "
            f"seed {cfg.seed}: the data stream would not continue"
        )
    warning = None
    batch = (data.get("global_batch"), data.get("num_microbatches"))
    if batch != (cfg.plan.global_batch, cfg.plan.num_microbatches):
        warning = (
            f"the checkpoint's run used global batch {batch[0]} in {batch[1]} microbatches, this run "
            f"{cfg.plan.global_batch} in {cfg.plan.num_microbatches}: the data stream continues from "
            f"step {step} but its batches differ"
        )
    return step, int(meta.get("skipped_steps", 0)), warning


def truncate_metrics(run_dir: Path, step: int) -> tuple[int, Path | None]:
    """Rows of steps >= ``step`` (the future of an interrupted or rewound run) move from
    ``metrics.jsonl`` to ``metrics.replaced.jsonl`` (appended, never lost). Returns (rows
    moved, the file they went to)."""
    path = run_dir / METRICS_FILENAME
    if not path.exists():
        return 0, None
    rows = read_metrics(path)
    keep = [r for r in rows if r["step"] < step]
    gone = [r for r in rows if r["step"] >= step]
    if not gone:
        return 0, None
    aside = run_dir / "metrics.replaced.jsonl"
    with aside.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in gone))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    tmp.replace(path)
    return len(gone), aside


def nonfinite_error(
    step: int, loss: float, grad_norm: float, sqnorms: list[float], *, loss_stage: int | None = None
) -> NonFiniteLossError:
    """Policy ``abort``: the error naming the step and where the non-finite values are
    (``sqnorms``: every stage's squared gradient norm, in stage order; ``loss_stage``: the
    stage holding the head, default the last -- zb-v's is stage 0)."""
    last = len(sqnorms) - 1 if loss_stage is None else loss_stage
    bad = [s for s, x in enumerate(sqnorms) if not math.isfinite(x)]
    where = []
    if not math.isfinite(loss):
        where.append(
            f"the loss of the last stage, stage {last}"
            if last == len(sqnorms) - 1
            else f"the loss of stage {last} (it holds the head)"
        )
    if bad:
        where.append(f"the gradients of stage{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}")
    return NonFiniteLossError(
        f"step {step}: {'non-finite' if not math.isfinite(loss) else 'finite'} loss={loss}, "
        f"{'non-finite' if not math.isfinite(grad_norm) else 'finite'} grad_norm={grad_norm} ({'; '.join(where)}); "
        "nothing was updated (train.nonfinite=skip would skip such steps)",
        step=step,
        stages=bad or [last],
    )
