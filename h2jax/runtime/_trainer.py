"""The training loop: config -> stages on their meshes -> pipelined optimizer steps.

``Trainer(cfg)`` validates, registers the chip types, cuts the model into stages, places
each on its mesh and checks memory; ``run()`` trains and writes the run folder:
``config.yaml``, ``plan.yaml``, ``metrics.jsonl``, ``tb/``, ``trace.json``, ``gantt.png``
and ``summary.json``. With checkpoints on, ``run()`` saves every ``checkpoint.every_steps``
steps and at the end, and on SIGTERM/SIGINT saves at the next step boundary and returns
(``preempted``); ``resume()`` continues from a checkpoint, under this trainer's plan.

Checkpoint step N is the state after N optimizer steps: parameters, optimizer state,
the data position (the next step; a batch is a pure function of (seed, step,
microbatch)), the seed, and the count of skipped steps.

The module-level checkpoint helpers (``stage_state_by_layer``, ``restore_targets``,
``load_state_by_layer``, ``checkpoint_meta``, ``check_checkpoint``, ``data_position``,
``nonfinite_error``) take a list of stages and the plan they belong to -- every stage of
the plan here, one stage with a one-stage plan (``one_stage_plan``) in a multi-process
run -- so both modes write and read the same plan-independent layout.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.console import Console

from h2jax.checkpoint import CheckpointError, CheckpointStore
from h2jax.comm import make_transport
from h2jax.config import ConfigError, ExperimentConfig, config_to_dict, save_config, validate
from h2jax.data import get_global_batch, load_dataset
from h2jax.models import StageModule, build_model, check_stageable
from h2jax.plan import get_schedule
from h2jax.runtime._cluster import StagePlacement, place_stages, setup_backends, stage_mesh
from h2jax.runtime._layout import model_layout, opt_state_layout, opt_state_names, opt_state_trees, stage_trees
from h2jax.runtime._metrics import METRICS_FILENAME, MetricsLogger, read_metrics
from h2jax.runtime._pipeline import Pipeline
from h2jax.runtime._stage import StageMemory, StageProgram
from h2jax.runtime._timeline import Timeline, bubble_fraction, plot_gantt

GIB = 1024**3


CHECKPOINT_FORMAT = 1


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf (policy ``abort``)."""

    def __init__(self, message: str, *, step: int, stages: list[int]):
        super().__init__(message)
        self.step, self.stages = step, stages


def one_stage_plan(spec: Any) -> Any:
    """A stand-in plan of one stage, for mapping that stage's trees to model paths."""
    from types import SimpleNamespace

    return SimpleNamespace(stages=(spec,))


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


# -- checkpoint helpers shared by the single-controller and the multi-process trainer ----------
def stage_state_by_layer(stages: list[StageProgram], plan: Any, *, stage_wide: bool = True) -> dict[str, jax.Array]:
    """Parameters and optimizer state of ``stages`` (the stages of ``plan``, in order), keyed by
    model path (plan-independent). ``stage_wide=False`` leaves out the optimizer leaves every
    stage holds alike (step counts): in a multi-process run stage 0 alone saves them."""
    params = [st.params for st in stages]
    out = {f"params/{k}": v for k, v in model_layout(params, plan).items()}
    opt = opt_state_layout([st.opt_state for st in stages], params, plan)
    if not stage_wide:
        wide = {
            name
            for st, spec in zip(stages, plan.stages)
            for name, param in opt_state_names(st.opt_state, st.params, spec)
            if param is None
        }
        opt = {k: v for k, v in opt.items() if k not in wide}
    out.update({f"opt_state/{k}": v for k, v in opt.items()})
    return out


def opt_state_shardings(stage: StageProgram, spec: Any) -> Any:
    """Where a stage's optimizer state belongs: per-parameter leaves (mu, nu) with their
    parameter's sharding, stage-wide leaves (counts) replicated over the stage mesh."""
    by_param = model_layout([stage.param_shardings], one_stage_plan(spec))
    leaves = [
        by_param[p] if p is not None else stage.scalar_sharding
        for _, p in opt_state_names(stage.opt_state, stage.params, spec)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stage.opt_state), leaves)


