"""Does the planner's plan train faster than the hand-made default plan, on this machine?

    python benchmarks/plan_vs_hand.py [--rounds 6] [--steps 6] [--repeats 5] [--out runs/bench_plan_vs_hand]
        [--tensor T ...] [--microbatch B ...] [--profiles FILE]

Everything goes through the real CLI in subprocesses, as a user would run it:
  1. profiles: ``h2jax profile --chip C --model configs/default.yaml --measure`` for every
     chip type of configs/clusters/sim_mix.yaml (the default job's cluster and model), over
     every tensor degree and sequences-per-device the planner can consider for that job
     (``--tensor``, ``--microbatch``), so no stage of the planned plan is priced by the
     roofline (the plan command says so if one is; ``--profiles FILE`` reuses an earlier
     run's instead, for replays -- say so beside the numbers);
  2. the plan: ``h2jax plan configs/clusters/sim_mix.yaml --profiles prof.json --out DIR``,
     the same cluster, model and global batch as the default job, with the planner's
     defaults;
  3. training: ``h2jax train configs/default.yaml`` (the hand-made plan) and ``h2jax train
     DIR/experiment.yaml`` (the planner's), ``--steps`` steps each, in ``--rounds`` rounds
     that alternate which goes first, so both see the machine's slow and fast phases
     alike; each run reports its median tokens/s after its first step (``h2jax train``'s
     own summary line), and each side's figure is the median over its rounds;
  4. predicted against measured: both plans priced with the same profiles by the cost model
     (``h2jax.plan.estimate``, what the planner ranks by) and the simulator, beside the
     median step time each measured (every step after the first, over all rounds): a
     planner whose prediction is far off for either plan picks by a wrong yardstick.

Prints the load average before and after (other work on the machine slows every step) and
writes everything measured to ``OUT/result.json``. Last line: ``RESULT {"planned_over_hand":
tokens/s ratio, "planned_tokens_per_s": ..., "hand_tokens_per_s": ..., "predicted": {...},
"rounds": N, "steps": S}``; above 1 the planner's plan is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs" / "clusters" / "sim_mix.yaml"
HAND = ROOT / "configs" / "default.yaml"
TOKENS = re.compile(r"median ([\d,]+) tokens/s")


def h2jax(*args: str, timeout: float = 3600) -> str:
    """Run one ``h2jax`` command; its stdout and stderr (the trainer's summary goes to the
    latter), or exit with both."""
    r = subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if r.returncode != 0:
        sys.exit(f"h2jax {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r.stdout + r.stderr


def lookups(cluster: dict, global_batch: int) -> tuple[list[int], list[int]]:
    """Tensor degrees and sequences per device the planner can price for this job: every
    tensor degree up to a node, every divisor of the global batch (a stage's microbatch over
    its data degree is again one)."""
    per_node = []
    for name in cluster["chips"]:
        spec = yaml.safe_load((ROOT / "configs" / "chips" / f"{name}.yaml").read_text())
        per_node.append(int(spec["devices_per_node"]))
    tensor = [t for t in range(1, max(per_node) + 1) if max(per_node) % t == 0]
    per_device = [b for b in range(1, global_batch + 1) if global_batch % b == 0]
    return tensor, per_device


def predictions(prof: Path, plans: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Each plan's predicted step seconds by the cost model and by the simulator, with the
    profiles of step 1 (pure Python: no device is touched)."""
    from h2jax.plan import Cluster, ModelShape, Plan, ProfileTable, estimate, simulate_plan

    raw = yaml.safe_load(CLUSTER.read_text())
    cluster = Cluster.from_dict(raw, name=CLUSTER.stem)
    model = ModelShape.from_config(raw["model"])
    table = ProfileTable.load(prof)
    out = {}
    for name, path in plans.items():
        data = yaml.safe_load(path.read_text())
        data = data["plan"] if isinstance(data.get("plan"), dict) else data
        plan = Plan.from_dict({k: v for k, v in data.items() if k != "model"})
        cost = estimate(plan, model, cluster, table=table)
        sim, _ = simulate_plan(plan, model, cluster, table=table)
        out[name] = {
            "estimate_s": cost.iteration_s,
            "simulated_s": sim.iteration_s,
            "estimated_rows": sum(s.estimated for s in cost.stages),
            "bound_by": cost.bound_by,
        }
    return out


