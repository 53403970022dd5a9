"""What a checkpoint records besides its arrays, and the optimizer: shared by every trainer
of every world.

Checkpoint step N is the state after N optimizer steps: parameters and optimizer state
(keyed by model path, never by stage: h2jax.runtime._layout), the data position (the next
step; a batch is a pure function of (seed, step, microbatch)), the seed, and the count of
skipped steps, so a checkpoint of any plan restores under any other. Here: that meta
(:func:`checkpoint_meta`), the checks of a checkpoint against this run, where its data
stream continues, and the optimizer, clipping and non-finite policy every stage applies.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from h2jax.checkpoint import CheckpointError, CheckpointStore, leftover_steps, model_difference
from h2jax.config import ExperimentConfig, config_to_dict
from h2jax.runtime._metrics import METRICS_FILENAME, read_metrics
from h2jax.runtime._world import MpiWorld, World


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf (policy ``abort``)."""

    def __init__(self, message: str, *, step: int, stages: list[int]):
        super().__init__(message)
        self.step, self.stages = step, stages


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


def part_name(stage: int) -> str:
    """The checkpoint part a stage writes when every process saves its own stage."""
    return f"stage{stage}"


def checkpoint_writer(cfg: ExperimentConfig, world: World, directory: Path) -> CheckpointStore:
    """This process's writer of ``directory``: one part holding every stage in one process;
    under mpirun its stage's part of every step (module docstring of h2jax.checkpoint._store)."""
    c, w = cfg.checkpoint, world
    kw: dict[str, Any] = dict(keep_last=c.keep_last, keep_every=c.keep_every, async_save=c.async_save)
    if isinstance(w, MpiWorld):
        n = cfg.plan.num_stages
        group = w.group
        kw.update(
            part=part_name(w.stage_idx),
            parts=[part_name(i) for i in range(n)],
            lead=w.rank == 0,
            shared=bool(group is not None and group.distributed),
        )
    return CheckpointStore(directory, **kw)


def checkpoint_meta(cfg: ExperimentConfig, step: int, skipped_steps: int, consumed: int) -> dict[str, Any]:
    """What a checkpoint records besides the arrays (the same in every part). ``consumed``: the
    sequences the run consumed before ``step`` (the position of a ``data.sources`` stream)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "skipped_steps": skipped_steps,
        # data.sources: the position is the sequences consumed (plan-free); otherwise a batch is a
        # pure function of (seed, step, microbatch) and the position is the next step
        "data": {
            "seed": cfg.seed,
            "next_step": step,
            "sequences_consumed": consumed,
            "global_batch": cfg.plan.global_batch,
            "num_microbatches": cfg.plan.num_microbatches,
            "sources": dict(cfg.data.sources) if cfg.data.sources else None,
            "holdout": cfg.data.holdout,
            "packing": cfg.data.packing,
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
    diff = model_difference(meta.get("model"), config_to_dict(cfg)["model"])
    if diff:
        raise CheckpointError(f"{store.dir} step {step} holds another model (checkpoint vs this run: {diff})")
    model_keys = set(model_keys)
    extra = sorted(
        n for n in store.shapes(step) if n not in model_keys and (n.startswith("params/") or not params_only)
    )
    if extra:
        raise CheckpointError(f"{store.dir} step {step} holds {len(extra)} arrays this model lacks, e.g. {extra[:3]}")
    return meta


def data_position(meta: dict[str, Any], cfg: ExperimentConfig, where: str) -> tuple[int, int, int, str | None]:
    """(the step the run continues at, skipped steps so far, sequences consumed before it, a
    warning or None) from a checkpoint's meta; a data stream that cannot continue (another
    seed) is an error."""
    step = int(meta["step"])
    data = meta.get("data", {})
    if data.get("seed", cfg.seed) != cfg.seed:
        raise CheckpointError(
            f"{where} was written with seed {data['seed']}, this run has "
            f"seed {cfg.seed}: the data stream would not continue"
        )
    consumed = int(data.get("sequences_consumed", step * int(data.get("global_batch", cfg.plan.global_batch))))
    warning = None
    batch = (data.get("global_batch"), data.get("num_microbatches"))
    sources = dict(cfg.data.sources) if cfg.data.sources else None
    was = (data.get("sources"), data.get("holdout", 0.0), data.get("packing", True))
    if sources is not None and was[0] is not None and was != (sources, cfg.data.holdout, cfg.data.packing):
        warning = (
            f"the checkpoint's run read data.sources {was[0]} (holdout {was[1]}, packing {was[2]}), this run "
            f"{sources} (holdout {cfg.data.holdout}, packing {cfg.data.packing}): the stream continues at "
            f"sequence {consumed:,} of the new mixture"
        )
    elif sources is None and batch[0] not in (None, cfg.plan.global_batch):
        # a step's batch is its first global_batch rows (h2jax.data._batching): another split is
        # the same sequences, another global batch is not
        warning = (
            f"the checkpoint's run used global batch {batch[0]}, this run {cfg.plan.global_batch}: the data "
            f"stream continues from step {step}, each step with {cfg.plan.global_batch} sequences"
        )
    return step, int(meta.get("skipped_steps", 0)), consumed, warning


def read_plan(
    directory: str | Path, step: int | None, cfg: ExperimentConfig, model_keys: Any, *, params_only: bool
) -> dict[str, Any]:
    """What a restore from ``directory`` reads, decided once: its step (``step``, or the latest
    committed), checked against this run (:func:`check_checkpoint`), and for a full restore
    where the run continues (:func:`data_position`)."""
    store = CheckpointStore(directory)
    try:
        s = step if step is not None else store.latest_committed()
        if s is None:
            raise CheckpointError(f"{store.dir} holds no committed checkpoint")
        meta = check_checkpoint(store, s, cfg, model_keys, params_only=params_only)
    finally:
        store.close()
    out = {"dir": str(store.dir), "step": s, "params_only": params_only, "warning": None}
    if not params_only:
        out["next_step"], out["skipped_steps"], out["sequences_consumed"], out["warning"] = data_position(
            meta, cfg, f"{store.dir} step {s}"
        )
    return out


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


def leftovers_line(removed: list[str]) -> str:
    """What cleanup removed, by step: a save cut off before every part was written."""
    steps = leftover_steps(removed)
    which = f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else "a step"
    return (
        f"removed the unfinished save of {which} ({len(removed)} leftover file(s): it was cut off before "
        f"every part was written, so it had never been committed)"
    )
