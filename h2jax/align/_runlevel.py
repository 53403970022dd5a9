"""Run level: N training steps from the same init and data, loss curves against the reference.

Each run is the trainer's step written as one jitted program: the step loss (the global
batch as one batch: the same mean as over equal microbatches) and its gradient under a numerics policy, clipping to the global norm
(``optimizer.clip_norm``, as the trainer does over all stages), and the experiment's AdamW
(``h2jax.runtime.make_optimizer``). Runs:

- ``reference``: the host in float64 (parameters, gradients and optimizer state);
- each chip type alone, on its own device, with its policy;
- ``plan``: the experiment's heterogeneous plan -- every layer under the policy of its
  stage's chip type (:func:`h2jax.align._targets.plan_policy`), as one sequential program on
  the host. The pipeline itself is not run: that it computes the same step as the
  sequential program is what the pipeline-equivalence tests prove; what differs between
  chip types is the numerics, and those are applied here per layer.

- ``trainer`` (asked for with ``trainer_dir``): the plan through the real pipeline trainer,
  ``h2jax.runtime.train``, its losses read back from ``metrics.jsonl``, every chip type in
  the host's fp32 (the exact policy): it shows that the loop above computes what the trainer
  computes. (The runtime applies a chip's policy to its forward ops and autodiff carries it
  into the backward; align re-emits the backward's ops under the policy as well, so under a
  rounding policy the two would not compute the same step.)

Gate: the loss's mean relative error against the reference over the N steps
(``MRE = mean_t |loss_t - ref_t| / |ref_t|``), 1.5 % by default (H2's bar).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from h2jax._jaxpr import PolicyLike, apply_policy
from h2jax.align._reference import reference
from h2jax.align._targets import HOST, ChipTarget, Experiment, graphdef_for, step_loss

DEFAULT_MRE_GATE = 0.015
"""Loss mean relative error allowed against the reference over the run (H2: < 1.5 % over 300 steps)."""


@dataclass
class RunLevel:
    steps: int
    gate: float
    losses: dict[str, list[float]]  # run -> loss per step ("reference" included)
    mre: dict[str, float]
    describe: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def status(self, run: str) -> str:
        mre = self.mre[run]
        return "pass" if np.isfinite(mre) and mre <= self.gate else "fail"

    def passed(self) -> bool:
        return all(self.status(r) == "pass" for r in self.mre)

    def rel_error(self, run: str) -> np.ndarray:
        ref = np.asarray(self.losses["reference"])
        return np.abs(np.asarray(self.losses[run]) - ref) / np.abs(ref)


def _optimizer(cfg: Any, steps: int):
    import dataclasses

    from h2jax.runtime import make_optimizer

    train = dataclasses.replace(cfg.train, steps=steps)
    return make_optimizer(dataclasses.replace(cfg, train=train))[0]


def _train_step(loss_and_grad: Any, tx: Any, clip_norm: float):
    import optax

    def step(params, opt_state, tokens, targets):
        loss, grads = loss_and_grad(params, tokens, targets)
        norm = optax.tree.norm(grads)
        # the trainer's clip_scale: clip when the norm reaches clip_norm; no clipping when clip_norm <= 0
        scale = jnp.where((clip_norm > 0) & (norm >= clip_norm), clip_norm / norm, 1.0)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def train_losses(
    exp: Experiment,
    policy: PolicyLike | None,
    device: Any,
    steps: int,
    *,
    graphdef: Any = None,
    fault: Any = None,
    label: str = "",
) -> list[float]:
    """Loss per step of ``steps`` steps on ``device`` with ``policy`` (None: the float64 reference);
    ``label`` names the run in its progress line."""
    graphdef = graphdef if graphdef is not None else exp.graphdef
    fn = jax.value_and_grad(step_loss(graphdef))
    tx = _optimizer(exp.cfg, steps)
    clip = float(exp.cfg.optimizer.clip_norm)
    if policy is None:
        ref = reference(fn, exp.params, *exp.whole_batch())  # traced in the model's dtypes
        with jax.enable_x64(True), jax.default_device(device):
            params = jax.device_put(jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), exp.params), device)
            step = _train_step(ref, tx, clip)
            return _loop(exp, step, params, tx, device, steps, label)
    step = _train_step(apply_policy(fn, policy, fault=fault), tx, clip)
    return _loop(exp, step, jax.device_put(exp.params, device), tx, device, steps, label)


def _loop(exp: Experiment, step: Any, params: Any, tx: Any, device: Any, steps: int, label: str = "") -> list[float]:
    from h2jax._progress import Progress

    opt_state = jax.device_put(tx.init(params), device)
    losses = []
    with Progress(f"align run level: {label}" if label else "align run level", total=steps) as progress:
        for t in range(steps):
            tokens, targets = exp.whole_batch(t)
            params, opt_state, loss = step(
                params, opt_state, jax.device_put(tokens, device), jax.device_put(targets, device)
            )
            losses.append(loss.block_until_ready())  # steps run one after another anyway
            progress.advance(note=f"step {t}, loss {float(loss):.4f}")
    return [float(x) for x in jax.device_get(losses)]


def trainer_losses(cfg: Any, steps: int, run_dir: str | Path) -> list[float]:
    """Loss per step of ``steps`` steps of the experiment through ``h2jax.runtime.train``
    (no checkpoints, timeline, TensorBoard or progress bar; a fresh run folder), every chip
    type under the exact policy."""
    import dataclasses
    import shutil

    from h2jax.plan import NumericsPolicy
    from h2jax.runtime import read_metrics, train

    exact = {name: dataclasses.replace(chip, numerics=NumericsPolicy()) for name, chip in cfg.cluster.chips.items()}
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, chips=exact))

    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    quiet = dataclasses.replace(cfg.train, steps=steps, log_every=1, timeline=False, tensorboard=False, progress=False)
    cfg = dataclasses.replace(cfg, train=quiet, checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False))
    train(cfg, run_dir=run_dir)
    rows = sorted((r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r), key=lambda r: r["step"])
    return [float(r["loss"]) for r in rows][:steps]


def run_level(
    exp: Experiment,
    chips: Sequence[ChipTarget],
    *,
    steps: int,
    plan: PolicyLike | None = None,
    gate: float = DEFAULT_MRE_GATE,
    trainer_dir: str | Path | None = None,
) -> RunLevel:
    """Reference, each chip type alone, and the plan (if given): ``steps`` steps each; see the module doc."""
    host = jax.devices(HOST)[0]
    losses: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    describe: dict[str, str] = {"reference": "host CPU, float64"}

    runs = 1 + len(chips) + (plan is not None) + (trainer_dir is not None)

    def timed(name: str, fn: Any) -> None:
        """Run ``fn(label)``: its progress line names the run and its place among the runs."""
        start = time.perf_counter()
        losses[name] = fn(f"{name} (run {len(losses) + 1} of {runs})")
        seconds[name] = time.perf_counter() - start

    timed("reference", lambda label: train_losses(exp, None, host, steps, label=label))
    for chip in chips:
        g = graphdef_for(exp, chip.policy)
        timed(
            chip.name,
            lambda label, c=chip, g=g: train_losses(
                exp, c.policy, c.device, steps, graphdef=g, fault=c.fault, label=label
            ),
        )
        describe[chip.name] = chip.describe()
    if plan is not None:
        timed("plan", lambda label: train_losses(exp, plan, host, steps, label=label))
        stages = ", ".join(
            f"{s.chip} " + " ".join(f"{a}-{b - 1}" for a, b in s.layer_chunks) for s in exp.cfg.plan.stages
        )
        describe["plan"] = f"stages {stages}; each layer under its chip's policy, sequential on the host"
    if trainer_dir is not None:
        timed("trainer", lambda label: trainer_losses(exp.cfg, steps, trainer_dir))  # the trainer's own progress
        describe["trainer"] = "the plan through h2jax.runtime.train, every chip in the host's fp32"
    ref = np.asarray(losses["reference"])
    mre = {
        name: float(np.mean(np.abs(np.asarray(v) - ref) / np.abs(ref)))
        for name, v in losses.items()
        if name != "reference"
    }
    return RunLevel(steps, gate, losses, mre, describe, seconds)
