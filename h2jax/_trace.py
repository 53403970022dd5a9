"""Pipeline events as a Chrome/Perfetto trace and as a Gantt chart: one format, one drawing.

A :class:`TraceEvent` is one timed interval on one stage (a forward, a backward, a boundary
transfer, an optimizer update). The runtime's recorded timeline (``h2jax.runtime``) and the
planner's simulator (``h2jax.plan``) both produce them, and both are

- written as Chrome/Perfetto trace JSON (open it at https://ui.perfetto.dev or
  ``chrome://tracing``) by :func:`chrome_trace` / :func:`write_trace`: one process row per
  stage, a compute thread and a communication thread inside each; read back by
  :func:`load_trace`;
- reduced to numbers: per-stage busy time and the pipeline *bubble fraction*;
- drawn as a Gantt chart PNG by :func:`plot_gantt`.

Times are microseconds from an origin. No JAX here, and matplotlib only when drawing, so the
planner may use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "EVENT_KINDS",
    "TraceEvent",
    "bubble_fraction",
    "chrome_trace",
    "colour_key",
    "load_trace",
    "plot_gantt",
    "sort_events",
    "stage_busy",
    "write_trace",
]

EVENT_KINDS: tuple[str, ...] = ("fwd", "bwd", "send", "recv", "update", "other")
"""Every kind a :class:`TraceEvent` may have."""

COMPUTE_KINDS: frozenset[str] = frozenset({"fwd", "bwd"})
"""Kinds that count as pipeline compute in :func:`stage_busy` / :func:`bubble_fraction`."""

COMM_KINDS: frozenset[str] = frozenset({"send", "recv"})
"""Kinds drawn on the communication thread / lane."""

# Chrome trace thread ids inside each stage's process row.
_TID_COMPUTE = 0
_TID_COMM = 1
_TID_OTHER = 2
_THREAD_NAMES = {_TID_COMPUTE: "compute", _TID_COMM: "comm", _TID_OTHER: "other"}

# args keys the trace writer owns; every other args key is an ``extra``.
_RESERVED_ARGS = frozenset({"step", "stage", "microbatch", "kind", "chip"})


@dataclass(frozen=True)
class TraceEvent:
    """One timed interval on one stage.

    Attributes:
        kind: one of :data:`EVENT_KINDS` (``fwd``, ``bwd``, ``send``, ``recv``,
            ``update``, ``other``).
        stage: stage index (0 = embedding side).
        step: optimizer step the event belongs to.
        microbatch: microbatch index, or ``None`` for per-step work (``update``).
        start_us: start, µs after the timeline's origin.
        dur_us: duration in µs (>= 0).
        chip: chip type of the stage, e.g. ``"sim_a"``; ``""`` when unknown.
        extra: free-form JSON-serialisable details, e.g. ``bytes``, ``peer``
            (the other stage of a transfer), ``transport``, ``phase``
            (``"F"``/``"B"``: whether a transfer carries activations or gradients),
            ``name`` (label of an ``other`` event).
    """

    kind: str
    stage: int
    step: int
    microbatch: int | None
    start_us: float
    dur_us: float
    chip: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def end_us(self) -> float:
        """End of the interval, µs after the origin."""
        return self.start_us + self.dur_us

    @property
    def name(self) -> str:
        """Short label: ``F3``, ``B3``, ``send F3``, ``recv B3``, ``update``."""
        return _event_name(self)


def _transfer_phase(ev: TraceEvent) -> str:
    """``"F"`` (activations) or ``"B"`` (gradients) for a transfer, ``""`` if unknown.

    An explicit ``phase`` extra wins; otherwise the direction follows from ``peer``:
    activations flow to higher stages, gradients to lower ones.
    """
    phase = ev.extra.get("phase")
    if isinstance(phase, str) and phase:
        return {"fwd": "F", "bwd": "B"}.get(phase.lower(), phase.upper()[:1])
    peer = ev.extra.get("peer")
    if isinstance(peer, int) and not isinstance(peer, bool) and peer != ev.stage:
        downstream = peer > ev.stage
        if ev.kind == "send":
            return "F" if downstream else "B"
        return "B" if downstream else "F"
    return ""


def _event_name(ev: TraceEvent) -> str:
    mb = "" if ev.microbatch is None else str(ev.microbatch)
    if "chunk" in ev.extra and ev.kind in ("fwd", "bwd"):  # a stage of several layer chunks: which one ran
        mb += f"c{ev.extra['chunk']}"
    if ev.kind == "fwd":
        return f"F{mb}"
    if ev.kind == "bwd":  # a split backward records its input-gradient (B) and weight-gradient (W) parts
        return f"{ev.extra.get('part', 'B')}{mb}"
    if ev.kind in COMM_KINDS:
        return f"{ev.kind} {_transfer_phase(ev)}{mb}".rstrip()
    if ev.kind == "update":
        return "update"
    return str(ev.extra.get("name", "other"))


def _tid(kind: str) -> int:
    if kind in COMM_KINDS:
        return _TID_COMM
    if kind == "other":
        return _TID_OTHER
    return _TID_COMPUTE


def _sort_key(ev: TraceEvent) -> tuple[float, int, float]:
    return (ev.start_us, ev.stage, ev.dur_us)


def _stage_label(stage_labels: Sequence[str], stage: int) -> str:
    return stage_labels[stage] if 0 <= stage < len(stage_labels) else f"stage {stage}"


def sort_events(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    """``events`` by start time (then stage, then duration)."""
    return sorted(events, key=_sort_key)


def write_trace(path: str | Path, trace: dict[str, Any]) -> Path:
    """Write Chrome trace JSON (as :func:`chrome_trace` makes it) to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # An odd extra (numpy scalar, tuple, object) must not lose the whole trace.
    path.write_text(json.dumps(trace, default=_json_default))
    return path


