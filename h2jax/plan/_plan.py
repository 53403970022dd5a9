"""The Plan: the serialisable contract between the planner and the runtime.

A Plan says, for every pipeline stage, which chip type runs it, its mesh shape
(data x tensor), which layers it holds (one range, or under ``interleaved`` / ``zb-v`` several
layer chunks) and whether it recomputes activations; plus the schedule and batch sizes. The planner writes one, the runtime executes it, a person can
read and edit it as YAML. Everything here is plain Python: validation happens before any
device is touched, and every error names the dotted key, the value and what was expected.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

from h2jax._strict import PARSERS, VALUE_CHECKS, ConfigError, build_dataclass, read_yaml
from h2jax.plan.schedules import Schedule, ScheduleError, as_schedule, schedule_family, schedule_names

INTERLEAVED_CHUNKS: tuple[int, ...] = (2, 3, 4)
"""The chunk counts v a search tries for a family whose chunk count is a choice (interleaved:
``SearchOptions.interleaved_chunks``)."""


class PlanError(ConfigError):
    """A plan that cannot run; `key` is the dotted path of the offending field.

    A ConfigError, so every command prints it as one line naming the key (exit 2).
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        # ValueError would re-create the error from its one formatted arg.
        return (type(self), (self.key, self.message))


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: a contiguous layer range (or several layer chunks) on a
    (data x tensor) mesh of one chip type.

    `layers` is half-open [start, end) in model layer indices. Under the `interleaved` and
    `zb-v` schedules a stage holds several non-contiguous chunks instead, `chunks` (each
    half-open, in chunk order; the schedule says where in the model chunk c sits), and
    `layers` is its first chunk. Code that walks a stage's layers reads `layer_chunks`, which
    is `(layers,)` for a one-chunk stage. `data` and `tensor` are mesh axis sizes in devices.
    `recompute` (every chunk of the stage) trades one extra forward per microbatch for
    keeping only the stage input in memory.
    """

    chip: str
    layers: tuple[int, int] | None = None
    data: int = 1
    tensor: int = 1
    recompute: bool = False
    chunks: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists (as read from YAML) but store tuples so specs stay hashable.
        chunks = tuple(tuple(c) for c in self.chunks)
        layers = tuple(self.layers) if self.layers is not None else None
        if len(chunks) == 1:  # one chunk is a plain layer range
            layers, chunks = layers or chunks[0], ()
        if layers is None and not chunks:
            raise ValueError(f"stage on {self.chip}: give layers (one range) or chunks (several)")
        if chunks:
            if layers is not None and layers != chunks[0]:
                raise ValueError(f"stage on {self.chip}: layers={layers} is not the first of chunks={chunks}")
            layers = chunks[0]
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "chunks", chunks)

    @property
    def num_devices(self) -> int:
        """Devices this stage occupies: data * tensor."""
        return self.data * self.tensor

    @property
    def layer_chunks(self) -> tuple[tuple[int, int], ...]:
        """The stage's layer ranges in chunk order: `chunks`, or `(layers,)` for one range."""
        return self.chunks or (self.layers,)

    @property
    def num_chunks(self) -> int:
        return len(self.layer_chunks)

    @property
    def num_layers(self) -> int:
        """Blocks the stage holds, over all its chunks."""
        return sum(b - a for a, b in self.layer_chunks)

    def chunk_spec(self, chunk: int) -> StageSpec:
        """The one-chunk stage of chunk `chunk` (same chip, mesh and recompute): what the
        runtime builds one stage program from."""
        return StageSpec(self.chip, self.layer_chunks[chunk], self.data, self.tensor, self.recompute)


