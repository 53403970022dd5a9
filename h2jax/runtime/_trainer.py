"""The training loop: config -> stages on their meshes -> pipelined optimizer steps.

``Trainer(cfg)`` validates, registers the chip types, cuts the model into stages, places
each on its mesh and checks memory; ``run()`` trains and writes the run folder:
``config.yaml``, ``plan.yaml``, ``metrics.jsonl``, ``tb/``, ``trace.json``, ``gantt.png``
and ``summary.json``.
"""

from __future__ import annotations

import json
import math
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

from h2jax.comm import make_transport
from h2jax.config import ConfigError, ExperimentConfig, save_config, validate
from h2jax.data import get_global_batch, load_dataset
from h2jax.models import StageModule, build_model, check_stageable
from h2jax.plan import get_schedule
from h2jax.runtime._cluster import StagePlacement, place_stages, setup_backends, stage_mesh
from h2jax.runtime._layout import model_layout
from h2jax.runtime._metrics import MetricsLogger
from h2jax.runtime._pipeline import Pipeline
from h2jax.runtime._stage import StageMemory, StageProgram
from h2jax.runtime._timeline import Timeline, bubble_fraction, plot_gantt

GIB = 1024**3


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf."""


def make_optimizer(cfg: ExperimentConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decay on matrices only) with linear warm-up and cosine decay."""
    o = cfg.optimizer
    steps = cfg.train.steps
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)
    tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                     mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
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
    extra: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Builds the stages of an experiment and trains them (single controller)."""

    def __init__(self, cfg: ExperimentConfig, *, model: nnx.Module | None = None,
                 run_dir: str | Path | None = None, console: Console | None = None):
        self.cfg = validate(cfg)
        self.console = console or Console(stderr=True)
        plan = cfg.plan
        self.run_dir = Path(run_dir) if run_dir is not None else Path(cfg.train.out_dir) / cfg.name
        # chip types first: emulated backends must exist before JAX initialises any backend
        setup_backends(cfg.cluster)
        self.dataset = load_dataset(corpus=cfg.data.corpus, token_file=cfg.data.token_file,
                                    tokenizer=cfg.data.tokenizer, token_dtype=cfg.data.token_dtype)
        if self.dataset.vocab_size > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size", f"vocab_size={cfg.model.vocab_size} is smaller than the "
                                                  f"tokenizer's {self.dataset.vocab_size}")
        if model is None:
            model = build_model(cfg.model, seed=cfg.seed)
        check_stageable(model)
        if len(model.blocks) != cfg.model.n_layers:
            raise ConfigError("model.n_layers", f"n_layers={cfg.model.n_layers} but the model has "
                                                f"{len(model.blocks)} blocks")
        self.model = model
        self.placements: list[StagePlacement] = place_stages(plan, cfg.cluster)
        self.tx, self.lr_schedule = make_optimizer(cfg)
        n = plan.num_stages
        self.stages: list[StageProgram] = []
        for s, (spec, place) in enumerate(zip(plan.stages, self.placements)):
            mesh = stage_mesh(place, data=spec.data, tensor=spec.tensor)
            module = StageModule(model, layers=spec.layers, first=s == 0, last=s == n - 1)
            label = f"stage {s} · {spec.chip} ({spec.data}x{spec.tensor}) layers {spec.layers[0]}-{spec.layers[1] - 1}"
            self.stages.append(StageProgram(s, spec, mesh, module, self.tx, first=s == 0, last=s == n - 1,
                                            label=label))
        self.schedule = get_schedule(plan.schedule, n, plan.num_microbatches)
        self.grid = self.schedule.tasks()
        self.timeline = Timeline(stage_labels=[st.label for st in self.stages]) if cfg.train.timeline else None
        self.pipeline = Pipeline(self.stages, make_transport(cfg.train.transport), self.grid,
                                 num_microbatches=plan.num_microbatches, timeline=self.timeline)
        self.tokens_per_step = plan.global_batch * cfg.model.seq_len
        self.step = 0
        self.memory: list[StageMemory] = []
        if cfg.train.memory_check:
            self.memory = self.check_memory()

    # -- data ----------------------------------------------------------------------------------
    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.cfg.plan
        return get_global_batch(self.dataset, seed=self.cfg.seed, step=step, num_microbatches=p.num_microbatches,
                                microbatch_size=p.microbatch_size, seq_len=self.cfg.model.seq_len)

    def _device_batch(self, step: int) -> tuple[list[jax.Array], list[jax.Array]]:
        tokens, targets = self.batch(step)
        first, last = self.stages[0], self.stages[-1]
        return ([jax.device_put(t, first.act_sharding) for t in tokens],
                [jax.device_put(t, last.act_sharding) for t in targets])

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
                    "(try recompute: true, more microbatches, or a larger tensor degree)")
            if not st.last:  # the next stage's input has this stage's output shape
                x = jax.device_put(jnp.zeros((x.shape[0], x.shape[1], self.cfg.model.d_model),
                                             jnp.dtype(self.cfg.model.dtype)), self.stages[s + 1].act_sharding)
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
        sq = [st.grad_sqnorm() for st in self.stages]  # dispatched on every stage before any sync
        grad_norm = math.sqrt(sum(float(x) for x in sq))
        if math.isfinite(grad_norm):
            scale = clip_scale(grad_norm, self.cfg.optimizer.clip_norm)
            for st in self.stages:
                st.apply_update(scale)
        return grad_norm

    def train_step(self) -> StepStats:
        step = self.step
        t0 = time.perf_counter()
        loss_dev = self.forward_backward(step)
        loss = float(loss_dev)
        grad_norm = self.finish_step()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"step {step}: loss={loss}, grad_norm={grad_norm} (loss from the last stage, "
                f"stage {len(self.stages) - 1}; gradient norm over all stages)")
        dt = time.perf_counter() - t0
        self.step += 1
        return StepStats(step=step, loss=loss, grad_norm=grad_norm, lr=float(self.lr_schedule(step)),
                         step_time_s=dt, tokens_per_s=self.tokens_per_step / dt)

    def step_metrics(self, stats: StepStats) -> dict[str, Any]:
        devices_by_chip: dict[str, int] = {}
        for spec in self.cfg.plan.stages:
            devices_by_chip[spec.chip] = devices_by_chip.get(spec.chip, 0) + spec.num_devices
        total = sum(devices_by_chip.values())
        m: dict[str, Any] = {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                             "step_time_s": stats.step_time_s, "tokens_per_s": stats.tokens_per_s,
                             "tgs": stats.tokens_per_s / total}
        for chip, ndev in devices_by_chip.items():
            m[f"tgs/{chip}"] = stats.tokens_per_s / ndev
        if self.timeline is not None:
            self.pipeline.drain_timeline()
            m["bubble_fraction"] = bubble_fraction(
                [e for e in self.timeline.events(stats.step) if e.kind in ("fwd", "bwd")], len(self.stages))
        return m

    # -- the loop ------------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[StepStats]:
        cfg = self.cfg
        steps = cfg.train.steps if steps is None else steps
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        cfg.plan.to_yaml(self.run_dir / "plan.yaml")
        metrics_file = self.run_dir / "metrics.jsonl"
        if self.step == 0 and metrics_file.exists():
            metrics_file.unlink()  # a fresh run; resuming runs keep appending (checkpoints)
        history: list[StepStats] = []
        t_start = time.perf_counter()
        with MetricsLogger(self.run_dir, total_steps=steps, tensorboard=cfg.train.tensorboard,
                           progress=cfg.train.progress, console=self.console) as log:
            while self.step < steps:
                stats = self.train_step()
                history.append(stats)
                if stats.step % cfg.train.log_every == 0 or self.step == steps:
                    log.log(stats.step, self.step_metrics(stats))
        wall = time.perf_counter() - t_start
        self.pipeline.drain_timeline()
        self.pipeline.close()
        self._write_outputs(history, wall)
        return history

    def _write_outputs(self, history: list[StepStats], wall_s: float) -> None:
        summary: dict[str, Any] = {
            "steps": len(history), "wall_s": wall_s,
            "first_loss": history[0].loss if history else None,
            "last_loss": history[-1].loss if history else None,
            # the first steps include compilation; the median excludes it
            "median_step_time_s": float(np.median([h.step_time_s for h in history[1:] or history])) if history else None,
            "tokens_per_step": self.tokens_per_step,
            "stages": [{"label": st.label, "backend": p.backend, "memory_gib": m.total / GIB if m else None}
                       for st, p, m in zip(self.stages, self.placements, self.memory or [None] * len(self.stages))],
        }
        if self.timeline is not None and history:
            self.timeline.save(self.run_dir / "trace.json")
            gstep = self.cfg.train.gantt_step if self.cfg.train.gantt_step >= 0 else history[-1].step
            events = self.timeline.events(gstep)
            plot_gantt(events, self.run_dir / "gantt.png", stage_labels=[st.label for st in self.stages],
                       title=f"{self.cfg.name}: step {gstep}, {self.cfg.plan.schedule}, "
                             f"{self.cfg.plan.num_microbatches} microbatches")
            summary["bubble_fraction_last_step"] = bubble_fraction(
                [e for e in events if e.kind in ("fwd", "bwd")], len(self.stages))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    # -- inspection (tests, tools) -------------------------------------------------------------
    def params_by_layer(self) -> dict[str, Any]:
        return model_layout([st.params for st in self.stages], self.cfg.plan)

    def grads_by_layer(self) -> dict[str, Any]:
        return model_layout([st.grads() for st in self.stages], self.cfg.plan)


def train(cfg: ExperimentConfig, *, model: nnx.Module | None = None, run_dir: str | Path | None = None) -> list[StepStats]:
    """Train ``model`` (default: the GPT of ``cfg.model``) as ``cfg`` says; returns per-step stats."""
    return Trainer(cfg, model=model, run_dir=run_dir).run()