def _json_default(obj: Any) -> Any:
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def chrome_trace(events: Sequence[TraceEvent], stage_labels: Sequence[str]) -> dict[str, Any]:
    """``events`` as Chrome/Perfetto trace JSON.

    One complete event (``ph: "X"``, ``ts``/``dur`` in µs) per event; ``pid`` = stage,
    ``tid`` 0 = compute (fwd/bwd/update), 1 = communication (send/recv), 2 = other.
    Metadata events name each stage row (``stage_labels``) and its threads.
    """
    trace_events: list[dict[str, Any]] = []
    stages = sorted(set(range(len(stage_labels))) | {ev.stage for ev in events})
    used_tids: dict[int, set[int]] = {s: {_TID_COMPUTE, _TID_COMM} for s in stages}
    for ev in events:
        used_tids[ev.stage].add(_tid(ev.kind))
    for s in stages:
        trace_events.append(
            {"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": _stage_label(stage_labels, s)}}
        )
        trace_events.append({"ph": "M", "name": "process_sort_index", "pid": s, "tid": 0, "args": {"sort_index": s}})
        for tid in sorted(used_tids[s]):
            trace_events.append(
                {"ph": "M", "name": "thread_name", "pid": s, "tid": tid, "args": {"name": _THREAD_NAMES[tid]}}
            )
            trace_events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": s, "tid": tid, "args": {"sort_index": tid}}
            )
    for ev in events:
        args: dict[str, Any] = {
            "step": ev.step,
            "stage": ev.stage,
            "microbatch": ev.microbatch,
            "kind": ev.kind,
            "chip": ev.chip,
        }
        args.update({k: v for k, v in ev.extra.items() if k not in _RESERVED_ARGS})
        trace_events.append(
            {
                "name": ev.name,
                "cat": ev.kind,
                "ph": "X",
                "ts": ev.start_us,
                "dur": ev.dur_us,
                "pid": ev.stage,
                "tid": _tid(ev.kind),
                "args": args,
            }
        )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Read a trace written by :func:`write_trace` back into events, sorted by start.

    Metadata (``ph: "M"``) and any other non-complete events are ignored; both the
    ``{"traceEvents": [...]}`` object form and a bare JSON array are accepted.
    """
    data = json.loads(Path(path).read_text())
    raw = data["traceEvents"] if isinstance(data, dict) else data
    events: list[TraceEvent] = []
    for item in raw:
        if item.get("ph") != "X":
            continue
        args = dict(item.get("args", {}))
        kind = args.get("kind") or item.get("cat") or "other"
        microbatch = args.get("microbatch")
        events.append(
            TraceEvent(
                kind=kind,
                stage=int(args.get("stage", item.get("pid", 0))),
                step=int(args.get("step", 0)),
                microbatch=None if microbatch is None else int(microbatch),
                start_us=float(item["ts"]),
                dur_us=float(item.get("dur", 0.0)),
                chip=str(args.get("chip", "")),
                extra={k: v for k, v in args.items() if k not in _RESERVED_ARGS},
            )
        )
    events.sort(key=_sort_key)
    return events


# ---------------------------------------------------------------------------- numbers


def stage_busy(events: Iterable[TraceEvent], num_stages: int) -> list[float]:
    """Compute time (fwd + bwd) in µs per stage, ``num_stages`` entries.

    Raises:
        ValueError: an event's stage is outside ``[0, num_stages)``.
    """
    busy = [0.0] * num_stages
    for ev in events:
        if ev.kind not in COMPUTE_KINDS:
            continue
        if not 0 <= ev.stage < num_stages:
            raise ValueError(f"event {ev.name!r} is on stage {ev.stage}, but num_stages={num_stages}")
        busy[ev.stage] += ev.dur_us
    return busy


def idle_share(busy: float, num_stages: int, window: float) -> float:
    """The one definition of a pipeline's bubble: ``1 - busy / (num_stages x window)``, the share
    of stage-time idle inside a window in which the stages computed `busy` in all (0.0 for an
    empty window). The runtime's timeline, the schedules' grids, the simulator and the cost
    model each count their busy time and window and ask this."""
    total = num_stages * window
    return max(0.0, 1.0 - busy / total) if total > 0 else 0.0


def bubble_fraction(events: Iterable[TraceEvent], num_stages: int) -> float:
    """Share of stage-time spent idle inside the pipeline's compute window.

    Window = first compute (fwd/bwd) start to last compute end over ``events``;
    result = ``1 - sum_s busy_s / (num_stages * window)``. Pass one step's events
    for the per-step bubble (a multi-step window would count the optimizer update
    and the gap between steps as bubble). Returns 0.0 when there is no compute or the
    window has zero length.
    """
    compute = [ev for ev in events if ev.kind in COMPUTE_KINDS]
    if not compute or num_stages <= 0:
        return 0.0
    window = max(ev.end_us for ev in compute) - min(ev.start_us for ev in compute)
    return idle_share(sum(stage_busy(compute, num_stages)), num_stages, window)


# ---------------------------------------------------------------------------- gantt

_COLOURS = {
    "fwd": "#4C72B0",
    "bwd": "#DD8452",
    "wgt": "#937860",  # a split backward's W task (a bwd event with part "W"), as SimResult.plot draws it
    "update": "#55A868",
    "send": "#8172B3",
    "recv": "#C44E52",
    "other": "#9A9A9A",
}
_LEGEND_NAMES = {
    "fwd": "forward",
    "bwd": "backward",
    "wgt": "weight gradient (W)",
    "update": "optimizer update",
    "send": "send",
    "recv": "recv",
    "other": "other",
}
# Vertical layout of one stage row (y grows downwards: the axis is inverted).
_COMPUTE_TOP, _COMPUTE_H = -0.40, 0.58
_COMM_TOP, _COMM_H = 0.22, 0.17
_COMM_LANE = {"send": (0.225, 0.075), "recv": (0.31, 0.075)}  # kind -> (top, height)


def colour_key(ev: Any) -> str:
    """The legend entry an event is drawn as: its kind, or "wgt" for a split backward's W task."""
    return "wgt" if ev.kind == "bwd" and ev.extra.get("part") == "W" else ev.kind


