"""Checkpoints: orbax save/restore in a layout independent of the plan (by model layer).

:class:`CheckpointStore` saves flat dicts keyed by model path (``params/blocks/5/attn/wq``,
``opt_state/0/mu/blocks/5/attn/wq``) with orbax's CheckpointManager, commits a step only
when every part (writer) has finalised it, applies retention and restores any subset onto
explicit target shardings. The runtime's ``Trainer`` maps its stages to and from that
layout (``h2jax.runtime._layout``).
"""

from h2jax.checkpoint._faults import failpoint
from h2jax.checkpoint._store import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointSaveError,
    CheckpointStore,
    check_start,
    leftover_steps,
    listed_steps,
    model_difference,
    nest,
    on_disk,
    retained,
    unnest,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointSaveError",
    "CheckpointStore",
    "check_start",
    "model_difference",
    "failpoint",
    "leftover_steps",
    "listed_steps",
    "on_disk",
    "nest",
    "retained",
    "unnest",
]
