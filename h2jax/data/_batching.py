"""Deterministic, resumable batching: a step's batch is a pure function of (seed, step).

No iterator state exists, so resuming at step ``s`` needs only ``s``. Row ``g`` of step
``s``'s global batch is the window starting at the ``g``-th draw of
``np.random.default_rng([seed, step])`` (numpy's draws are prefix-stable: the first ``g``
of more draws are the same), and microbatch ``i`` of size ``b`` is rows ``i*b .. (i+1)*b``.
So a step's global batch is the same sequences whatever the plan splits it into (the
microbatch count and size, the data degree, the number of pipelines or processes: an
elastic re-plan trains the same data), and a larger global batch extends it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from h2jax._strict import ConfigError
from h2jax.data._dataset import TokenDataset


def _starts(dataset: TokenDataset, *, seed: int, step: int, rows: int, seq_len: int) -> np.ndarray:
    """The window starts of the first ``rows`` rows of step ``step``'s batch (module docstring)."""
    if rows < 1 or seq_len < 1:
        raise ValueError(f"microbatch_size and seq_len must be >= 1, got {rows} rows and {seq_len}")
    if min(seed, step) < 0:
        raise ValueError(f"seed and step must be >= 0, got {seed}, {step}")
    num_starts = len(dataset) - seq_len
    if num_starts < 1:
        raise ConfigError(
            "model.seq_len",
            f"the dataset has {len(dataset)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "expected a larger corpus (data.corpus, data.token_file) or a smaller model.seq_len",
        )
    return np.random.default_rng([seed, step]).integers(0, num_starts, size=rows)


def _windows(dataset: TokenDataset, starts: np.ndarray, seq_len: int) -> np.ndarray:
    # Gather only the needed windows: works on a memmap without reading the whole file.
    return np.stack([np.asarray(dataset.tokens[s : s + seq_len + 1]) for s in starts]).astype(np.int32)


def get_microbatch(
    dataset: TokenDataset,
    *,
    seed: int,
    step: int,
    microbatch_idx: int,
    microbatch_size: int,
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One microbatch: ``(tokens, targets)``, both int32 of shape [microbatch_size, seq_len].

    Rows ``microbatch_idx * microbatch_size ..`` of step ``step``'s batch: each a window of
    ``seq_len + 1`` consecutive tokens whose start is drawn uniformly from the
    ``len(dataset) - seq_len`` valid starts (module docstring); ``targets`` is ``tokens``
    shifted left by one (the next token at every position).
    """
    if microbatch_idx < 0:
        raise ValueError(f"microbatch_idx must be >= 0, got {microbatch_idx}")
    lo = microbatch_idx * microbatch_size
    starts = _starts(dataset, seed=seed, step=step, rows=lo + microbatch_size, seq_len=seq_len)[lo:]
    windows = _windows(dataset, starts, seq_len)
    return windows[:, :-1], windows[:, 1:]


def get_global_batch(
    dataset: TokenDataset,
    *,
    seed: int,
    step: int,
    num_microbatches: int,
    microbatch_size: int,
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """All microbatches of one step: ``(tokens, targets)``, int32 of shape
    [num_microbatches, microbatch_size, seq_len].

    Exactly ``get_microbatch(..., microbatch_idx=i)`` stacked for ``i`` in
    ``range(num_microbatches)``: the step's first num_microbatches x microbatch_size rows,
    whatever the split.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    rows = num_microbatches * microbatch_size
    windows = _windows(dataset, _starts(dataset, seed=seed, step=step, rows=rows, seq_len=seq_len), seq_len)
    windows = windows.reshape(num_microbatches, microbatch_size, seq_len + 1)
    return windows[..., :-1], windows[..., 1:]


def microbatch_split(plan: Any) -> tuple[int, int]:
    """(microbatches, sequences per microbatch) a step's batch is cut into: the plan's own, or
    for a plan of several pipelines (1, global batch) -- each pipeline cuts its rows of it into
    its own microbatches (h2jax.runtime._pipelines)."""
    if getattr(plan, "pipelines", None):
        return 1, plan.global_batch
    return plan.num_microbatches, plan.microbatch_size


def step_batch(dataset: Any, cfg: Any, step: int, *, position: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` of an experiment ``cfg`` (its seed, plan and sequence length):
    ``(tokens, targets)`` int32 [num_microbatches, microbatch_size, seq_len].

    From a :class:`~h2jax.data._sequences.SequenceStream` (``data.sources``) the batch is run
    sequences ``position ..`` (default ``step * global_batch``), microbatch ``i`` the
    ``i``-th run of ``microbatch_size`` of them; otherwise the windows :func:`get_global_batch`
    draws for (seed, step)."""
    p = cfg.plan
    from h2jax.data._sequences import SequenceStream

    m, mb = microbatch_split(p)
    if isinstance(dataset, SequenceStream):
        start = step * p.global_batch if position is None else position
        rows = dataset.next_batch(start, p.global_batch).tokens
        return split_rows(rows.reshape(m, mb, rows.shape[-1]))
    return get_global_batch(
        dataset,
        seed=cfg.seed,
        step=step,
        num_microbatches=m,
        microbatch_size=mb,
        seq_len=cfg.model.seq_len,
    )


def split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of rows of ``seq_len + 1`` ids [..., seq_len + 1]: targets are the next
    ids, with PAD (-1, no loss) where a row is padded; inputs see id 0 there instead."""
    from h2jax.data._sequences import PAD

    inputs = rows[..., :-1]
    if (inputs == PAD).any():
        inputs = np.where(inputs == PAD, 0, inputs).astype(rows.dtype)
    return inputs, rows[..., 1:]


def loss_weights(targets: np.ndarray) -> np.ndarray | None:
    """Each microbatch's share of the step's loss, for targets [microbatches, ...] with PAD
    (negative) ones: its real targets over the step's, float32 [microbatches]; then the step's
    loss (the sum of each microbatch's mean over its real targets times its share) is the mean
    over the step's real targets, whatever the microbatch split. None when no target is PAD:
    every microbatch weighs 1 / microbatches (the same number)."""
    real = (targets >= 0).reshape(len(targets), -1).sum(axis=1)
    if int(real.sum()) == targets.size:
        return None
    return (real / max(int(real.sum()), 1)).astype(np.float32)


def step_segments(dataset: Any, cfg: Any, step: int, *, position: int | None = None) -> np.ndarray | None:
    """The document segment ids of the inputs of :func:`step_batch`'s batch (int32
    [num_microbatches, microbatch_size, seq_len], from 1 in each row) for packed data
    (``data.sources``); None for the windows of a flat corpus, whose attention is causal."""
    from h2jax.data._sequences import SequenceStream

    if not isinstance(dataset, SequenceStream) or not dataset.packing:
        return None  # one document per row (or windows of a flat corpus): causal attention
    p = cfg.plan
    start = step * p.global_batch if position is None else position
    seg = dataset.next_batch(start, p.global_batch).segments[:, :-1]
    return seg.reshape(*microbatch_split(p), seg.shape[-1])