def plot_gantt(
    events: Sequence[TraceEvent],
    path: str | Path,
    *,
    stage_labels: Sequence[str],
    title: str = "",
    what: str | None = None,
) -> Path:
    """Draw ``events`` (normally one step's) as a Gantt chart PNG at ``path``; returns ``path``.

    One row per stage (stage 0 on top): forward and backward boxes (microbatch index, and
    for a stage of several layer chunks ``c<chunk>``, written inside boxes wide enough for
    it; chunks after the first hatched), optimizer update and other work in the
    same lane, sends and receives as thin bars in a lane below. x axis in ms from the
    first event (in s when the span is 10 s or more); the subtitle gives ``what`` (default:
    the steps of the events), the span and the bubble fraction.
    """
    # Figure without pyplot: no global backend state, safe in threads and under tests.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = sorted(events, key=_sort_key)
    num_stages = max([len(stage_labels)] + [ev.stage + 1 for ev in events])
    labels = [_stage_label(stage_labels, s) for s in range(num_stages)]

    fig = Figure(figsize=(13.0, 1.6 + 0.85 * num_stages), dpi=120, layout="constrained")
    ax = fig.add_subplot()

    if events:
        origin = events[0].start_us
        end = max(ev.end_us for ev in events)
    else:
        origin, end = 0.0, 1000.0
    scale, unit = (1e3, "ms") if end - origin < 10e6 else (1e6, "s")  # µs per unit
    span = max((end - origin) / scale, 1e-6)
    pad = 0.01 * span
    ax.set_xlim(-pad, span + pad)
    ax.set_ylim(num_stages - 0.5, -0.5)

    # Alternate row shading makes long pipelines readable.
    for s in range(num_stages):
        if s % 2 == 1:
            ax.axhspan(s - 0.5, s + 0.5, color="#F3F3F3", zorder=0, lw=0)
        ax.broken_barh(
            [(-pad, span + 2 * pad)],
            (s + _COMM_TOP, _COMM_H),
            facecolors="#E4E4EC",
            alpha=0.5,
            edgecolor="none",
            zorder=1,
        )
    # Labels sit level with the compute boxes, the comm lane hangs below them.
    ax.set_yticks([s + _COMPUTE_TOP + _COMPUTE_H / 2 for s in range(num_stages)], labels)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#DDDDDD", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    # Pixels per time unit, to decide which boxes have room for their label.
    fig.canvas.draw()
    px_per_unit = ax.get_window_extent().width / (span + 2 * pad)

    kinds_seen: set[str] = set()
    hatched = False
    for ev in events:
        x = (ev.start_us - origin) / scale
        w = ev.dur_us / scale
        look = colour_key(ev)
        colour = _COLOURS.get(look, _COLOURS["other"])
        kinds_seen.add(look)
        if ev.kind in COMM_KINDS:
            top, h = _COMM_LANE[ev.kind]
            ax.broken_barh([(x, max(w, 0.0))], (ev.stage + top, h), facecolors=colour, edgecolor="none", zorder=3)
            continue
        chunk = ev.extra.get("chunk") if ev.kind in COMPUTE_KINDS else None
        ax.broken_barh(
            [(x, w)],
            (ev.stage + _COMPUTE_TOP, _COMPUTE_H),
            facecolors=colour,
            edgecolor="white",
            linewidth=0.6,
            hatch="///" if chunk else None,  # a stage's later layer chunks are hatched
            zorder=3,
        )
        hatched = hatched or bool(chunk)
        label = ev.name if ev.kind in COMPUTE_KINDS else ("U" if ev.kind == "update" else "")
        if ev.kind in COMPUTE_KINDS and ev.microbatch is not None:
            label = str(ev.microbatch) + (f"c{chunk}" if chunk is not None else "")
        if label and w * px_per_unit >= 7.0 * len(label) + 4.0:
            ax.text(
                x + w / 2,
                ev.stage + _COMPUTE_TOP + _COMPUTE_H / 2,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                fontweight="bold",
                zorder=4,
                clip_on=True,
            )

    legend = [k for kind in EVENT_KINDS for k in ((kind, "wgt") if kind == "bwd" else (kind,))]
    order = [k for k in legend if k in kinds_seen] or ["fwd", "bwd"]
    handles = [Patch(facecolor=_COLOURS[k], label=_LEGEND_NAMES[k]) for k in order]
    if hatched:  # everything drawn is named: the hatching too
        handles.append(Patch(facecolor="#999999", edgecolor="white", hatch="///", label="a later layer chunk"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9)

    bubble = bubble_fraction(events, num_stages)
    steps = sorted({ev.step for ev in events})
    if what is not None:
        step_txt = what
    elif not steps:
        step_txt = "no events"
    elif len(steps) == 1:
        step_txt = f"step {steps[0]}"
    else:
        step_txt = f"steps {steps[0]}–{steps[-1]}"
    span_txt = f"{span:,.0f}" if span >= 100 else f"{span:.3g}"  # 2,840 ms, not 2.84e+03
    subtitle = f"{step_txt} · {span_txt} {unit} · bubble {100 * bubble:.1f} %"
    if title:
        ax.set_title(f"{title}\n", fontsize=12, loc="left", fontweight="bold")
        ax.set_title(subtitle, fontsize=9, loc="right", color="#555555")
    else:
        ax.set_title(subtitle, fontsize=10, loc="left")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
