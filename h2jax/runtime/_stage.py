"""One pipeline stage on its own mesh: parameters, optimizer state and its jitted programs.

For each stage, once, on that stage's mesh (devices of one backend):

- ``forward_fn(params, x, targets) -> (y, saved)``: ``saved`` is the ``jax.vjp`` closure, a
  pytree that leaves the jit and is handed to the backward; with recompute it is the
  input alone and the backward recomputes.
- ``backward_fn(params, saved, targets, dy, acc) -> (acc + dparams, dx)``: gradients
  accumulate in fp32 in a donated buffer, so accumulation costs no extra dispatch.
- ``update(params, opt_state, acc, scale) -> (params, opt_state, zeros)``: the global
  clip factor ``scale`` comes from every stage's squared norm.

Schedules that split the backward (zb-h1) use three other programs instead of forward and
backward (``h2jax.runtime._split`` explains the split and why it is exact):

- ``split_forward_fn(params, x, targets) -> (y, saved)``: ``saved`` is the vjp closure with
  respect to the input and the mixing-output probes only, plus the activations W needs;
  with recompute, the input alone.
- ``input_grad_fn(params, saved, targets, dy) -> (dx, kept)`` (B): the input gradient, and
  for W the cotangent of every mixing output and the activations beside it.
- ``weight_grad_fn(params, kept, acc) -> (acc + dparams, done)`` (W): the weight gradient,
  one transpose per mixing equation, no chain through the activations.

The forward and backward programs wrap those two functions; an in-program channel
(``ffi``) adds its receive and send inside them.

Layer chunks (interleaved, zb-v): a stage runs one StageProgram per chunk, each over its
chunk's layers on the stage's mesh (``position``: the chunk's place in the model, which
decides ``first`` and ``last``); each has its own gradient accumulator, optimizer state and
update. A neighbour chunk on the same stage (``local_in`` / ``local_out``) hands its
tensor over as a plain argument: no in-program transfer is traced on that side.

Dropout: every function above takes a last argument ``rng``, uint32 [step, microbatch] (or
None on a stage without dropout: its programs are exactly the dropout-free ones). The
stage function runs inside ``h2jax.models._dropout.dropout_step(rng)``, where each dropout
layer folds its layer and site into a key of (seed, step, microbatch); so the masks are
those of the sequential model at that step, a recompute redraws the forward's masks, B and
W see one mask (W needs none: masks only touch activations, which W takes from B), and a
resumed run draws the uninterrupted run's masks. State other than Params is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax._jaxpr import apply_policy
from h2jax.models import Dropout, StageModule, document_segments, dropout_step, partition_specs
from h2jax.plan import StageSpec
from h2jax.runtime._split import SplitJaxpr, analyse


def check_params_only(rest: Any, where: str) -> None:
    """Refuse, in one line naming it, model state that is not an nnx.Param (batch statistics,
    caches, stored RNG streams): h2jax trains and checkpoints Params only, and dropout keys
    come from (seed, step, microbatch, layer), never from a stream kept in the model."""
    flat = nnx.to_flat_state(rest)
    if not len(flat):
        return
    path, var = next(iter(flat))
    name = "/".join(map(str, path))
    hint = (
        " (an nnx.Dropout given rngs keeps its stream there; use h2jax.models.Dropout)"
        if isinstance(var, nnx.RngState)
        else ""
    )
    raise TypeError(
        f"{where}: the model holds non-Param state {name} ({type(var).__name__}"
        f"{f' and {len(flat) - 1} more' if len(flat) > 1 else ''}); h2jax trains Params only{hint}"
    )


def _f32_zeros(tree: Any) -> Any:
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)


def _like_params(opt_state: Any, param_shardings: Any, replicated: NamedSharding) -> Any:
    """Shardings for an optax state: subtrees with the parameters' structure get theirs."""
    structure = jax.tree.structure(param_shardings)
    return jax.tree.map(
        lambda node: param_shardings if jax.tree.structure(node) == structure else replicated,
        opt_state,
        is_leaf=lambda node: jax.tree.structure(node) == structure,
    )