def step_times(run_dir: Path) -> list[float]:
    """Seconds of every step after the first (compilation) in a run's metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["step_time_s"]) for r in rows if r.get("step", 0) >= 1 and "step_time_s" in r]


def train(config: Path, *, steps: int, out: Path, tag: str) -> float:
    output = h2jax(
        "train",
        str(config),
        f"train.steps={steps}",
        f"train.out_dir={out}",
        f"name={tag}",
        "train.progress=false",
        "train.timeline=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
    )
    m = TOKENS.search(" ".join(output.split()))
    if not m:
        sys.exit(f"no 'median ... tokens/s' in the output of h2jax train {config}:\n{output[-2000:]}")
    return float(m.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="training rounds; each trains both plans once")
    ap.add_argument("--steps", type=int, default=6, help="steps per training run (the first is not counted)")
    ap.add_argument("--repeats", type=int, default=5, help="`h2jax profile --repeats`: timed rounds per program")
    ap.add_argument("--out", default="runs/bench_plan_vs_hand", help="folder for profiles, the plan and the runs")
    ap.add_argument(
        "--profiles",
        default=None,
        help="skip step 1 and plan with this profile cache (made by an earlier run; say so beside its numbers)",
    )
    ap.add_argument(
        "--tensor", type=int, nargs="*", default=None, help="profile only these tensor degrees (default: every one)"
    )
    ap.add_argument(
        "--microbatch",
        type=int,
        nargs="*",
        default=None,
        help="profile only these sequences per device (default: every one; fewer leave roofline-priced stages, "
        "which the plan's output names)",
    )
    args = ap.parse_args()
    for flag in ("rounds", "steps", "repeats"):
        if getattr(args, flag) < 1 or (flag == "steps" and args.steps < 2):
            sys.exit(f"--{flag}: expected >= {2 if flag == 'steps' else 1}, got {getattr(args, flag)}")
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cluster = yaml.safe_load(CLUSTER.read_text())
    hand = yaml.safe_load(HAND.read_text())
    gb = int(cluster["global_batch"])
    if gb != hand["plan"]["global_batch"] or cluster["model"] != {
        k: hand["model"][k] for k in cluster["model"] if k in hand["model"]
    }:
        sys.exit(f"{CLUSTER.name} no longer describes the default job's model and global batch; fix one of them")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    # 1. profiles of the default job's model, every lookup the planner can make
    prof = out / "prof.json"
    tensor, per_device = lookups(cluster, gb)
    tensor, per_device = args.tensor or tensor, args.microbatch or per_device
    if args.profiles:
        prof = Path(args.profiles).resolve()
        print(f"profiles reused from {prof} (not measured in this run)", flush=True)
    else:
        prof.unlink(missing_ok=True)
    for chip in [] if args.profiles else cluster["chips"]:
        h2jax(
            "profile",
            "--chip",
            chip,
            "--model",
            str(HAND),
            "--tensor",
            *map(str, tensor),
            "--microbatch",
            *map(str, per_device),
            "--measure",
            "--repeats",
            str(args.repeats),
            "--out",
            str(prof),
        )
    if not args.profiles:
        print(f"profiled {', '.join(cluster['chips'])}: tensor {tensor}, sequences per device {per_device}", flush=True)

    # 2. the planner's plan for the same cluster, model and global batch
    plan_dir = out / "plan"
    text = h2jax("plan", str(CLUSTER), "--profiles", str(prof), "--out", str(plan_dir))
    print(text, flush=True)
    planned = plan_dir / "experiment.yaml"

    # 3. both trained in interleaved rounds
    pred = predictions(prof, {"hand": HAND, "planned": planned})
    got: dict[str, list[float]] = {"hand": [], "planned": []}
    steps: dict[str, list[float]] = {"hand": [], "planned": []}
    for r in range(args.rounds):
        pair = [("hand", HAND), ("planned", planned)]
        for name, config in pair if r % 2 == 0 else reversed(pair):
            tps = train(config, steps=args.steps, out=out / "runs", tag=f"{name}_{r}")
            got[name].append(tps)
            steps[name] += step_times(out / "runs" / f"{name}_{r}")
            print(f"round {r} {name}: {tps:,.0f} tokens/s", flush=True)
    hand_tps, planned_tps = statistics.median(got["hand"]), statistics.median(got["planned"])
    tokens = gb * int(cluster["model"]["seq_len"])
    print(f"hand-made plan (configs/default.yaml): median {hand_tps:,.0f} tokens/s over {args.rounds} rounds")
    print(f"planner's plan ({planned}): median {planned_tps:,.0f} tokens/s")
    print(
        f"\n{'plan':<8} {'estimate':>9} {'simulated':>9} {'measured':>9} {'est. err':>8} {'sim. err':>8}   "
        "(step seconds; measured: median step after the first, all rounds)"
    )
    for name in ("hand", "planned"):
        p, med = pred[name], statistics.median(steps[name])
        pred[name]["measured_s"] = med
        rough = f", {p['estimated_rows']} stages priced by the roofline" if p["estimated_rows"] else ""
        print(
            f"{name:<8} {p['estimate_s']:>9.3f} {p['simulated_s']:>9.3f} {med:>9.3f} "
            f"{p['estimate_s'] / med - 1:>+8.1%} {p['simulated_s'] / med - 1:>+8.1%}   "
            f"({tokens / p['estimate_s']:,.0f} predicted vs {tokens / med:,.0f} tokens/s; bound by {p['bound_by']}{rough})"
        )
    print(
        f"predicted planned/hand: {pred['hand']['estimate_s'] / pred['planned']['estimate_s']:.3f} (estimate), "
        f"{pred['hand']['simulated_s'] / pred['planned']['simulated_s']:.3f} (simulator)"
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    result = {
        "planned_over_hand": round(planned_tps / hand_tps, 4),
        "planned_tokens_per_s": round(planned_tps, 1),
        "hand_tokens_per_s": round(hand_tps, 1),
        "predicted": {
            name: {k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()} for name, p in pred.items()
        },
        "rounds": args.rounds,
        "steps": args.steps,
    }
    (out / "result.json").write_text(json.dumps({**result, "tokens_per_s": got, "step_s": steps}, indent=1))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
