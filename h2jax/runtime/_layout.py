"""Plan-independent naming of parameters and optimizer state: by model layer, not by stage.

A stage's parameter tree holds ``embed`` (stage 0), ``blocks/<local index>/...`` and
``head`` (last stage). ``model_layout`` renames ``blocks/<local>`` to
``blocks/<global layer>``, so trees from any plan compare (tests) and restore (checkpoints)
against the whole model's tree; ``stage_trees`` is its inverse for a given plan.

Optimizer state gets the same treatment. Its leaves are of two kinds: those shaped like a
parameter (AdamW's ``mu``/``nu``: the path ends in a parameter's path, e.g.
``0/mu/blocks/1/attn/wq``) are renamed like that parameter; the others (step counts) are
the same on every stage and are stored once, under their own path (``0/count``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from h2jax.plan import Plan, StageSpec


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
