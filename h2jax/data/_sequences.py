"""Sequences from token stores: packed, shuffled per epoch, mixed by weight, addressed by a
plan-free position.

A source's documents are one stream (stored order, each document ending where the next
begins); its sequence ``k`` is the ``seq_len + 1`` tokens from ``k * seq_len`` (inputs and
next-token targets; packing, as Megatron and MaxText pack), with a per-token segment id that
starts at 1 and grows at every document start inside the window; the runtime hands the ids
of a step's inputs to every stage (h2jax.models.document_segments), whose attention then
stays inside each document. Without packing (``data.packing: false``) a source's sequence
``k`` is its document ``k``: the first ``seq_len + 1`` tokens (a longer document is cut),
then PAD up to ``seq_len + 1``; a PAD target carries no loss (h2jax.data.loss_weights), and
one document per row needs no segment ids (causal attention never looks ahead to the
padding).

The order is Grain's: each source's sequence numbers shuffled (``MapDataset.shuffle``, a
global shuffle by seed), repeated so that one *epoch* of the mixture reads its largest
source (largest size / weight) once and the others in proportion, the sources interleaved
by weight (``MapDataset.mix``), and epochs repeated with fresh shuffles
(``repeat(reseed_each_epoch=True)``). Sequence ``g`` of the run is a pure function of
(seed, sources, weights, seq_len, g): the position of a run is the count of sequences it has
consumed, whatever the plan's batch split, microbatch count, data degree or process count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from h2jax._strict import ConfigError
from h2jax.data._stores import TokenStore

if TYPE_CHECKING:
    from h2jax.data._dataset import TokenDataset


PAD = -1
"""A padded position of an unpacked row (``data.packing: false``): as a target it carries no
loss; as an input the model sees id 0 there (h2jax.data.split_rows)."""


@dataclass(frozen=True)
class SequenceBatch:
    """``count`` consecutive sequences of the run: ``tokens`` int32 [count, seq_len + 1],
    ``segments`` int32 (the document number inside each row, from 1), and which source
    (``source``) and sequence of it (``sequence``) each row is."""

    tokens: np.ndarray
    segments: np.ndarray
    source: np.ndarray
    sequence: np.ndarray


class SequenceStream:
    """The run's sequences (module docstring) over ``stores`` mixed with ``weights``."""

    def __init__(
        self,
        stores: list[TokenStore],
        weights: list[float],
        *,
        seq_len: int,
        seed: int,
        key: str,
        holdout: float = 0.0,
        split: str = "train",
        packing: bool = True,
    ):
        import grain

        if len(stores) != len(weights) or not stores:
            raise ValueError("one weight per store, at least one store")
        bad = [(s.path, w) for s, w in zip(stores, weights) if not (w > 0 and math.isfinite(w))]
        if bad:
            raise ConfigError(key, f"{bad[0][0]!r} has weight {bad[0][1]!r}; expected a finite weight > 0")
        self.stores, self.seq_len, self.seed, self.packing = stores, seq_len, seed, packing
        self.vocab_size: int | None = None  # the run's tokenizer's, set by open_stream
        wsum = float(sum(weights))
        self.weights = [w / wsum for w in weights]
        if not 0.0 <= holdout < 1.0 or split not in ("train", "val"):
            raise ValueError(f"holdout in [0, 1) and split train or val, got {holdout}, {split!r}")
        self.split = split
        # packed, sequences k of a source: training [0, n - held - 1), validation [n - held, n);
        # the one between them is left out, so that no token is in both (a window's last token
        # is the next window's first). Unpacked: documents, training [0, n - held), validation after.
        self.offsets = [None if packing else document_offsets(s, key) for s in stores]
        total = [(s.num_tokens - 1) // seq_len if o is None else len(o) - 1 for s, o in zip(stores, self.offsets)]
        held = [math.ceil(n * holdout) if holdout > 0 else 0 for n in total]
        gap = 1 if packing else 0
        if split == "val":
            self.first = [n - h for n, h in zip(total, held)]
            self.sizes = held
        else:
            self.first = [0] * len(stores)
            self.sizes = [n - h - gap if h else n for n, h in zip(total, held)]  # sequences per source
        short = [(s, n, t) for s, n, t in zip(stores, self.sizes, total) if n < 1]
        if short:
            s, _, t = short[0]
            unit = f"sequences of model.seq_len + 1 = {seq_len + 1} tokens" if packing else "documents"
            if t >= 1:  # the source holds sequences, too few for both parts
                raise ConfigError(
                    "data.holdout",
                    f"{s.path!r} holds {t} {unit}: too few to hold out {holdout} of them for validation and "
                    "train on the rest; expected a larger source",
                )
            if not packing:
                raise ConfigError(key, f"{s.path!r} holds no document; expected a source with documents")
            raise ConfigError(
                key,
                f"{s.path!r} holds {s.num_tokens} tokens, fewer than one sequence (model.seq_len + 1 = "
                f"{seq_len + 1}); expected a larger source or a smaller model.seq_len",
            )
        span = max(n / w for n, w in zip(self.sizes, self.weights))  # mixture sequences per epoch
        parts = []
        for j, (n, w) in enumerate(zip(self.sizes, self.weights)):
            seed_j = int(np.random.SeedSequence([seed, j]).generate_state(1)[0])
            reps = max(1, math.ceil(span * w / n - 1e-9))
            parts.append(grain.MapDataset.range(n).shuffle(seed=seed_j).repeat(reps).map(_Tag(j, self.first[j])))
        mix = grain.MapDataset.mix(parts, self.weights) if len(parts) > 1 else parts[0]
        self.epoch_length = len(mix)
        self._order = mix.repeat(None, reseed_each_epoch=True)
        self._reader, self._reader_at = None, (-1, -1)  # next_batch's reader and where it stands
        self._last: tuple[tuple[int, int], SequenceBatch] | None = None  # next_batch's last answer

    def ids(self, start: int, count: int) -> np.ndarray:
        """int64 [count, 2]: (source, sequence of that source) of run sequences ``start..``."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        return np.array([self._order[g] for g in range(start, start + count)], np.int64).reshape(count, 2)

    def describe(self) -> str:
        """One line: the sources, their weights and sizes, and the epoch."""
        parts = []
        for st, w, n, off in zip(self.stores, self.weights, self.sizes, self.offsets):
            docs = "" if st.num_documents is None else f"{st.num_documents:,} documents, "
            if off is not None:
                cut = int(np.count_nonzero(np.diff(off) > self.seq_len + 1))
                docs = f"{len(off) - 1:,} documents ({cut:,} cut to {self.seq_len + 1} tokens), "
            parts.append(f"{st.path} {w:.0%} ({st.kind}, {docs}{st.num_tokens:,} tokens, {n:,} sequences)")
        how = (
            f"documents packed into sequences of {self.seq_len + 1} tokens (attention stays inside each document)"
            if self.packing
            else f"one document per sequence of {self.seq_len + 1} tokens, cut or padded (no loss on the padding)"
        )
        return f"data: {len(self.stores)} source(s), {how}, one epoch = {self.epoch_length:,} sequences: " + "; ".join(
            parts
        )

    def epoch(self, position: int) -> float:
        """Epochs of the mixture consumed at ``position`` sequences."""
        return position / self.epoch_length

    def sequence(self, source: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``k`` of ``source``: (ids, segment ids), each [seq_len + 1]. Unpacked: its
        document ``k``, cut or PAD-ded; segment 1 on the document, 0 on the padding."""
        off = self.offsets[source]
        if off is not None:
            n = self.seq_len + 1
            start = int(off[k])
            stop = min(int(off[k + 1]), start + n)
            ids = np.full(n, PAD, np.int64)
            ids[: stop - start] = self.stores[source].read(start, stop)[0]
            return ids, (ids != PAD).astype(np.int64)
        start = k * self.seq_len
        ids, docs = self.stores[source].read(start, start + self.seq_len + 1)
        return ids, (docs - docs[0] + 1)

    def batch(self, start: int, count: int) -> SequenceBatch:
        """Run sequences ``start .. start + count``, read now."""
        which = self.ids(start, count)
        return _stack([(*self.sequence(int(j), int(k)), int(j), int(k)) for j, k in which])

    def next_batch(self, start: int, count: int) -> SequenceBatch:
        """What :meth:`batch` returns, from a reader that runs ahead: Grain threads read and
        pack the following batches while the caller trains on this one. A call that does not
        continue where the last one ended (the first, or after a restore) starts a new reader."""
        if self._last is not None and self._last[0] == (start, count):  # asked again (tokens, then segments)
            return self._last[1]
        if self._reader is None or self._reader_at != (start, count):
            self._reader = iter(self.reader(start, count))
        out = next(self._reader)
        self._reader_at = (start + count, count)
        self._last = ((start, count), out)
        return out

    def reader(self, start: int, count: int, *, threads: int = 2, ahead: int = 2):
        """Grain's iterable of the batches of ``count`` sequences from ``start`` on, read by
        ``threads`` threads up to ``ahead`` batches before they are asked for."""
        import grain

        ds = self._order.slice(slice(start, None)).map(_Read(self)).batch(count, batch_fn=_stack)
        return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=ahead))


