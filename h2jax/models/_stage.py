"""Cutting a stageable model into pipeline stages, and reading its tensor-parallel layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

TENSOR_AXIS = "tensor"  # the stage mesh axis tensor parallelism splits (models._llama.TENSOR)


def check_stageable(model: object) -> None:
    """Raise TypeError unless `model` has the stageable form h2jax trains.

    The form: an `nnx.Module` with `.embed` (callable, tokens -> h), `.blocks` (a sequence
    of callables, h -> h) and `.head` (callable, (h, targets) -> scalar loss).
    """
    name = type(model).__name__
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{name} is not a flax.nnx.Module; h2jax trains NNX modules in the stageable form")
    missing = [attr for attr in ("embed", "blocks", "head") if not hasattr(model, attr)]
    if missing:
        raise TypeError(
            f"{name} is not stageable: it lacks {', '.join(missing)}. A stageable model has "
            ".embed(tokens) -> h, .blocks (a sequence of block(h) -> h) and "
            ".head(h, targets) -> scalar loss"
        )
    for attr in ("embed", "head"):
        if not callable(getattr(model, attr)):
            kind = type(getattr(model, attr)).__name__
            raise TypeError(f"{name}.{attr} is not callable ({kind})")
    blocks = model.blocks
    if not isinstance(blocks, Sequence | nnx.List) or isinstance(blocks, str):
        raise TypeError(f"{name}.blocks must be a sequence of blocks (e.g. nnx.List), got {type(blocks).__name__}")
    if len(blocks) == 0:
        raise TypeError(f"{name}.blocks is empty; a stage needs at least one block to hold")
    for i, block in enumerate(blocks):
        if not callable(block):
            raise TypeError(f"{name}.blocks[{i}] is not callable ({type(block).__name__})")


def check_calls(model: nnx.Module, seq_len: int) -> None:
    """Raise TypeError, naming the part, where the model cannot run as h2jax runs it, before any
    step: an ``nnx.Dropout`` without rngs (a stream kept in the model is refused elsewhere;
    h2jax.models.Dropout draws its masks from (seed, step, microbatch, layer)), and a head that
    does not return one scalar loss (a per-token loss would fail only in step 0's backward,
    with JAX's message). The shapes come from ``jax.eval_shape`` of embed, the first block and
    the head on one sequence of ``seq_len`` tokens: nothing is computed."""
    from h2jax.models._dropout import Dropout

    name = type(model).__name__
    for path, m in nnx.iter_modules(model):
        if (
            isinstance(m, nnx.Dropout)
            and not isinstance(m, Dropout)
            and m.rngs is None
            and m.rate > 0
            and not m.deterministic
        ):
            where = ".".join(map(str, path))
            raise TypeError(
                f"{name}.{where} is an nnx.Dropout without rngs, which cannot draw a mask; use "
                f"h2jax.models.Dropout(rate, seed=..., layer=..., site=...), whose masks the pipeline "
                f"draws as the sequential model does"
            )
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        m = nnx.merge(graphdef, state)
        return m.head(m.blocks[0](m.embed(tokens)), tokens)

    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    out = jax.eval_shape(loss, state, tokens)
    if not hasattr(out, "shape") or out.shape != ():
        got = f"shape {tuple(out.shape)}" if hasattr(out, "shape") else type(out).__name__
        raise TypeError(
            f"{name}.head(h, targets) returned {got}; expected one scalar loss, the mean over the "
            f"tokens (e.g. optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean())"
        )


class StageModule(nnx.Module):
    """The part of a stageable model that one pipeline stage runs.

    Holds the model's own submodules, not copies: `embed` if `first`, the blocks in
    `layers = (start, stop)` (half-open, indices into `model.blocks`) as an nnx.List, and
    `head` if `last`. Absent parts are None. Splitting one model into stages whose layer
    ranges tile [0, n_layers) therefore partitions its parameters: each one lives in
    exactly one stage -- except a parameter two parts share (a head tied to the embedding),
    which every stage holding one of those parts holds (`shared_parameters`; the runtime
    trains the copies as one, h2jax.runtime._tied).
    """

    def __init__(self, model: nnx.Module, *, layers: tuple[int, int], first: bool, last: bool):
        check_stageable(model)
        start, stop = layers
        n_layers = len(model.blocks)
        if not 0 <= start <= stop <= n_layers:
            raise ValueError(f"layers={layers} is not a range within [0, {n_layers}] blocks")
        if start == stop and not (first or last):
            raise ValueError(f"layers={layers} is empty and the stage holds neither embed nor head")
        self.first, self.last, self.layers = first, last, (start, stop)
        self.embed = model.embed if first else None
        self.blocks = nnx.List([model.blocks[i] for i in range(start, stop)])
        self.head = model.head if last else None

    def __call__(self, x: jax.Array, targets: jax.Array | None = None) -> jax.Array:
        """tokens (first) or h -> h, or the scalar loss (last; needs `targets`)."""
        h = self.embed(x) if self.first else x
        for block in self.blocks:
            h = block(h)
        if not self.last:
            return h
        if targets is None:
            raise ValueError("the last stage computes the loss and needs targets")
        return self.head(h, targets)


def partition_specs(module: nnx.Module, *, tensor: int | None = None) -> nnx.State:
    """PartitionSpecs of every nnx.Param of `module`, read from its NNX sharding metadata.

    The result matches `nnx.split(module, nnx.Param)[1]` leaf for leaf (same State tree,
    each leaf a `jax.sharding.PartitionSpec`), so
    `jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(m))` is a sharding
    tree for `jax.device_put(state, ...)`. A Param without metadata gets P() (replicated).

    `tensor`: the stage's tensor degree. A Param whose metadata holds ``tensor_units`` (the
    key/value heads of grouped-query attention) is replicated instead of split over the
    "tensor" axis when `tensor` does not divide that count; None keeps every split.
    """
    _, params = nnx.split(module, nnx.Param)
    specs = nnx.get_partition_spec(params)
    if tensor is None or tensor == 1:
        return specs

    def resolve(var: Any, spec: Any) -> Any:
        units = var.get_metadata().get("tensor_units") if isinstance(var, nnx.Variable) else None
        if units is None or units % tensor == 0:
            return spec
        inner = spec.get_value() if isinstance(spec, nnx.Variable) else spec
        dropped = P(*(None if axis == TENSOR_AXIS else axis for axis in inner))
        return spec.replace(dropped) if isinstance(spec, nnx.Variable) else dropped

    return jax.tree.map(resolve, params, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclass(frozen=True)
class SharedParam:
    """A parameter that several stages of a plan hold (e.g. an embedding table the head reuses).

    ``name``: its path in the whole model (the key ``nnx.split(model, nnx.Param)`` gives it,
    which checkpoints and the sequential reference use); ``paths``: (stage, its path in that
    stage's StageModule) for every holding stage, ascending -- the first holder owns it."""

    name: str
    paths: tuple[tuple[int, str], ...]
    shape: tuple[int, ...]
    dtype: Any

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.paths)

    @property
    def owner(self) -> int:
        return self.paths[0][0]


