"""Text, JSON-lines and Parquet files -> token files h2jax reads (``h2jax tokenize``).

Two outputs. ``tokens`` (the default): nanoGPT's layout, the flat file ``data.token_file``
reads: raw little-endian uint16 or uint32 ids, no header, every document's ids followed by
the end-of-text id (and preceded by a begin id if asked). ``arrayrecord``: a token store
folder ``data.sources`` reads (h2jax.data._stores): ``--shards`` ArrayRecord files of one
record per document (document ``i`` goes to shard ``i % shards``), each with its documents'
lengths, and ``manifest.json`` with the counts, dtype, vocabulary, end-of-document id and the
tokenizer's identity (its sha256), so a run with another tokenizer is refused. A
*document* is a JSON-lines record's or a Parquet row's text field, or a piece of a text
file: a paragraph (blank-line separated, the default), a line, or the whole file. A folder
stands for the files under it with a known suffix (INPUT_SUFFIXES), in path order. Documents are encoded
whole, in batches of about `batch_bytes` of text with the tokenizers package's
``encode_batch`` (Rust threads over every core), so the file is exactly what encoding each
document alone, in order, gives (tests/data/test_tokenize.py). Files are streamed: memory
holds one batch, not the corpus.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h2jax._strict import ConfigError
from h2jax.data._stores import tokenizer_identity
from h2jax.data._tokenizer import token_dtype_for

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
"""End-of-text tokens ``eos="auto"`` looks for, in this order (GPT-2, LLaMA 3, LLaMA 2, Gemma, Qwen)."""

SPLITS = ("paragraph", "line", "file")
INPUT_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet")
"""What a folder given to ``h2jax tokenize`` contributes: its files with these suffixes."""
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
    document; ``.parquet`` files: the `field` column of every row (read a row group at a time,
    through pyarrow); other files: UTF-8 text cut into documents by `split`."""
    path = Path(path)
    if split not in SPLITS:
        raise ConfigError("--split", f"{split!r}; expected one of {list(SPLITS)}")
    if path.suffix == ".parquet":
        yield from _parquet_documents(path, field)
        return
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


def _parquet_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(str(path), f"not a readable Parquet file ({e})") from None
    names = f.schema_arrow.names
    if field not in names:
        raise ConfigError(str(path), f"no column {field!r} (--field); the file has {names}")
    kind = f.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(str(path), f"column {field!r} holds {kind}; expected text (string)")
    size, groups = path.stat().st_size, max(f.num_row_groups, 1)
    for g in range(f.num_row_groups):
        done = size * (g + 1) // groups  # progress: row groups read, in bytes of the file
        for text in f.read_row_group(g, columns=[field]).column(0).to_pylist():
            if text:
                yield text, done


def input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files `inputs` name, in order: a file itself, a folder its files with a suffix of
    INPUT_SUFFIXES (recursively, sorted by path)."""
    out: list[Path] = []
    for given in inputs:
        p = Path(given)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in INPUT_SUFFIXES)
            if not found:
                raise ConfigError(str(p), f"is a folder with no input files; expected files ending in {INPUT_SUFFIXES}")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(str(p), "no such file or folder")
    return out


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
    format: str = "tokens",
    shards: int = 1,
) -> TokenizeStats:
    """Tokenize `inputs` (in order) into the flat token file `out`; see the module docstring.

    `dtype` "auto" picks uint16 when the vocabulary fits (<= 65,536 ids), else uint32; an
    explicit uint16 with a larger vocabulary is refused. `eos` / `bos`: a token string,
    "none", or (eos) "auto": the first of EOS_CANDIDATES the tokenizer has. Progress: a bar
    on a terminal, else a line on stderr every 10 s (`progress=False`: neither). The file is
    written beside `out` and renamed into place at the end."""
    if format not in FORMATS:
        raise ConfigError("--format", f"{format!r}; expected one of {list(FORMATS)}")
    if format == "arrayrecord" and shards < 1:
        raise ConfigError("--shards", f"{shards}; expected >= 1")
    tok = _load(str(tokenizer))
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
    paths = input_files(inputs)
    total = sum(p.stat().st_size for p in paths)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no offsets computed

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if format == "arrayrecord" and out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a file; expected a folder for the token store")
    if format == "arrayrecord" and out.is_dir() and any(out.iterdir()):
        raise ConfigError("--out", f"{str(out)!r} holds files; expected a new or empty folder (nothing was written)")
    if format == "tokens" and out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a folder; expected a file name (or --format arrayrecord)")
    if tmp.is_dir():  # the leftover of a killed run
        shutil.rmtree(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = _Report(total, enabled=progress)
    tokens = documents = 0
    t0 = time.perf_counter()
    sink = _StoreSink(tmp, shards, np_dtype) if format == "arrayrecord" else _FlatSink(tmp, np_dtype)
    try:
        before = 0
        for p in paths:
            batch: list[str] = []
            size = 0
            for doc, done in iter_documents(p, field=field, split=split):
                batch.append(doc)
                size += len(doc)
                if size >= batch_bytes:
                    tokens += sink.write(_ids(encode(batch, add_special_tokens=False), bos_id, eos_id))
                    documents += len(batch)
                    batch, size = [], 0
                    report.update(before + done, tokens)
            if batch:
                tokens += sink.write(_ids(encode(batch, add_special_tokens=False), bos_id, eos_id))
                documents += len(batch)
            before += p.stat().st_size
            report.update(before, tokens)
        extra = {"vocab_size": vocab, "tokenizer": tokenizer_identity(str(tokenizer)), "tokenizer_path": str(tokenizer)}
        sink.close({**extra, "eod_id": eos_id, "bos_id": bos_id, "inputs": [str(p) for p in paths]})
        if format == "arrayrecord" and out.is_dir():
            out.rmdir()  # empty: checked above
        os.replace(tmp, out)
    finally:
        sink.abort()
        report.close()
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return TokenizeStats(tokens, documents, total, time.perf_counter() - t0, np_dtype.name)


FORMATS = ("tokens", "arrayrecord")


class _ByteTok:
    """The byte tokenizer (h2jax.data.ByteTokenizer) behind the tokenizers package's calls used here."""

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 256

    def token_to_id(self, token: str) -> int | None:
        return None  # 256 ids, all bytes: no special tokens (documents stay apart in an arrayrecord store)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


