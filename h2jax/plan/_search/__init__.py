"""HeteroAuto: search the plan space of a heterogeneous cluster for the fastest plan that fits.

The space (the exhaustive enumerator in this module walks exactly the same one):

- microbatch size mb: a divisor of the global batch (m = global_batch / mb microbatches);
- stage order across chip types: every permutation (memory-descending is the paper's rule;
  the search confirms or beats it), all stages of one chip type contiguous;
- per chip type c: its number of stages k_c and tensor degree t_c (dividing heads, d_ff and
  vocab; at most a node); the data degree follows from the device count: the largest
  d <= devices_c / (k_c t_c) that divides mb (and, with ``stage_in_node``, lets k_c stages
  of d x t_c devices pack into the chip's nodes). With ``group_size`` g the chips of a type
  are handled g at a time: k_c <= ceil(devices_c / g) (a restriction for experts: the
  defaults search without it);
- per stage: its number of layers (>= 1, summing to the model's) and its recompute flag.

- the schedule, among every one the runtime runs (``SearchOptions.schedules``; GPipe only where
  1F1B is not offered: same time, more memory): ZB-H1's split backward shortens the fill
  and drain but keeps more activations alive, so where memory is tight 1F1B wins; the
  chunked ones (interleaved with each v of ``SearchOptions.interleaved_chunks``, zb-v with 2)
  shorten them further for more activations, program calls and boundary crossings, and
  need a block per chunk on every stage (a stage's blocks become even chunks,
  :func:`h2jax.plan.chunked_variant`) and their microbatch counts (interleaved: a multiple of
  the stage count; zb-v: at least 2p - 1). Internally interleaved with v chunks is the
  schedule object ``Interleaved(v)`` (label ``interleaved:v``).

Objective: the cost model's iteration time (:mod:`h2jax.plan._cost`); constraint: every
stage fits its chip's memory. Per configuration and order each schedule is solved in turn
(split ones first, so the faster sets the bar); every schedule's T_pipe has the same shape
(``(m - 1) max t + sum fill + max end``, fill and end non-decreasing in the layer count: affine,
but for zb-v's maximum of affine terms, priced at every count), so the exact round below
covers them unchanged (a chunked stage's fill is infinite below one block per chunk). Every bound below
is taken per schedule, with that schedule's memory caps (its ``count_floors``) and fills,
and a schedule is solved only where its own bound leaves it a chance: ZB-H1's shorter fill
does not loosen the bound of configurations where its extra memory cannot fit.

Why the exact round is exact. For a fixed (mb, per-chip choice, order) every stage's time,
tail and memory are affine in its layer count, and time and tail grow with it, so the exact
optimum of ``(m - 1) max_s t_s + sum_s t_s + transfers + max_s g_s`` over layer splits and
recompute flags is found by enumerating thresholds B >= max t and G >= max g in increasing
order and solving ``min sum t`` under the per-stage layer caps they imply with a min-plus
dynamic program (compiled: :mod:`h2jax.plan._planner`), stopping as soon as
``(m - 1) B + G + min sum t`` cannot beat the best. Per-chip choices are walked depth first,
every order for each; a configuration is skipped only when a lower bound of every plan it
can give -- ``(m - 1) B_lb + L min_s a_s`` plus the cheapest embedding and head, with B_lb
the slot time below which its stages cannot hold the L whole blocks within their memory
(:meth:`ChipChoice.layers_within`: a stage with l blocks takes at least l a_s, and holds
no more than its memory allows with the fewest microbatches its rank allows in flight: under
1F1B the r-th fewest of a chip type's k stages holds at least min(r, m)) -- cannot beat the
best plan found so far, under every schedule. Nothing else is cut, so when the exact round
ends every plan of the space was priced or bounded out: the result says ``exhaustive``, and
the tests hold it to a brute force over the same space on 60 random instances, and on 20
more with the shared-host term.

Effort (``SearchOptions.auto``, the default). The exact round is taken at once when the
space has at most EXACT_DIRECT (microbatch, configuration, order) triples. Otherwise the
search runs rounds of growing cost, each pruning with the best plan so far, and keeps the
best plan between them (anytime: a budget that runs out mid-round returns it):
seeds (per microbatch size, each chip type's choice that holds the most blocks at the
slot-time bound, and every chip type with the same stage count K for K = 1, 2, 3, 4, 6, 8,
...: the stage count is what that ranking judges worst), in an order neighbourhood
(memory-descending, its adjacent swaps, reversed, by speed); coordinate descent from the
best configuration and the two best other seeds (a chip type's stage count and tensor
degree together, or the microbatch size, while that helps; then the order, by the
neighbourhood and adjacent swaps); beams of the best 2, 3, 4, 6, 9, 13, ... choices per chip
type by the same ranking (half as wide again after 4: a beam of width w prices up to w^k
configurations of k chip types, so the round that confirms convergence costs 1.5^k, not 2^k,
times the one before), each followed by coordinate descent; last the exact round, which the
incumbent lets prune hard. A space of at most EXACT_AFTER_LOCAL triples skips the beams: its
exact round comes soon in any case, and pruned by the seeds' and the climb's best plan it found
the same plans in half the time the beams before it took (one chip type at 10,000 chips, the
mid-size instances: docs/LOG.md, session 43). Before the exact round a configuration's chunked schedules are
solved only in the stage order its one-chunk schedules found best (a heuristic, like those
rounds; the exact round tries every order under every schedule).
The search stops at the exact round's end (exhaustive), at the
time budget, or -- in a space of more than EXACT_AFTER_LOCAL triples -- when two beam
rounds in a row found nothing better after 15 % of the budget (converged, not exhaustive). How near that is to the optimum is measured, not
proven: on instances of 64-256 chips whose whole space the exact search covers in seconds
(tests/plan/test_search_effort.py) the defaults' plan is within 2 % of the enumerated
optimum, and ``benchmarks/planner_scale.py`` prints the same study beside the large
clusters.

The lower bound reported with the result (:func:`root_bound`) holds for the whole space:
per microbatch size, the slot-time bound with every chip type at its best choice, plus the
pipeline's fill and drain -- ``sum_s t_s`` at least the cheapest split of the L blocks over
the chip types (each at least one) within their memory-capped capacities at that slot time
-- plus the cheapest embedding and head; per schedule, the least over the schedules. A
microbatch size (or one schedule at it) whose bound cannot beat the best plan so far is
skipped by every round. ZB-H1's caps know a chip type's own stage count k only (every
stage holds at least min(p, m) + 1 microbatches awaiting B or W, with p >= k + the other
chip types), so its bound stays looser than 1F1B's where its memory would not fit. On the mid-size instances the optimum itself
sits some 20-80 % above it (the bound ignores transfers, tails and that the stages of all chip
types share one sequence of in-flight counts), so a gap of that size at scale is the
bound's, not necessarily the search's.

Shared hosts (emulated chips, whose stages all compute on one machine's cores): the cost
model lengthens the steady-state period to the time the host's cores take to run one
microbatch of every stage at once, and bounds the step by W_h / C_h (``h2jax.plan._cost``);
both depend on the configuration (data degrees, stage count, microbatches: program calls)
far more than on the layer split. The search finds each configuration's T_pipe-optimal
split as above, improves it by the full estimate (:func:`polish_split`: give a layer of one
stage to another or flip a recompute flag while that helps) and ranks configurations by
that; pruning stays valid (every bound is below T_pipe, which is below the full estimate).
Exact for T_pipe; with contention the hill climb is not proven optimal, but on 80 random
shared-host instances (1, 2 or 4 cores) it matched the brute force on all 80; 20 of them
are in the tests.
"""

from h2jax.plan._search._bounds import root_bound
from h2jax.plan._search._driver import lower_bound, prove, search
from h2jax.plan._search._options import (
    DEFAULT_TIME_BUDGET_S,
    ChipChoice,
    SearchCache,
    SearchOptions,
    SearchResult,
    StageCaps,
)
from h2jax.plan._search._reference import exhaustive
from h2jax.plan._search._space import (
    build_plan,
    chip_choices,
    data_degrees,
    is_memory_descending,
    searched_labels,
)

__all__ = [
    "DEFAULT_TIME_BUDGET_S",
    "ChipChoice",
    "SearchCache",
    "SearchOptions",
    "SearchResult",
    "StageCaps",
    "build_plan",
    "chip_choices",
    "data_degrees",
    "exhaustive",
    "is_memory_descending",
    "lower_bound",
    "root_bound",
    "prove",
    "search",
    "searched_labels",
]
