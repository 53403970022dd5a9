"""The training side of an elastic run (h2jax.elastic): injected faults, and the records the
supervisor reads.

The supervisor starts each launch of the job with these variables:

- ``H2JAX_ELASTIC_DIR``: the folder (``<run>/elastic``) where a process of the job leaves
  what the supervisor needs to know, as files it writes whole (``os.replace``): a record of
  an injected fault just before it fires (``fault-<id>.json``: what, the step, the time,
  the rank, pid, host and stages), and its progress (``progress-<rank>.json``: the last step
  it finished and when; the first one of a launch is its restart-to-first-step time);
- ``H2JAX_ELASTIC_CLOCK``: ``[t0, s]``: when the supervisor started (time.time()) and the
  seconds of the steps earlier launches trained that count (their rows before the step this
  launch resumes from), so each metrics row carries the run's ``goodput`` so far (the steps'
  own time over the wall time since t0);
- ``H2JAX_ELASTIC_RESUME`` (a launch after the first): ``{"attempt", "after", "step",
  "launched"}``: why this launch resumes, from which step, and when the supervisor started it;
  the job marks the boundary on its timeline (an ``other`` event on each stage, from the launch
  to the first step) and in the Gantt's title and ``summary.json`` (``resumed``);
- ``H2JAX_FAULTS``: the faults still to inject, a JSON list of ``{"id", "kind", "step",
  ...}``: ``node`` (``chip``, ``node``: every process with a stage on that node of that
  chip type SIGKILLs itself, and the supervisor takes the node out of the cluster),
  ``kill`` (``rank``: that process SIGKILLs itself; its node stays), ``stop`` (``rank``:
  that process SIGSTOPs itself, a hang the others and the supervisor detect),
  ``slow`` (``stage``, ``delay_s``: from its step on, each forward and backward of that
  stage takes ``delay_s`` longer: a straggler) and ``back`` (``chip``: a node of that chip
  type comes back; rank 0 writes the ``admit-*.json`` record ``h2jax admit`` writes).

Stragglers are detected in the job (:class:`Stragglers`, on the process that writes the
metrics, from the timeline's per-stage busy time; ``train.timeline`` must be on): a stage
whose busy time per step stays at STRAGGLER_RATIO times its own earlier median or more, and
as much above the other stages' (against theirs), for STRAGGLER_STEPS logged steps is named,
with its chip type and the slowdown, in one line, a ``straggler_stage`` metric, and (elastic) ``straggler.json``, which the supervisor may act on.

A fault fires at the start of its step, before any of that step's work. SIGKILL and SIGSTOP
cannot be caught: nothing after the record runs, as in a real failure. The checkpoint's
failpoints (h2jax.checkpoint._faults) kill at points of a save instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from h2jax.launch import ELASTIC_DIR_ENV

FAULTS_ENV = "H2JAX_FAULTS"
FAULT_KINDS = ("node", "kill", "stop", "slow", "back")
STRAGGLER_RATIO = 2.0  # busy time over the stage's own baseline that makes it a straggler
STRAGGLER_STEPS = 3  # consecutive logged steps at that ratio
BASELINE_STEPS = 3  # logged steps (after the first, which compiles) that set each stage's baseline
CLOCK_ENV = "H2JAX_ELASTIC_CLOCK"
RESUME_ENV = "H2JAX_ELASTIC_RESUME"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """``record`` as JSON at ``path``, whole or not at all (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def stage_nodes(cfg: Any) -> list[tuple[str, int]]:
    """(chip type, node index) of each stage of ``cfg``'s plan, as h2jax places them
    (h2jax.plan.assign_devices over the cluster's nodes)."""
    from h2jax.plan import assign_devices

    chips = cfg.cluster.chips
    placed = assign_devices(
        cfg.plan,
        nodes={n: c.nodes for n, c in chips.items()},
        devices_per_node={n: c.devices_per_node for n, c in chips.items()},
    )
    return [(st.chip, node) for st, (node, _) in zip(cfg.plan.stages, placed)]


class ElasticHooks:
    """What one process of an elastic launch does at step boundaries (module docstring).
    Outside an elastic run (no ``H2JAX_ELASTIC_DIR``) every call does nothing."""

    def __init__(self, cfg: Any, rank: int, stages: list[int]):
        d = os.environ.get(ELASTIC_DIR_ENV)
        self.dir = Path(d) if d else None
        self.rank, self.stages = rank, list(stages)
        self.faults: list[dict[str, Any]] = json.loads(os.environ.get(FAULTS_ENV) or "[]") if self.dir else []
        self._nodes = stage_nodes(cfg) if any(f["kind"] == "node" for f in self.faults) else []
        clock = json.loads(os.environ.get(CLOCK_ENV) or "null") if self.dir else None
        self.t0, self.productive = (float(clock[0]), float(clock[1])) if clock else (None, 0.0)
        self.resumed: dict[str, Any] | None = json.loads(os.environ.get(RESUME_ENV) or "null") if self.dir else None

    def mark_resume(self, timeline: Any, step: int, runners: list[Any]) -> None:
        """A launch that resumes after a failure or a re-plan: one ``other`` event on each
        stage this process records (of ``runners``; a stage over several processes records
        once), from the launch (or the timeline's origin, if later) to now, the start of its
        first step ``step``."""
        if self.resumed is None or timeline is None:
            return
        now = time.perf_counter()
        start = max(now - (time.time() - float(self.resumed["launched"])), timeline.t0)
        for r in runners:
            if r.timeline is None:
                continue
            timeline.add(
                "other",
                stage=r.stage_idx,
                step=step,
                microbatch=None,
                start=min(start, now),
                end=now,
                chip=r.program.spec.chip,
                name=f"resumed after {self.resumed['after']}",
                recovery=True,
                attempt=self.resumed["attempt"],
                from_step=self.resumed["step"],
            )

    def metrics(self) -> dict[str, float]:
        """``goodput``: the productive step time over the wall time since the supervisor began."""
        if self.t0 is None:
            return {}
        return {"goodput": self.productive / max(time.time() - self.t0, 1e-9)}

    def before_step(self, step: int, runners: list[Any] = ()) -> None:
        """Fire the faults of ``step`` that strike this process (a ``slow`` one slows its stage's
        runner from then on)."""
        for f in self.faults:
            if f["step"] != step:
                continue
            if f["kind"] == "back":  # a node of that chip type is back: rank 0 tells the supervisor
                if self.rank == 0:
                    now = time.time()
                    write_record(self.dir / f"admit-fault{f['id']}.json", {"chip": f["chip"], "nodes": 1, "time": now})
                    write_record(self.dir / f"fault-{f['id']}-rank0.json", {**f, "fired_step": step, "time": now})
                continue
            if f["kind"] == "slow":
                for r in runners:
                    if r.stage_idx == f["stage"]:
                        r.delay_s = float(f["delay_s"])
                        rec = {**f, "fired_step": step, "time": time.time(), "rank": self.rank, "pid": os.getpid()}
                        write_record(self.dir / f"fault-{f['id']}-rank{self.rank}.json", rec)
                continue
            if f["kind"] == "node":
                hit = any(self._nodes[s] == (f["chip"], f["node"]) for s in self.stages)
            else:
                hit = f["rank"] == self.rank
            if hit:
                self._fire(f, step)

    def _fire(self, fault: dict[str, Any], step: int) -> None:
        record = {
            **fault,
            "fired_step": step,
            "time": time.time(),
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "stages": self.stages,
        }
        write_record(self.dir / f"fault-{fault['id']}-rank{self.rank}.json", record)
        os.kill(os.getpid(), signal.SIGSTOP if fault["kind"] == "stop" else signal.SIGKILL)

    def after_step(self, step: int, step_time_s: float = 0.0) -> None:
        """This process finished ``step`` (steps count from 0: ``step`` + 1 are done) in ``step_time_s``."""
        self.productive += step_time_s
        if self.dir is not None:
            write_record(
                self.dir / f"progress-{self.rank}.json", {"step": step, "time": time.time(), "pid": os.getpid()}
            )


class Stragglers:
    """Per-stage busy time per step (the timeline's fwd/bwd events), against each stage's own
    baseline (the median of its first BASELINE_STEPS logged steps after the first): a stage at
    STRAGGLER_RATIO or more for STRAGGLER_STEPS logged steps in a row is a straggler, said once."""

    def __init__(self, cfg: Any, elastic_dir: Path | None):
        self.chips = [st.chip for st in cfg.plan.stages]
        self.dir = elastic_dir
        self.busy: dict[int, list[float]] = {s: [] for s in range(len(self.chips))}
        self.high: dict[int, int] = {}
        self.named: dict[str, Any] | None = None

    def observe(self, step: int, events: list[Any] | None) -> str | None:
        """Take ``step``'s events (every stage's); returns the line naming a new straggler, else None."""
        if not events or self.named is not None:
            return None
        busy = {s: 0.0 for s in self.busy}
        for e in events:
            if e.kind in ("fwd", "bwd") and e.stage in busy:
                busy[e.stage] += e.dur_us / 1e6
        ratios = {}
        for s, b in busy.items():
            hist = self.busy[s]
            hist.append(b)
            base = sorted(hist[1 : 1 + BASELINE_STEPS])
            if len(hist) > 1 + BASELINE_STEPS and base and base[len(base) // 2] > 0:
                ratios[s] = b / base[len(base) // 2]
        for s, r in ratios.items():
            # slower than its own baseline, and than the other stages are against theirs (a host
            # that slows down as a whole slows every stage: no one of them is the straggler)
            others = sorted(v for k, v in ratios.items() if k != s)
            rel = r / others[len(others) // 2] if others else r
            self.high[s] = self.high.get(s, 0) + 1 if min(r, rel) >= STRAGGLER_RATIO else 0
        slow = [s for s, n in self.high.items() if n >= STRAGGLER_STEPS]
        if not slow:
            return None
        s = max(slow, key=lambda k: ratios[k])
        self.named = {"stage": s, "chip": self.chips[s], "slowdown": ratios[s], "step": step, "time": time.time()}
        if self.dir is not None:
            write_record(self.dir / "straggler.json", self.named)
        return (
            f"straggler: stage {s} ({self.chips[s]}) has taken {ratios[s]:.1f}x its usual busy time for "
            f"{STRAGGLER_STEPS} steps (step {step})"
        )

    def metrics(self) -> dict[str, Any]:
        return {} if self.named is None else {"straggler_stage": self.named["stage"]}
