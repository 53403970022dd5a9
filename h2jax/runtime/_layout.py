"""The checkpoint layout: the names, model paths and shardings of the saved state, by model
layer, not by stage, so a checkpoint of any plan restores under any other.

A stage's parameter tree holds ``embed`` (stage 0), ``blocks/<local index>/...`` and
``head`` (last stage). ``model_layout`` renames ``blocks/<local>`` to
``blocks/<global layer>``, so trees from any plan compare (tests) and restore (checkpoints)
against the whole model's tree; ``stage_trees`` is its inverse for a given plan.

Optimizer state gets the same treatment. Its leaves are of two kinds: those shaped like a
parameter (AdamW's ``mu``/``nu``: the path ends in a parameter's path, e.g.
``0/mu/blocks/1/attn/wq``) are renamed like that parameter; the others (step counts) are
the same on every stage and are stored once, under their own path (``0/count``).

A parameter several stages hold (a tied embedding table) is one entry, under its path in
the whole model, with its owner's optimizer state (h2jax.runtime._tied): the same entry a
plan whose one stage holds every use writes. The stage-program helpers
(:func:`stage_state_by_layer`, :func:`restore_targets`, :func:`load_state_by_layer`) take
the programs this process runs and the plan of their one-chunk specs, so every world writes
and reads the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from h2jax.plan import Plan, StageSpec

if TYPE_CHECKING:
    from h2jax.runtime._stage import StageProgram


def _key_str(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path_key(path: Sequence[Any]) -> str:
    parts = [_key_str(k) for k in path]
    if parts and parts[-1] == "value":  # nnx Variable leaves
        parts = parts[:-1]
    return "/".join(parts)


def flatten(tree: Any) -> dict[str, Any]:
    """``{"blocks/0/attn/wq": leaf, ...}`` for a pytree of arrays (nnx.State or dicts)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_path_key(path): leaf for path, leaf in flat}


def to_model_key(key: str, spec: StageSpec) -> str:
    """Stage-local parameter path -> model path (``blocks/<local>`` -> ``blocks/<global>``)."""
    parts = key.split("/")
    if parts[0] == "blocks":
        parts[1] = str(int(parts[1]) + spec.layers[0])
    return "/".join(parts)


def model_layout(stage_trees: Sequence[Any], plan: Plan) -> dict[str, Any]:
    """Merge per-stage trees into one flat dict keyed by model path (global layer numbers)."""
    out: dict[str, Any] = {}
    for tree, spec in zip(stage_trees, plan.stages):
        for key, leaf in flatten(tree).items():
            name = to_model_key(key, spec)
            if name in out:
                raise ValueError(f"parameter {name} appears in two stages")
            out[name] = leaf
    return out


def _unflatten_like(template: Any, names: Sequence[str], flat: Mapping[str, Any], what: str) -> Any:
    missing = [n for n in names if n not in flat]
    if missing:
        raise KeyError(f"{what}: {len(missing)} entries missing from the model layout, e.g. {missing[:3]}")
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])


def stage_trees(flat: Mapping[str, Any], templates: Sequence[Any], plan: Plan) -> list[Any]:
    """The inverse of :func:`model_layout`: per-stage trees shaped like ``templates`` (one per
    stage of ``plan``, e.g. the stages' current parameters), leaves taken from ``flat`` by
    model path."""
    out = []
    for s, (template, spec) in enumerate(zip(templates, plan.stages)):
        names = [to_model_key(k, spec) for k in flatten(template)]
        out.append(_unflatten_like(template, names, flat, f"stage {s}"))
    return out


