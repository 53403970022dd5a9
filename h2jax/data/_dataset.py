"""Token datasets: one flat 1-D array of token ids, in memory or memory-mapped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h2jax._strict import ConfigError
from h2jax.data._corpus import default_corpus_text, load_text
from h2jax.data._tokenizer import Tokenizer, load_tokenizer

_TOKEN_FILE_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class TokenDataset:
    """A 1-D array of token ids (shape [num_tokens]) and the vocabulary it indexes."""

    tokens: np.ndarray
    vocab_size: int

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise ValueError(f"TokenDataset.tokens must be 1-D, got shape {self.tokens.shape}")

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer) -> TokenDataset:
        """Tokenize ``text`` whole with ``tokenizer``."""
        return cls(tokens=tokenizer.encode(text), vocab_size=int(tokenizer.vocab_size))

    @classmethod
    def from_file(cls, path: str | Path, *, dtype: str = "uint16", vocab_size: int | None = None) -> TokenDataset:
        """Memory-map a nanoGPT-layout token file: raw little-endian ids, no header.

        ``dtype`` is ``"uint16"`` (2 bytes/token) or ``"uint32"`` (4 bytes/token).
        ``vocab_size`` defaults to max id + 1 (one pass over the file); pass the
        tokenizer's vocabulary size when you know it. Ids must be below ``vocab_size``.
        Problems are ConfigErrors naming ``data.token_file`` (see :func:`check_token_file`).
        """
        tokens = open_token_file(path, dtype=dtype)
        max_id = check_token_ids(tokens, path, vocab_size=vocab_size)
        return cls(tokens=tokens, vocab_size=max_id + 1 if vocab_size is None else vocab_size)

    def split(self, val_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """Contiguous (train, val) split: the last ``val_fraction`` of tokens is validation."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        num_val = int(round(len(self) * val_fraction))
        cut = len(self) - num_val
        return (
            TokenDataset(tokens=self.tokens[:cut], vocab_size=self.vocab_size),
            TokenDataset(tokens=self.tokens[cut:], vocab_size=self.vocab_size),
        )

    def __len__(self) -> int:
        """Number of tokens."""
        return int(self.tokens.shape[0])


def open_token_file(path: str | Path, *, dtype: str, key: str = "data.token_file") -> np.memmap:
    """The token file memory-mapped; ConfigError when it is missing or its size is not a
    positive multiple of the token dtype's size."""
    if dtype not in _TOKEN_FILE_DTYPES:
        raise ConfigError(
            "data.token_dtype", f"data.token_dtype={dtype!r} is not valid: expected one of {_TOKEN_FILE_DTYPES}"
        )
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(key, f"{str(path)!r} {what}; expected a flat binary file of {dtype} token ids")
    np_dtype = np.dtype(dtype).newbyteorder("<")
    num_bytes = path.stat().st_size
    if num_bytes < np_dtype.itemsize or num_bytes % np_dtype.itemsize:
        raise ConfigError(
            key,
            f"{str(path)!r} has {num_bytes} bytes, which is not a positive multiple of "
            f"{np_dtype.itemsize} bytes per {dtype} token; check data.token_dtype",
        )
    return np.memmap(path, dtype=np_dtype, mode="r")


def check_token_ids(
    tokens: np.ndarray, path: str | Path, *, vocab_size: int | None, key: str = "data.token_file"
) -> int:
    """The largest id of ``tokens`` (the ids of file ``path``); ConfigError naming the first id
    >= ``vocab_size`` and its position. The file is scanned in chunks (a memmap is never read
    whole into memory), once per file version: validation and the run share the scan."""
    st = Path(path).stat()
    version = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size, tokens.dtype.str)
    max_id = _MAX_IDS.get(version)
    if max_id is None:
        max_id = max(int(np.asarray(tokens[s : s + _CHUNK]).max()) for s in range(0, len(tokens), _CHUNK))
        _MAX_IDS.clear()  # one file version kept: the one a run validates, then reads
        _MAX_IDS[version] = max_id
    if vocab_size is not None and max_id >= vocab_size:
        for start in range(0, len(tokens), _CHUNK):
            part = np.asarray(tokens[start : start + _CHUNK])
            if int(part.max()) >= vocab_size:
                pos = start + int(np.argmax(part >= vocab_size))
                raise ConfigError(
                    key,
                    f"{str(path)!r} holds token id {int(tokens[pos])} at position {pos}, but the tokenizer's "
                    f"vocab_size is {vocab_size}; expected ids below it (check data.tokenizer and data.token_dtype)",
                )
    return max_id


_CHUNK = 1 << 24  # ids per step of a scan: 32-64 MiB
_MAX_IDS: dict[tuple[str, int, int, str], int] = {}  # file version -> its largest id


def load_dataset(*, corpus: str, token_file: str | None, tokenizer: str, token_dtype: str) -> TokenDataset:
    """Build the dataset the ``data.*`` config keys describe.

    ``token_file`` (a pre-tokenized flat binary of ``token_dtype``) wins when given;
    its vocabulary size is ``tokenizer``'s.
    Otherwise ``corpus`` is ``"pydoc"`` (the built-in stdlib corpus) or a path to a
    UTF-8 text file, tokenized with ``tokenizer`` (see ``load_tokenizer``).
    """
    if token_file:
        # The tokenizer that wrote the file knows the true vocabulary size; from_file
        # checks every id is below it, so a mismatched tokenizer fails loudly here.
        vocab_size = load_tokenizer(tokenizer).vocab_size
        return TokenDataset.from_file(token_file, dtype=token_dtype, vocab_size=vocab_size)
    text = default_corpus_text() if corpus == "pydoc" else load_text(corpus)
    return TokenDataset.from_text(text, load_tokenizer(tokenizer))
