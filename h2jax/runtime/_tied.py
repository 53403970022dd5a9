"""Parameters that several pipeline stages hold (a head tied to the embedding table), trained as one.

A LLaMA-family model with ``model.tie_embeddings=true`` uses one table twice: the first stage
looks tokens up in it, the last stage computes the logits with it. Split over stages, each
holding stage keeps a copy on its own mesh -- possibly another chip type, another process,
another tensor degree -- and the backward leaves each copy only its own uses' share of the
gradient. :class:`TiedParams` makes the copies one parameter again (the first holder, in
stage order, *owns* it; the others hold *mirrors*):

- **Gradient.** After a step's backward every mirror sends its share to the owner, which adds
  them in stage order (owner + next holder + ...): the gradient autodiff of the whole model
  gives. The mirrors' shares are then zeroed, so each stage's squared norm, hence the global
  norm that clipping uses and the non-finite check, count the parameter once, with its summed
  gradient (a non-finite share makes the sum non-finite, and stays so on its own stage, so
  an abort names both stages).
- **Update.** The owner alone computes the parameter's update (its AdamW moments included);
  after every update each mirror takes the owner's new value. Megatron instead all-reduces the
  gradient and lets every holder apply the same update. That keeps the copies equal only where
  every holder computes the update with the same arithmetic; here the holders sit on different
  chip types, whose compilers may round the update (square root, division, fused
  multiply-adds) differently in the last bit, and such differences would compound step after
  step into two different tables. Taking the owner's bits makes the copies identical (``==``)
  after every update on any mix of chips. A mirror's own optimizer moments of the parameter
  are never read: its update is replaced by the owner's value, and a checkpoint keeps the
  owner's moments (below), so they do not travel (they decay under the zeroed gradient, inert).
  The cost per step: each mirror's share of the gradient travels once to the owner, the new
  value once back. In one process: ``jax.device_put`` between the stage meshes, sharded over the
  data axes and all-gathered on arrival, which also reshards when the stages' tensor degrees
  differ. Across processes the same pattern: each process sends, through host memory, the
  slices it holds that a process of the other stage needs in the cut layout
  (:func:`h2jax.plan.slice_routes` over both layouts: each element once, replicas sharing the
  load; :meth:`World.post`), and the receiving stage all-gathers them over its data axis: every
  process moves its own part, none the whole.
- **Checkpoints.** A tied parameter and its optimizer state are saved once, by the owner,
  under the parameter's path in the whole model (``embed/embedding``); a restore gives every
  holder the same values (``h2jax.runtime._state``), under any plan -- also one whose single
  stage holds every use, where there is nothing to tie.

A skipped step (``train.nonfinite=skip``) updates no copy, so they stay equal.

With layer chunks (interleaved, zb-v) the holders are model positions, i.e. chunk programs:
``zb-v`` puts the embedding (position 0) and the head (the last position) on stage 0, so a
tied table has two holders on one stage -- its two chunk programs, each with its own
accumulator and optimizer state -- and the hand-overs between them stay on that stage's
processes (across processes, a process of the stage takes from another only the slices the
other's layout holds and its own lacks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax.config import ConfigError
from h2jax.models import SharedParam
from h2jax.plan import slice_routes
from h2jax.runtime._layout import flatten, to_model_key
from h2jax.runtime._world import World

Block = tuple[tuple[int, int], ...]  # a slice of a global array: (start, stop) per dim


def check_tieable(shared: Sequence[SharedParam]) -> None:
    """Refuse what cannot be trained as one parameter: gradients of a non-float parameter
    (e.g. an integer table) cannot be summed."""
    for sp in shared:
        if not jnp.issubdtype(sp.dtype, jnp.inexact):
            stages = " and ".join(map(str, sp.stages))
            raise ConfigError(
                "plan.stages",
                f"parameter {sp.name} ({jnp.dtype(sp.dtype).name}) is held by stages {stages}: only a floating-point "
                "parameter's gradients can be summed across stages (use a plan whose one stage holds every use)",
            )


def _replace(tree: Any, values: dict[int, Any]) -> Any:
    """``tree`` with the leaves at the given leaf indices replaced."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for i, v in values.items():
        leaves[i] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _wire(x: jax.Array) -> Any:
    """The layout ``x`` travels in between stages: its own sharding with the data axis added on the
    first dimension that is not split yet and divides by it, so each of a stage's devices sends or
    receives a distinct piece (a parameter is replicated over its stage's data axis; sent as it is,
    every data replica would take the whole of it over the link between the stages). Its own
    sharding where the mesh has no data axis, the data axis is used, or no dimension divides."""
    sh = x.sharding
    n = sh.mesh.shape.get("data", 1) if isinstance(sh, NamedSharding) else 1
    if n == 1:
        return sh
    spec = list(sh.spec) + [None] * (x.ndim - len(sh.spec))
    if any(a == "data" or (isinstance(a, tuple) and "data" in a) for a in spec):
        return sh
    for i, (axis, size) in enumerate(zip(spec, x.shape)):
        if axis is None and size % n == 0:
            spec[i] = "data"
            return NamedSharding(sh.mesh, P(*spec))
    return sh


