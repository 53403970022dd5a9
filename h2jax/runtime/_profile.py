"""Measured per-part costs of a chip type: what ``h2jax profile --measure`` caches.

For each tensor degree and microbatch size, stages are built (``StageModule`` +
``StageProgram``, the very programs training runs) on a (data=1, tensor=t) mesh of the
chip type's devices: 1, 2 and 4 blocks, the embedding + 1 block, and 1 block + the head.
Their forward and forward+backward, and the optimizer step (gradient norm + AdamW update)
of the block programs, are timed, each call run to completion, round-robin over the
programs (so that a slow phase of the machine hits them all alike; ``ChipProfiler`` builds
the programs once and times them in rounds, which a caller may spread over a long run),
and one statistic of the rounds kept: ``statistic="median"`` (the default: what a
training step sees, and what the trainer and the benchmarks report, so the cost model
predicts a median step) or ``"lower-quartile"`` (the program with the machine to itself:
other work on the machine only adds time). The backward is forward+backward minus the
forward (it needs a fresh forward's residuals).

One program call costs a fixed amount (dispatch from Python, launch, synchronisation)
plus its layers' work: T(k) = fixed + k x block for a k-block program. The line is fitted
to T(1), T(2), T(4) by least squares -- a block costs (5 T(4) - T(2) - 4 T(1)) / 14, the
fixed cost the mean of T(k) - k x block (clamped at 0), stored as the pseudo-part
``"program"`` -- which damps the timing noise ninefold in variance against the two-point
difference T(2) - T(1) (whose part costs moved by 25 % between runs on a busy 2-core
host); the embedding costs T(embed + 1 block) minus the fitted T(1), the head T(1 block +
head) minus the fitted T(1). The optimizer step is elementwise
over the parameters, so the embedding's and the head's are the block's per parameter
byte times theirs. A fused stage program (embedding +
blocks + head) then pays the fixed cost once, as it does in training -- summing parts
timed as programs of their own would pay it once per part.

How much of a shared host a part takes (``fwd_cores`` / ``bwd_cores``: host cores busy
on average while it runs alone; every emulated chip shares this machine's cores) is
measured by contention: on a small host (2-4 cores) as many copies of the 2-block
program as the host has cores are started together, each on a client of its own (the
chip type's emulated nodes 0, 1, ...), and their time T_C is taken. C copies keep every
core busy (each alone keeps at least one busy), so one copy's core-seconds are T_C (C
cores / C copies), and cores = T_C / T_alone, forward and backward apart; every part of
that tensor degree and microbatch is taken to share the blocks' figure. This counts
what contention really costs (the XLA CPU runtime's worker threads, the Python threads
dispatching, caches), which the CPU time of a program run alone does not; where no
second client can be had (JAX started before the probe's nodes could be registered) or
the host is larger, each part's process CPU seconds over wall seconds are used instead.
With a second client at hand, moving the block's output (one boundary tensor) to it with
``jax.device_put`` -- what the single-process transport does between stages -- is timed
too, as the pseudo-part ``"transfer"`` (with the host cores it keeps busy: process CPU over
wall seconds): between emulated chips a boundary crosses this machine's memory, not the
link the chip profile names. So is the exchange across pipelines of the 1-, 2- and 4-block
programs' parameters with a mirror on that client (h2jax.runtime._tied's own calls: the gradient
sum, the copy back of the values), fitted per block and per call like the blocks, as the
pseudo-parts ``"exchange"`` and ``"exchange_call"``. Bytes come from the arrays'
shardings and XLA's compiled memory analysis. The rows are
``LayerCost``s with ``estimated=False``, keyed like the planner's roofline estimates.

On emulated chips the times are this host's CPU, not the accelerator the profile names.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax.config import ChipSpec
from h2jax.models import GPTConfig, StageModule, build_model
from h2jax.plan import EXCHANGE, EXCHANGE_CALL, PROGRAM, TRANSFER, DriverCost, LayerCost, StageSpec, local_cores
from h2jax.runtime._cluster import StagePlacement, stage_mesh
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._state import make_optimizer
from h2jax.runtime._tied import exchange_calls

MAX_PROBE_COPIES = 4  # the contention probe runs one copy per host core, on hosts this small
BLOCK_COUNTS = (1, 2, 4)  # blocks of the programs the per-block cost is fitted to
BLOCK_PROGRAMS = tuple(f"b{k}" for k in BLOCK_COUNTS)


def fit_line(times: dict[str, float], kind: str) -> tuple[float, float]:
    """(per block, fixed >= 0): the least-squares line through ``times["b<k>/<kind>"]``
    against k over BLOCK_COUNTS (module docstring)."""
    ks = np.asarray(BLOCK_COUNTS, float)
    ts = np.asarray([times[f"b{k}/{kind}"] for k in BLOCK_COUNTS])
    kc = ks - ks.mean()
    blk = float(kc @ (ts - ts.mean()) / (kc @ kc))
    return blk, max(0.0, float(ts.mean() - blk * ks.mean()))


def exchange_rows(times: dict[str, float], block_bytes: float) -> dict[str, LayerCost]:
    """The ``"exchange"`` (per block) and ``"exchange_call"`` (per list) parts from the timed
    exchange of the 1-, 2- and 4-block programs' parameters (``times["b<k>/xs"]``: the gradient
    sum's seconds, ``"b<k>/xc"``: the copy back's): fwd is the sum, bwd the copy back."""
    (xs_blk, xs_fixed), (xc_blk, xc_fixed) = fit_line(times, "xs"), fit_line(times, "xc")
    return {
        part: LayerCost(
            fwd_s=max(fwd, 0.0),
            bwd_s=max(bwd, 0.0),
            param_bytes=block_bytes if part == EXCHANGE else 0.0,
            act_bytes=0.0,
            input_bytes=0.0,
            temp_bytes=0.0,
            estimated=False,
        )
        for part, fwd, bwd in ((EXCHANGE, xs_blk, xc_blk), (EXCHANGE_CALL, xs_fixed, xc_fixed))
    }


def _backend_devices(chip_name: str, chip: ChipSpec, nodes: int) -> list[tuple[str, list]]:
    """(backend, devices) of up to `nodes` nodes of the chip type (emulated: one CPU client
    each, registered here when JAX has not started yet; fewer when it has)."""
    if not chip.emulated:
        return [(chip.platform, jax.devices(chip.platform))]
    from xla_plugins import emulated_backends, register_emulated_chips
    from xla_plugins.emulated import EmulatedBackendError, backend_name

    try:
        names = register_emulated_chips({chip_name: (nodes, chip.devices_per_node)})[chip_name]
    except EmulatedBackendError:  # JAX already started: the nodes registered before
        names = register_emulated_chips({chip_name: (1, chip.devices_per_node)})[chip_name]
        have = emulated_backends()
        names += [backend_name(chip_name, i) for i in range(1, nodes) if backend_name(chip_name, i) in have]
    return [(n, jax.devices(n)) for n in names]


def _time_calls(
    fns: dict[str, Callable[[], object]], walls: dict[str, list[float]], cpus: dict[str, list[float]]
) -> None:
    """One round: each call run to completion, its wall and process CPU seconds appended."""
    for k, fn in fns.items():
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn())
        walls.setdefault(k, []).append(time.perf_counter() - t0)
        cpus.setdefault(k, []).append(time.process_time() - c0)


def _time_together(copies: dict[str, list[Callable[[], object]]], times: dict[str, list[float]]) -> None:
    """One round: for each name, its copies started together on different clients (each call
    run to completion); the copies' mean seconds appended."""
    for k, fns in copies.items():
        took = [0.0] * len(fns)
        gate = threading.Barrier(len(fns))

        def run(i: int, fn: Callable[[], object], took=took, gate=gate) -> None:
            gate.wait()
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            took[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns[1:], 1)]
        for th in threads:
            th.start()
        run(0, fns[0])
        for th in threads:
            th.join()
        times.setdefault(k, []).append(sum(took) / len(took))


