"""The MPI world's agreement logic without mpirun: ranks as threads of this process.

Each thread runs one stage's Trainer over an MpiWorld whose communicator is a ThreadComm
(the object collectives mpi4py offers); the stages exchange tensors through one LocalHub.
What mpirun adds on top (processes, launchers, MPI transports) is tested in test_multiproc.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from h2jax.comm import LocalHub
from h2jax.config import load_config
from h2jax.runtime import MpiWorld, ThreadGroup, Trainer
from tests._harness import on_thread_ranks

BASE = [
    "model.vocab_size=256",
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.n_layers=4",
    "plan.global_batch=8",
    "plan.num_microbatches=4",
    "optimizer.warmup_steps=1",
    "train.progress=false",
    "train.tensorboard=false",
    "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
    "plan.stages=[{chip: sim_a, data: 2, tensor: 1, layers: [0, 2]}, {chip: sim_b, data: 1, tensor: 2, layers: [2, 4]}]",
]


def run_ranks(cfg, run_dir, *, before=None, steps_fn=None):
    """Both ranks on threads: build, resume, run; returns [(trainer, resumed message, history)]."""
    group = ThreadGroup(2)
    hub = LocalHub(2)
    out: list = [None, None]

    def rank(r: int) -> None:
        world = MpiWorld(group.comm(r), [0, 1], launcher="threads")
        tr = Trainer(cfg, run_dir=run_dir, world=world, hub=hub)
        if before is not None:
            before(r, tr)
        msg = tr.resume()
        history = tr.run()
        tr.close()
        out[r] = (tr, msg, history)

    on_thread_ranks(rank, hub)
    return out


def local_run(cfg, run_dir):
    tr = Trainer(cfg, run_dir=run_dir)
    tr.resume()
    history = tr.run()
    params = {k: np.asarray(v) for k, v in tr.gathered_params().items()}
    tr.close()
    return history, params


@pytest.mark.slow
def test_thread_ranks_equal_one_process(tmp_path):
    cfg = load_config(None, [*BASE, "train.steps=3", "checkpoint.enabled=false"])
    want_hist, want_params = local_run(cfg, tmp_path / "local")
    out = run_ranks(cfg, tmp_path / "ranks")
    for _tr, _, history in out:  # every rank knows the loss and the global norm
        assert [h.loss for h in history] == pytest.approx([h.loss for h in want_hist], abs=1e-6)
        assert [h.grad_norm for h in history] == pytest.approx([h.grad_norm for h in want_hist], abs=1e-6)
    got = {}
    for tr, _, _ in out:
        got.update({k: np.asarray(v) for k, v in tr.params_by_layer().items()})
    assert sorted(got) == sorted(want_params)
    for k in got:
        np.testing.assert_allclose(got[k], want_params[k], atol=1e-6, rtol=0, err_msg=k)
    # the writer (rank 0) wrote the run folder with every stage's events
    assert (tmp_path / "ranks" / "summary.json").is_file() and (tmp_path / "ranks" / "gantt.png").is_file()


class Watchdog:
    """What a trainer uses of h2jax.launch.FailFast: the timeouts it is asked to watch."""

    def __init__(self):
        self.last_completed_step = -1
        self.stop_signal = None
        self.watched: list[float] = []

    def watch(self, timeout_s: float) -> None:
        self.watched.append(timeout_s)

    def heartbeat(self) -> None:
        pass


@pytest.mark.slow
def test_trainers_sharing_one_world_step_alone_and_alternately(tmp_path):
    """Two trainers on every rank over one world and one hub, stepped by train_step() alone in
    turn (no run(): as benchmarks/schedules.py runs its trainers under mpirun), with a launcher's
    watchdog: each trains exactly as it does on its own, and the watchdog is kept armed."""
    cfgs = {
        s: load_config(None, [*BASE, "train.steps=3", "checkpoint.enabled=false", f"plan.schedule={s}"])
        for s in ("1f1b", "zb-h1")
    }
    want = {s: local_run(cfg, tmp_path / s)[0] for s, cfg in cfgs.items()}
    group, hub = ThreadGroup(2), LocalHub(2)
    got: dict = {}
    gathered: dict = {}
    dogs = [Watchdog(), Watchdog()]

    def rank(r: int) -> None:
        world = MpiWorld(group.comm(r), [0, 1], launcher="threads")
        trainers = {s: Trainer(cfg, run_dir=None, world=world, hub=hub, fail_fast=dogs[r]) for s, cfg in cfgs.items()}
        for _ in range(3):
            for s, tr in trainers.items():
                got.setdefault((r, s), []).append(tr.train_step())
        for s, tr in trainers.items():  # the benchmark's trace: every rank's events, on the writer
            gathered[(r, s)] = (world.is_writer, tr.gather_events())
        for tr in trainers.values():
            tr.close()

    on_thread_ranks(rank, hub)
    assert sorted(got) == sorted((r, s) for r in range(2) for s in cfgs)
    for (r, s), history in got.items():
        assert [h.loss for h in history] == pytest.approx([h.loss for h in want[s]], abs=1e-6), (r, s)
        assert [h.grad_norm for h in history] == pytest.approx([h.grad_norm for h in want[s]], abs=1e-6), (r, s)
    for (r, s), (writer, events) in gathered.items():
        if not writer:
            assert events is None, (r, s)
            continue
        computed = {(e.stage, e.step) for e in events if e.kind in ("fwd", "bwd")}
        assert computed == {(st, step) for st in range(2) for step in range(3)}, (r, s)
    assert sum(writer for writer, _ in gathered.values()) == len(cfgs)
    for dog in dogs:  # armed after every step but each trainer's first (which compiles)
        assert len(dog.watched) == 2 * 2 and all(t > 0 for t in dog.watched)
        assert dog.last_completed_step == 2


def test_nonfinite_skip_is_decided_alike_on_every_rank(tmp_path):
    cfg = load_config(
        None,
        [
            *BASE,
            "train.steps=3",
            "checkpoint.enabled=false",
            "train.nonfinite=skip",
            "train.inject_nonfinite_steps=[1]",
        ],
    )
    out = run_ranks(cfg, tmp_path)
    for tr, _, history in out:
        assert [h.skipped for h in history] == [False, True, False]
        assert tr.skipped_steps == 1


@pytest.mark.slow
def test_a_stop_on_one_rank_stops_every_rank_at_the_same_boundary_and_resumes(tmp_path):
    # synchronous saves: the two ranks' orbax managers share this one process
    cfg = load_config(None, [*BASE, "train.steps=6", "checkpoint.every_steps=0", "checkpoint.async_save=false"])

    def stop_rank1_after_step_2(r, tr):
        if r == 1:
            tr._local_stop = lambda: "SIGTERM" if tr.step >= 2 else None

    out = run_ranks(cfg, tmp_path, before=stop_rank1_after_step_2)
    for tr, _, history in out:
        assert tr.preempted == "SIGTERM" and tr.step == 2 and len(history) == 2
    # both ranks saved their part of step 2; a new job resumes from it on both
    out = run_ranks(cfg, tmp_path)
    for _tr, msg, history in out:
        assert msg.startswith("resumed from") and "step 2" in msg, msg
        assert [h.step for h in history] == [2, 3, 4, 5]
    # and the resumed run ends where a straight run does
    straight_hist, straight_params = local_run(cfg, tmp_path / "straight")
    assert [h.loss for h in out[0][2]] == pytest.approx([h.loss for h in straight_hist[2:]], abs=1e-6)
