"""Pipeline overhead: tokens/s of the h2jax 1F1B pipeline vs one device doing the same work.

Both sides train the same GPT on the same global batch with the same microbatches:

- **single**: one jitted step on one device: ``lax.scan`` over the microbatches
  accumulating fp32 gradients, then global-norm clipping + AdamW (donated buffers).
- **pipeline**: ``h2jax.Trainer`` with 2 stages (emulated chip types sim_a, sim_b) and
  1F1B, boundary tensors through the ``local`` transport; first with one device per
  stage, then with stage meshes of data/tensor > 1.

All run in this process on this host's CPU cores; emulated chips share them, so bubbles
cost little here (an idle stage leaves its cores to the busy one) and the ratio measures
the runtime's own overhead: dispatch, transfers, threads. Median step times over
alternating rounds; the model is sized so one microbatch's forward takes >= 20 ms.

    python benchmarks/pipeline_overhead.py [--steps 4] [--rounds 3] [--one-core]

Last line: ``RESULT {"ratio": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

MODEL = [
    "model.vocab_size=256",
    "model.seq_len=128",
    "model.d_model=256",
    "model.n_heads=8",
    "model.d_ff=1024",
    "model.n_layers=4",
]
BATCH = ["plan.global_batch=32", "plan.num_microbatches=16"]
COMMON = [
    "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
    "train.progress=false",
    "train.tensorboard=false",
    "train.memory_check=false",
    "optimizer.warmup_steps=2",
]
VARIANTS = {
    "1x1 -> 1x1": "plan.stages=[{chip: sim_a, layers: [0, 2]}, {chip: sim_b, layers: [2, 4]}]",
    "2x1 -> 1x2": ("plan.stages=[{chip: sim_a, data: 2, layers: [0, 2]}, {chip: sim_b, tensor: 2, layers: [2, 4]}]"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians over all)")
    ap.add_argument(
        "--one-core",
        action="store_true",
        help="pin the process to one CPU core: no side can use idle cores, so the ratio is the runtime's pure overhead",
    )
    args = ap.parse_args()
    if args.one_core:  # before JAX creates its thread pools
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    from h2jax.config import load_config
    from h2jax.runtime import Trainer, setup_backends

    cfgs = {
        name: load_config(None, MODEL + BATCH + COMMON + [stages, "train.timeline=false"])
        for name, stages in VARIANTS.items()
    }
    base = cfgs["1x1 -> 1x1"]
    setup_backends(base.cluster)  # before JAX starts

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from h2jax.models import build_model
    from h2jax.runtime import make_optimizer

    # ---- single device: one jitted step, scan over microbatches --------------------------------
    dev = jax.devices("cpu")[0]
    model = build_model(base.model, seed=base.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(params, dev)
    tx, _ = make_optimizer(base)
    tx = optax.chain(optax.clip_by_global_norm(base.optimizer.clip_norm), tx)
    opt_state = tx.init(params)

    def loss_fn(p, tok, tgt):
        return nnx.merge(graphdef, p)(tok, tgt)

    def single_step(p, o, tokens, targets):
        def body(acc, mb):
            loss, g = jax.value_and_grad(loss_fn)(p, *mb)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), loss

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p)
        acc, losses = jax.lax.scan(body, zeros, (tokens, targets))
        grads = jax.tree.map(lambda g: g / tokens.shape[0], acc)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, jnp.mean(losses)

    single = jax.jit(single_step, donate_argnums=(0, 1))
    fwd_one = jax.jit(loss_fn)

    trainers = {name: Trainer(cfg, run_dir="runs/bench_pipeline_overhead") for name, cfg in cfgs.items()}
    tokens_per_step = base.plan.global_batch * base.model.seq_len

    def batch(step):
        tok, tgt = trainers["1x1 -> 1x1"].batch(step)
        return jax.device_put(tok, dev), jax.device_put(tgt, dev)

    # forward time of one microbatch on one device (the model-size requirement)
    tok, tgt = batch(0)
    fwd_one(params, tok[0], tgt[0]).block_until_ready()
    fwd_times = []
    for _ in range(5):
        t = time.perf_counter()
        fwd_one(params, tok[0], tgt[0]).block_until_ready()
        fwd_times.append(time.perf_counter() - t)
    fwd_ms = 1e3 * statistics.median(fwd_times)

    def time_single(n, step0):
        nonlocal params, opt_state
        out = []
        for i in range(n):
            tok, tgt = batch(step0 + i)
            t = time.perf_counter()
            params, opt_state, loss = single(params, opt_state, tok, tgt)
            loss.block_until_ready()
            out.append(time.perf_counter() - t)
        return out

    def time_pipeline(trainer, n):
        return [trainer.train_step().step_time_s for _ in range(n)]

    # warm-up (compilation) on every side
    time_single(2, 0)
    for tr in trainers.values():
        time_pipeline(tr, 2)

    times: dict[str, list[float]] = {"single": []} | {name: [] for name in trainers}
    for r in range(args.rounds):
        times["single"] += time_single(args.steps, 2 + r * args.steps)
        for name, tr in trainers.items():
            times[name] += time_pipeline(tr, args.steps)

    # one traced step of the 1x1 pipeline: where the time goes
    traced_cfg = load_config(None, MODEL + BATCH + COMMON + [VARIANTS["1x1 -> 1x1"], "train.timeline=true"])
    traced = Trainer(traced_cfg, run_dir="runs/bench_pipeline_overhead")
    time_pipeline(traced, 3)
    traced.drain_timeline()
    ev = traced.timeline.events(2)
    span = (max(e.end_us for e in ev) - min(e.start_us for e in ev)) / 1e3
    busy = [sum(e.dur_us for e in ev if e.stage == s and e.kind in ("fwd", "bwd")) / 1e3 for s in range(2)]
    xfer = sum(e.dur_us for e in ev if e.kind == "send") / 1e3

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens_per_step / v for k, v in med.items()}
    print(
        f"\ncores: {len(os.sched_getaffinity(0))}; model: {base.model.n_layers} layers, d_model {base.model.d_model}, seq {base.model.seq_len}; "
        f"global batch {base.plan.global_batch} = {base.plan.num_microbatches} x {base.plan.microbatch_size}; "
        f"forward of one microbatch on one device: {fwd_ms:.1f} ms"
    )
    print(f"{'side':<26}{'median step (ms)':>18}{'tokens/s':>12}{'ratio':>8}")
    for k in times:
        label = "single device (scan)" if k == "single" else f"pipeline 1F1B {k}"
        print(f"{label:<26}{1e3 * med[k]:>18.1f}{tps[k]:>12,.0f}{tps[k] / tps['single']:>8.3f}")
    print(
        f"\ntraced 1x1 step: span {span:.1f} ms; stage busy {busy[0]:.1f} / {busy[1]:.1f} ms; "
        f"transfers {xfer:.2f} ms total over {sum(1 for e in ev if e.kind == 'send')} sends"
    )
    result = {
        "ratio": tps["1x1 -> 1x1"] / tps["single"],
        "cores": len(os.sched_getaffinity(0)),
        "ratio_2x1_to_1x2": tps["2x1 -> 1x2"] / tps["single"],
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "fwd_ms_per_microbatch": round(fwd_ms, 2),
        "traced_step_ms": round(span, 2),
        "transfer_ms_per_step": round(xfer, 3),
    }
    for tr in list(trainers.values()) + [traced]:
        tr.close()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