def restore_targets(stages: list[StageProgram], plan: Any, *, params_only: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """What a restore onto ``stages`` reads: every array with its shape, dtype and target
    sharding (stage-wide optimizer leaves onto the first of ``stages``; load_state_by_layer
    copies them to the others)."""
    params = [st.params for st in stages]
    sh = model_layout([st.param_shardings for st in stages], plan)
    out = {
        f"params/{k}": jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k])
        for k, v in model_layout(params, plan).items()
    }
    if not params_only:
        opt_sh = [opt_state_shardings(st, spec) for st, spec in zip(stages, plan.stages)]
        sh = opt_state_layout(opt_sh, params, plan)
        for k, v in opt_state_layout([st.opt_state for st in stages], params, plan).items():
            out[f"opt_state/{k}"] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k])
    return out


def load_state_by_layer(
    stages: list[StageProgram], plan: Any, flat: dict[str, jax.Array], *, params_only: bool = False
) -> None:
    """Place a model-layout state (``stage_state_by_layer``'s keys) onto ``stages``; the
    accumulated gradients start from zero."""
    params = {k[len("params/") :]: v for k, v in flat.items() if k.startswith("params/")}
    new_params = stage_trees(params, [st.params for st in stages], plan)
    if not params_only:
        opt = {k[len("opt_state/") :]: v for k, v in flat.items() if k.startswith("opt_state/")}
        new_opt = opt_state_trees(opt, [st.opt_state for st in stages], [st.params for st in stages], plan)
        opt_shardings = [opt_state_shardings(st, spec) for st, spec in zip(stages, plan.stages)]
    for s, st in enumerate(stages):
        st.params = jax.device_put(new_params[s], st.param_shardings)
        if not params_only:
            st.opt_state = jax.device_put(new_opt[s], opt_shardings[s])
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
        # the model has no stochastic layers: the seed made the initial parameters and the data
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


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metric rows of steps >= ``step``: the lost future of an interrupted run."""
    path = run_dir / METRICS_FILENAME
    if not path.exists():
        return
    rows = [r for r in read_metrics(path) if r["step"] < step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def nonfinite_error(step: int, loss: float, grad_norm: float, sqnorms: list[float]) -> NonFiniteLossError:
    """Policy ``abort``: the error naming the step and where the non-finite values are
    (``sqnorms``: every stage's squared gradient norm, in stage order)."""
    last = len(sqnorms) - 1
    bad = [s for s, x in enumerate(sqnorms) if not math.isfinite(x)]
    where = []
    if not math.isfinite(loss):
        where.append(f"the loss of the last stage, stage {last}")
    if bad:
        where.append(f"the gradients of stage{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}")
    return NonFiniteLossError(
        f"step {step}: non-finite loss={loss}, grad_norm={grad_norm} ({'; '.join(where)}); "
        "nothing was updated (train.nonfinite=skip would skip such steps)",
        step=step,
        stages=bad or [last],
    )


class Trainer:
    """Builds the stages of an experiment and trains them (single controller)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        model: nnx.Module | None = None,
        run_dir: str | Path | None = None,
        console: Console | None = None,
    ):
        self.cfg = validate(cfg)
        self.console = console or Console(stderr=True)
        plan = cfg.plan
        self.run_dir = Path(run_dir) if run_dir is not None else Path(cfg.train.out_dir) / cfg.name
        # chip types first: emulated backends must exist before JAX initialises any backend
        setup_backends(cfg.cluster)
        self.dataset = load_dataset(
            corpus=cfg.data.corpus,
            token_file=cfg.data.token_file,
            tokenizer=cfg.data.tokenizer,
            token_dtype=cfg.data.token_dtype,
        )
        if self.dataset.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {self.dataset.vocab_size}",
            )
        if model is None:
            model = build_model(cfg.model, seed=cfg.seed)
        check_stageable(model)
        if len(model.blocks) != cfg.model.n_layers:
            raise ConfigError(
                "model.n_layers", f"n_layers={cfg.model.n_layers} but the model has {len(model.blocks)} blocks"
            )
        self.model = model
        self.placements: list[StagePlacement] = place_stages(plan, cfg.cluster)
        self.tx, self.lr_schedule = make_optimizer(cfg)
        n = plan.num_stages
        self.stages: list[StageProgram] = []
        for s, (spec, place) in enumerate(zip(plan.stages, self.placements)):
            mesh = stage_mesh(place, data=spec.data, tensor=spec.tensor)
            module = StageModule(model, layers=spec.layers, first=s == 0, last=s == n - 1)
            label = f"stage {s} · {spec.chip} ({spec.data}x{spec.tensor}) layers {spec.layers[0]}-{spec.layers[1] - 1}"
            self.stages.append(StageProgram(s, spec, mesh, module, self.tx, first=s == 0, last=s == n - 1, label=label))
        self.schedule = get_schedule(plan.schedule, n, plan.num_microbatches)
        self.grid = self.schedule.tasks()
        self.timeline = Timeline(stage_labels=[st.label for st in self.stages]) if cfg.train.timeline else None
        self.pipeline = Pipeline(
            self.stages,
            make_transport(cfg.train.transport),
            self.grid,
            num_microbatches=plan.num_microbatches,
            timeline=self.timeline,
        )
        self.tokens_per_step = plan.global_batch * cfg.model.seq_len
        self.step = 0
        self.skipped_steps = 0
        self.preempted: str | None = None  # the signal that stopped run(), if one did
        self._stop_signal: str | None = None
        self._store: CheckpointStore | None = None
        self.memory: list[StageMemory] = []
        if cfg.train.memory_check:
            self.memory = self.check_memory()

    # -- data ----------------------------------------------------------------------------------
    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.cfg.plan
        return get_global_batch(
            self.dataset,
            seed=self.cfg.seed,
            step=step,
            num_microbatches=p.num_microbatches,
            microbatch_size=p.microbatch_size,
            seq_len=self.cfg.model.seq_len,
        )

    def _device_batch(self, step: int) -> tuple[list[jax.Array], list[jax.Array]]:
        tokens, targets = self.batch(step)
        first, last = self.stages[0], self.stages[-1]
        return (
            [jax.device_put(t, first.act_sharding) for t in tokens],
            [jax.device_put(t, last.act_sharding) for t in targets],
        )

    # -- memory --------------------------------------------------------------------------------
    def check_memory(self) -> list[StageMemory]:
        """Per-device memory of every stage against its chip's declared memory."""
        tokens, targets = self._device_batch(0)
        in_flight = self.schedule.max_in_flight()
        out = []
        x = tokens[0]
        for s, st in enumerate(self.stages):
            mem = st.memory(x, targets[0] if st.last else None, in_flight=in_flight[s])
            out.append(mem)
            limit = self.cfg.cluster.chips[st.spec.chip].memory_gib * GIB
            if mem.total > limit:
                raise ConfigError(
                    f"plan.stages[{s}]",
                    f"needs {mem.total / GIB:.2f} GiB per device (params {mem.params / GIB:.2f}, grads "
                    f"{mem.grads / GIB:.2f}, optimizer {mem.opt_state / GIB:.2f}, activations of "
                    f"{in_flight[s]} in-flight microbatches {mem.activations / GIB:.2f}, workspace "
                    f"{mem.workspace / GIB:.2f}); chip {st.spec.chip} has {limit / GIB:.2f} GiB "
                    "(try recompute: true, more microbatches, or a larger tensor degree)",
                )
            if not st.last:  # the next stage's input has this stage's output shape
                x = jax.device_put(
                    jnp.zeros((x.shape[0], x.shape[1], self.cfg.model.d_model), jnp.dtype(self.cfg.model.dtype)),
                    self.stages[s + 1].act_sharding,
                )
        return out

    # -- one step ------------------------------------------------------------------------------
    def forward_backward(self, step: int) -> jax.Array:
        """Run every forward and backward of ``step``; gradients accumulate in the stages.

        Returns the step's loss (mean over microbatches) as a device scalar."""
        tokens, targets = self._device_batch(step)
        result = self.pipeline.run_step(step, tokens, targets)
        return jnp.mean(jnp.stack(result.losses))

    def finish_step(self) -> float:
        """Clip by the global gradient norm over all stages and update every stage; returns the norm.

        A non-finite norm updates nothing (the caller decides what that means)."""
        grad_norm = math.sqrt(sum(self._grad_sqnorms()))
        self._apply(grad_norm)
        return grad_norm

    def _grad_sqnorms(self) -> list[float]:
        sq = [st.grad_sqnorm() for st in self.stages]  # dispatched on every stage before any sync
        return [float(x) for x in sq]

    def _apply(self, grad_norm: float) -> None:
        if math.isfinite(grad_norm):
            scale = clip_scale(grad_norm, self.cfg.optimizer.clip_norm)
            for st in self.stages:
                st.apply_update(scale)

    def _drop_grads(self) -> None:
        """Zero the accumulated gradients without an update (a skipped step)."""
        for st in self.stages:
            st.zero_grads()

    def train_step(self) -> StepStats:
        step = self.step
        t0 = time.perf_counter()
        loss_dev = self.forward_backward(step)
        if step in self.cfg.train.inject_nonfinite_steps:
            for st in self.stages:
                st.acc = poison(st.acc)
            loss_dev = loss_dev * jnp.float32(jnp.nan)
        loss = float(loss_dev)
        sq = self._grad_sqnorms()
        grad_norm = math.sqrt(sum(sq))
        skipped = False
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._apply(grad_norm)
        elif self.cfg.train.nonfinite == "skip":
            self._drop_grads()
            self.skipped_steps += 1
            skipped = True
        else:
            raise nonfinite_error(step, loss, grad_norm, sq)
        dt = time.perf_counter() - t0
        self.step += 1
        return StepStats(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=float(self.lr_schedule(step)),
            step_time_s=dt,
            tokens_per_s=self.tokens_per_step / dt,
            skipped=skipped,
        )

    def step_metrics(self, stats: StepStats) -> dict[str, Any]:
        devices_by_chip: dict[str, int] = {}
        for spec in self.cfg.plan.stages:
            devices_by_chip[spec.chip] = devices_by_chip.get(spec.chip, 0) + spec.num_devices
        total = sum(devices_by_chip.values())
        m: dict[str, Any] = {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "step_time_s": stats.step_time_s,
            "tokens_per_s": stats.tokens_per_s,
            "tgs": stats.tokens_per_s / total,
            "skipped": int(stats.skipped),
            "skipped_steps": self.skipped_steps,
        }
        for chip, ndev in devices_by_chip.items():
            m[f"tgs/{chip}"] = stats.tokens_per_s / ndev
        if self.timeline is not None:
            self.pipeline.drain_timeline()
            m["bubble_fraction"] = bubble_fraction(
                [e for e in self.timeline.events(stats.step) if e.kind in ("fwd", "bwd")], len(self.stages)
            )
        return m

    # -- the loop ------------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[StepStats]:
        """Train up to ``steps`` (default ``train.steps``) from ``self.step``; checkpoint as
        configured. Returns early, after saving, on SIGTERM/SIGINT (see ``preempted``)."""
        cfg = self.cfg
        steps = cfg.train.steps if steps is None else steps
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        cfg.plan.to_yaml(self.run_dir / "plan.yaml")
        metrics_file = self.run_dir / METRICS_FILENAME
        if self.step == 0 and metrics_file.exists():
            metrics_file.unlink()  # a fresh run; a resumed run keeps appending
        store = self.checkpoint_store() if cfg.checkpoint.enabled else None
        every = cfg.checkpoint.every_steps
        history: list[StepStats] = []
        t_start = time.perf_counter()
        restore_signals = self._catch_signals()
        try:
            with MetricsLogger(
                self.run_dir,
                total_steps=steps,
                tensorboard=cfg.train.tensorboard,
                progress=cfg.train.progress,
                console=self.console,
            ) as log:
                while self.step < steps and self._stop_signal is None:
                    stats = self.train_step()
                    history.append(stats)
                    if stats.step % cfg.train.log_every == 0 or self.step == steps or stats.skipped:
                        log.log(stats.step, self.step_metrics(stats))
                    if store is not None:
                        store.poll()  # commit a finished background save
                        if every > 0 and self.step % every == 0 and self.step < steps:
                            self.save_checkpoint()
            self.preempted = self._stop_signal
            if store is not None and (self.step == steps or self.preempted):
                if store.latest_committed() != self.step and self._saved_step != self.step:
                    self.save_checkpoint()
                store.wait()
        finally:
            restore_signals()
            self.close_checkpoints()
            self.pipeline.drain_timeline()
            self.pipeline.close()
        wall = time.perf_counter() - t_start
        self._write_outputs(history, wall)
        return history

    def _catch_signals(self):
        """SIGTERM/SIGINT ask run() to save at the next step boundary and stop; a second
        SIGINT interrupts at once. Returns the function that restores the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = name
            self.console.print(f"[yellow]h2jax: {name} received: saving at the end of step {self.step} and stopping[/]")

        for sig in old:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, h in old.items():
                signal.signal(sig, h)

        return restore

    def _write_outputs(self, history: list[StepStats], wall_s: float) -> None:
        summary: dict[str, Any] = {
            "steps": len(history),
            "wall_s": wall_s,
            "first_loss": history[0].loss if history else None,
            "last_loss": history[-1].loss if history else None,
            # the first steps include compilation; the median excludes it
            "median_step_time_s": float(np.median([h.step_time_s for h in history[1:] or history]))
            if history
            else None,
            "tokens_per_step": self.tokens_per_step,
            "stages": [
                {"label": st.label, "backend": p.backend, "memory_gib": m.total / GIB if m else None}
                for st, p, m in zip(self.stages, self.placements, self.memory or [None] * len(self.stages))
            ],
        }
        if self.timeline is not None and history:
            self.timeline.save(self.run_dir / "trace.json")
            gstep = self.cfg.train.gantt_step if self.cfg.train.gantt_step >= 0 else history[-1].step
            events = self.timeline.events(gstep)
            plot_gantt(
                events,
                self.run_dir / "gantt.png",
                stage_labels=[st.label for st in self.stages],
                title=f"{self.cfg.name}: step {gstep}, {self.cfg.plan.schedule}, "
                f"{self.cfg.plan.num_microbatches} microbatches",
            )
            summary["bubble_fraction_last_step"] = bubble_fraction(
                [e for e in events if e.kind in ("fwd", "bwd")], len(self.stages)
            )
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    # -- checkpoints ---------------------------------------------------------------------------
    _saved_step: int | None = None

    @property
    def checkpoint_dir(self) -> Path:
        d = self.cfg.checkpoint.dir
        return Path(d) if d is not None else self.run_dir / "checkpoints"

    def checkpoint_store(self) -> CheckpointStore:
        if self._store is None:
            c = self.cfg.checkpoint
            self._store = CheckpointStore(
                self.checkpoint_dir, keep_last=c.keep_last, keep_every=c.keep_every, async_save=c.async_save
            )
        return self._store

    def close_checkpoints(self) -> None:
        """Commit the save in flight (if any) and release the store."""
        if self._store is not None:
            store, self._store = self._store, None
            store.close()

    def state_by_layer(self) -> dict[str, jax.Array]:
        """Parameters and optimizer state of every stage, keyed by model path (plan-independent)."""
        return stage_state_by_layer(self.stages, self.cfg.plan)

    def checkpoint_meta(self) -> dict[str, Any]:
        return checkpoint_meta(self.cfg, self.step, self.skipped_steps)

    def save_checkpoint(self) -> None:
        """Start saving the current state as checkpoint ``self.step`` (async if configured)."""
        store = self.checkpoint_store()
        if self._saved_step is None:
            store.dir.mkdir(parents=True, exist_ok=True)
            try:
                save_config(self.cfg, store.dir / "config.yaml")
            except OSError:
                pass  # the save below reports an unwritable directory with the step
        store.clear(self.step)  # an older future of this run (--restore-step)
        store.save(self.step, self.state_by_layer(), self.checkpoint_meta())
        self._saved_step = self.step

    def _opt_shardings(self, s: int) -> Any:
        return opt_state_shardings(self.stages[s], self.cfg.plan.stages[s])

    def load_state_by_layer(self, flat: dict[str, jax.Array], *, params_only: bool = False) -> None:
        """Place a model-layout state (``state_by_layer``'s keys) onto this trainer's stages."""
        load_state_by_layer(self.stages, self.cfg.plan, flat, params_only=params_only)

    def _targets(self, *, params_only: bool) -> dict[str, jax.ShapeDtypeStruct]:
        return restore_targets(self.stages, self.cfg.plan, params_only=params_only)

    def restore(self, directory: str | Path, step: int | None = None, *, params_only: bool = False) -> int:
        """Load checkpoint ``step`` (default: the latest committed) of ``directory`` onto this
        trainer's plan. Full state: the run continues at that step; ``params_only``: the
        weights alone, for a new run from step 0. Returns the step read."""
        store = CheckpointStore(directory)
        if step is None:
            step = store.latest_committed()
            if step is None:
                raise CheckpointError(f"{store.dir} holds no committed checkpoint")
        targets = self._targets(params_only=params_only)
        meta = check_checkpoint(store, step, self.cfg, targets, params_only=params_only)
        self.load_state_by_layer(store.restore(step, targets), params_only=params_only)
        if not params_only:
            self.step, self.skipped_steps, warning = data_position(meta, self.cfg, f"{store.dir} step {step}")
            if warning:
                self.console.print(f"[yellow]h2jax: {warning}[/]")
        return step

    def resume(self, *, restore_step: int | None = None, init_from: str | Path | None = None) -> str | None:
        """What ``h2jax train`` does before training: continue from this run's checkpoints
        (the latest committed step, or ``restore_step``), or start from the weights of
        another run's checkpoint (``init_from``). Returns a line saying what happened."""
        if init_from is not None:
            step = self.restore(init_from, restore_step, params_only=True)
            msg = f"initialised the weights from {Path(init_from).absolute()} step {step}; training from step 0"
            if self.cfg.checkpoint.enabled and self.checkpoint_store().latest_committed() is not None:
                raise CheckpointError(
                    f"{self.checkpoint_dir} already holds checkpoints of a run; --init-from "
                    "starts a new one (use another name or checkpoint.dir)"
                )
            return msg
        if not self.cfg.checkpoint.enabled:
            if restore_step is not None:
                raise CheckpointError("--restore-step needs checkpoint.enabled=true")
            return None
        store = self.checkpoint_store()
        removed = store.cleanup()
        latest = store.latest_committed()
        if latest is None:
            if restore_step is not None:
                raise CheckpointError(f"--restore-step {restore_step}: {store.dir} holds no committed checkpoint")
            return f"cleaned up {len(removed)} leftovers of an interrupted save" if removed else None
        step = self.restore(store.dir, restore_step)
        self._truncate_metrics(self.step)
        msg = f"resumed from {store.dir} step {step}"
        if removed:
            msg += f" (cleaned up {len(removed)} leftovers of an interrupted save)"
        if step != latest:
            msg += f"; committed steps after {step} (up to {latest}) are replaced as this run reaches them"
        return msg

    def _truncate_metrics(self, step: int) -> None:
        truncate_metrics(self.run_dir, step)

    # -- inspection (tests, tools) -------------------------------------------------------------
    def params_by_layer(self) -> dict[str, Any]:
        return model_layout([st.params for st in self.stages], self.cfg.plan)

    def grads_by_layer(self) -> dict[str, Any]:
        return model_layout([st.grads() for st in self.stages], self.cfg.plan)


def train(
    cfg: ExperimentConfig, *, model: nnx.Module | None = None, run_dir: str | Path | None = None
) -> list[StepStats]:
    """Train ``model`` (default: the GPT of ``cfg.model``) as ``cfg`` says, continuing from the
    run's latest checkpoint if there is one; returns the per-step stats of this call."""
    trainer = Trainer(cfg, model=model, run_dir=run_dir)
    trainer.resume()
    return trainer.run()