@dataclass(frozen=True)
class Plan:
    """The complete decision for one training run (see DESIGN.md, "The Plan").

    `global_batch` is in sequences per optimizer step; it is split into
    `num_microbatches` equal microbatches that flow through the pipeline. More
    microbatches shrink the pipeline bubble (~(num_stages-1)/num_microbatches of a step)
    but make each microbatch smaller, and so each kernel less efficient.

    A job of several pipelines gives ``pipelines`` instead of ``stages``,
    ``num_microbatches`` and ``schedule``: each pipeline is a one-pipeline Plan over the whole
    model (its own stages, schedule, microbatches and share of the step, its ``global_batch``).
    The job's ``global_batch`` is their sum (derived when not given), ``stages`` every
    pipeline's stages in turn (the job's stage index: pipeline 0's first), ``num_microbatches``
    every pipeline's together, and ``schedule`` None; a step's sequences are the job's global
    batch in order, pipeline 0 taking the first of them (:meth:`sequence_ranges`).
    """

    stages: tuple[StageSpec, ...] = ()
    global_batch: int | None = None
    num_microbatches: int | None = None
    schedule: Schedule | None = None  # type: ignore[assignment]  # a name or file is read by as_schedule
    """The pipeline schedule (a name, ``name:chunks`` or a schedule file is read into one; default
    1f1b); where its chunk count is a choice, the stages' is its (stage 0's: :func:`check_plan`
    makes them equal). None in a plan of several pipelines (each has its own)."""
    model: str | None = None
    pipelines: tuple[Plan, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stages, list):
            object.__setattr__(self, "stages", tuple(self.stages))
        if len(self.pipelines) == 1:  # a plan of one pipeline is that pipeline
            (pipe,) = self.pipelines
            given = self.stages or self.num_microbatches is not None or self.schedule is not None
            if given or self.global_batch not in (None, pipe.global_batch):
                self._join_pipelines()  # names what is given twice
            for name in ("stages", "global_batch", "num_microbatches", "schedule"):
                object.__setattr__(self, name, getattr(pipe, name))
            object.__setattr__(self, "pipelines", ())
            return
        if self.pipelines:
            self._join_pipelines()
            return
        for name in ("global_batch", "num_microbatches"):
            if getattr(self, name) is None:
                raise PlanError(f"plan.{name}", "required key is missing (or give plan.pipelines)")
        try:
            sched = as_schedule(self.schedule if self.schedule is not None else "1f1b")
            if sched.chunk_choice and self.stages and self.stages[0].num_chunks != sched.chunks:
                sched = sched.with_chunks(self.stages[0].num_chunks)
        except ScheduleError as e:
            raise PlanError("plan.schedule", str(e)) from None
        object.__setattr__(self, "schedule", sched)

    def _join_pipelines(self) -> None:
        pipes = tuple(self.pipelines)
        object.__setattr__(self, "pipelines", pipes)
        for name in ("stages", "num_microbatches", "schedule"):
            if getattr(self, name) not in (None, ()):
                raise PlanError(f"plan.{name}", "a plan of several pipelines sets it in each of plan.pipelines")
        for i, pipe in enumerate(pipes):
            if pipe.pipelines:
                raise PlanError(f"plan.pipelines[{i}].pipelines", "a pipeline holds stages, not pipelines")
        total = sum(pipe.global_batch for pipe in pipes)
        if self.global_batch is not None and self.global_batch != total:
            shares = " + ".join(str(pipe.global_batch) for pipe in pipes)
            raise PlanError(
                "plan.global_batch",
                f"global_batch={self.global_batch}, but the pipelines' global batches add up to {shares} = {total}",
            )
        object.__setattr__(self, "global_batch", total)
        object.__setattr__(self, "num_microbatches", sum(pipe.num_microbatches for pipe in pipes))
        object.__setattr__(self, "stages", tuple(st for pipe in pipes for st in pipe.stages))

    @property
    def num_pipelines(self) -> int:
        return max(len(self.pipelines), 1)

    def pipeline_plans(self) -> tuple[Plan, ...]:
        """Each pipeline as a one-pipeline plan (a one-pipeline plan: itself)."""
        return self.pipelines or (self,)

    def stage_offsets(self) -> tuple[int, ...]:
        """The job's stage index of each pipeline's stage 0."""
        out, at = [], 0
        for pipe in self.pipeline_plans():
            out.append(at)
            at += pipe.num_stages
        return tuple(out)

    def pipeline_of_stage(self, stage: int) -> int:
        """The pipeline that holds the job's stage ``stage``."""
        offsets = self.stage_offsets()
        return max(p for p, off in enumerate(offsets) if off <= stage)

    def sequence_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each pipeline's [start, end) of a step's global batch, in pipeline order."""
        out, at = [], 0
        for pipe in self.pipeline_plans():
            out.append((at, at + pipe.global_batch))
            at += pipe.global_batch
        return tuple(out)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def describe(self) -> str:
        """The schedule and batch in words: "1f1b, global batch 32 = 8 x 4"; several pipelines:
        "2 pipelines (1f1b 3 x 4, zb-v 5 x 4), global batch 32"."""
        if not self.pipelines:
            return (
                f"{self.schedule}, global batch {self.global_batch} = {self.num_microbatches} x {self.microbatch_size}"
            )
        each = ", ".join(f"{p.schedule} {p.num_microbatches} x {p.microbatch_size}" for p in self.pipelines)
        return f"{len(self.pipelines)} pipelines ({each}), global batch {self.global_batch}"

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch (global_batch // num_microbatches); a plan of several
        pipelines has one per pipeline (``pipelines[i].microbatch_size``)."""
        if self.pipelines:
            raise PlanError("plan.pipelines", "a plan of several pipelines has a microbatch size per pipeline")
        return self.global_batch // self.num_microbatches

    @property
    def num_chunks(self) -> int:
        """Layer chunks per stage (virtual stages): 1 unless the schedule is chunked
        (:func:`check_plan` makes it the same on every stage)."""
        return max((s.num_chunks for s in self.stages), default=1)

    def positions(self) -> tuple[tuple[int, int], ...]:
        """(stage_idx, chunk) at each model position 0..num_stages*num_chunks-1 (position 0
        holds the embedding, the last the head), as the schedule places the chunks; for a
        one-chunk schedule simply (s, 0) per stage. Needs a plan :func:`check_plan` accepts.
        Several pipelines: each pipeline's positions in turn, by the job's stage index (each
        pipeline's first position holds the embedding, its last the head)."""
        if self.pipelines:
            return tuple(
                (s + off, c) for pipe, off in zip(self.pipelines, self.stage_offsets()) for s, c in pipe.positions()
            )
        return self.schedule.positions(self.num_stages)

    def position_pipelines(self) -> tuple[int, ...]:
        """The pipeline of each position (:meth:`positions`)."""
        return tuple(p for p, pipe in enumerate(self.pipeline_plans()) for _ in pipe.positions())

    def position_specs(self) -> tuple[StageSpec, ...]:
        """The one-chunk StageSpec of every model position (see :meth:`positions`): the plan
        read as a pipeline of num_stages*num_chunks virtual stages."""
        return tuple(self.stages[s].chunk_spec(c) for s, c in self.positions())

    # -- serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of YAML-able values; `layers` becomes a 2-element list, `chunks` (a
        stage of several chunks, written instead of `layers`) a list of them."""
        if self.pipelines:
            return {
                "model": self.model,
                "global_batch": self.global_batch,
                "pipelines": [{k: v for k, v in pipe.to_dict().items() if k != "model"} for pipe in self.pipelines],
            }
        return {
            "model": self.model,
            "global_batch": self.global_batch,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule.to_raw(),
            "stages": [_stage_dict(s) for s in self.stages],
        }

    @classmethod
    def from_dict(cls, d: Any, *, key_prefix: str = "plan") -> Plan:
        """Build a Plan from plain data with the one strict parser (:func:`h2jax._strict.build_dataclass`).

        Unknown keys, missing required keys and wrong types (a bool is not an int)
        raise PlanError naming the dotted key, e.g. `plan.stages[0].layers`. Values
        are checked against a model and a cluster by `check_plan`, not here.
        """
        try:
            return build_dataclass(cls, d, key_prefix)
        except PlanError:
            raise
        except ConfigError as e:
            raise PlanError(e.key, e.message) from None

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as commented, hand-editable YAML (one flow mapping per stage)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_yaml_str())

    def to_yaml_str(self) -> str:
        """The text `to_yaml` writes."""
        if self.pipelines:
            return self._pipelines_yaml()
        total_layers = sum(s.num_layers for s in self.stages)
        total_devices = sum(s.num_devices for s in self.stages)
        lines = [
            "# h2jax plan: an experiment's `plan:` section (`h2jax train` reads it there: the experiment.yaml",
            "# `h2jax plan --out` writes beside it); `h2jax simulate` reads this file. Editable by hand.",
            f"# {self.num_stages} stages, {total_layers} layers, {total_devices} devices.",
            "# stages[i].layers is half-open [start, end); data x tensor = devices of the stage.",
        ]
        if any(s.chunks for s in self.stages):
            lines.append(
                f"# stages[i].chunks: the stage's layer chunks in chunk order ({self.schedule.name} places "
                f"{self.schedule.placement})."
            )
        lines += [
            _commented(f"model: {_scalar(self.model)}", "model config this plan was made for"),
            _commented(f"global_batch: {_scalar(self.global_batch)}", "sequences per optimizer step"),
        ]
        mb = (
            f"microbatch = {self.global_batch // self.num_microbatches} sequences"
            if isinstance(self.num_microbatches, int) and self.num_microbatches > 0
            else "microbatches per step"
        )
        lines.append(_commented(f"num_microbatches: {_scalar(self.num_microbatches)}", mb))
        lines.append(
            _commented(f"schedule: {_scalar(self.schedule.to_raw())}", " | ".join((*schedule_names(), "<file>.csv")))
        )
        lines.append(_commented("stages:", "ordered: stage 0 = embedding side"))
        for stage in self.to_dict()["stages"]:
            lines.append(f"  - {_scalar(stage)}")
        return "\n".join(lines) + "\n"

    def _pipelines_yaml(self) -> str:
        lines = [
            "# h2jax plan: an experiment's `plan:` section (`h2jax train` reads it there); editable by hand.",
            f"# {len(self.pipelines)} pipelines over one model, {sum(s.num_devices for s in self.stages)} devices: "
            "each takes its share of a step's sequences",
            "# (pipeline 0 the first); every parameter's gradient is summed over the pipelines.",
            _commented(f"model: {_scalar(self.model)}", "model config this plan was made for"),
            _commented(f"global_batch: {_scalar(self.global_batch)}", "sequences per optimizer step (the shares' sum)"),
            "pipelines:",
        ]
        for pipe in self.pipelines:
            d = pipe.to_dict()
            lines.append("  - " + _commented(f"global_batch: {_scalar(d['global_batch'])}", "this pipeline's share"))
            mb = f"microbatch = {pipe.microbatch_size} sequences"
            lines.append("    " + _commented(f"num_microbatches: {_scalar(d['num_microbatches'])}", mb))
            lines.append("    " + _commented(f"schedule: {_scalar(d['schedule'])}", "this pipeline's schedule"))
            lines.append("    stages:")
            lines += [f"      - {_scalar(st)}" for st in d["stages"]]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, key_prefix: str = "plan") -> Plan:
        """The plan of a YAML file; PlanError naming the file (and line and column) when it is
        not UTF-8 or not YAML, else naming the dotted key (see :meth:`from_dict`)."""
        try:
            data = read_yaml(path, key=key_prefix)
        except PlanError:
            raise
        except ConfigError as e:
            raise PlanError(e.key, e.message) from None
        return cls.from_dict(data, key_prefix=key_prefix)


def _scalar(value: Any) -> str:
    """One value as single-line YAML flow text (quoted only where YAML needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=math.inf)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _commented(text: str, comment: str) -> str:
    return f"{text:<25} # {comment}"


