"""What each word and number of `h2jax plan`'s output means (printed under ``--explain``)."""

from __future__ import annotations


def fmt_s(x: float) -> str:
    """Seconds as `h2jax plan` prints them: milliseconds below one second."""
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def explanation(res, cluster, gb: int, *, measured: bool, several: bool, other: bool) -> list[str]:
    """What each word and number of `h2jax plan`'s output means, with this plan's own numbers:
    printed under --explain, in the order the output shows them."""
    plan, cost = res.plan, res.cost
    s0 = plan.stages[0]
    c0 = cost.stages[0]
    fits = "fits" if cost.fits else "does not fit"
    lines = [
        f"title: {plan.num_microbatches} x {plan.microbatch_size} is microbatches x sequences per microbatch "
        f"(global batch {gb} = their product); {plan.schedule} is the pipeline schedule the plan runs.",
        f"data x tensor: a stage's devices, as data-parallel replicas x tensor-parallel degree (stage 0: "
        f"{s0.data} x {s0.tensor} = {s0.data * s0.tensor} {s0.chip} chips, each replica taking "
        f"{plan.microbatch_size // s0.data} of a microbatch's {plan.microbatch_size} sequences).",
        "layers: the model blocks a stage holds, first-last; a stage of an interleaved or zb-v schedule holds "
        "several chunks, listed each.",
        "recompute: yes where the stage recomputes its forward in the backward instead of keeping activations "
        "(less memory, about one more forward of time).",
        f"fwd+bwd / mb: one stage's forward plus backward for one microbatch, in the cost model (stage 0: "
        f"{fmt_s(c0.t)}).",
        "costs: where those times come from: `measured` (a profile from `h2jax profile --measure`, passed with "
        "--profiles), or `roofline (t, b)`, an estimate from the chip file's declared peak FLOP/s and memory "
        "bandwidth at tensor degree t and b sequences per device; an estimate, not a measurement.",
        f"memory / device: the peak bytes the cost model predicts on one device of the stage (weights, "
        f"gradients, optimizer state, the activations the schedule keeps in flight) / the chip's memory; "
        f"this plan {fits}.",
        f"estimated iteration: one training step ({fmt_s(cost.iteration_s)}): the pipeline's fill, steady "
        f"state and drain, the transfers between stages, the gradient sync and the optimizer update. "
        f"tokens/s = {gb} x seq_len tokens per step / the iteration = {cost.tokens_per_s:,.0f}.",
        f"bubble: the share of the pipeline's time a stage is idle on average, 1 - (microbatches x each "
        f"stage's time) / (stages x pipeline time) = {100 * cost.bubble_fraction:.1f} %.",
        f"lower bound: {fmt_s(res.lower_bound_s)}, a time no plan of the searched space can beat: (microbatches "
        f"- 1) x the least slot time at which the chip types hold every block within their memory, plus the "
        f"least fill and drain, plus what every plan pays beyond the blocks. gap: how far the plan is above it, "
        f"{fmt_s(cost.iteration_s)} / {fmt_s(res.lower_bound_s)} - 1 = {100 * res.gap:.1f} %. The bound is "
        "not always reachable, so a gap says at most how much better a plan could be, not that one exists.",
        "search: its wall time; `plan found at` is when the printed plan was found (the rest of the time "
        "found nothing better); configurations are the (chip type, stages, data x tensor) choices priced, "
        "orders the stage orders of chip types solved for each; `exhaustive` means every plan of the "
        "space was priced or excluded by its lower bound, so the printed plan is the cost model's best; "
        "`not exhaustive` says why the search stopped (its time budget, or rounds that found nothing better).",
        "schedule: the chosen (or --schedule's) schedule, and the same stages priced under each other "
        "schedule: +x % slower, -x % faster than the chosen one, `does not fit` where that schedule's "
        "activations in flight exceed a stage's memory (why a faster-looking one was not chosen).",
        "stage order: memory-descending when the stages' chip types go from the most memory per device to "
        "the least (the first stages of a pipeline keep the most activations in flight; the H2 paper's "
        "rule). The search tries other orders too; `is not` means another order was faster here.",
        f"TGS: tokens per chip per second, the tokens/s over every chip of the cluster, used or not "
        f"({cost.tokens_per_s:,.0f} / {cluster.num_devices}); the same for each chip type, and the line "
        "says how many chips of that type the plan uses.",
    ]
    if several:
        lines += [
            f"homogeneous <chip>: the best plan of that chip type's chips alone at global batch {gb}, searched "
            "the same way; `exact` where that search was exhaustive (each chip type's searches run in a worker "
            "process of their own, --workers: exact searches find the same plans wherever they run).",
            "HeteroSpeedupRatio: the heterogeneous plan's tokens/s / the sum of the homogeneous plans' tokens/s. "
            "Over 100 % the chip types train faster together than apart (more than the sum of their "
            "parts); under 100 %, slower than running them as separate jobs would add up to.",
            f"matched total batch: the homogeneous jobs' global batches add up to {gb}, the heterogeneous job's "
            "(the same sequences per step, shared among the chip types); the split is searched (each share a "
            "multiple of the step shown, 0 where a chip type does not run) for the most tokens/s added up, each "
            "job planned at its share; the step starts at an eighth of the batch and is halved while the best split "
            "gains at least 0.5 %, to a 32nd (the coarser steps tried are shown with their best split's tokens/s "
            "against the one used: a coarse step misses splits and so overstates the ratio); then the split is balanced "
            "to the sequence near it with the plans found (each taken with more or fewer microbatches), each job "
            "searched at its new share, where that adds tokens/s. The fair test of a claim to beat the sum of the parts. At the same "
            "global batch each homogeneous job takes all of it (a smaller bubble than its share would give): "
            "the larger baseline, so the lower ratio. Both are in comparison.json with --out.",
            "several pipelines: a plan whose chip types are split into groups, each group its own pipeline (the "
            "search's best plan of those chips) on its share of every step's sequences (a multiple of the step "
            "shown, then the fastest splits balanced to the sequence near it with the same pipelines, more or "
            "fewer microbatches; 0: the group does not train); after each step every layer's copies are summed and copied "
            "back (the exchange: each layer's gradient sent to the first pipeline's copy, sharded over the "
            "smaller stage's devices, over the slower chip type's inter-node link, after the backward; the new "
            "values back). The search prices one pipeline per chip type first, then the other "
            "partitions (every one up to four chip types, else runs of the one pipeline's stage order), those "
            "of the smallest groups first, within --time-budget; the faster of its best and the one pipeline is "
            "chosen and written with --out. --max-pipelines 1 keeps one pipeline.",
            "what limits the ratio (under 100 %): the one-pipeline space's optimum where a search of it was "
            "exact (with --prove SECONDS the search runs on to its exact round to get it), else the search's "
            "lower bound, as a ratio; and one pipeline per chip type, which on the baseline's shares cannot "
            "pass 100 %: apart, each chip type runs at its own pace; together every pipeline waits for the "
            "slowest, then the exchange. With two chip types those are the only plans of several pipelines, "
            "so an exact one-pipeline optimum under 100 % proves no plan of the space reaches it. With --prove "
            "also the lower bound over the plans of one and of several pipelines: each pipeline at least the "
            "search's lower bound of its chips at its share, the least over every partition and split (the "
            "exchange left out); under 100 % it proves no plan of the space reaches it, above it decides nothing.",
        ]
    if other:
        lines.append(
            "the mismatched ratio: the heterogeneous plan at --other-global-batch over the homogeneous ones at "
            "the global batch; the ratio at the same global batch (both at --other-global-batch) is the fair "
            "comparison."
        )
    if measured:
        lines.append(
            "measured configurations: with --profiles only the (tensor degree, sequences per device) a chip type "
            "was measured at are searched; --allow-estimates adds the others, priced by the roofline."
        )
    return lines