def opt_state_names(opt_state: Any, params: Any, spec: StageSpec) -> list[tuple[str, str | None]]:
    """(model-layout name, model path of its parameter or None if stage-wide) of every
    optimizer-state leaf of one stage, in leaf order."""
    param_keys = set(flatten(params))
    out = []
    for key in flatten(opt_state):
        parts = key.split("/")
        for i in range(len(parts)):  # the longest suffix that is a parameter path
            suffix = "/".join(parts[i:])
            if suffix in param_keys:
                prefix = "/".join(parts[:i])
                param = to_model_key(suffix, spec)
                out.append((f"{prefix}/{param}" if prefix else param, param))
                break
        else:
            out.append((key, None))
    return out


def opt_state_layout(opt_states: Sequence[Any], params: Sequence[Any], plan: Plan) -> dict[str, Any]:
    """Optimizer state of every stage as one flat dict keyed by model path.

    Per-parameter leaves (``0/mu/blocks/5/attn/wq``) appear once, from the stage that owns
    the parameter; stage-wide leaves (``0/count``) are taken from stage 0: every stage
    updates on every step (or on none), so they agree."""
    out: dict[str, Any] = {}
    for opt_state, p, spec in zip(opt_states, params, plan.stages):
        for (name, param), leaf in zip(opt_state_names(opt_state, p, spec), flatten(opt_state).values()):
            if name in out:
                if param is not None:
                    raise ValueError(f"optimizer state {name} appears in two stages")
                continue
            out[name] = leaf
    return out


def opt_state_trees(
    flat: Mapping[str, Any], opt_templates: Sequence[Any], param_templates: Sequence[Any], plan: Plan
) -> list[Any]:
    """The inverse of :func:`opt_state_layout` for ``plan`` (stage-wide leaves go to every stage)."""
    out = []
    for s, (opt_t, p_t, spec) in enumerate(zip(opt_templates, param_templates, plan.stages)):
        names = [name for name, _ in opt_state_names(opt_t, p_t, spec)]
        out.append(_unflatten_like(opt_t, names, flat, f"optimizer state of stage {s}"))
    return out


# -- the state of stage programs ----------------------------------------------------------------
def _no_ties(stage: int, key: str) -> tuple[str, bool]:
    return key, True


def _naming(ties: Any) -> Any:
    """(stage, model key) -> (model path, owned): a tied parameter's copies are all named by
    its path in the whole model, and one of them (its owner's) counts (h2jax.runtime._tied)."""
    return ties.name if ties else _no_ties


def param_names(stage: StageProgram, spec: Any, ties: Any = None) -> list[tuple[str, bool]]:
    """(model path, owned) of every parameter leaf of ``stage``, in leaf order."""
    name = _naming(ties)
    return [name(stage.position, to_model_key(key, spec)) for key in flatten(stage.params)]


def opt_names(stage: StageProgram, spec: Any, ties: Any = None) -> list[tuple[str, bool, bool]]:
    """(model-layout name, per-parameter, owned) of every optimizer-state leaf of ``stage``, in
    leaf order; stage-wide leaves (step counts) are not per-parameter."""
    name = _naming(ties)
    out = []
    for leaf_name, param in opt_state_names(stage.opt_state, stage.params, spec):
        if param is None:
            out.append((leaf_name, False, True))
            continue
        path, owned = name(stage.position, param)
        out.append((leaf_name[: len(leaf_name) - len(param)] + path, True, owned))
    return out


def by_model_path(stages: list[StageProgram], plan: Any, trees: list[Any], ties: Any = None) -> dict[str, Any]:
    """Per-stage trees shaped like the stages' parameters (the parameters, their gradients)
    as one dict keyed by model path; a tied parameter once, from its owner."""
    out: dict[str, Any] = {}
    for st, spec, tree in zip(stages, plan.stages, trees):
        for (name, owned), leaf in zip(param_names(st, spec, ties), jax.tree.leaves(tree)):
            if not owned:
                continue
            if name in out:
                raise ValueError(f"parameter {name} appears in two stages")
            out[name] = leaf
    return out