def _stage_dict(s: StageSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"chip": s.chip, "data": s.data, "tensor": s.tensor}
    if s.chunks:
        out["chunks"] = [[a, b] for a, b in s.chunks]
    else:
        out["layers"] = [s.layers[0], s.layers[1]]
    out["recompute"] = s.recompute
    return out


def _check_stage(values: dict[str, Any], key: str) -> None:
    """A stage gives exactly one of layers (one range) and chunks (several)."""
    if (values["layers"] is None) == (not values["chunks"]):
        raise PlanError(
            f"{key}.layers",
            "give exactly one of layers ([start, end]) and chunks ([[start, end], ...], interleaved / zb-v)"
            + ("; got both" if values["chunks"] else "; required key is missing"),
        )


def _schedule_from_raw(value: Any, key: str) -> Schedule:
    if not isinstance(value, str):
        raise PlanError(
            key, f"got {value!r}; expected a string: one of {', '.join(schedule_names())}, or a schedule file"
        )
    try:
        return as_schedule(value)
    except ScheduleError as e:
        raise PlanError(key, str(e)) from None


def _check_plan_keys(values: dict[str, Any], key: str) -> None:
    """A one-pipeline plan gives its stages (a plan of several pipelines gives pipelines)."""
    if not values["pipelines"] and not values["stages"]:
        raise PlanError(f"{key}.stages", "required key is missing or empty (or give plan.pipelines)")


