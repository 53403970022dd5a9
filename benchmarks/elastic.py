"""An elastic run healing itself: the tiny config under mpirun (``h2jax train --elastic``, its
defaults) over sim_a (1 node) and sim_b (2 nodes) loses the sim_b node of its last stage
mid-run; the supervisor detects it, re-plans onto the survivors, resumes from the newest
committed checkpoint and trains to the end. A second run has a process stop responding
(SIGSTOP) instead: detected as a hang, the job restarts under the same plan.

Each scenario runs twice in one folder tree: the first warms the XLA compilation cache for
both plans, the second is measured (the restart-to-first-step target is for a warm cache).
Printed: the recovery timeline of each measured run (seconds from the fault) and a table.

    python benchmarks/elastic.py [--steps 20] [--every 5] [--fault-step 12]

Last line: ``RESULT {"detect_s": a, "replan_s": b, "restart_to_first_step_s": c,
"steps_redone": n, "goodput": g, "detect_stopped_s": d}``. Targets on a 2-core machine:
detect <= 10 s for a killed process and <= 60 s for a stopped one, re-plan <= 2 s, restart to
the first step <= 60 s with the cache warm, steps redone <= the checkpoint interval.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _elastic(d: Path, name: str, fault: str, args: argparse.Namespace) -> list[dict]:
    from h2jax.launch import find_mpirun

    launcher = f"{find_mpirun()} --allow-run-as-root --oversubscribe -np {{stages}}"
    cmd = [
        sys.executable, "-m", "h2jax.cli", "train", str(REPO / "configs" / "tiny.yaml"),
        "cluster.chips.sim_b.nodes=2", f"train.steps={args.steps}", f"checkpoint.every_steps={args.every}",
        "train.progress=false", "train.tensorboard=false", "train.timeline=false", f"name={name}",
        "--elastic", "--launcher", launcher, "--inject-fault", fault,
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: the elastic run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in (d / "runs" / name / "events.jsonl").read_text().splitlines()]


def _timeline(name: str, ev: list[dict]) -> None:
    fail = next(e for e in ev if e["event"] == "failure")
    t0 = fail["time"] - (fail["detect_s"] or 0.0)  # the fault
    print(f"\n{name}: recovery timeline (s from the fault)")
    for e in ev:
        extra = {
            "launch": lambda e: f"attempt {e['attempt']}, {len(e['plan']['stages'])} stages",
            "failure": lambda e: (
                f"{e['why']}; lost {e['lost_nodes'] or 'no node'}; detect {e['detect_s']:.2f} s; "
                f"resume at step {e['resume_step']}, {e['steps_redone']} step(s) to redo"
            ),
            "replan": lambda e: f"{e['replan_s']:.3f} s onto {e['nodes']}",
            "first_step": lambda e: f"step {e['step']} done, {e['restart_to_first_step_s']:.1f} s after the relaunch",
            "finished": lambda e: (
                f"goodput {e['goodput']:.2f} ({e['productive_s']:.1f} s of steps, {e['wall_s']:.1f} s wall)"
            ),
        }.get(e["event"], lambda e: "")(e)
        print(f"  {e['time'] - t0:8.2f}  {e['event']:<11} {extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    ap.add_argument("--fault-step", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        node = f"node:sim_b:0@{args.fault_step}"  # tiny's last stage is on sim_b node 0
        stop = f"stop:1@{args.fault_step}"  # the process of stage 1
        _elastic(d, "warm_node", node, args)
        lost = _elastic(d, "node", node, args)
        _elastic(d, "warm_stop", stop, args)
        stopped = _elastic(d, "stop", stop, args)
    _timeline("a node lost (its process killed)", lost)
    _timeline("a process stopped (SIGSTOP)", stopped)

    def one(ev: list[dict], event: str, key: str) -> float | None:
        got = [e[key] for e in ev if e["event"] == event]
        return got[0] if got else None

    result = {
        "detect_s": one(lost, "failure", "detect_s"),
        "replan_s": one(lost, "replan", "replan_s"),
        "restart_to_first_step_s": one(lost, "first_step", "restart_to_first_step_s"),
        "steps_redone": one(lost, "failure", "steps_redone"),
        "goodput": one(lost, "finished", "goodput"),
        "detect_stopped_s": one(stopped, "failure", "detect_s"),
        "restart_to_first_step_stopped_s": one(stopped, "first_step", "restart_to_first_step_s"),
    }
    targets = {
        "detect_s": 10.0,
        "replan_s": 2.0,
        "restart_to_first_step_s": 60.0,
        "steps_redone": float(args.every),
        "detect_stopped_s": 60.0,
    }
    print(f"\n{'measure':<34}{'value':>10}{'target':>10}  met")
    for k, v in result.items():
        t = targets.get(k)
        met = "" if t is None else ("yes" if v is not None and v <= t else "NO")
        print(
            f"{k:<34}{v if v is not None else float('nan'):>10.3f}{t if t is not None else float('nan'):>10.1f}  {met}"
        )
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "restart_to_first_step_stopped_s"}))


if __name__ == "__main__":
    main()
