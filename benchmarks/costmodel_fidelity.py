"""Cost-model fidelity: predicted vs measured step time of several plans, run for real.

Measured (on this machine, by this script):
  1. per-part costs of every chip type the plans use, with ``h2jax profile --measure``'s
     code (``h2jax.runtime._profile.ChipProfiler``): the real stage programs timed alone
     -- per-block / embedding / head forward, backward and optimizer step, the fixed cost
     of one program call -- and how much of the host each takes (copies run together on
     as many emulated nodes as the host has cores), the time of a boundary tensor moved
     between two clients, and the runtime driver's own costs (``DriverProfiler``: a null
     model through the real trainer: per step, per op, per boundary tensor); the host's
     core count is this process's CPU affinity. The programs are built once and timed in
     ``--repeats`` rounds spread over the training rounds below (a few before each), so
     the profile and the steps see the machine's slow and fast phases alike
     (``--profile-first``: all of them back to back before the steps, as ``h2jax
     profile`` takes them). Each program's median round is kept (``--statistic``; the
     step times below are medians too) or its lower quartile;
  2. the step time of every plan, trained for real on the emulated chips: the median of
     ``--rounds`` x ``--steps`` steps after 2 warm-up steps, the plans interleaved round by
     round (every plan sees the machine's slow and fast phases alike); in each round a
     plan's first step after the other plans ran is not timed (caches, memory), so the
     steps timed are steady-state steps.
Modelled (``h2jax.plan``, no fitting to the step times): ``estimate`` -- the pipeline
formula, its steady-state period lengthened where the stages share this machine's cores
(the time the cores take to run one microbatch of every stage at once), and bounded by the
host's core-seconds over its cores -- and the discrete-event simulator with processor
sharing of the host's cores, op by op. The runtime reduces gradients in every backward,
so both use ``grad_sync="microbatch"``. The column "no host" is the estimate with the
shared-host terms switched off (``CostOptions(host_contention=False)``: no contention, no
driver CPU; the measured transfers kept), for comparison.

The plan set is fixed by a rule, not picked by outcome: global batch 16 sequences of the
model below, 1F1B, chips sim_a, sim_b, sim_c in stage order;
  - the grid {1, 2, 3 stages, layers split evenly} x {2, 8 microbatches}, 1x1 meshes,
    no recompute (6 plans);
  - one-factor variants of the 2-stage, 8-microbatch plan: recompute on every stage;
    tensor degree 2 on every stage; data degree 2 on every stage; the uneven split 5 + 1
    (4 plans).

    python benchmarks/costmodel_fidelity.py [--rounds 24] [--steps 3] [--repeats 48] [--driver-steps 72]
        [--profile-first] [--statistic median|lower-quartile] [--save FILE]
    python benchmarks/costmodel_fidelity.py --replay FILE

Every run saves what it measured (the profile table, every plan's step times, the load
averages) to ``--save`` (default ``runs/bench_costmodel/fidelity.json``); ``--replay FILE``
prices the plans again from such a file without measuring anything -- to see how a change
to the model moves its errors on the same measurements. A replayed table is not a new
measurement: report numbers from fresh runs.

Prints the load average before and after (other work on the machine slows every step;
while it runs, the benchmark itself keeps about 1.5-2 of the 2 cores busy, so the "after"
figures count it too).
Last line: ``RESULT {"median_abs_err": ..., "kendall_tau": ..., ...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

MODEL = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 6, "d_ff": 512, "dtype": "float32"}
CLUSTER = {"sim_a": {"nodes": 1}, "sim_b": {"nodes": 1}, "sim_c": {"nodes": 1}}
GLOBAL_BATCH = 16
CHIPS = ("sim_a", "sim_b", "sim_c")


def S(chip, layers, data=1, tensor=1, recompute=False):
    return {"chip": chip, "layers": list(layers), "data": data, "tensor": tensor, "recompute": recompute}


def even(n_stages: int, **kw) -> list[dict]:
    L = MODEL["n_layers"]
    cuts = [round(i * L / n_stages) for i in range(n_stages + 1)]
    return [S(CHIPS[i], (cuts[i], cuts[i + 1]), **kw) for i in range(n_stages)]


def plans() -> dict[str, tuple[int, list[dict]]]:
    """name -> (num_microbatches, stages), by the rule of the module docstring."""
    out: dict[str, tuple[int, list[dict]]] = {}
    for n in (1, 2, 3):
        for m in (2, 8):
            out[f"{n}st m{m}"] = (m, even(n))
    out["2st m8 recompute"] = (8, even(2, recompute=True))
    out["2st m8 tp2"] = (8, even(2, tensor=2))
    out["2st m8 dp2"] = (8, even(2, data=2))
    out["2st m8 split 5+1"] = (8, [S("sim_a", (0, 5)), S("sim_b", (5, 6))])
    return out


def kendall_tau(a, b) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum(
        (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0) for i, j in pairs
    )
    return s / len(pairs)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rounds",
        type=int,
        default=24,
        help="rounds over all plans (interleaved); the plans differ by about their step-to-step "
        "spread, so fewer rounds rank them by noise",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan per round")
    ap.add_argument(
        "--repeats", type=int, default=48, help="profiler rounds per program, spread over the training rounds"
    )
    ap.add_argument(
        "--driver-steps",
        type=int,
        default=72,
        help="rounds of the driver calibration (null model through the trainer), spread likewise",
    )
    ap.add_argument(
        "--profile-first",
        action="store_true",
        help="take the whole profile back to back before the training rounds instead (as "
        "`h2jax profile` does; for comparison)",
    )
    ap.add_argument(
        "--statistic",
        default="median",
        choices=("median", "lower-quartile"),
        help="what the profiler keeps of a program's rounds; the median matches the step medians "
        "the plans are compared by",
    )
    ap.add_argument(
        "--save",
        default="runs/bench_costmodel/fidelity.json",
        help="where to save the measurements (profile table, step times)",
    )
    ap.add_argument("--replay", metavar="FILE", help="price the plans from a saved file; measure nothing")
    args = ap.parse_args()
    for key in ("rounds", "steps", "repeats", "driver_steps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected at least 1")
    t_start = time.perf_counter()
    if args.replay:
        saved = json.loads(Path(args.replay).read_text())
        report(saved, replayed=args.replay, wall_s=time.perf_counter() - t_start)
        return
    load_before = load()
    print(f"load average before: {load_before}", flush=True)
    saved = measure(args)
    saved["load_avg_before"] = load_before
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    Path(args.save).write_text(json.dumps(saved, indent=1))
    print(f"measurements saved to {args.save}")
    report(saved, replayed=None, wall_s=time.perf_counter() - t_start)


def configs() -> dict:
    from h2jax.config import load_config

    overrides = [
        f"model={json.dumps(MODEL)}",
        f"cluster.chips={json.dumps(CLUSTER)}",
        "train.progress=false",
        "train.tensorboard=false",
        "train.timeline=false",
        "checkpoint.enabled=false",
        f"plan.global_batch={GLOBAL_BATCH}",
    ]
    cfgs = {}
    for name, (m, stages) in plans().items():
        cfgs[name] = load_config(
            None, overrides + [f"plan.num_microbatches={m}", "plan.schedule=1f1b", f"plan.stages={json.dumps(stages)}"]
        )
    return cfgs


def spread(total: int, rounds: int) -> list[int]:
    """`total` profile rounds over `rounds` training rounds, as evenly as they go."""
    return [total // rounds + (1 if r < total % rounds else 0) for r in range(rounds)]


def measure(args) -> dict:
    """Profile the chips and train every plan; the table and step times as JSON."""
    from h2jax.runtime import setup_backends

    cfgs = configs()
    from h2jax.plan._profiles import local_cores
    from h2jax.runtime._profile import MAX_PROBE_COPIES
    from xla_plugins import register_emulated_chips

    # the profiler's contention probe runs one copy of a program per host core, each on an
    # emulated node of its own: register that many nodes per chip type before JAX starts
    probe = max(1, min(local_cores(), MAX_PROBE_COPIES))
    register_emulated_chips(
        {c: (probe, any_spec.devices_per_node) for c, any_spec in next(iter(cfgs.values())).cluster.chips.items()}
    )
    setup_backends(next(iter(cfgs.values())).cluster)

    from h2jax.plan import ModelShape, ProfileTable, load_chip
    from h2jax.runtime import Trainer
    from h2jax.runtime._profile import ChipProfiler, DriverProfiler

    any_cfg = next(iter(cfgs.values()))
    shape = ModelShape.from_config(MODEL)
    cores = local_cores()
    host = load_chip(CHIPS[0])[0].host
    # (chip, tensor) -> per-device microbatches the plans need
    need: dict[tuple[str, int], set[int]] = {}
    for c in cfgs.values():
        for st in c.plan.stages:
            need.setdefault((st.chip, st.tensor), set()).add(c.plan.microbatch_size // st.data)

    t0 = time.perf_counter()
    profilers = [
        ChipProfiler(chip, any_cfg.cluster.chips[chip], any_cfg.model, tensor_degrees=[t], microbatches=sorted(mbs))
        for (chip, t), mbs in sorted(need.items())
    ]
    # the runtime driver's own costs on this host (null model through the real trainer)
    driver = DriverProfiler(CHIPS[0])
    print(f"built the profiler's programs in {time.perf_counter() - t0:.0f} s", flush=True)

    def profile(n_rounds: int, n_driver: int) -> None:
        for _ in range(n_rounds):
            for prof in profilers:
                prof.round()
        for _ in range(n_driver):
            driver.round()

    trainers = {}
    for name, cfg in cfgs.items():
        tr = Trainer(cfg, run_dir="runs/bench_costmodel")
        for _ in range(2):  # compile, warm up
            tr.train_step()
        trainers[name] = tr
    times: dict[str, list[float]] = {n: [] for n in cfgs}
    names = list(cfgs)
    if args.profile_first:  # the profile back to back before the steps (how `h2jax profile` takes it)
        profile(args.repeats, args.driver_steps)
        print(f"profiled in one block before the steps (load average {load()})", flush=True)
    # otherwise the profile's rounds are interleaved with the steps' rounds, so the profile and
    # the steps see the machine's slow and fast phases alike
    per_round = [0] * args.rounds if args.profile_first else spread(args.repeats, args.rounds)
    per_round_driver = [0] * args.rounds if args.profile_first else spread(args.driver_steps, args.rounds)
    for r in range(args.rounds):
        profile(per_round[r], per_round_driver[r])
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            trainers[name].train_step()  # back to this plan after the others ran: one step untimed
            for _ in range(args.steps):
                times[name].append(trainers[name].train_step().step_time_s)
    for tr in trainers.values():
        tr.close()
    table = ProfileTable()
    for prof in profilers:
        for (t, b), parts in prof.rows(args.statistic).items():
            table.add(prof.chip_name, shape.key(), t, b, parts, host_cores=cores)
    table.driver[host] = d = driver.result(args.statistic)
    driver.close()
    print(
        f"profile: {args.repeats} rounds per program, "
        + ("back to back before the steps" if args.profile_first else f"spread over the {args.rounds} rounds")
        + f", each program's {args.statistic} kept"
    )
    print(
        f"  driver on host {host!r}: {1e3 * d.step_s:.2f} ms per step outside the ops, CPU "
        f"{1e3 * d.step_cpu_s:.2f} ms per step, {1e3 * d.op_cpu_s:.3f} ms per op beyond its call, "
        f"{1e3 * d.transfer_cpu_s:.3f} ms per boundary tensor"
    )
    for (chip, _, t, b), parts in sorted(table.entries.items()):
        print(
            f"  {chip} t={t} b={b}: "
            + "; ".join(
                f"{k} f {1e3 * p.fwd_s:.2f} ms x{p.fwd_cores:.2f} b {1e3 * p.bwd_s:.2f} ms x{p.bwd_cores:.2f} "
                f"u {1e3 * p.update_s:.2f} ms"
                for k, p in parts.items()
            )
        )
    return {
        "table": table.to_json(),
        "host_cores": cores,
        "rounds": args.rounds,
        "steps": args.steps,
        "times": times,
        "load_avg_after": load(),
        "statistic": args.statistic,
        "profile": "first" if args.profile_first else "interleaved",
        "profile_rounds": args.repeats,
    }


def report(saved: dict, *, replayed: str | None, wall_s: float) -> None:
    """Price every plan from the saved profile table; print the table and the RESULT line."""
    from h2jax.plan import Cluster, CostOptions, ModelShape, ProfileTable, estimate, simulate_plan

    cfgs = configs()
    shape = ModelShape.from_config(MODEL)
    table = ProfileTable()
    table.merge_json(saved["table"])
    times, cores = saved["times"], saved["host_cores"]
    load_before, load_after = saved["load_avg_before"], saved["load_avg_after"]
    cluster = Cluster.from_dict({"chips": CLUSTER})
    opts = CostOptions(grad_sync="microbatch")
    no_host = CostOptions(grad_sync="microbatch", host_contention=False)
    rows = []
    for name, cfg in cfgs.items():
        cost = estimate(cfg.plan, shape, cluster, table=table, opts=opts)
        sim, _ = simulate_plan(cfg.plan, shape, cluster, table=table, opts=opts)
        flat = estimate(cfg.plan, shape, cluster, table=table, opts=no_host)
        ts = sorted(times[name])
        q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        rows.append(
            dict(
                name=name,
                measured=statistics.median(ts),
                iqr=(q3 - q1),
                est=cost.iteration_s,
                sim=sim.iteration_s,
                flat=flat.iteration_s,
                bound=cost.bound_by,
            )
        )
    meas = [r["measured"] for r in rows]
    # the noise ceiling of the ranking: the plans' medians over the even rounds against those
    # over the odd rounds (the same measurement, split in two) -- no model ranks them better
    k = saved["steps"]
    halves = (
        [
            [statistics.median(x for i, x in enumerate(times[r["name"]]) if (i // k) % 2 == h) for r in rows]
            for h in (0, 1)
        ]
        if saved["rounds"] >= 2
        else None
    )
    tau_halves = kendall_tau(*halves) if halves else None
    err = lambda key: [abs(r[key] - r["measured"]) / r["measured"] for r in rows]  # noqa: E731
    e_est, e_sim, e_flat = err("est"), err("sim"), err("flat")
    print(
        f"\nmodel {MODEL}; global batch {GLOBAL_BATCH}; {saved['rounds']} rounds x {saved['steps']} steps per "
        f"plan (interleaved); profiles measured on this host ({cores} cores), each program's "
        f"{saved.get('statistic', 'lower-quartile')} kept"
        + (f"; REPLAYED from {replayed} (no new measurement)" if replayed else "")
    )
    print(
        f"{'plan':<18}{'measured ms':>12}{'IQR':>7}{'estimate':>10}{'err':>6}{'simulator':>11}{'err':>6}"
        f"{'no host':>9}{'err':>6}  bound by"
    )
    for r, a, b, c in zip(rows, e_est, e_sim, e_flat):
        print(
            f"{r['name']:<18}{1e3 * r['measured']:>12.1f}{1e3 * r['iqr']:>7.1f}{1e3 * r['est']:>10.1f}{a:>6.2f}"
            f"{1e3 * r['sim']:>11.1f}{b:>6.2f}{1e3 * r['flat']:>9.1f}{c:>6.2f}  {r['bound']}"
        )
    if tau_halves is not None:
        print(
            f"Kendall tau of the even rounds' medians against the odd rounds': {tau_halves:.2f} "
            "(how well the measurement ranks the plans against itself)"
        )
    print(f"load average before {load_before}, after {load_after}; wall {wall_s:.0f} s")
    result = {
        "median_abs_err": round(statistics.median(e_est), 4),
        "kendall_tau": round(kendall_tau([r["est"] for r in rows], meas), 4),
        "median_abs_err_simulator": round(statistics.median(e_sim), 4),
        "kendall_tau_simulator": round(kendall_tau([r["sim"] for r in rows], meas), 4),
        "median_abs_err_no_host_term": round(statistics.median(e_flat), 4),
        "kendall_tau_no_host_term": round(kendall_tau([r["flat"] for r in rows], meas), 4),
        "kendall_tau_measured_halves": None if tau_halves is None else round(tau_halves, 4),
        "measured_spread": round(max(meas) / min(meas), 3),
        "plans": len(rows),
        "host_cores": cores,
        "load_avg_before": load_before,
        "load_avg_after": load_after,
    }
    if replayed:
        result["replayed"] = True
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