VALUE_CHECKS[StageSpec] = _check_stage
VALUE_CHECKS[Plan] = _check_plan_keys
PARSERS[Schedule] = _schedule_from_raw


# -- validation --------------------------------------------------------------------------


def _ranges(plan: Plan) -> str:
    return ", ".join(f"[{s.layers[0]}, {s.layers[1]})" for s in plan.stages)


def check_plan(
    plan: Plan,
    *,
    num_layers: int,
    chip_devices: Mapping[str, int] | None = None,
    devices_per_node: Mapping[str, int] | None = None,
    divisible_by_tensor: Mapping[str, int] | None = None,
    key_prefix: str = "plan",
) -> None:
    """Raise PlanError for the first reason `plan` cannot run; return None if it can.

    `num_layers` is the model's block count. `chip_devices` maps chip type to devices in
    the cluster; `devices_per_node` maps chip type to devices per node (a stage lives
    inside one node in single-process mode). `divisible_by_tensor` maps a named model
    size (e.g. "model.n_heads") to its value; every stage's tensor degree must divide it,
    or the tensor axis cannot shard that dim evenly.
    """
    p = key_prefix
    if plan.pipelines:
        for i, pipe in enumerate(plan.pipelines):
            check_plan(
                pipe,
                num_layers=num_layers,
                chip_devices=None,
                devices_per_node=devices_per_node,
                divisible_by_tensor=divisible_by_tensor,
                key_prefix=f"{p}.pipelines[{i}]",
            )
        if chip_devices is not None:
            _check_chip_devices(plan, chip_devices, p)
        return
    if plan.num_stages < 1:
        raise PlanError(f"{p}.stages", f"the plan has {plan.num_stages} stages; expected at least 1")
    for i, s in enumerate(plan.stages):
        for axis, size in (("data", s.data), ("tensor", s.tensor)):
            if size < 1:
                raise PlanError(f"{p}.stages[{i}].{axis}", f"{axis}={size}; expected >= 1")

    if plan.num_microbatches < 1:
        raise PlanError(f"{p}.num_microbatches", f"num_microbatches={plan.num_microbatches}; expected >= 1")
    why = plan.schedule.shape_error(plan.num_stages, plan.num_microbatches)
    if why is not None:
        raise PlanError(f"{p}.num_microbatches", f"{plan.schedule.label}: {why}")
    if plan.schedule.chunk_choice or plan.schedule.chunks > 1:
        _check_chunks(plan, num_layers, p)
    else:
        _check_layers(plan, num_layers, p)

    # devices first: a stage that cannot be placed is the most basic problem
    for inventory in (chip_devices, devices_per_node):
        if inventory is None:
            continue
        for i, s in enumerate(plan.stages):
            if s.chip not in inventory:
                raise PlanError(
                    f"{p}.stages[{i}].chip",
                    f"chip {s.chip!r} is not in the cluster; known chips: {', '.join(sorted(inventory)) or '(none)'}",
                )
    if chip_devices is not None:
        _check_chip_devices(plan, chip_devices, p)
    if devices_per_node is not None:
        for i, s in enumerate(plan.stages):
            if s.num_devices > devices_per_node[s.chip]:
                raise PlanError(
                    f"{p}.stages[{i}]",
                    f"stage {i} needs data*tensor = {s.data}*{s.tensor} = {s.num_devices} "
                    f"devices of chip {s.chip}, a node has {devices_per_node[s.chip]} "
                    "(a stage lives inside one node)",
                )

    if plan.global_batch < 1:
        raise PlanError(f"{p}.global_batch", f"global_batch={plan.global_batch}; expected >= 1")
    if plan.num_microbatches < 1:
        raise PlanError(f"{p}.num_microbatches", f"num_microbatches={plan.num_microbatches}; expected >= 1")
    if plan.global_batch % plan.num_microbatches:
        raise PlanError(
            f"{p}.num_microbatches",
            f"num_microbatches={plan.num_microbatches} does not divide global_batch={plan.global_batch}",
        )
    mb = plan.microbatch_size
    for i, s in enumerate(plan.stages):
        if mb % s.data:
            raise PlanError(
                f"{p}.stages[{i}].data",
                f"data={s.data} does not divide microbatch_size={mb} "
                f"(global_batch={plan.global_batch} / num_microbatches={plan.num_microbatches})",
            )
    for name, size in (divisible_by_tensor or {}).items():
        for i, s in enumerate(plan.stages):
            if size % s.tensor:
                raise PlanError(f"{p}.stages[{i}].tensor", f"tensor={s.tensor} does not divide {name}={size}")