# what the profiler keeps of a program's timed rounds: the percentile
STATISTICS = {"median": 50.0, "lower-quartile": 25.0}


def _stat(xs: list[float], statistic: str) -> float:
    """`statistic` (a key of STATISTICS) of `xs`: the median -- what a training step sees on
    a machine that also runs other work -- or the lower quartile -- the time with the machine
    to itself, little moved by other work (which only ever adds time)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r}: expected one of {', '.join(STATISTICS)}")
    return float(np.percentile(np.asarray(xs, dtype=np.float64), STATISTICS[statistic]))


def _with_backward(samples: dict[str, list[float]], statistic: str) -> dict[str, float]:
    """`statistic` of each timed call's rounds, and each program's backward ("<name>/b"): its
    forward+backward less its forward (module docstring)."""
    d = {k: _stat(v, statistic) for k, v in samples.items()}
    for key in [k for k in d if k.endswith("/fb")]:
        name = key.removesuffix("/fb")
        d[f"{name}/b"] = d[key] - d[f"{name}/f"]
    return d


def _cores(cpu: float, wall: float, cap: int) -> float:
    """Host cores busy on average: CPU over wall seconds, within [0, cap] (0 when unmeasurable)."""
    if wall <= 0:
        return 0.0
    return min(max(cpu / wall, 0.0), float(cap))


class ChipProfiler:
    """The timed programs of one chip type, built and compiled once, timed in rounds.

    ``round()`` times every program of every (tensor, microbatch) row once (round-robin,
    each call run to completion) and the contention probe once; ``rows(statistic)`` turns
    the rounds so far into the profile's rows. The rounds can be spread over a long run
    (``benchmarks/costmodel_fidelity.py`` interleaves them with training steps, so the
    profile and the steps see the machine's slow and fast phases alike) or taken back to
    back (:func:`profile_chip`). Every row holds its programs' parameters and optimizer
    state until the profiler is dropped (``profile_chip`` builds one row at a time).
    """

    def __init__(
        self,
        chip_name: str,
        chip: ChipSpec,
        model: GPTConfig,
        *,
        tensor_degrees: Sequence[int],
        microbatches: Sequence[int],
        seed: int = 0,
    ):
        from h2jax.config import ExperimentConfig

        self.chip_name = chip_name
        self.cap = cap = local_cores()
        # contention probe: as many copies as the host has cores, each on a client of its own
        # (emulated chips on a small host); otherwise CPU time over wall time
        want = cap if chip.emulated and 2 <= cap <= MAX_PROBE_COPIES else 1
        nodes = _backend_devices(chip_name, chip, want)
        self.copies = copies = len(nodes) if len(nodes) == want else 1
        two = dataclasses.replace(model, n_layers=max(BLOCK_COUNTS))
        tx, _ = make_optimizer(ExperimentConfig(model=two))
        # one model: every stage program puts its own copy of the parameters on its devices
        gpt = build_model(two, seed=seed)
        self.programs = programs = {f"b{k}": dict(layers=(0, k), first=False, last=False) for k in BLOCK_COUNTS}
        programs |= {
            "eb": dict(layers=(0, 1), first=True, last=False),
            "bh": dict(layers=(0, 1), first=False, last=True),
        }
        self._rows: dict[tuple[int, int], dict] = {}
        for t in tensor_degrees:
            if t > len(nodes[0][1]):
                raise ValueError(f"tensor={t}: chip {chip_name} has {len(nodes[0][1])} devices in a node")
            meshes = [
                stage_mesh(StagePlacement(0, chip_name, backend, i, tuple(devs[:t])), data=1, tensor=t)
                for i, (backend, devs) in enumerate(nodes[:copies])
            ]
            for b in microbatches:
                self._rows[(t, b)] = self._build_row(
                    chip_name, two, gpt, tx, meshes, t, b, np.random.default_rng((seed, t, b))
                )
        self.rounds = 0

    def _build_row(self, chip_name, two, gpt, tx, meshes, t: int, b: int, rng) -> dict:
        fns: dict[str, Callable[[], object]] = {}
        together: dict[str, list[Callable[[], object]]] = {}
        mems, inputs = {}, {}
        for name, kw in self.programs.items():
            # the probe runs copies of the 2-block program; its contention holds for every part
            for i, mesh in enumerate(meshes if name == "b2" else meshes[:1]):
                spec = StageSpec(chip=chip_name, layers=kw["layers"], data=1, tensor=t)
                st = StageProgram(
                    0,
                    spec,
                    mesh,
                    StageModule(gpt, **kw),
                    tx,
                    first=kw["first"],
                    last=kw["last"],
                    label=f"profile {name}",
                )
                shape = (b, two.seq_len)
                if kw["first"]:
                    x = jax.device_put(rng.integers(0, two.vocab_size, shape, dtype=np.int32), st.act_sharding)
                else:
                    x = jax.device_put(
                        jnp.asarray(rng.normal(size=(*shape, two.d_model)), jnp.dtype(two.dtype)), st.act_sharding
                    )
                tgt = (
                    jax.device_put(rng.integers(0, two.vocab_size, shape, dtype=np.int32), st.act_sharding)
                    if kw["last"]
                    else None
                )
                y, _ = st.forward(0, x, tgt)
                dy = (
                    jax.device_put(jnp.float32(1.0), st.scalar_sharding)
                    if kw["last"]
                    else jax.device_put(jnp.ones_like(y), st.act_sharding)
                )
                f = lambda st=st, x=x, tgt=tgt: st.forward(0, x, tgt)[0]  # noqa: E731
                fb = lambda st=st, x=x, tgt=tgt, dy=dy: st.backward(0, st.forward(0, x, tgt)[1], tgt, dy)  # noqa: E731
                if name == "b2":
                    together.setdefault("f", []).append(f)
                    together.setdefault("fb", []).append(fb)
                if i:
                    continue
                fns[f"{name}/f"], fns[f"{name}/fb"] = f, fb
                if name in BLOCK_PROGRAMS:
                    if self.copies > 1:  # the exchange across pipelines of its parameters, with another client
                        xs, xc = exchange_calls(lambda st=st: jax.tree.leaves(st.params), meshes[1])
                        fns[f"{name}/xs"], fns[f"{name}/xc"] = xs, xc

                    def update(st=st):
                        float(st.grad_sqnorm())  # the driver syncs on every stage's norm, then updates
                        st.apply_update(1.0)
                        return st.params

                    fns[f"{name}/u"] = update
                if name in ("b1", "eb", "bh"):
                    mems[name] = st.memory(x, tgt, in_flight=1)
                inputs[name] = float(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize)
        if self.copies > 1:  # a boundary tensor moved to another client of the host, as the runtime does
            y1 = fns["b1/f"]()
            dst = NamedSharding(meshes[1], P("data"))
            fns["xfer"] = lambda y1=y1, dst=dst: jax.device_put(y1, dst)
        else:
            together = {}
        for fn in fns.values():  # warm-up: compilation
            jax.block_until_ready(fn())
        for copies in together.values():
            for fn in copies:
                jax.block_until_ready(fn())
        return dict(fns=fns, together=together, mems=mems, inputs=inputs, walls={}, cpus={}, tog={})

    def round(self) -> None:
        """Time every program of every row once, and the contention probe once."""
        for row in self._rows.values():
            _time_calls(row["fns"], row["walls"], row["cpus"])
            _time_together(row["together"], row["tog"])
        self.rounds += 1

    def rows(self, statistic: str = "median") -> dict[tuple[int, int], dict[str, LayerCost]]:
        """{(tensor, microbatch): {"embed" | "block" | "head" | "program" [| "transfer"]: LayerCost}}
        from the rounds so far: `statistic` (``"median"`` or ``"lower-quartile"``) of each
        program's rounds (module docstring)."""
        _stat([0.0], statistic)
        if not self.rounds:
            raise RuntimeError(f"profiler of {self.chip_name}: no round timed yet")
        return {key: self._row(row, statistic) for key, row in self._rows.items()}

    def unsure(self, statistic: str = "median") -> list[str]:
        """What of the rounds so far fits to a block that costs nothing (forward, backward or
        optimizer step at or below 0 s): one phrase per row and kind."""
        out = []
        for (t, b), row in self._rows.items():
            wall = _with_backward(row["walls"], statistic)
            for kind, what in (("f", "forward"), ("b", "backward"), ("u", "optimizer step")):
                blk, _ = fit_line(wall, kind)
                if not blk > 0:
                    times = ", ".join(f"{wall[f'b{k}/{kind}'] * 1e3:.3g}" for k in BLOCK_COUNTS)
                    out.append(
                        f"tensor {t}, microbatch {b}: a block's {what} fits to {blk * 1e3:.3g} ms "
                        f"(1, 2, 4 blocks took {times} ms)"
                    )
        return out

    def _row(self, row: dict, statistic: str) -> dict[str, LayerCost]:
        cap = self.cap
        wall = _with_backward(row["walls"], statistic)
        work = _with_backward(row["cpus"], statistic)  # process CPU seconds
        probe: dict[str, float] = {}
        if row["tog"]:
            # `copies` = host-cores programs at once keep every core busy (each alone keeps
            # >= 1 busy): one copy's core-seconds are the cores' share of the time it took
            tog = {k: _stat(v, statistic) for k, v in row["tog"].items()}
            probe = {
                "f": tog["f"] * cap / self.copies / wall["b2/f"],
                "b": (tog["fb"] - tog["f"]) * cap / self.copies / wall["b2/b"],
            }

        def split(d: dict[str, float], kind: str) -> dict[str, float]:
            """Per part and the fixed cost of a call (module docstring)."""
            blk, fixed = fit_line(d, kind)
            one = fixed + blk  # the fitted 1-block program
            return {"block": blk, PROGRAM: fixed, "embed": d[f"eb/{kind}"] - one, "head": d[f"bh/{kind}"] - one}

        w = {k: split(wall, k) for k in ("f", "b")}
        c = {k: split(work, k) for k in ("f", "b")}
        # bytes per part: the block program's, and differences of the programs' memory analyses
        mems, inputs = row["mems"], row["inputs"]
        mb1, me, mh = mems["b1"], mems["eb"], mems["bh"]
        nbytes = {
            "block": (float(mb1.params), float(mb1.activations), inputs["b1"], float(mb1.workspace)),
            "embed": (
                float(me.params - mb1.params),
                float(me.activations - mb1.activations),
                inputs["eb"],
                float(me.workspace),
            ),
            "head": (
                float(mh.params - mb1.params),
                float(mh.activations - mb1.activations),
                inputs["b1"],
                float(mh.workspace),
            ),
            PROGRAM: (0.0, 0.0, 0.0, 0.0),  # holds no parameters or activations of its own
        }
        # optimizer step: per block and per call from the block programs; elementwise, so the
        # embedding's and the head's are the block's per parameter byte
        upd_blk, upd_fixed = fit_line(wall, "u")
        upd_blk = max(upd_blk, 1e-9)
        upd = {
            "block": upd_blk,
            PROGRAM: upd_fixed,
            "embed": upd_blk * nbytes["embed"][0] / nbytes["block"][0],
            "head": upd_blk * nbytes["head"][0] / nbytes["block"][0],
        }
        out: dict[str, LayerCost] = {}
        for part in ("embed", "block", "head", PROGRAM):
            pb, ab, ib, tb = nbytes[part]
            out[part] = LayerCost(
                fwd_s=max(w["f"][part], 0.0),
                bwd_s=max(w["b"][part], 0.0),
                param_bytes=pb,
                act_bytes=max(ab, 0.0),
                input_bytes=ib,
                temp_bytes=tb,
                estimated=False,
                fwd_cores=_cores(probe["f"], 1.0, cap) if probe else _cores(c["f"][part], w["f"][part], cap),
                bwd_cores=_cores(probe["b"], 1.0, cap) if probe else _cores(c["b"][part], w["b"][part], cap),
                update_s=upd[part],
            )
        if "b1/xs" in wall:  # the exchange across pipelines: per block and per call, sum and copy back
            out |= exchange_rows(wall, nbytes["block"][0])
        if "xfer" in wall:  # the host cores the copy keeps busy: its process CPU over its wall seconds
            xc = _cores(work["xfer"], wall["xfer"], cap)
            out[TRANSFER] = LayerCost(
                fwd_s=wall["xfer"],
                bwd_s=wall["xfer"],
                param_bytes=0.0,
                act_bytes=0.0,
                input_bytes=0.0,
                temp_bytes=0.0,
                estimated=False,
                fwd_cores=xc,
                bwd_cores=xc,
            )
        return out


def profile_chip(
    chip_name: str,
    chip: ChipSpec,
    model: GPTConfig,
    *,
    tensor_degrees: Sequence[int],
    microbatches: Sequence[int],
    repeats: int = 5,
    statistic: str = "median",
    seed: int = 0,
) -> dict[tuple[int, int], dict[str, LayerCost]]:
    """{(tensor, microbatch): {"embed" | "block" | "head" | "program" [| "transfer"]: LayerCost}}
    measured on ``chip_name``: every row's programs built first, then `repeats` rounds, each
    timing every row once (round-robin), so that a slow or quiet phase of the machine (other
    work on a shared host) hits every row alike; `statistic` of each program's rounds kept
    (module docstring). The rows are compared with each other by the planner, which picks
    the cheapest: a row timed alone in a quiet phase would look cheaper than it is and be
    picked for that (timed one row at a time, a tensor-2 row came out at a third of what
    the same programs took a few minutes later, and the plan built on it lost).

    The host's core count (what ``fwd_cores`` / ``bwd_cores`` are out of) is
    :func:`h2jax.plan._profiles.local_cores`; record it with ``ProfileTable.add(...,
    host_cores=...)``.
    """
    _stat([0.0], statistic)  # a bad statistic fails before anything is built
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected at least 1")
    from h2jax._progress import Progress

    out: dict[tuple[int, int], dict[str, LayerCost]] = {}
    rows = [(t, b) for t in tensor_degrees for b in microbatches]
    with Progress(f"profile {chip_name}", total=len(rows) * (repeats + 1)) as progress:
        profs = []
        for t, b in rows:
            profs.append(ChipProfiler(chip_name, chip, model, tensor_degrees=[t], microbatches=[b], seed=seed))
            progress.advance(note=f"tensor {t}, microbatch {b}: programs built")
        for r in range(repeats):
            for (t, b), prof in zip(rows, profs):
                prof.round()
                progress.advance(note=f"round {r + 1}/{repeats}: tensor {t}, microbatch {b}")
        # a block costs more than nothing: a fit at or below 0 is the host's noise (other work
        # in one of the rounds), so more rounds are taken -- of every row, to keep them alike --
        # and a fit still at 0 after them is refused, not handed to the planner as a free block
        extra = 0
        while (unsure := [u for prof in profs for u in prof.unsure(statistic)]) and extra < EXTRA_ROUNDS * repeats:
            for prof in profs:
                prof.round()
            extra += 1
            progress.set(progress.done, note=f"extra round {extra}: {unsure[0]}")
        if unsure:
            raise ProfileNoiseError(
                f"profile {chip_name}: {'; '.join(unsure)} after {repeats + extra} rounds: this host's "
                f"timing noise is larger than the model's blocks; measure a larger model or with more "
                f"--repeats on a quieter host"
            )
        for prof in profs:
            out |= prof.rows(statistic)
    return out


EXTRA_ROUNDS = 2  # rounds taken beyond `repeats` when a fit is not positive, per repeat asked for


class ProfileNoiseError(RuntimeError):
    """A measured block cost fits to 0 s or less: the host's noise is larger than the blocks."""


# the driver calibration: a model whose programs cost next to nothing, and microbatch counts
# of its own (the driver's costs are per step, per op and per boundary tensor, not per plan)
NULL_MODEL = {"vocab_size": 256, "seq_len": 4, "d_model": 8, "n_heads": 1, "n_layers": 2, "d_ff": 8, "dtype": "float32"}
DRIVER_RUNS = ((1, 3), (1, 6), (2, 6))  # (stages, microbatches)


class DriverProfiler:
    """What the runtime's driver costs on this host beyond its programs (``DriverCost``),
    timed in rounds like :class:`ChipProfiler`.

    The real trainer runs a model whose programs cost next to nothing (``NULL_MODEL``) as 1
    stage with 3 and with 6 microbatches and as 2 stages (two nodes of ``chip_name``, so two
    clients) with 6, after 2 warm-up steps each; a round is one step of each and one
    forward+backward call of the 1-stage program timed alone. `statistic` (``_stat``) of
    the rounds' wall and process CPU seconds gives the driver's CPU per forward/backward
    beyond the call itself (which the profile's ``"program"`` part already holds), per
    boundary tensor and per step, and its wall seconds per step outside the ops. Needs two
    emulated nodes of the chip registered (the profiler's contention probe registers them).
    ``close()`` releases the trainers.
    """

    def __init__(self, chip_name: str):
        import json

        from h2jax.config import load_config
        from h2jax.runtime._trainer import Trainer

        def S(layers):
            return {"chip": chip_name, "layers": list(layers), "data": 1, "tensor": 1, "recompute": False}

        base = [
            f"model={json.dumps(NULL_MODEL)}",
            f"cluster.chips={json.dumps({chip_name: {'nodes': 2}})}",
            "train.progress=false",
            "train.tensorboard=false",
            "train.timeline=false",
            "checkpoint.enabled=false",
            "train.memory_check=false",
        ]
        self.trainers: dict[tuple[int, int], Trainer] = {}
        try:
            for n, m in DRIVER_RUNS:
                stages = [S((0, 2))] if n == 1 else [S((0, 1)), S((1, 2))]
                cfg = load_config(
                    None,
                    base
                    + [f"plan.global_batch={m}", f"plan.num_microbatches={m}", f"plan.stages={json.dumps(stages)}"],
                )
                self.trainers[(n, m)] = tr = Trainer(cfg, run_dir=None)
                for _ in range(2):
                    tr.train_step()
            tr1 = self.trainers[(1, 3)]
            st = tr1.stages[0]
            tok, tgt, _ = tr1.device_batch(0)
            dloss = tr1.runners[0].dloss
            self._call = {"fb": lambda: st.backward(0, st.forward(0, tok[0], tgt[0])[1], tgt[0], dloss)}
            jax.block_until_ready(self._call["fb"]())
        except BaseException:
            self.close()
            raise
        self.walls: dict[tuple[int, int], list[float]] = {k: [] for k in self.trainers}
        self.cpus: dict[tuple[int, int], list[float]] = {k: [] for k in self.trainers}
        self._call_wall: dict[str, list[float]] = {}
        self._call_cpu: dict[str, list[float]] = {}
        self.rounds = 0

    def round(self) -> None:
        """One step of each trainer and one call timed alone."""
        for k, tr in self.trainers.items():
            c0 = time.process_time()
            self.walls[k].append(tr.train_step().step_time_s)
            self.cpus[k].append(time.process_time() - c0)
        _time_calls(self._call, self._call_wall, self._call_cpu)
        self.trainers[(1, 3)].stages[0].zero_grads()  # the call alone accumulated gradients
        self.rounds += 1

    def result(self, statistic: str = "median") -> DriverCost:
        _stat([0.0], statistic)
        if not self.rounds:
            raise RuntimeError("driver profiler: no round timed yet")
        w = {k: _stat(v, statistic) for k, v in self.walls.items()}
        c = {k: _stat(v, statistic) for k, v in self.cpus.items()}
        call_cpu = _stat(self._call_cpu["fb"], statistic) / 2  # one forward or backward call alone
        per_op_cpu = (c[(1, 6)] - c[(1, 3)]) / (2 * 3)  # 2 ops per microbatch
        per_op_wall = (w[(1, 6)] - w[(1, 3)]) / (2 * 3)
        step_cpu = max(0.0, c[(1, 3)] - 2 * 3 * per_op_cpu)
        step_s = max(0.0, w[(1, 3)] - 2 * 3 * per_op_wall)
        # 2 stages: twice the ops of 1 stage, plus 2 x 6 boundary tensors
        transfer_cpu = max(0.0, (c[(2, 6)] - step_cpu - 2 * 2 * 6 * per_op_cpu) / (2 * 6))
        return DriverCost(
            step_s=step_s, step_cpu_s=step_cpu, op_cpu_s=max(0.0, per_op_cpu - call_cpu), transfer_cpu_s=transfer_cpu
        )

    def close(self) -> None:
        for tr in self.trainers.values():
            tr.close()


def profile_driver(chip_name: str, *, steps: int = 30, statistic: str = "median") -> DriverCost:
    """The driver's costs (``DriverProfiler``) from `steps` rounds back to back."""
    _stat([0.0], statistic)
    prof = DriverProfiler(chip_name)
    try:
        for _ in range(steps):
            prof.round()
        return prof.result(statistic)
    finally:
        prof.close()
