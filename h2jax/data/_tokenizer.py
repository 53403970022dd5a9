"""Tokenizers: text <-> 1-D numpy arrays of token ids.

Two kinds, behind one duck-typed contract (``vocab_size``, ``encode``, ``decode``):
``ByteTokenizer`` (UTF-8 bytes, no files) and ``HFTokenizer`` (a local Hugging Face
``tokenizer.json``). Nothing here ever downloads.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import numpy as np

from h2jax._strict import ConfigError

_UINT16_LIMIT = 1 << 16


class Tokenizer(Protocol):
    """What datasets need from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray | list[int]) -> str: ...


def token_dtype_for(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype (uint16 or uint32) that holds ids in ``[0, vocab_size)``."""
    return np.dtype(np.uint16 if vocab_size <= _UINT16_LIMIT else np.uint32)


class ByteTokenizer:
    """One token per UTF-8 byte; ``vocab_size`` = 256. Needs no file."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a uint16 array of shape [num_bytes]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Bytes back to text; invalid UTF-8 (e.g. a window cut mid-character) becomes U+FFFD."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"ByteTokenizer.decode: ids must be in [0, 255], got range [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer  # deferred: optional at import time

        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises a bare Exception
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                "data.tokenizer",
                f"{str(self.path)!r} is not a valid tokenizer.json ({reason}); expected a file "
                "written by the Hugging Face tokenizers library (Tokenizer.save)",
            ) from None
        self.vocab_size: int = int(self._tok.get_vocab_size())
        self.dtype: np.dtype = token_dtype_for(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, uint16 if the vocabulary fits in 2**16 ids, else uint32."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Token ids back to text."""
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()])

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """Build the tokenizer named by config key ``data.tokenizer``.

    ``"byte"`` gives a ``ByteTokenizer``; a path to an existing ``tokenizer.json`` file
    gives an ``HFTokenizer`` (cached per file version: validation before the devices and
    the run share one). Anything else, or a file the tokenizers library cannot read, is a
    ConfigError naming ``data.tokenizer``.
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.suffix == ".json" and path.is_file():
        st = path.stat()
        return _hf_tokenizer(str(path.resolve()), st.st_mtime_ns, st.st_size)
    raise ConfigError(
        "data.tokenizer",
        f"{spec!r} is not valid; expected 'byte' or the path to an existing Hugging Face tokenizer.json file"
        + (" (no such file)" if path.suffix == ".json" else ""),
    )


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str, mtime_ns: int, size: int) -> HFTokenizer:
    del mtime_ns, size  # the cache key: a rewritten file is read again
    return HFTokenizer(path)