def _check_chip_devices(plan: Plan, chip_devices: Mapping[str, int], p: str) -> None:
    """Every chip type's stages (of every pipeline) fit the cluster's devices of it."""
    for i, s in enumerate(plan.stages):
        if s.chip not in chip_devices:
            where = f"{p}.stages[{i}].chip" if not plan.pipelines else f"{p}.pipelines[{plan.pipeline_of_stage(i)}]"
            raise PlanError(
                where,
                f"chip {s.chip!r} is not in the cluster; known chips: {', '.join(sorted(chip_devices)) or '(none)'}",
            )
    for chip, idxs in _stages_by_chip(plan).items():
        need = [plan.stages[i].num_devices for i in idxs]
        if sum(need) > chip_devices[chip]:
            raise PlanError(
                f"{p}.stages" if not plan.pipelines else f"{p}.pipelines",
                f"stages on chip {chip} need {_sum_text(need)} devices, the cluster has "
                f"{chip_devices[chip]} ({_stage_shapes(plan, idxs)})",
            )


def _check_layers(plan: Plan, num_layers: int, p: str) -> None:
    """One layer range per stage: [0, num_layers) covered exactly once, contiguous, in stage order."""
    for i, s in enumerate(plan.stages):
        if s.chunks:
            raise PlanError(
                f"{p}.stages[{i}].chunks",
                f"stage {i} holds {s.num_chunks} layer chunks; schedule {plan.schedule.label!r} runs one layer "
                f"range per stage (chunks need schedule {' or '.join(_chunked_names())})",
            )
    expected_start = 0
    for i, s in enumerate(plan.stages):
        start, end = s.layers
        where = f"stages must cover [0, {num_layers}) contiguously in order; got {_ranges(plan)}"
        if start >= end:
            raise PlanError(
                f"{p}.stages[{i}].layers",
                f"layers [{start}, {end}) hold no layer; each stage needs at least one; {where}",
            )
        if start != expected_start:
            after = "the model starts at layer 0" if i == 0 else f"stage {i - 1} ends at layer {expected_start}"
            raise PlanError(
                f"{p}.stages[{i}].layers",
                f"stage {i} starts at layer {start}, expected {expected_start} ({after}); {where}",
            )
        expected_start = end
    if expected_start != num_layers:
        raise PlanError(
            f"{p}.stages",
            f"stages end at layer {expected_start}, the model has num_layers={num_layers}; "
            f"stages must cover [0, {num_layers}) contiguously in order; got {_ranges(plan)}",
        )


