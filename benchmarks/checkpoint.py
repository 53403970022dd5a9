"""How long a checkpoint save blocks the training loop: asynchronous vs synchronous.

A GPT with >= 100 MB of state (parameters + AdamW mu and nu, fp32) across two emulated chip
types; after a warm-up step, the trainer saves its state N times in each mode, with one
training step between saves (what overlaps the background write). Blocking time is what
the training thread spends inside ``save_checkpoint()``: for an async save, the
device-to-host copy and orbax's bookkeeping; for a sync save, everything up to the commit.

    python benchmarks/checkpoint.py [--d-model 512 --layers 4 --saves 3]

Prints a table, then ``RESULT {"blocking_ratio": async / sync, ...}`` (target <= 0.3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()

    from h2jax.config import load_config
    from h2jax.runtime import Trainer, setup_backends

    overrides = [
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.d_ff={4 * args.d_model}",
        "model.n_heads=8",
        "model.seq_len=32",
        "plan.global_batch=8",
        "plan.num_microbatches=2",
        f"plan.stages.0.layers=[0,{args.layers // 2}]",
        f"plan.stages.1.layers=[{args.layers // 2},{args.layers}]",
        "train.progress=false",
        "train.tensorboard=false",
        "train.timeline=false",
        "train.memory_check=false",
        "optimizer.warmup_steps=0",
    ]
    cfg = load_config(None, overrides)
    setup_backends(cfg.cluster)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, run_dir=tmp)
        trainer.train_step()  # compile; real optimizer state
        state = trainer.state_by_layer()
        state_mb = sum(v.nbytes for v in state.values()) / 1e6
        results = {}
        for mode in ("sync", "async"):
            trainer.cfg = replace(
                cfg, checkpoint=replace(cfg.checkpoint, dir=os.path.join(tmp, mode), async_save=mode == "async")
            )
            trainer._store, trainer._saved_step = None, None
            blocking, step_s, commit_s = [], [], []
            for _ in range(args.saves):
                t0 = time.perf_counter()
                trainer.save_checkpoint()
                blocking.append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                trainer.train_step()
                step_s.append(time.perf_counter() - t1)
                trainer.checkpoint_store().wait()  # the background write, if any, off the clock
                commit_s.append(trainer.checkpoint_store().last_commit_s)
            trainer.close_checkpoints()
            results[mode] = (statistics.median(blocking), statistics.median(step_s), statistics.median(commit_s))
            rows.append((mode, *results[mode]))
    print(
        f"checkpoint save of {state_mb:.0f} MB of state ({len(state)} arrays: params + AdamW mu, nu), "
        f"2 stages on sim_a/sim_b, median of {args.saves} saves"
    )
    print(f"{'mode':<6} {'blocking s':>11} {'next step s':>12} {'wait after step s':>18}")
    for mode, b, st, c in rows:
        print(f"{mode:<6} {b:>11.3f} {st:>12.3f} {c:>18.3f}")
    ratio = results["async"][0] / results["sync"][0]
    print(
        "RESULT "
        + json.dumps(
            {
                "blocking_ratio": round(ratio, 4),
                "state_mb": round(state_mb, 1),
                "async_blocking_s": round(results["async"][0], 4),
                "sync_blocking_s": round(results["sync"][0], 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
