"""Cost-model fidelity: predicted vs measured step time of several plans, run for real.

A small GPT is profiled on the emulated chips (``h2jax profile --measure``'s code: the
real stage programs, timed alone), then >= 6 plans (2-3 stages, uneven splits, data and
tensor degrees, recompute, GPipe and 1F1B) are trained for a few steps on the emulated
chips and their median step time is compared with the cost model (``h2jax.plan.estimate``
with the measured profiles; the runtime reduces gradients every microbatch, so
``grad_sync="microbatch"``) and with the simulator.

Emulated chips share this host's cores: stages that the model treats as independent
chips slow each other down here, which the cost model does not know. The table shows
how much that matters.

    python benchmarks/costmodel_fidelity.py [--steps 5]

Last line: ``RESULT {"median_abs_err": ..., "kendall_tau": ..., ...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

MODEL = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 6, "d_ff": 512,
         "dtype": "float32"}
CLUSTER = {"sim_a": {"nodes": 1}, "sim_b": {"nodes": 1}, "sim_c": {"nodes": 1}}


def S(chip, layers, data=1, tensor=1, recompute=False):
    return {"chip": chip, "layers": list(layers), "data": data, "tensor": tensor, "recompute": recompute}


PLANS = {
    "2st even 1x1": ("1f1b", [S("sim_a", (0, 3)), S("sim_b", (3, 6))]),
    "2st uneven 1x1": ("1f1b", [S("sim_a", (0, 5)), S("sim_b", (5, 6))]),
    "2st tp2 / dp2": ("1f1b", [S("sim_a", (0, 3), 1, 2), S("sim_b", (3, 6), 2, 1)]),
    "2st recompute": ("1f1b", [S("sim_a", (0, 3), recompute=True), S("sim_b", (3, 6), recompute=True)]),
    "2st gpipe": ("gpipe", [S("sim_a", (0, 2)), S("sim_b", (2, 6))]),
    "3st 1x1": ("1f1b", [S("sim_a", (0, 2)), S("sim_b", (2, 4)), S("sim_c", (4, 6))]),
    "3st mixed": ("1f1b", [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 4), 1, 2), S("sim_c", (4, 6))]),
    "1st 1x1": ("1f1b", [S("sim_a", (0, 6))]),
}
GLOBAL_BATCH, MICROBATCHES = 16, 8


def kendall_tau(a, b) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
            for i, j in pairs)
    return s / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan (after 2 warm-up steps)")
    args = ap.parse_args()

    from h2jax.config import load_config
    from h2jax.runtime import setup_backends

    overrides = [f"model={json.dumps(MODEL)}", f"cluster.chips={json.dumps(CLUSTER)}", "train.progress=false",
                 "train.tensorboard=false", "train.timeline=false", "checkpoint.enabled=false",
                 f"plan.global_batch={GLOBAL_BATCH}", f"plan.num_microbatches={MICROBATCHES}"]
    cfgs = {}
    for name, (schedule, stages) in PLANS.items():
        cfgs[name] = load_config(None, overrides + [f"plan.schedule={schedule}", f"plan.stages={json.dumps(stages)}"])
    setup_backends(next(iter(cfgs.values())).cluster)

    from h2jax.plan import Cluster, CostOptions, ModelShape, ProfileTable, estimate, simulate_plan
    from h2jax.runtime import Trainer
    from h2jax.runtime._profile import profile_chip

    any_cfg = next(iter(cfgs.values()))
    shape = ModelShape.from_config(MODEL)
    table = ProfileTable()
    mb = GLOBAL_BATCH // MICROBATCHES
    per_device = sorted({mb // st.data for c in cfgs.values() for st in c.plan.stages})
    tensors = sorted({st.tensor for c in cfgs.values() for st in c.plan.stages})
    for chip in CLUSTER:
        rows = profile_chip(chip, any_cfg.cluster.chips[chip], any_cfg.model, tensor_degrees=tensors,
                            microbatches=per_device, repeats=5)
        for (t, b), parts in rows.items():
            table.add(chip, shape.key(), t, b, parts)
    cluster = Cluster.from_dict({"chips": CLUSTER})
    opts = CostOptions(grad_sync="microbatch")

    names, measured, predicted, simulated = [], [], [], []
    for name, cfg in cfgs.items():
        trainer = Trainer(cfg, run_dir="runs/bench_costmodel")
        for _ in range(2):
            trainer.train_step()
        times = [trainer.train_step().step_time_s for _ in range(args.steps)]
        trainer.pipeline.close()
        cost = estimate(cfg.plan, shape, cluster, table=table, opts=opts)
        sim, _ = simulate_plan(cfg.plan, shape, cluster, table=table, opts=opts)
        names.append(name)
        measured.append(statistics.median(times))
        predicted.append(cost.iteration_s)
        simulated.append(sim.iteration_s)

    errs = [abs(p - m) / m for p, m in zip(predicted, measured)]
    sim_errs = [abs(s - m) / m for s, m in zip(simulated, measured)]
    print(f"\nmodel {MODEL}; global batch {GLOBAL_BATCH} = {MICROBATCHES} x {mb}; profiles measured on this host")
    print(f"{'plan':<18}{'measured ms':>13}{'cost model ms':>15}{'rel err':>9}{'simulator ms':>14}{'rel err':>9}")
    for n, m, p, s, e, se in zip(names, measured, predicted, simulated, errs, sim_errs):
        print(f"{n:<18}{1e3 * m:>13.1f}{1e3 * p:>15.1f}{e:>9.2f}{1e3 * s:>14.1f}{se:>9.2f}")
    result = {
        "median_abs_err": round(statistics.median(errs), 4),
        "kendall_tau": round(kendall_tau(predicted, measured), 4),
        "median_abs_err_simulator": round(statistics.median(sim_errs), 4),
        "kendall_tau_simulator": round(kendall_tau(simulated, measured), 4),
        "plans": len(names),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