def _chunk_text(plan: Plan) -> str:
    return "; ".join(
        f"stage {i}: " + ", ".join(f"[{a}, {b})" for a, b in s.layer_chunks) for i, s in enumerate(plan.stages)
    )


def _check_chunks(plan: Plan, num_layers: int, p: str) -> None:
    """Several chunks per stage: the same count v on every stage (zb-v: 2), the schedule's own
    constraints on the microbatches, and the chunks in model-position order (the schedule
    places chunk c of stage s) covering [0, num_layers) exactly, contiguously."""
    sched = plan.schedule
    name, v = sched.label, sched.chunks
    need = f"{v} (as many as stage 0)" if sched.chunk_choice else f"exactly {v} ({sched.placement})"
    for i, s in enumerate(plan.stages):
        if s.num_chunks != v:
            raise PlanError(
                f"{p}.stages[{i}].chunks",
                f"stage {i} holds {s.num_chunks} layer chunk(s); schedule {name} needs {need} on every stage "
                "(stages[i].chunks: [[start, end], ...])",
            )
    where = (
        f"{sched.name} places {sched.placement}; the chunks in position order must cover [0, {num_layers}) "
        f"contiguously; got {_chunk_text(plan)}"
    )
    expected = 0
    for q, (i, c) in enumerate(plan.positions()):
        start, end = plan.stages[i].layer_chunks[c]
        key = f"{p}.stages[{i}].chunks[{c}]" if plan.stages[i].chunks else f"{p}.stages[{i}].layers"
        if start >= end:
            raise PlanError(key, f"chunk [{start}, {end}) holds no layer; each chunk needs at least one; {where}")
        if start != expected:
            raise PlanError(
                key,
                f"chunk {c} of stage {i} sits at model position {q} and starts at layer {start}, expected "
                f"{expected} ("
                + ("the model starts at layer 0" if q == 0 else f"position {q - 1} ends there")
                + f"); {where}",
            )
        expected = end
    if expected != num_layers:
        raise PlanError(
            f"{p}.stages", f"the chunks end at layer {expected}, the model has num_layers={num_layers}; {where}"
        )