def _place_all(values: list[Any], likes: list[jax.Array]) -> list[jax.Array]:
    """``values`` (device arrays of another mesh of this process) laid out as ``likes``, each in
    a buffer of its own: two chunks of one stage may hold the copies on the same devices, and
    each update donates its own (an aliased buffer would be deleted under the other). They move
    sharded (:func:`_wire`: cut over the sender's data axis -- a local slice -- moved
    piece by piece to the receiver's, then all-gathered there over its data axis: what
    h2jax.plan's exchange cost prices), each step one ``jax.device_put`` of the whole list."""
    src = [_wire(v) for v in values]
    if any(w != v.sharding for w, v in zip(src, values)):  # a stage with a data axis: cut first
        values = jax.device_put(list(values), src)
    dst, final = [_wire(x) for x in likes], [x.sharding for x in likes]
    if dst == final:  # no data axis on the receiver: one move, nothing to gather
        return list(jax.device_put(list(values), final, may_alias=False))
    return list(jax.device_put(jax.device_put(list(values), dst), final, may_alias=False))


def _block(index: tuple[slice, ...], shape: tuple[int, ...]) -> Block:
    """A device's index (slices, as a sharding gives them) as a :data:`Block`."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _within(region: Block, block: Block) -> tuple[slice, ...]:
    """``region`` as numpy slices of the array that holds ``block``."""
    return tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(region, block))


def layout(sharding: Any, shape: tuple[int, ...], ranks: Sequence[int]) -> tuple[tuple[int, Block], ...]:
    """(world rank, block) for every device of an array of ``shape`` laid out as ``sharding``
    (:func:`h2jax.plan.slice_routes`' layout): ``ranks`` are its stage's processes
    (World.ranks_of), a device's ``process_index`` picks one."""
    blocks = sharding.devices_indices_map(shape).items()
    return tuple(sorted((ranks[d.process_index], _block(idx, shape)) for d, idx in blocks))


def list_program(kind: str, like: list[jax.Array], cache: dict) -> Any:
    """A jitted add of two lists of arrays (``kind`` "add"), a times-zero of one ("times_zero":
    finite elements become 0, non-finite ones stay NaN, so a stage whose share was non-finite
    still reports it) or the list as it is ("place": resharded, e.g. all-gathered), whose
    outputs keep ``like``'s shardings (the next step's programs see the layout they were
    compiled for); kept in ``cache`` by (kind, layouts). One program per list: a job of several
    pipelines ties every layer, and a program per parameter costs a dispatch each."""
    key = (kind, tuple(x.sharding for x in like))
    if key not in cache:
        if kind == "add":
            fn = lambda a, b: [x + y for x, y in zip(a, b)]  # noqa: E731
        elif kind == "place":
            fn = list
        else:
            fn = lambda a: [x * jnp.zeros((), x.dtype) for x in a]  # noqa: E731
        cache[key] = jax.jit(fn, out_shardings=[x.sharding for x in like])
    return cache[key]


def exchange_calls(params: Callable[[], list[jax.Array]], mesh: Any) -> tuple[Any, Any]:
    """The exchange across pipelines of one stage's parameters (``params()``: its current ones;
    an update donates them) with a mirror of them on ``mesh`` (another client), as
    :class:`TiedParams` runs it, for the profiler to time: (the gradient sum: the mirror's share
    zeroed and moved into the owner's layout, added there; the copy back: the values moved into
    the mirror's layout). Each returns what it made (to wait on)."""
    mirror = [jax.device_put(x, NamedSharding(mesh, x.sharding.spec)) for x in params()]
    cache: dict = {}

    def summed() -> Any:
        mine = params()
        zeroed = list_program("times_zero", mirror, cache)(mirror)
        return zeroed, list_program("add", mine, cache)(mine, _place_all(mirror, mine))

    def copied() -> Any:
        return _place_all(params(), mirror)

    return summed, copied


class TiedParams:
    """The tied parameters of a plan, for the stages of this process (module docstring).

    ``shared``: every parameter several stages hold (``h2jax.models.shared_parameters``);
    ``stages``: this process's StageProgram objects; ``plan``: the whole plan. With layer
    chunks, "stage" below is a model position: ``plan`` is the plan read position by
    position (one one-chunk spec each) and ``shared`` was found on it; ``stage_of`` maps a
    position to its plan stage (the unit the world talks in)."""

    def __init__(
        self,
        shared: Sequence[SharedParam],
        plan: Any,
        stages: Sequence[Any],
        world: World,
        *,
        stage_of: Sequence[int] | None = None,
    ):
        self.shared = tuple(shared)
        self.world = world
        self.local = {st.position: st for st in stages}
        self._specs = plan.stages
        self._stage_of = tuple(stage_of) if stage_of is not None else tuple(range(len(plan.stages)))
        # stage -> model key as that stage names the parameter -> (path in the whole model, owned)
        self._names: dict[int, dict[str, tuple[str, bool]]] = {}
        for sp in self.shared:
            for s, path in sp.paths:
                self._names.setdefault(s, {})[to_model_key(path, plan.stages[s])] = (sp.name, s == sp.owner)
        self._programs: dict[tuple[str, Any], Any] = {}
        self._index: dict[tuple[str, str, int], Any] = {}  # leaf positions (the trees keep their structure)
        # across processes: every holder's layouts of every tied parameter, (position, path) ->
        # (held, arriving), told once by the processes holding it (the same plan on every process, so
        # every process reaches this collective); the routes between two layouts kept as computed
        self._layouts: dict[tuple[int, str], Any] = {}
        self._routes: dict[tuple[int, int, str], Any] = {}
        self._arriving: dict[tuple[int, str], Any] = {}  # this process's positions: the sharding pieces arrive in
        self.bytes_posted = 0  # to other processes, since the start (what the exchange moved from here)
        if world.multiprocess and self.shared:
            mine = {}
            for sp in self.shared:
                for q, _ in sp.paths:
                    if q in self.local:
                        x = jax.tree.leaves(self.local[q].params)[self._param_index(sp, q)]
                        ranks = world.ranks_of(self._stage_of[q])
                        # as held (what it sends from), and as it arrives (cut over the data axis;
                        # the parameter's, which its gradient accumulator shares: one spelling)
                        wired = self._arriving[(q, sp.name)] = _wire(x)
                        mine[(q, sp.name)] = (layout(x.sharding, x.shape, ranks), layout(wired, x.shape, ranks))
            for told in world.allgather(mine):
                self._layouts.update(told)

    def __bool__(self) -> bool:
        return bool(self.shared)

    def name(self, stage: int, key: str) -> tuple[str, bool]:
        """(the model path, whether ``stage`` owns it) of the parameter that ``stage`` names
        ``key`` (a model key: ``to_model_key`` of its stage-local path)."""
        return self._names.get(stage, {}).get(key, (key, True))

    # -- the leaves of one holder ---------------------------------------------------------------
    def _path(self, sp: SharedParam, stage: int) -> str:
        return dict(sp.paths)[stage]

    def _param_index(self, sp: SharedParam, stage: int) -> int:
        key = ("param", sp.name, stage)
        if key not in self._index:
            self._index[key] = list(flatten(self.local[stage].params)).index(self._path(sp, stage))
        return self._index[key]

    def _program(self, kind: str, like: list[jax.Array]) -> Any:
        """:func:`list_program`, kept per (kind, layouts) for this job."""
        return list_program(kind, like, self._programs)

    def _move(
        self, src: int, dsts: Sequence[int], values: list[jax.Array] | None, sps: Sequence[SharedParam], likes: Any
    ) -> dict[int, list[jax.Array]]:
        """``values`` (position ``src``'s arrays of ``sps``, given where this process holds it) laid
        out as each position of ``dsts`` that this process holds lays them out (``likes(q)``: its
        arrays of ``sps``), each in buffers of its own: {q: arrays}. Only the processes of ``src``
        and ``dsts`` take part, in the same order of calls (module docstring). As in one process
        (:func:`_place_all`), what crosses between stages is cut over the receiving stage's data
        axis (each of its data replicas takes a distinct piece, from the sending process that
        holds it, replicas of the sender sharing the load) and all-gathered on arrival over that
        axis; the pieces travel through host memory."""
        if not self.world.multiprocess:
            return {q: _place_all(values, likes(q)) for q in dsts if q in self.local}
        me, dsts = self.world.rank, sorted(set(dsts))
        routes = {q: [self._route(src, q, sp.name) for sp in sps] for q in dsts}
        kept: dict[int, list[np.ndarray]] = {}  # the pieces this process sends itself
        if values is not None:
            held = [{_block(sh.index, x.shape): sh.data for sh in reversed(x.addressable_shards)} for x in values]
            for q, per in routes.items():
                for r in sorted({r for rt in per for s, r in rt if s == me}):
                    pieces = [
                        np.array(np.asarray(held[j][e])[_within(region, e)])
                        for j, rt in enumerate(per)
                        for region, e, _ in rt.get((me, r), ())
                    ]
                    if r == me:
                        kept[q] = pieces
                    else:
                        self.world.post(r, pieces)
                        self.bytes_posted += sum(p.nbytes for p in pieces)
        out = {}
        for q, per in routes.items():
            if q not in self.local:
                continue
            blocks: list[dict[Block, np.ndarray]] = [{} for _ in sps]
            for s in sorted({s for rt in per for s, r in rt if r == me}):
                pieces = iter(kept.pop(q) if s == me else self.world.take(s))
                for j, rt in enumerate(per):
                    for region, _, d in rt.get((s, me), ()):
                        piece = next(pieces)
                        if d not in blocks[j]:
                            blocks[j][d] = np.empty([b - a for a, b in d], piece.dtype)
                        blocks[j][d][_within(region, d)] = piece
            like = likes(q)
            arrived = [
                jax.make_array_from_callback(
                    x.shape, self._arriving[(q, sp.name)], lambda idx, b=b, n=x.shape: b[_block(idx, n)]
                )
                for x, b, sp in zip(like, blocks, sps)
            ]
            if any(a.sharding != x.sharding for a, x in zip(arrived, like)):  # all-gathered over the data axis
                arrived = self._program("place", like)(arrived)
            out[q] = list(arrived)
        return out

    def _route(self, src: int, dst: int, name: str) -> Any:
        key = (src, dst, name)
        if key not in self._routes:
            self._routes[key] = slice_routes(self._layouts[(src, name)][0], self._layouts[(dst, name)][1])
        return self._routes[key]

    def _leaves(self, q: int, tree: str, sps: Sequence[SharedParam]) -> list[jax.Array]:
        """Position ``q``'s arrays of ``sps`` in its ``tree`` ("params" or "acc")."""
        leaves = jax.tree.leaves(getattr(self.local[q], tree))
        return [leaves[self._param_index(sp, q)] for sp in sps]

    def _groups(self, by_owner: bool) -> dict[tuple[int, Any], list[SharedParam]]:
        """The tied parameters by (owner, mirror) -- each mirror on its own, ``by_owner`` False: for
        the gradient sum, in mirror order -- or by (owner, every mirror) for the copy back."""
        out: dict[tuple[int, Any], list[SharedParam]] = {}
        for sp in self.shared:
            if by_owner:
                out.setdefault((sp.owner, sp.stages[1:]), []).append(sp)
            else:
                for m in sp.stages[1:]:
                    out.setdefault((sp.owner, m), []).append(sp)
        return out

    # -- one step ------------------------------------------------------------------------------
    def sum_grads(self) -> None:
        """Every tied parameter's gradient summed into its owner's accumulator, in stage order
        (each mirror's share added in turn, the mirrors in ascending order); the mirrors'
        accumulators of it zeroed (call after the step's backward). The parameters a mirror and
        its owner share travel together. A mirror posts its shares (:meth:`_move`) to its
        owners from the last stage down: a pipeline's last stages are done with their backward
        first (h2jax.plan._pipelines prices the sum beside the drain of the stages below)."""
        for (owner, m), sps in sorted(self._groups(by_owner=False).items(), key=lambda kv: (kv[0][1], -kv[0][0])):
            shares = self._leaves(m, "acc", sps) if m in self.local else None
            got = self._move(m, [owner], shares, sps, lambda q: self._leaves(q, "acc", sps))
            if m in self.local:
                idx = [self._param_index(sp, m) for sp in sps]
                self.local[m].acc = _replace(
                    self.local[m].acc, dict(zip(idx, self._program("times_zero", shares)(shares)))
                )
            if owner in self.local:
                st = self.local[owner]
                idx = [self._param_index(sp, owner) for sp in sps]
                mine = self._leaves(owner, "acc", sps)
                st.acc = _replace(st.acc, dict(zip(idx, self._program("add", mine)(mine, got[owner]))))
        self.world.settle()

    def sync(self) -> None:
        """Every mirror takes its owner's value of each tied parameter (call after every update;
        the mirror's optimizer moments of it are never read: module docstring)."""
        for (owner, mirrors), sps in self._groups(by_owner=True).items():
            if owner not in self.local and not any(m in self.local for m in mirrors):
                continue
            values = self._leaves(owner, "params", sps) if owner in self.local else None
            got = self._move(owner, mirrors, values, sps, lambda q: self._leaves(q, "params", sps))
            for m, arrays in got.items():
                st = self.local[m]
                st.params = _replace(st.params, dict(zip([self._param_index(sp, m) for sp in sps], arrays)))
        self.world.settle()

    def copies(self) -> dict[str, dict[int, Any]]:
        """Each tied parameter's copies on this process's stages: {model path: {stage: array}}
        (for tests and tools: they are equal after every update)."""
        out: dict[str, dict[int, Any]] = {}
        for sp in self.shared:
            for s in sp.stages:
                if s in self.local:
                    out.setdefault(sp.name, {})[s] = jax.tree.leaves(self.local[s].params)[self._param_index(sp, s)]
        return out
