"""Plan-independent naming of parameters: by model layer, not by stage.

A stage's parameter tree holds ``embed`` (stage 0), ``blocks/<local index>/...`` and
``head`` (last stage). ``model_layout`` renames ``blocks/<local>`` to
``blocks/<global layer>``, so trees from any plan compare (tests) and restore (checkpoints)
against the whole model's tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from h2jax.plan import Plan


def _key_str(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten(tree: Any) -> dict[str, Any]:
    """``{"blocks/0/attn/wq": leaf, ...}`` for a pytree of arrays (nnx.State or dicts)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in flat:
        parts = [_key_str(k) for k in path]
        if parts and parts[-1] == "value":  # nnx Variable leaves
            parts = parts[:-1]
        out["/".join(parts)] = leaf
    return out


def model_layout(stage_trees: Sequence[Any], plan: Plan) -> dict[str, Any]:
    """Merge per-stage trees into one flat dict keyed by model path (global layer numbers)."""
    out: dict[str, Any] = {}
    for tree, spec in zip(stage_trees, plan.stages):
        for key, leaf in flatten(tree).items():
            parts = key.split("/")
            if parts[0] == "blocks":
                parts[1] = str(int(parts[1]) + spec.layers[0])
            name = "/".join(parts)
            if name in out:
                raise ValueError(f"parameter {name} appears in two stages")
            out[name] = leaf
    return out