def shared_parameters(model: nnx.Module, plan: Any) -> list[SharedParam]:
    """The parameters that two or more stages of ``plan`` would both hold, in model-path order."""
    name_of = {
        id(node): "/".join(map(str, path)) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)
    }
    held: dict[int, list[tuple[int, str]]] = {}
    nodes: dict[int, nnx.Param] = {}
    n = plan.num_stages
    # several pipelines: each pipeline's first and last positions hold the embedding and the head
    firsts = getattr(plan, "firsts", None) or [s == 0 for s in range(n)]
    lasts = getattr(plan, "lasts", None) or [s == n - 1 for s in range(n)]
    for s, spec in enumerate(plan.stages):
        module = StageModule(model, layers=spec.layers, first=firsts[s], last=lasts[s])
        for path, node in nnx.iter_graph(module):  # each node once, at the path nnx.split gives it
            if isinstance(node, nnx.Param):
                held.setdefault(id(node), []).append((s, "/".join(map(str, path))))
                nodes[id(node)] = node
    out = [
        SharedParam(name_of[i], tuple(paths), tuple(nodes[i].shape), nodes[i].dtype)
        for i, paths in held.items()
        if len(paths) > 1
    ]
    return sorted(out, key=lambda sp: sp.name)


def boundary_shapes(model: nnx.Module, plan: Any, token_shape: tuple[int, int]) -> list[jax.ShapeDtypeStruct]:
    """The tensor between stage b and b+1 for each boundary b, from the model itself
    (``jax.eval_shape`` of the stages in turn; no arrays are made)."""
    n = plan.num_stages
    x = jax.ShapeDtypeStruct(token_shape, jnp.int32)
    out = []
    for s, spec in enumerate(plan.stages[:-1]):
        graphdef, params = nnx.split(StageModule(model, layers=spec.layers, first=s == 0, last=False), nnx.Param)
        x = jax.eval_shape(lambda p, x_, g=graphdef: nnx.merge(g, p)(x_), params, x)
        out.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert len(out) == n - 1
    return out
