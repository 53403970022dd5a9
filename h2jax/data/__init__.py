"""Tokenizers, corpora, token datasets and stores, and deterministic batching.

Pure numpy; no JAX import.
"""

from h2jax.data._batching import (
    get_global_batch,
    get_microbatch,
    loss_weights,
    microbatch_split,
    split_rows,
    step_batch,
    step_segments,
)
from h2jax.data._corpus import default_corpus_text, load_text
from h2jax.data._dataset import TokenDataset, check_token_ids, load_dataset, open_token_file
from h2jax.data._sequences import PAD, SequenceBatch, SequenceStream, load_data, load_validation, open_stream
from h2jax.data._stores import TokenStore, open_store, write_megatron
from h2jax.data._tokenize import tokenize_files as tokenize_files  # h2jax tokenize
from h2jax.data._tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype_for,
)

__all__ = [
    "PAD",
    "ByteTokenizer",
    "SequenceBatch",
    "SequenceStream",
    "TokenStore",
    "load_data",
    "load_validation",
    "open_store",
    "open_stream",
    "write_megatron",
    "HFTokenizer",
    "TokenDataset",
    "Tokenizer",
    "check_token_ids",
    "default_corpus_text",
    "get_global_batch",
    "get_microbatch",
    "load_dataset",
    "load_text",
    "load_tokenizer",
    "loss_weights",
    "split_rows",
    "microbatch_split",
    "step_batch",
    "step_segments",
    "open_token_file",
    "token_dtype_for",
]
