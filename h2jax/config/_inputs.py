"""What a run reads and writes, checked before any device is touched.

:func:`validate` checks a config against itself; :func:`check_inputs` checks it against the
filesystem: the data files (token file size, dtype, id range and length; corpus present,
non-empty, UTF-8), the tokenizer file and its vocabulary against ``model.vocab_size``, and
the output folders (writable; room for one checkpoint). Every failure is one ConfigError
naming the key, the path and what was expected, so the CLI exits 2 with one line instead
of a traceback after the backends start.

Cheap by construction: nothing is tokenized here (the tokenizer itself is cached, so the
run reuses it); a token file is scanned once for its largest id through its memory map.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from h2jax._strict import ConfigError
from h2jax._units import GIB, KIB, MIB, TIB
from h2jax.config._schema import ExperimentConfig
from h2jax.data import (
    check_token_ids,
    default_corpus_text,
    load_data,
    load_text,
    load_tokenizer,
    load_validation,
    open_token_file,
)

# a checkpoint holds the fp32 parameters and AdamW's two fp32 moments per parameter
CHECKPOINT_BYTES_PER_PARAM = 12


def format_count(n: float) -> str:
    """A count for people, three significant digits: 1.65 T, 101 B, 2.69 M, 52.9 k or 512."""
    for scale, unit in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k"), (1, "")):
        if abs(n) >= scale * 0.9995 or scale == 1:
            v = n / scale
            digits = 0 if abs(v) >= 99.95 or scale == 1 else 1 if abs(v) >= 9.995 else 2
            return f"{v:.{digits}f}{unit}"
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    """Bytes for people, in binary units (h2jax._units)."""
    for scale, unit in ((TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def writable_folder(path: str | Path, *, key: str) -> Path:
    """The nearest existing folder at or above ``path`` (where h2jax would create it), after
    checking that a file can be written there (an unnamed temporary file, gone at once);
    ConfigError naming ``key`` when a component is a file or the folder is not writable."""
    p = Path(path)
    existing = p if p.is_absolute() else Path.cwd() / p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            key, f"{str(p)!r} cannot be a folder: {existing} is a file; expected a folder h2jax can create and write"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(
            key, f"{str(p)!r} is not writable ({e.strerror or e} in {existing}); expected a folder h2jax can write"
        ) from None
    return existing


def _check_data(cfg: ExperimentConfig) -> None:
    d, m = cfg.data, cfg.model
    tokenizer = load_tokenizer(d.tokenizer)  # ConfigError naming data.tokenizer
    if tokenizer.vocab_size > m.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"vocab_size={m.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} "
            f"(data.tokenizer={d.tokenizer!r}); expected >= {tokenizer.vocab_size}",
        )
    need = m.seq_len + 1  # one training window: seq_len inputs and the next token
    if d.sources:  # stores, shards, indexes, tokenizer and weights: what the run opens, opened once here
        load_data(cfg)
        if cfg.train.eval_every:
            load_validation(cfg)
        return
    if d.token_file:
        tokens = open_token_file(d.token_file, dtype=d.token_dtype)
        if len(tokens) < need:
            raise ConfigError(
                "data.token_file",
                f"{d.token_file!r} holds {len(tokens)} tokens, fewer than model.seq_len + 1 = {need}; "
                "expected a longer file or a smaller model.seq_len",
            )
        check_token_ids(tokens, d.token_file, vocab_size=tokenizer.vocab_size)
        return
    if d.corpus == "pydoc":
        text, key, where = default_corpus_text(), "model.seq_len", "the pydoc corpus"
    else:
        text, key, where = load_text(d.corpus), "data.corpus", repr(d.corpus)
    # every token covers at least one byte: fewer bytes than one window cannot be enough
    # (the exact count needs the whole corpus tokenized: the run checks it when it has)
    n = len(text.encode("utf-8"))
    if n < need:
        raise ConfigError(
            key,
            f"{where} has {n} bytes, fewer than the {need} tokens of one sequence (model.seq_len + 1); "
            "expected a longer corpus or a smaller model.seq_len",
        )


def _check_outputs(cfg: ExperimentConfig, run_dir: str | Path | None) -> None:
    run_key = "--run-dir" if run_dir is not None else "train.out_dir"
    run = Path(run_dir) if run_dir is not None else Path(cfg.train.out_dir) / cfg.name
    where = writable_folder(run, key=run_key)
    c = cfg.checkpoint
    if not c.enabled:
        return
    ckpt_key = "checkpoint.dir" if c.dir is not None else run_key
    if c.dir is not None:
        where = writable_folder(c.dir, key=ckpt_key)
    params = cfg.model.num_params()
    need = CHECKPOINT_BYTES_PER_PARAM * params
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConfigError(
            ckpt_key,
            f"one checkpoint needs about {format_bytes(need)} ({CHECKPOINT_BYTES_PER_PARAM} bytes x "
            f"{format_count(params)} parameters: fp32 weights and two AdamW moments), {where} has "
            f"{format_bytes(free)} free; expected room for it (or checkpoint.enabled=false)",
        )


def check_inputs(cfg: ExperimentConfig, *, run_dir: str | Path | None = None) -> ExperimentConfig:
    """Check what the run of ``cfg`` reads and writes, before any device is touched.

    ``run_dir``: the run folder when it is not ``<train.out_dir>/<name>`` (``--run-dir``).
    Raises ConfigError naming the key, the path and what was expected; returns ``cfg``.
    Creates nothing (the writability probe is an unnamed temporary file).
    """
    _check_data(cfg)
    _check_outputs(cfg, run_dir)
    return cfg
