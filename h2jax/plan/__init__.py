"""h2jax.plan: the pure half of h2jax — plans, schedules, placement and their checks.

This package never imports jax (only the standard library, numpy and pyyaml), so a
plan can be written, validated and simulated on a laptop with no accelerator, and every
function here is tested exhaustively in milliseconds. The runtime imports it, never the
reverse.
"""

from h2jax.plan._plan import (
    INTERLEAVED_CHUNKS,
    Plan,
    PlanError,
    StageSpec,
    assign_devices,
    check_plan,
    chunked_variant,
    even_layers,
)
from h2jax.plan._reshard import Transfer, bytes_crossing, reshard_pattern, slice_routes
from h2jax.plan.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    BoundSchedule,
    Event,
    FileSchedule,
    GPipe,
    Grid,
    Interleaved,
    OneFOneB,
    Schedule,
    ScheduleError,
    Task,
    ZeroBubbleH1,
    ZeroBubbleV,
    as_schedule,
    bubble_fraction,
    check_execution,
    get_schedule,
    grid_events,
    idle_fraction,
    schedule_names,
    stage_tasks,
    timed_events,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "WEIGHT",
    "INTERLEAVED_CHUNKS",
    "BoundSchedule",
    "FileSchedule",
    "ScheduleError",
    "as_schedule",
    "schedule_names",
    "Event",
    "GPipe",
    "Grid",
    "Interleaved",
    "OneFOneB",
    "Plan",
    "PlanError",
    "Schedule",
    "StageSpec",
    "Task",
    "Transfer",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "assign_devices",
    "bubble_fraction",
    "bytes_crossing",
    "check_execution",
    "check_plan",
    "chunked_variant",
    "even_layers",
    "get_schedule",
    "grid_events",
    "idle_fraction",
    "reshard_pattern",
    "slice_routes",
    "stage_tasks",
    "timed_events",
]

# -- HeteroAuto: profiles, cost model, search, simulator (pure as the rest) --------------------
from h2jax.plan._baselines import Baseline, Searcher, idle_chips, matched_total, same_batch  # noqa: E402
from h2jax.plan._cost import (  # noqa: E402
    CostOptions,
    PlanCost,
    StageCost,
    estimate,
    expand_chunks,
    schedule_estimates,
    stage_cost,
    transfer_s,
)
from h2jax.plan._pipeline_search import PipelinesResult, search_pipelines  # noqa: E402
from h2jax.plan._pipelines import PipelinesCost, estimate_pipelines  # noqa: E402
from h2jax.plan._profiles import (  # noqa: E402
    EXCHANGE,
    EXCHANGE_CALL,
    GIB,
    PROGRAM,
    TRANSFER,
    ChipProfile,
    Cluster,
    DriverCost,
    Efficiency,
    LayerCost,
    ModelShape,
    ProfileError,
    ProfileTable,
    load_chip,
    local_cores,
    roofline_costs,
)
from h2jax.plan._search import (  # noqa: E402
    DEFAULT_TIME_BUDGET_S,
    SearchOptions,
    SearchResult,
    exhaustive,
    is_memory_descending,
    prove,
    search,
)
from h2jax.plan._simulate import SimEvent, SimResult, simulate, simulate_pipelines, simulate_plan  # noqa: E402

__all__ += [
    "Baseline",
    "PipelinesCost",
    "Searcher",
    "estimate_pipelines",
    "search_pipelines",
    "PipelinesResult",
    "idle_chips",
    "matched_total",
    "same_batch",
    "DEFAULT_TIME_BUDGET_S",
    "EXCHANGE",
    "EXCHANGE_CALL",
    "GIB",
    "PROGRAM",
    "TRANSFER",
    "expand_chunks",
    "local_cores",
    "schedule_estimates",
    "SimEvent",
    "SimResult",
    "simulate",
    "simulate_pipelines",
    "simulate_plan",
    "ChipProfile",
    "Cluster",
    "CostOptions",
    "DriverCost",
    "Efficiency",
    "LayerCost",
    "ModelShape",
    "PlanCost",
    "ProfileError",
    "ProfileTable",
    "SearchOptions",
    "SearchResult",
    "StageCost",
    "estimate",
    "exhaustive",
    "is_memory_descending",
    "load_chip",
    "roofline_costs",
    "prove",
    "search",
    "stage_cost",
    "transfer_s",
]

from h2jax.plan._numerics import NumericsError, NumericsPolicy, parse_numerics  # noqa: E402

__all__ += ["NumericsError", "NumericsPolicy", "parse_numerics"]
