"""Tests for h2jax.data: tokenizers, corpora, token files, deterministic batching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from h2jax.config import ConfigError
from h2jax.data import (
    ByteTokenizer,
    HFTokenizer,
    TokenDataset,
    default_corpus_text,
    get_global_batch,
    get_microbatch,
    load_dataset,
    load_text,
    load_tokenizer,
)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "pipelines move microbatches between stages",
    "every chip type runs one stage of the model",
]


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A tiny BPE tokenizer.json trained in memory; nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])
    tok.train_from_iterator(SENTENCES, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def small_dataset() -> TokenDataset:
    return TokenDataset(tokens=np.arange(1000, dtype=np.uint16) % 251, vocab_size=256)


# tokenizers


def test_byte_round_trip_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.ndim == 1
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.vocab_size == 256 and int(ids.max()) < 256
    assert tok.decode(ids) == text


def test_byte_decode_replaces_invalid_utf8() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é")[:1]  # half of a two-byte character
    assert tok.decode(ids) == "\ufffd"


def test_hf_tokenizer_from_local_json(tokenizer_json: Path) -> None:
    tok = load_tokenizer(str(tokenizer_json))
    assert isinstance(tok, HFTokenizer)
    assert 0 < tok.vocab_size <= 120
    ids = tok.encode(SENTENCES[0])
    assert ids.dtype == np.uint16 and ids.ndim == 1 and len(ids) > 0
    assert int(ids.max()) < tok.vocab_size
    assert tok.decode(ids).replace(" ", "") == SENTENCES[0].replace(" ", "")


def test_load_tokenizer_byte() -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


@pytest.mark.parametrize("spec", ["gpt2", "/no/such/tokenizer.json", ""])
def test_load_tokenizer_rejects_unknown(spec: str) -> None:
    with pytest.raises(ValueError, match=r"data\.tokenizer") as err:
        load_tokenizer(spec)
    assert repr(spec) in str(err.value) and "'byte'" in str(err.value)


# corpus


def test_default_corpus_is_deterministic_text() -> None:
    text = default_corpus_text()
    assert isinstance(text, str) and len(text) > 10_000
    assert text == default_corpus_text()


def test_load_text(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("añb\n", encoding="utf-8")
    assert load_text(path) == "añb\n"
    with pytest.raises(ConfigError, match=r"data\.corpus: '.*missing.txt' does not exist"):
        load_text(tmp_path / "missing.txt")


def test_load_text_refuses_empty_and_non_utf8(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.corpus: '.*empty.txt' is empty"):
        load_text(empty)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"data\.corpus: '.*latin1.txt' is not UTF-8 text \(byte 3: invalid"):
        load_text(latin1)
    with pytest.raises(ConfigError, match="is a folder"):
        load_text(tmp_path)


def test_invalid_tokenizer_json_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(b"\xff\xfe not json")
    with pytest.raises(ConfigError, match=r"data\.tokenizer: '.*tokenizer.json' is not a valid tokenizer.json \("):
        load_tokenizer(str(bad))
    bad.write_text('{"version": "1.0"}')
    with pytest.raises(ConfigError, match="is not a valid tokenizer.json"):
        load_tokenizer(str(bad))


def test_hf_tokenizer_is_loaded_once_per_file_version(tokenizer_json: Path) -> None:
    assert load_tokenizer(str(tokenizer_json)) is load_tokenizer(str(tokenizer_json))


# datasets


def test_from_text_and_split() -> None:
    ds = TokenDataset.from_text("abcdefghij", ByteTokenizer())
    assert len(ds) == 10 and ds.vocab_size == 256
    train, val = ds.split(0.2)
    assert len(train) == 8 and len(val) == 2
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), ds.tokens)
    with pytest.raises(ValueError, match="val_fraction"):
        ds.split(1.0)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_memmap_round_trip(tmp_path: Path, dtype: str) -> None:
    high = 60_000 if dtype == "uint16" else 100_000
    tokens = np.random.default_rng(0).integers(0, high, size=777).astype(dtype)
    path = tmp_path / f"train_{dtype}.bin"
    tokens.tofile(path)
    ds = TokenDataset.from_file(path, dtype=dtype)
    assert isinstance(ds.tokens, np.memmap)
    np.testing.assert_array_equal(np.asarray(ds.tokens), tokens)
    assert ds.vocab_size == int(tokens.max()) + 1


def test_token_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.arange(5, dtype=np.uint16).tofile(path)  # 10 bytes: not a multiple of 4
    with pytest.raises(ValueError, match=r"data\.token_dtype='int64'.*uint16"):
        TokenDataset.from_file(path, dtype="int64")
    with pytest.raises(ValueError, match="10 bytes.*4 bytes per uint32"):
        TokenDataset.from_file(path, dtype="uint32")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        TokenDataset.from_file(empty)
    with pytest.raises(ConfigError, match=r"data\.token_file: '.*nope.bin' does not exist"):
        TokenDataset.from_file(tmp_path / "nope.bin")
    with pytest.raises(ConfigError, match="token id 3 at position 3, but the tokenizer's vocab_size is 3"):
        TokenDataset.from_file(path, vocab_size=3)


def test_load_dataset_sources(tmp_path: Path) -> None:
    text_path = tmp_path / "c.txt"
    text_path.write_text("hello corpus", encoding="utf-8")
    ds = load_dataset(corpus=str(text_path), token_file=None, tokenizer="byte", token_dtype="uint16")
    assert ByteTokenizer().decode(ds.tokens) == "hello corpus"

    pydoc = load_dataset(corpus="pydoc", token_file=None, tokenizer="byte", token_dtype="uint16")
    assert len(pydoc) == len(default_corpus_text().encode("utf-8"))

    token_path = tmp_path / "t.bin"
    np.array([1, 2, 3, 200], dtype=np.uint32).tofile(token_path)
    from_file = load_dataset(
        corpus="pydoc", token_file=str(token_path), tokenizer="byte", token_dtype="uint32"
    )  # token_file wins over corpus
    np.testing.assert_array_equal(np.asarray(from_file.tokens), [1, 2, 3, 200])
    assert from_file.vocab_size == 256

    np.array([1, 300], dtype=np.uint16).tofile(token_path)
    with pytest.raises(ValueError, match="token id 300.*vocab_size is 256"):
        load_dataset(corpus="pydoc", token_file=str(token_path), tokenizer="byte", token_dtype="uint16")


# batching


def _mb(ds: TokenDataset, **overrides: int) -> tuple[np.ndarray, np.ndarray]:
    kwargs = dict(seed=0, step=3, microbatch_idx=1, microbatch_size=4, seq_len=16)
    kwargs.update(overrides)
    return get_microbatch(ds, **kwargs)


def test_microbatch_shape_dtype_and_shift(small_dataset: TokenDataset) -> None:
    tokens, targets = _mb(small_dataset)
    assert tokens.shape == targets.shape == (4, 16)
    assert tokens.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    # Each row is a real window of the dataset.
    data = small_dataset.tokens.astype(np.int32)
    for row_tokens, row_targets in zip(tokens, targets):
        starts = [s for s in range(len(data) - 16) if np.array_equal(data[s : s + 16], row_tokens)]
        assert starts and any(data[s + 16] == row_targets[-1] for s in starts)


def test_microbatch_is_deterministic(small_dataset: TokenDataset) -> None:
    a, b = _mb(small_dataset), _mb(small_dataset)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    for change in ({"step": 4}, {"microbatch_idx": 2}, {"seed": 1}):
        assert not np.array_equal(_mb(small_dataset, **change)[0], a[0]), change


def test_microbatch_reaches_every_valid_start() -> None:
    # 20 tokens, seq_len 4: starts 0..15 are valid; each row's first token is its start.
    ds = TokenDataset(tokens=np.arange(20, dtype=np.uint16), vocab_size=20)
    seen = set()
    for step in range(200):
        tokens, targets = get_microbatch(ds, seed=0, step=step, microbatch_idx=0, microbatch_size=8, seq_len=4)
        seen.update(tokens[:, 0].tolist())
        assert int(targets.max()) <= 19
    assert seen == set(range(16))


def test_exactly_seq_len_plus_one_tokens_works() -> None:
    ds = TokenDataset(tokens=np.arange(9, dtype=np.uint16), vocab_size=9)
    tokens, targets = get_microbatch(ds, seed=0, step=0, microbatch_idx=0, microbatch_size=2, seq_len=8)
    np.testing.assert_array_equal(tokens, np.tile(np.arange(8), (2, 1)))
    np.testing.assert_array_equal(targets, np.tile(np.arange(1, 9), (2, 1)))


def test_dataset_too_short_error() -> None:
    ds = TokenDataset(tokens=np.arange(8, dtype=np.uint16), vocab_size=8)
    with pytest.raises(ValueError, match=r"8 tokens, fewer than seq_len \+ 1 = 9"):
        get_microbatch(ds, seed=0, step=0, microbatch_idx=0, microbatch_size=2, seq_len=8)


def test_global_batch_is_stacked_microbatches(small_dataset: TokenDataset) -> None:
    tokens, targets = get_global_batch(small_dataset, seed=7, step=5, num_microbatches=3, microbatch_size=2, seq_len=8)
    assert tokens.shape == targets.shape == (3, 2, 8)
    for i in range(3):
        mb_tokens, mb_targets = get_microbatch(
            small_dataset, seed=7, step=5, microbatch_idx=i, microbatch_size=2, seq_len=8
        )
        np.testing.assert_array_equal(tokens[i], mb_tokens)
        np.testing.assert_array_equal(targets[i], mb_targets)
    # A plan with more microbatches keeps the first ones; another split of the same global
    # batch is the same rows (a re-plan trains the same sequences)
    more, _ = get_global_batch(small_dataset, seed=7, step=5, num_microbatches=5, microbatch_size=2, seq_len=8)
    np.testing.assert_array_equal(more[:3], tokens)
    for m, b in ((1, 10), (2, 5), (10, 1)):
        other, _ = get_global_batch(small_dataset, seed=7, step=5, num_microbatches=m, microbatch_size=b, seq_len=8)
        np.testing.assert_array_equal(other.reshape(10, 8), more.reshape(10, 8))


def test_batching_works_on_memmap(tmp_path: Path) -> None:
    tokens = (np.arange(500) % 256).astype(np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    from_file = TokenDataset.from_file(path)
    in_memory = TokenDataset(tokens=tokens, vocab_size=256)
    kwargs = dict(seed=1, step=2, num_microbatches=2, microbatch_size=3, seq_len=10)
    a = get_global_batch(from_file, **kwargs)
    b = get_global_batch(in_memory, **kwargs)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_data_package_does_not_import_jax() -> None:
    import subprocess
    import sys

    code = "import sys, h2jax.data; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