def stage_state_by_layer(
    stages: list[StageProgram], plan: Any, *, stage_wide: bool = True, ties: Any = None
) -> dict[str, jax.Array]:
    """Parameters and optimizer state of ``stages`` (the stages of ``plan``, in order), keyed by
    model path (plan-independent); a tied parameter and its optimizer state once, from its
    owner. ``stage_wide=False`` leaves out the optimizer leaves every stage holds alike (step
    counts): in a multi-process run stage 0 alone saves them."""
    out = {f"params/{k}": v for k, v in by_model_path(stages, plan, [st.params for st in stages], ties).items()}
    for st, spec in zip(stages, plan.stages):
        for (name, per_param, owned), leaf in zip(opt_names(st, spec, ties), jax.tree.leaves(st.opt_state)):
            key = f"opt_state/{name}"
            if per_param and owned:
                if key in out:
                    raise ValueError(f"optimizer state {name} appears in two stages")
                out[key] = leaf
            elif not per_param and stage_wide:
                out.setdefault(key, leaf)  # every stage updates on every step (or on none): they agree
    return out


def opt_state_shardings(stage: StageProgram, spec: Any) -> Any:
    """Where a stage's optimizer state belongs: per-parameter leaves (mu, nu) with their
    parameter's sharding, stage-wide leaves (counts) replicated over the stage mesh."""
    by_param = model_layout([stage.param_shardings], SimpleNamespace(stages=(spec,)))
    leaves = [
        by_param[p] if p is not None else stage.scalar_sharding
        for _, p in opt_state_names(stage.opt_state, stage.params, spec)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stage.opt_state), leaves)


def restore_targets(
    stages: list[StageProgram], plan: Any, *, params_only: bool, ties: Any = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """What a restore onto ``stages`` reads: every array with its shape, dtype and target
    sharding. An array several of ``stages`` hold (stage-wide optimizer leaves, a tied
    parameter's copies) is read once, onto the first of them; load_state_by_layer places it
    on the others."""
    out: dict[str, jax.ShapeDtypeStruct] = {}
    for st, spec in zip(stages, plan.stages):
        for (name, _), leaf, sh in zip(
            param_names(st, spec, ties), jax.tree.leaves(st.params), jax.tree.leaves(st.param_shardings)
        ):
            out.setdefault(f"params/{name}", jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh))
        if params_only:
            continue
        shardings = jax.tree.leaves(opt_state_shardings(st, spec))
        for (name, _, _), leaf, sh in zip(opt_names(st, spec, ties), jax.tree.leaves(st.opt_state), shardings):
            out.setdefault(f"opt_state/{name}", jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh))
    return out


def load_state_by_layer(
    stages: list[StageProgram], plan: Any, flat: dict[str, jax.Array], *, params_only: bool = False, ties: Any = None
) -> None:
    """Place a model-layout state (``stage_state_by_layer``'s keys) onto ``stages`` (every
    copy of a tied parameter gets the same values); the accumulated gradients start from zero."""
    params = {k[len("params/") :]: v for k, v in flat.items() if k.startswith("params/")}
    opt = {k[len("opt_state/") :]: v for k, v in flat.items() if k.startswith("opt_state/")}
    new_params, new_opt = [], []  # every stage's trees first: a missing entry changes no stage
    for s, (st, spec) in enumerate(zip(stages, plan.stages)):
        names = [n for n, _ in param_names(st, spec, ties)]
        new_params.append(_unflatten_like(st.params, names, params, f"stage {s}"))
        if not params_only:
            names = [n for n, _, _ in opt_names(st, spec, ties)]
            new_opt.append(_unflatten_like(st.opt_state, names, opt, f"optimizer state of stage {s}"))
    for s, (st, spec) in enumerate(zip(stages, plan.stages)):
        st.params = jax.device_put(new_params[s], st.param_shardings)
        if not params_only:
            st.opt_state = jax.device_put(new_opt[s], opt_state_shardings(st, spec))
        st.acc = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=st.param_shardings)(st.acc)