def _stack(rows: list[tuple[np.ndarray, np.ndarray, int, int]]) -> SequenceBatch:
    return SequenceBatch(
        tokens=np.stack([r[0] for r in rows]).astype(np.int32),
        segments=np.stack([r[1] for r in rows]).astype(np.int32),
        source=np.array([r[2] for r in rows], np.int64),
        sequence=np.array([r[3] for r in rows], np.int64),
    )


class _Read:
    """(source, k) -> (ids, segment ids, source, k) of that sequence."""

    def __init__(self, stream: SequenceStream):
        self.stream = stream

    def __call__(self, which: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, int, int]:
        j, k = which
        return (*self.stream.sequence(j, k), j, k)


class _Tag:
    """i -> (source, first + i): picklable, so Grain may send the dataset to worker processes."""

    def __init__(self, source: int, first: int):
        self.source, self.first = source, first

    def __call__(self, k: int) -> tuple[int, int]:
        return self.source, self.first + int(k)


def document_offsets(store: TokenStore, key: str) -> np.ndarray:
    """Where each document of ``store`` starts, and the end: int64 [documents + 1]. A flat file's
    documents end at its end-of-document ids (one scan of the file); without ``data.eod_id``
    it has no document boundaries, and unpacked data needs them."""
    if store.offsets is not None:
        return store.offsets
    if store.eod_id is None:
        raise ConfigError(
            "data.packing",
            f"false makes each document a sequence, and {store.path!r} (a flat token file) has no document "
            f"boundaries; expected data.eod_id (the id that ends its documents) or packing=true [{key}]",
        )
    ends = np.flatnonzero(np.asarray(store._flat) == store.eod_id) + 1
    if not len(ends) or ends[-1] != store.num_tokens:
        ends = np.append(ends, store.num_tokens)  # the last document needs no end id
    return np.concatenate([[0], ends]).astype(np.int64)