def _tree_bytes_per_device(tree: Any) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        n = 1
        for d in shard:
            n *= d
        total += n * leaf.dtype.itemsize
    return total


Maybe = jax.Array | None  # an array a stage may not have (targets off the last stage, no segments)


@dataclass
class StageMemory:
    """Estimated bytes per device of one stage (what the memory check compares)."""

    params: int
    grads: int
    opt_state: int
    activations: int  # kept for the in-flight microbatches
    workspace: int  # the largest temporary buffer of fwd/bwd

    @property
    def total(self) -> int:
        return self.params + self.grads + self.opt_state + self.activations + self.workspace


class StageProgram:
    """Parameters and compiled programs of one stage (see module docstring).

    The stage's maths is defined once, as traceable functions: :meth:`forward_fn` and
    :meth:`backward_fn` (recompute is decided inside them). :meth:`build` jits them, and
    with a channel whose transfers live inside the programs (``channel.in_program``) it
    traces the receive before and the send after them, so every mode runs these functions.
    """

    def __init__(
        self,
        stage_idx: int,
        spec: StageSpec,
        mesh: Mesh,
        module: StageModule,
        tx: optax.GradientTransformation,
        *,
        first: bool,
        last: bool,
        label: str,
        numerics: Any = None,
        position: int | None = None,
        chunk: int = 0,
        local_in: bool = False,
        local_out: bool = False,
    ):
        self.stage_idx = stage_idx
        self.position = stage_idx if position is None else position  # the chunk's place in the model
        self.chunk = chunk
        # the input comes from / the output goes to a chunk of this same stage: handed over, no transfer
        self.local_in, self.local_out = local_in, local_out
        self._lanes = 1  # tag lanes of the channel's boundaries (h2jax.comm._routing)
        # the chip type's numerics policy (h2jax.plan.NumericsPolicy): None or exact = as the host computes
        self.numerics = None if numerics is None or numerics.is_exact else numerics
        self.spec = spec
        self.mesh = mesh
        self.first, self.last = first, last
        self.label = label
        self.recompute = spec.recompute
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        check_params_only(rest, f"stage {stage_idx}")
        self._graphdef = graphdef
        # dropout layers draw masks from (seed, step, microbatch, layer): the programs take [step, microbatch]
        self.dropout = any(isinstance(m, Dropout) and m.rate > 0 for _, m in nnx.iter_graph(module))
        specs = partition_specs(module, tensor=spec.tensor)  # kv heads split only when the degree divides them
        self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        self.params = jax.device_put(params, self.param_shardings)
        self.act_sharding = NamedSharding(mesh, P("data"))
        self.scalar_sharding = NamedSharding(mesh, P())
        self._tx = tx
        # optimizer moments (subtrees shaped like the parameters) shard as the parameters;
        # scalars (step counts) are replicated. Pinned, with the parameters' shardings, as the
        # outputs of every update: a changed sharding would make the next step recompile.
        self.opt_state_shardings = _like_params(
            jax.eval_shape(tx.init, params), self.param_shardings, NamedSharding(mesh, P())
        )
        self.opt_state = jax.jit(tx.init, out_shardings=self.opt_state_shardings)(self.params)
        self.acc = jax.jit(_f32_zeros, out_shardings=self.param_shardings)(self.params)
        self._split: SplitJaxpr | None = None  # the analysed stage function (set when a split program traces)
        self._build_optimizer_programs()
        self.build(None)

    # -- the stage's maths, defined once --------------------------------------------------------
    def _apply(self, params: Any, x: jax.Array, targets: jax.Array | None, rng: jax.Array | None = None) -> jax.Array:
        def run(p: Any, x_: jax.Array, t: jax.Array | None, r: jax.Array | None) -> jax.Array:
            module = nnx.merge(self._graphdef, p)
            counter, segments = r if isinstance(r, tuple) else (r, None)  # see rng()
            with dropout_step(counter), document_segments(segments):
                return module(x_, t) if self.last else module(x_)

        if self.numerics is not None:  # every op re-emitted as this chip type computes it
            run = apply_policy(run, self.numerics)
        y = run(params, x, targets, rng)
        if self.last:
            return y
        return jax.lax.with_sharding_constraint(y, self.act_sharding)

    def _vjp(self, params: Any, x: jax.Array, targets: jax.Array | None, rng: jax.Array | None):
        if self.first:  # integer tokens: differentiate the parameters only
            return jax.vjp(lambda p: self._apply(p, x, targets, rng), params)
        return jax.vjp(lambda p, x_: self._apply(p, x_, targets, rng), params, x)

    def forward_fn(
        self, params: Any, x: jax.Array, targets: jax.Array | None, rng: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """(output or loss, what the backward needs): the vjp residuals, or with recompute
        the input alone."""
        if self.recompute:
            return self._apply(params, x, targets, rng), x
        return self._vjp(params, x, targets, rng)

    def backward_fn(
        self,
        params: Any,
        saved: Any,
        targets: jax.Array | None,
        dy: jax.Array,
        acc: Any,
        rng: jax.Array | None = None,
    ) -> tuple[Any, jax.Array]:
        """(acc + this microbatch's fp32 parameter gradient, input gradient); on the first
        stage the input gradient is a scalar that becomes ready with the backward. ``rng``
        is the forward's: a recompute draws its masks again."""
        vjp = self._vjp(params, saved, targets, rng)[1] if self.recompute else saved
        grads = vjp(dy)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads[0])
        acc = jax.lax.with_sharding_constraint(acc, self.param_shardings)
        if self.first:
            return acc, jnp.zeros((), jnp.float32)
        return acc, jax.lax.with_sharding_constraint(grads[1], self.act_sharding)

    # -- the backward split into B and W (split schedules) ---------------------------------------
    def _probed_vjp(
        self, params: Any, x: jax.Array, targets: jax.Array | None, rng: jax.Array | None
    ) -> tuple[jax.Array, Any, list]:
        """(output, vjp w.r.t. the input and the mixing-output probes, activations W needs).
        ``rng`` is an input of the analysed function: the masks it draws are activations."""
        self._split = sp = analyse(self._apply, params, x, targets, rng)
        p_leaves = jax.tree.leaves(params)
        rest = jax.tree.leaves((targets, rng))
        probes = sp.probe_zeros()
        if self.first:  # integer tokens: no input gradient
            return jax.vjp(lambda pr: sp.forward(p_leaves, [x, *rest], pr), probes, has_aux=True)
        return jax.vjp(lambda x_, pr: sp.forward(p_leaves, [x_, *rest], pr), x, probes, has_aux=True)

    def split_forward_fn(
        self, params: Any, x: jax.Array, targets: jax.Array | None, rng: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """(output or loss, what B needs): the probed vjp and W's activations, or with
        recompute the input alone."""
        if self.recompute:
            self._split = analyse(self._apply, params, x, targets, rng)
            return self._apply(params, x, targets, rng), x
        y, vjp, kept = self._probed_vjp(params, x, targets, rng)
        return y, (vjp, kept)

    def input_grad_fn(
        self, params: Any, saved: Any, targets: jax.Array | None, dy: jax.Array, rng: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """B: (input gradient, what W needs: the activations and the mixing-output cotangents).
        The parameters are not differentiated here, so no weight-gradient work is traced."""
        if self.recompute:
            _, vjp, kept = self._probed_vjp(params, saved, targets, rng)
        else:
            vjp, kept = saved
        grads = vjp(dy)
        cotangents = grads[-1]
        if self.first:
            return jnp.zeros((), jnp.float32), (kept, cotangents)
        return jax.lax.with_sharding_constraint(grads[0], self.act_sharding), (kept, cotangents)

    def weight_grad_fn(self, params: Any, kept: Any, acc: Any) -> tuple[Any, jax.Array]:
        """W: (acc + this microbatch's fp32 parameter gradient, a scalar ready with it)."""
        if self._split is None:
            raise RuntimeError(f"stage {self.stage_idx}: W traced before any split forward analysed the stage")
        sp = self._split
        activations, cotangents = kept
        _, vjp = jax.vjp(lambda p: sp.mixing_outputs(jax.tree.leaves(p), activations), params)
        (grads,) = vjp(cotangents)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return jax.lax.with_sharding_constraint(acc, self.param_shardings), jnp.zeros((), jnp.float32)

    # -- programs ---------------------------------------------------------------------------------
    def build(self, channel: Any) -> None:
        """Jit the forward and backward programs; with an in-program channel, its receive and
        send are traced into them (the tag base of the microbatch is an argument)."""
        from h2jax.comm import BWD, FWD

        inside = channel is not None and channel.in_program
        self._in_program = inside
        self._lanes = channel.link.lanes if inside else 1
        recv_in = not self.first and not self.local_in  # a transfer arrives (else: the tokens, or a hand-over)
        send_out = not self.last and not self.local_out
        self._wgt = jax.jit(self.weight_grad_fn, donate_argnums=(2,))  # W never crosses a boundary
        if not inside:
            self._fwd = jax.jit(lambda p, x, t, base, r: self.forward_fn(p, x, t, r))
            self._bwd = jax.jit(
                lambda p, s, t, dy, acc, base, r: self.backward_fn(p, s, t, dy, acc, r), donate_argnums=(4,)
            )
            self._fwd_split = jax.jit(lambda p, x, t, base, r: self.split_forward_fn(p, x, t, r))
            self._bwd_in = jax.jit(lambda p, s, t, dy, base, r: self.input_grad_fn(p, s, t, dy, r))
            return

        def forward_program(forward_fn):
            def fwd(params, x, targets, base, rng):
                if recv_in:
                    x = channel.recv_in_program(FWD, base)
                y, saved = forward_fn(params, x, targets, rng)
                return (channel.send_in_program(FWD, y, base) if send_out else y), saved

            return fwd

        def bwd(params, saved, targets, dy, acc, base, rng):
            if send_out:  # the output's gradient comes back over the same boundary
                dy = channel.recv_in_program(BWD, base)
            acc, dx = self.backward_fn(params, saved, targets, dy, acc, rng)
            return acc, (channel.send_in_program(BWD, dx, base) if recv_in else dx)

        def bwd_in(params, saved, targets, dy, base, rng):
            if send_out:
                dy = channel.recv_in_program(BWD, base)
            dx, kept = self.input_grad_fn(params, saved, targets, dy, rng)
            return (channel.send_in_program(BWD, dx, base) if recv_in else dx), kept

        self._fwd = jax.jit(forward_program(self.forward_fn))
        self._bwd = jax.jit(bwd, donate_argnums=(4,))
        self._fwd_split = jax.jit(forward_program(self.split_forward_fn))
        self._bwd_in = jax.jit(bwd_in)

    def _build_optimizer_programs(self) -> None:
        def update(params, opt_state, acc, scale):
            grads = jax.tree.map(lambda g: g * scale, acc)
            updates, opt_state = self._tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, jax.tree.map(jnp.zeros_like, acc)

        self._update = jax.jit(
            update,
            donate_argnums=(0, 1, 2),
            out_shardings=(self.param_shardings, self.opt_state_shardings, self.param_shardings),
        )
        self._zeros = jax.jit(
            lambda acc: jax.tree.map(jnp.zeros_like, acc), donate_argnums=(0,), out_shardings=self.param_shardings
        )
        self._sqnorm = jax.jit(lambda acc: sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(acc)))

    # -- what the runner calls ------------------------------------------------------------------------
    def forward(
        self,
        microbatch: int,
        x: jax.Array | None,
        targets: jax.Array | None,
        *,
        split: bool = False,
        step: int = 0,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Dispatch the forward of one microbatch of ``step``; returns (output, loss or send
        token; what backward needs -- with ``split``, what B needs). ``x`` is None when the
        program receives it; ``segments``: the microbatch's document segment ids (packed
        data), on this stage's mesh."""
        from h2jax.comm import FWD

        program = self._fwd_split if split else self._fwd
        return program(self.params, x, targets, self._base(microbatch, FWD), self.rng(step, microbatch, segments))

    def input_backward(
        self, microbatch: int, saved: Any, targets: Maybe, dy: Maybe, *, step: int = 0, segments: Maybe = None
    ) -> tuple[jax.Array, Any]:
        """Dispatch B of one microbatch: returns (dx as :meth:`backward` does, what W needs)."""
        from h2jax.comm import BWD

        base, r = self._base(microbatch, BWD), self.rng(step, microbatch, segments)
        return self._bwd_in(self.params, saved, targets, dy, base, r)

    def weight_backward(self, microbatch: int, kept: Any) -> jax.Array:
        """Dispatch W of one microbatch; accumulates into ``self.acc``; returns a scalar that is
        ready when the work is."""
        self.acc, done = self._wgt(self.params, kept, self.acc)
        return done

    def backward(
        self, microbatch: int, saved: Any, targets: Maybe, dy: Maybe, *, step: int = 0, segments: Maybe = None
    ) -> jax.Array:
        """Dispatch the backward of one microbatch of ``step``; accumulates into ``self.acc``;
        returns dx (on the first stage a scalar, with in-program sends their token), ready
        with the work."""
        from h2jax.comm import BWD

        base, r = self._base(microbatch, BWD), self.rng(step, microbatch, segments)
        self.acc, dx = self._bwd(self.params, saved, targets, dy, self.acc, base, r)
        return dx

    def rng(self, step: int, microbatch: int, segments: jax.Array | None = None) -> Any:
        """What the programs take per microbatch: for dropout uint32 [step, microbatch] (None on
        a stage without dropout); with ``segments`` (packed documents) the pair (that, segments),
        so that a recompute and a split backward see the forward's masks and segments alike."""
        counter = np.array([step, microbatch], np.uint32) if self.dropout else None
        return counter if segments is None else (counter, segments)

    def _base(self, microbatch: int, direction: int) -> jax.Array | None:
        if not self._in_program:
            return None
        from h2jax.comm import tag_base

        return jnp.int32(tag_base(microbatch, direction, self._lanes))

    def zero_grads(self) -> None:
        """Drop the accumulated gradient (a skipped step) without an update."""
        self.acc = self._zeros(self.acc)

    def grad_sqnorm(self) -> jax.Array:
        return self._sqnorm(self.acc)

    def apply_update(self, scale: float) -> None:
        self.params, self.opt_state, self.acc = self._update(self.params, self.opt_state, self.acc, jnp.float32(scale))

    # -- inspection ---------------------------------------------------------------------------
    def grads(self) -> Any:
        """The accumulated gradient (fp32) as a pure pytree (for tests and tools)."""
        return self.acc

    def memory(
        self, example_x: jax.Array, example_t: jax.Array | None, *, in_flight: int, example_segments: Any = None
    ) -> StageMemory:
        """Per-device memory estimate from array shardings and XLA's compiled memory analysis."""
        params = _tree_bytes_per_device(self.params)
        opt = _tree_bytes_per_device(self.opt_state)
        lowered = jax.jit(self.forward_fn).lower(self.params, example_x, example_t, self.rng(0, 0, example_segments))
        fwd_mem = lowered.compile().memory_analysis()
        if self.recompute:
            kept = example_x.sharding.shard_shape(example_x.shape)
            n = 1
            for d in kept:
                n *= d
            per_mb = n * example_x.dtype.itemsize
        else:
            per_mb = int(getattr(fwd_mem, "output_size_in_bytes", 0)) if fwd_mem else 0
        temp = int(getattr(fwd_mem, "temp_size_in_bytes", 0)) if fwd_mem else 0
        return StageMemory(
            params=params,
            grads=params * 4 // max(1, self._param_itemsize()),
            opt_state=opt,
            activations=per_mb * in_flight,
            workspace=temp,
        )

    def _param_itemsize(self) -> int:
        leaves = jax.tree.leaves(self.params)
        return leaves[0].dtype.itemsize if leaves else 4
