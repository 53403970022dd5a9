"""Text and JSON-lines files -> the flat token file ``data.token_file`` reads (``h2jax tokenize``).

The output is nanoGPT's layout: raw little-endian uint16 or uint32 ids, no header, every
document's ids followed by the end-of-text id (and preceded by a begin id if asked). A
*document* is a JSON-lines record's text field, or a piece of a text file: a paragraph
(blank-line separated, the default), a line, or the whole file. Documents are encoded
whole, in batches of about `batch_bytes` of text with the tokenizers package's
``encode_batch`` (Rust threads over every core), so the file is exactly what encoding each
document alone, in order, gives (tests/data/test_tokenize.py). Files are streamed: memory
holds one batch, not the corpus.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h2jax._strict import ConfigError
from h2jax.data._tokenizer import token_dtype_for

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
"""End-of-text tokens ``eos="auto"`` looks for, in this order (GPT-2, LLaMA 3, LLaMA 2, Gemma, Qwen)."""

SPLITS = ("paragraph", "line", "file")
_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_READ_BYTES = 4 << 20


@dataclass(frozen=True)
class TokenizeStats:
    """What `tokenize_files` wrote: tokens, documents, input bytes, wall seconds, token dtype."""

    tokens: int
    documents: int
    bytes: int
    seconds: float
    dtype: str


def _split_docs(text: str, split: str) -> list[str]:
    if split == "paragraph":
        parts = _PARAGRAPH.split(text)
    elif split == "line":
        parts = text.split("\n")
    else:
        parts = [text]
    return [p for p in parts if p.strip()]


def iter_documents(path: str | Path, *, field: str = "text", split: str = "paragraph") -> Iterator[tuple[str, int]]:
    """(document, bytes of the file consumed so far) in file order.

    ``.jsonl`` / ``.json`` files: one JSON object per line, its `field` (a string) is the
    document; other files: UTF-8 text cut into documents by `split`."""
    path = Path(path)
    if split not in SPLITS:
        raise ConfigError("--split", f"{split!r}; expected one of {list(SPLITS)}")
    if path.suffix in (".jsonl", ".json"):
        with path.open("rb") as f:
            done = 0
            for n, line in enumerate(f, 1):
                done += len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}", f"not a JSON line: {e}") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ConfigError(f"{path}:{n}", f"no string field {field!r} (--field); the record has {keys}")
                if text:
                    yield text, done
        return
    # text: read in blocks, cut at the last document boundary, carry the rest over
    with path.open("rb") as f:
        carry, done = "", 0
        while block := f.read(_READ_BYTES):
            done += len(block)
            while True:  # finish a UTF-8 character cut by the block boundary
                try:
                    text = carry + block.decode("utf-8")
                    break
                except UnicodeDecodeError as e:
                    if e.start < len(block) - 3:
                        raise ConfigError(
                            str(path), f"not UTF-8 text near byte {done - len(block) + e.start}"
                        ) from None
                    more = f.read(1)
                    if not more:
                        raise ConfigError(str(path), "ends inside a UTF-8 character") from None
                    block += more
                    done += 1
            if split == "file":
                carry = text
                continue
            cut = _last_boundary(text, split)
            docs, carry = _split_docs(text[:cut], split), text[cut:]
            for d in docs:
                yield d, done
        for d in _split_docs(carry, split):
            yield d, done


def _last_boundary(text: str, split: str) -> int:
    """Index just past the last document separator of `text` (0: none yet)."""
    if split == "line":
        return text.rfind("\n") + 1
    matches = list(_PARAGRAPH.finditer(text))
    if not matches:
        return 0
    last = matches[-1]
    # a separator touching the end may continue in the next block: keep it for then
    if last.end() == len(text):
        return last.start()
    return last.end()


def _token_id(tok, token: str, what: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise ConfigError(what, f"{token!r} is not a token of the tokenizer")
    return int(i)


def tokenize_files(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tokenizer: str | Path,
    field: str = "text",
    split: str = "paragraph",
    dtype: str = "auto",
    eos: str = "auto",
    bos: str = "none",
    batch_bytes: int = 8_000_000,
    progress: bool = True,
) -> TokenizeStats:
    """Tokenize `inputs` (in order) into the flat token file `out`; see the module docstring.

    `dtype` "auto" picks uint16 when the vocabulary fits (<= 65,536 ids), else uint32; an
    explicit uint16 with a larger vocabulary is refused. `eos` / `bos`: a token string,
    "none", or (eos) "auto": the first of EOS_CANDIDATES the tokenizer has. Progress: a bar
    on a terminal, else a line on stderr every 10 s (`progress=False`: neither). The file is
    written beside `out` and renamed into place at the end."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a dependency of h2jax
        raise ConfigError("--tokenizer", "the tokenizers package is not installed") from None
    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises a bare Exception
        raise ConfigError("--tokenizer", f"{str(tokenizer)!r} is not a readable tokenizer.json ({e})") from None
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    if dtype == "auto":
        np_dtype = token_dtype_for(vocab)
    elif dtype in ("uint16", "uint32"):
        np_dtype = np.dtype(dtype)
        if vocab > np.iinfo(np_dtype).max + 1:
            raise ConfigError(
                "--dtype",
                f"the tokenizer has {vocab:,} ids, more than {dtype} holds ({np.iinfo(np_dtype).max + 1:,}); "
                "use uint32 (and data.token_dtype=uint32)",
            )
    else:
        raise ConfigError("--dtype", f"{dtype!r}; expected auto, uint16 or uint32")
    if eos == "auto":
        eos_id = next((i for t in EOS_CANDIDATES if (i := tok.token_to_id(t)) is not None), None)
    else:
        eos_id = None if eos == "none" else _token_id(tok, eos, "--eos")
    bos_id = None if bos == "none" else _token_id(tok, bos, "--bos")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise ConfigError(str(p), "no such file")
    total = sum(p.stat().st_size for p in paths)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no offsets computed

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    report = _Report(total, enabled=progress)
    tokens = documents = 0
    t0 = time.perf_counter()
    try:
        with tmp.open("wb") as f:
            before = 0
            for p in paths:
                batch: list[str] = []
                size = 0
                for doc, done in iter_documents(p, field=field, split=split):
                    batch.append(doc)
                    size += len(doc)
                    if size >= batch_bytes:
                        tokens += _write(f, encode(batch, add_special_tokens=False), np_dtype, bos_id, eos_id)
                        documents += len(batch)
                        batch, size = [], 0
                        report.update(before + done, tokens)
                if batch:
                    tokens += _write(f, encode(batch, add_special_tokens=False), np_dtype, bos_id, eos_id)
                    documents += len(batch)
                before += p.stat().st_size
                report.update(before, tokens)
        os.replace(tmp, out)
    finally:
        report.close()
        tmp.unlink(missing_ok=True)
    return TokenizeStats(tokens, documents, total, time.perf_counter() - t0, np_dtype.name)


def _write(f, encodings, dtype: np.dtype, bos_id: int | None, eos_id: int | None) -> int:
    pieces = []
    head = [] if bos_id is None else [bos_id]
    tail = [] if eos_id is None else [eos_id]
    for e in encodings:
        pieces.append(head + e.ids + tail)
    lengths = [len(p) for p in pieces]
    flat = np.fromiter((i for p in pieces for i in p), dtype=dtype, count=sum(lengths))
    flat.astype(dtype.newbyteorder("<"), copy=False).tofile(f)
    return int(flat.size)


class _Report:
    """Bytes read and tokens written so far, as h2jax's progress (a bar on a terminal, a line every
    10 s otherwise)."""

    def __init__(self, total: int, *, enabled: bool, every_s: float = 10.0):
        from h2jax._progress import Progress

        self.total, self.t0 = total, time.perf_counter()
        self.progress = Progress("tokenize", total=total, enabled=enabled, every_s=every_s).__enter__()

    def update(self, done: int, tokens: int) -> None:
        rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
        note = f"{done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB, {tokens:,} tokens, {rate:,.0f} tokens/s"
        self.progress.set(done, note=note)

    def close(self) -> None:
        self.progress.__exit__(None, None, None)