def _stages_by_chip(plan: Plan) -> dict[str, list[int]]:
    by_chip: dict[str, list[int]] = {}
    for i, s in enumerate(plan.stages):
        by_chip.setdefault(s.chip, []).append(i)
    return by_chip


def _sum_text(need: Sequence[int]) -> str:
    return f"{'+'.join(map(str, need))} = {sum(need)}" if len(need) > 1 else str(sum(need))


def _stage_shapes(plan: Plan, idxs: Sequence[int]) -> str:
    return ", ".join(f"stage {i}: {plan.stages[i].data}x{plan.stages[i].tensor}" for i in idxs)


# -- placement ---------------------------------------------------------------------------


def assign_devices(
    plan: Plan,
    *,
    nodes: Mapping[str, int],
    devices_per_node: Mapping[str, int],
    key_prefix: str = "plan",
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Place every stage on one node of its chip type.

    Returns, per stage, `(node_index, device_indices)`: the node's index among the
    nodes of that chip type, and the device indices within that node. Stages spread
    over distinct nodes first (programs on one node run one after another in
    single-process mode, so consecutive stages of one chip type on separate nodes can
    overlap); when that does not fit, stages are packed first-fit in stage order, and as
    a last resort an exhaustive search is tried. Raises PlanError when nothing fits.
    """
    p = key_prefix
    result: list[tuple[int, tuple[int, ...]] | None] = [None] * plan.num_stages
    for chip, idxs in _stages_by_chip(plan).items():
        for i in idxs:
            if chip not in nodes or chip not in devices_per_node:
                known = sorted(set(nodes) & set(devices_per_node))
                raise PlanError(
                    f"{p}.stages[{i}].chip",
                    f"chip {chip!r} is not in the cluster; known chips: {', '.join(known) or '(none)'}",
                )
        n_nodes, per_node = nodes[chip], devices_per_node[chip]
        need = [plan.stages[i].num_devices for i in idxs]
        for i, n in zip(idxs, need):
            if n > per_node:
                raise PlanError(
                    f"{p}.stages[{i}]",
                    f"stage {i} needs {plan.stages[i].data}*{plan.stages[i].tensor} = {n} devices "
                    f"of chip {chip}, a node has {per_node} (a stage never spans nodes)",
                )
        if sum(need) > n_nodes * per_node:
            raise PlanError(
                f"{p}.stages",
                f"stages on chip {chip} need {_sum_text(need)} devices, the cluster has "
                f"{n_nodes} nodes x {per_node} = {n_nodes * per_node} "
                f"({_stage_shapes(plan, idxs)})",
            )
        placement = (
            _place_greedy(need, n_nodes, per_node, spread=True)
            or _place_greedy(need, n_nodes, per_node, spread=False)
            or _place_search(need, n_nodes, per_node)
        )
        if placement is None:
            raise PlanError(
                f"{p}.stages",
                f"stages on chip {chip} need {'+'.join(map(str, need))} devices, which do not fit "
                f"on {n_nodes} nodes of {per_node} devices without a stage spanning nodes",
            )
        used = [0] * n_nodes
        for i, n, node in zip(idxs, need, placement):
            result[i] = (node, tuple(range(used[node], used[node] + n)))
            used[node] += n
    return tuple(r for r in result if r is not None)


def _place_greedy(need: Sequence[int], n_nodes: int, per_node: int, *, spread: bool) -> list[int] | None:
    """Node per stage, first-fit in stage order; with `spread`, an empty node when one fits."""
    free = [per_node] * n_nodes
    placement = []
    for n in need:
        fits = [k for k in range(n_nodes) if free[k] >= n]
        if spread:
            # an empty node if one fits, else the first node with room
            fits = [k for k in fits if free[k] == per_node] or fits
        if not fits:
            return None
        free[fits[0]] -= n
        placement.append(fits[0])
    return placement


def _place_search(need: Sequence[int], n_nodes: int, per_node: int, max_steps: int = 100_000) -> list[int] | None:
    """Exact bin packing by depth-first search; empty nodes are interchangeable."""
    free = [per_node] * n_nodes
    placement: list[int] = []
    steps = 0

    def visit(j: int) -> bool:
        nonlocal steps
        if j == len(need):
            return True
        steps += 1
        if steps > max_steps:
            return False
        tried_empty = False
        for k in range(n_nodes):
            if free[k] < need[j] or (free[k] == per_node and tried_empty):
                continue
            tried_empty = tried_empty or free[k] == per_node
            free[k] -= need[j]
            placement.append(k)
            if visit(j + 1):
                return True
            placement.pop()
            free[k] += need[j]
        return False

    return placement if visit(0) else None


def even_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split [0, num_layers) into num_stages contiguous half-open ranges, sizes within 1.

    The first `num_layers % num_stages` stages get the extra layer.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"cannot split num_layers={num_layers} into num_stages={num_stages} "
            "non-empty stages; expected 1 <= num_stages <= num_layers"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _chunked_names() -> tuple[str, ...]:
    """The registered families whose stages hold several layer chunks (or may)."""
    return tuple(n for n in schedule_names() if (f := schedule_family(n)).chunk_choice or f.default_chunks > 1)


def chunked_variant(plan: Plan, schedule: Schedule | str, num_chunks: int | None = None) -> Plan:
    """The same stages (chip, mesh, recompute and block count each) under a chunked schedule
    (its chunks per stage; `num_chunks` where that count is a choice, interleaved's default 2):
    each stage's blocks as even chunks (the earlier chunks one block larger where they do not
    divide), in the model order the schedule gives chunk c of stage s. What ``h2jax plan``
    prices beside the searched plan. A stage with fewer blocks than chunks, or a microbatch
    count the schedule cannot run, is a PlanError naming the key."""
    try:
        sched = as_schedule(schedule, chunks=num_chunks)
    except ScheduleError as e:
        raise PlanError("plan.schedule", str(e)) from None
    if not (sched.chunk_choice or sched.chunks > 1):
        raise PlanError("plan.schedule", f"schedule={sched.label!r}; expected one of {', '.join(_chunked_names())}")
    v = sched.chunks
    for i, st in enumerate(plan.stages):
        if st.num_layers < v:
            raise PlanError(
                f"plan.stages[{i}]", f"holds {st.num_layers} block(s); {sched.label} needs {v} chunks per stage"
            )
    try:
        sched = sched.bind(plan.num_stages, plan.num_microbatches)
    except ScheduleError as e:
        raise PlanError("plan.num_microbatches", str(e)) from None
    size = {(s, c): st.num_layers // v + (c < st.num_layers % v) for s, st in enumerate(plan.stages) for c in range(v)}
    ranges: dict[tuple[int, int], tuple[int, int]] = {}
    start = 0
    for _, s, c in sorted((sched.virtual_stage(s, c), s, c) for s, c in size):
        ranges[s, c] = (start, start + size[s, c])
        start += size[s, c]
    stages = tuple(
        StageSpec(st.chip, ranges[s, 0], st.data, st.tensor, st.recompute, tuple(ranges[s, c] for c in range(v)))
        for s, st in enumerate(plan.stages)
    )
    return replace(plan, stages=stages, schedule=sched.schedule)