def open_stream(
    sources: Mapping[str, float],
    *,
    seq_len: int,
    seed: int,
    tokenizer: str = "byte",
    token_dtype: str = "uint16",
    eod_id: int | None = None,
    key: str = "data.sources",
    holdout: float = 0.0,
    split: str = "train",
    packing: bool = True,
) -> SequenceStream:
    """The stream of ``data.sources`` (path -> weight), each source checked against the run's
    tokenizer: a store that records its tokenizer must name this one; every id of the others
    must be below its vocabulary (one scan of the file, cached)."""
    from h2jax.data._dataset import check_token_ids
    from h2jax.data._stores import open_store, tokenizer_identity
    from h2jax.data._tokenizer import load_tokenizer

    if not sources:
        raise ConfigError(key, "is empty; expected at least one source path with a weight > 0")
    vocab = load_tokenizer(tokenizer).vocab_size
    ident = tokenizer_identity(tokenizer)
    stores = []
    for p in sources:
        st = open_store(p, key=f"{key}.{p}", token_dtype=token_dtype, eod_id=eod_id)
        if st.tokenizer is not None and st.tokenizer != ident:
            raise ConfigError(
                f"{key}.{p}",
                f"{p!r} was tokenized with {st.tokenizer} (vocabulary {st.vocab_size}), data.tokenizer="
                f"{tokenizer!r} is {ident} (vocabulary {vocab}); expected the tokenizer that wrote it",
            )
        if st.tokenizer is None and st.num_tokens:
            check_token_ids(
                st._flat, st.path if st.kind == "tokens" else st.path + ".bin", vocab_size=vocab, key=f"{key}.{p}"
            )
        stores.append(st)
    weights = [float(w) for w in sources.values()]
    stream = SequenceStream(
        stores, weights, seq_len=seq_len, seed=seed, key=key, holdout=holdout, split=split, packing=packing
    )
    stream.vocab_size = vocab
    return stream


def load_validation(cfg: Any) -> SequenceStream:
    """The validation stream of an experiment: ``data.val_sources``, else the sequences
    ``data.holdout`` keeps out of the training sources."""
    d = cfg.data
    common = dict(
        seq_len=cfg.model.seq_len, seed=cfg.seed, tokenizer=d.tokenizer, token_dtype=d.token_dtype, packing=d.packing
    )
    if d.val_sources:
        return open_stream(d.val_sources, eod_id=d.eod_id, key="data.val_sources", **common)
    return open_stream(d.sources, eod_id=d.eod_id, holdout=d.holdout, split="val", **common)


def load_data(cfg: Any) -> TokenDataset | SequenceStream:
    """The data of an experiment ``cfg`` (its ``data.*`` keys, ``model.seq_len`` and ``seed``):
    the mixed token stores of ``data.sources`` when given (h2jax.data._sequences), else the
    dataset :func:`~h2jax.data._dataset.load_dataset` builds."""
    d = cfg.data
    if d.sources:
        return open_stream(
            d.sources,
            seq_len=cfg.model.seq_len,
            seed=cfg.seed,
            tokenizer=d.tokenizer,
            token_dtype=d.token_dtype,
            eod_id=d.eod_id,
            holdout=d.holdout,
            packing=d.packing,
        )
    from h2jax.data._dataset import load_dataset

    return load_dataset(corpus=d.corpus, token_file=d.token_file, tokenizer=d.tokenizer, token_dtype=d.token_dtype)