def _load(spec: str):
    if spec == "byte":
        return _ByteTok()
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a dependency of h2jax
        raise ConfigError("--tokenizer", "the tokenizers package is not installed") from None
    try:
        return Tokenizer.from_file(spec)
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises a bare Exception
        raise ConfigError("--tokenizer", f"{spec!r} is not a readable tokenizer.json ({e})") from None


def _ids(encodings, bos_id: int | None, eos_id: int | None) -> list[list[int]]:
    head = [] if bos_id is None else [bos_id]
    tail = [] if eos_id is None else [eos_id]
    return [head + (e if isinstance(e, list) else e.ids) + tail for e in encodings]


class _FlatSink:
    """Documents appended to one flat file."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.f, self.dtype = path.open("wb"), dtype

    def write(self, docs: list[list[int]]) -> int:
        n = sum(len(d) for d in docs)
        flat = np.fromiter((i for d in docs for i in d), dtype=self.dtype, count=n)
        flat.astype(self.dtype.newbyteorder("<"), copy=False).tofile(self.f)
        return n

    def close(self, manifest: dict) -> None:
        self.f.close()

    def abort(self) -> None:
        self.f.close()


class _StoreSink:
    """Documents dealt to ``shards`` ArrayRecord files, one record each; the manifest at the end."""

    def __init__(self, folder: Path, shards: int, dtype: np.dtype):
        from array_record.python.array_record_module import ArrayRecordWriter

        folder.mkdir()
        self.folder, self.dtype, self.n = folder, dtype.newbyteorder("<"), 0
        self.names = [f"shard-{i:05d}-of-{shards:05d}" for i in range(shards)]
        self.writers = [ArrayRecordWriter(str(folder / f"{n}.array_record"), "group_size:1") for n in self.names]
        self.lengths: list[list[int]] = [[] for _ in range(shards)]

    def write(self, docs: list[list[int]]) -> int:
        for d in docs:
            s = self.n % len(self.writers)
            self.writers[s].write(np.asarray(d, self.dtype).tobytes())
            self.lengths[s].append(len(d))
            self.n += 1
        return sum(len(d) for d in docs)

    def close(self, manifest: dict) -> None:
        from h2jax.data._stores import MANIFEST, STORE_FORMAT, STORE_VERSION

        for w in self.writers:
            w.close()
        self.writers = []
        shards = []
        for name, lens in zip(self.names, self.lengths):
            np.save(self.folder / f"{name}.lengths.npy", np.asarray(lens, np.int64))
            shards.append(
                {
                    "file": f"{name}.array_record",
                    "lengths": f"{name}.lengths.npy",
                    "documents": len(lens),
                    "tokens": sum(lens),
                }
            )
        body = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "dtype": self.dtype.name,
            **manifest,
            "documents": self.n,
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
        }
        (self.folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")

    def abort(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []


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
