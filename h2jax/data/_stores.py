"""Token stores: tokenized documents on disk, read by random access.

Three layouts, one reading contract (:class:`TokenStore`): the documents' token ids in
order, as one stream whose token ``t`` is reachable without reading what comes before.

- ``arrayrecord``: a folder that ``h2jax tokenize --format arrayrecord`` writes:
  ``manifest.json`` (counts, dtype, vocabulary, the tokenizer's identity, end-of-document
  id) and shards ``shard-NNNNN-of-MMMMM.array_record`` holding one record per document
  (its ids, little-endian), each with a ``.lengths.npy`` of its documents' lengths. Records
  are read through Grain's ``ArrayRecordDataSource``.
- ``megatron``: Megatron-LM's indexed dataset, ``<prefix>.bin`` + ``<prefix>.idx``
  (``MMIDIDX`` index: version 1, dtype code, sequence and document counts, int32
  sequence lengths, int64 byte pointers, int64 document indices). Each Megatron
  sequence is one document, as Megatron's GPT dataset reads it.
- ``tokens``: a flat file of ids (nanoGPT layout, ``data.token_dtype``); documents are
  what its end-of-document ids (``data.eod_id``) separate, else the file is one document.

Opening a store checks it (missing shard, index that does not match its ``.bin``,
manifest counts); every problem is a ConfigError naming ``key`` and the path.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from h2jax._strict import ConfigError

MANIFEST = "manifest.json"
STORE_FORMAT = "h2jax-token-store"
STORE_VERSION = 1

_MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py)
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


def tokenizer_identity(spec: str) -> str:
    """What names a tokenizer across machines: ``"byte"``, or the sha256 of its tokenizer.json."""
    if spec == "byte":
        return "byte"
    return "sha256:" + hashlib.sha256(Path(spec).read_bytes()).hexdigest()


@dataclass
class TokenStore:
    """One store's documents as a stream of ``num_tokens`` ids (documents in stored order).

    ``offsets``: int64 [num_documents + 1], where each document starts in the stream (None for
    a flat file whose documents are marked by ``eod_id`` alone)."""

    path: str
    kind: str
    dtype: np.dtype
    num_tokens: int
    offsets: np.ndarray | None
    eod_id: int | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None  # tokenizer_identity() of the tokenizer that wrote it, when recorded
    tokenizer_path: str | None = None  # where that tokenizer was, as `h2jax tokenize` was given it
    _flat: np.ndarray | None = field(default=None, repr=False)  # the stream itself, where it is one array
    _records: object | None = field(default=None, repr=False)  # Grain data source of documents

    @property
    def num_documents(self) -> int | None:
        return None if self.offsets is None else len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s ids (stores with an index)."""
        if self.offsets is None:
            raise ValueError(f"{self.path}: a flat token file has no document index")
        if self._flat is not None:
            return np.asarray(self._flat[self.offsets[i] : self.offsets[i + 1]])
        return np.frombuffer(self._records[int(i)], dtype=self.dtype)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, document number of each id) of stream tokens ``[start, stop)``; document
        numbers count from the store's first document (flat files: from ``start``'s)."""
        if not 0 <= start < stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the store's {self.num_tokens}")
        if self.offsets is None:
            ids = np.asarray(self._flat[start:stop])
            if self.eod_id is None:
                return ids, np.zeros(len(ids), np.int64)
            ends = (ids == self.eod_id).astype(np.int64)  # a document ends at its end-of-document id
            return ids, np.concatenate([[0], np.cumsum(ends[:-1])])
        pos = np.arange(start, stop)
        docs = np.searchsorted(self.offsets, pos, side="right") - 1
        if self._flat is not None:
            return np.asarray(self._flat[start:stop]), docs
        first, last = int(docs[0]), int(docs[-1])
        records = self._records.__getitems__(list(range(first, last + 1)))
        ids = np.concatenate([np.frombuffer(r, dtype=self.dtype) for r in records])
        base = int(self.offsets[first])
        return ids[start - base : stop - base], docs


def open_store(path: str | Path, *, key: str, token_dtype: str = "uint16", eod_id: int | None = None) -> TokenStore:
    """The store at ``path``: a folder with a manifest (arrayrecord), a Megatron prefix (or its
    ``.bin`` / ``.idx``), or a flat token file."""
    p = Path(path)
    if p.is_dir():
        if not (p / MANIFEST).is_file():
            raise ConfigError(
                key,
                f"{str(p)!r} is a folder without {MANIFEST}; expected a token store written by "
                "`h2jax tokenize --format arrayrecord`, a Megatron .bin/.idx prefix or a flat token file",
            )
        return _open_arrayrecord(p, key)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    idx, binf = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if idx.is_file() or (p.suffix == ".idx"):
        return _open_megatron(prefix, key)
    if p.is_file():
        from h2jax.data._dataset import open_token_file

        flat = open_token_file(p, dtype=token_dtype, key=key)
        return TokenStore(str(p), "tokens", flat.dtype, len(flat), None, eod_id=eod_id, _flat=flat)
    if binf.is_file():
        raise ConfigError(key, f"{str(idx)!r} does not exist beside {str(binf)!r}; expected Megatron's .idx index")
    raise ConfigError(
        key,
        f"{str(p)!r} does not exist; expected a token store folder, a Megatron .bin/.idx prefix or a flat token file",
    )


def read_manifest(folder: Path, key: str) -> dict:
    """The manifest of an arrayrecord store, checked for the keys h2jax reads."""
    path = folder / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(key, f"{str(path)!r} is not readable JSON ({e}); expected a token store manifest") from None
    if not isinstance(m, dict) or m.get("format") != STORE_FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ConfigError(key, f"{str(path)!r} has format {got!r}; expected {STORE_FORMAT!r}")
    if m.get("version") != STORE_VERSION:
        raise ConfigError(key, f"{str(path)!r} is version {m.get('version')!r}; this h2jax reads {STORE_VERSION}")
    missing = [k for k in ("dtype", "vocab_size", "tokenizer", "shards", "documents", "tokens") if k not in m]
    if missing:
        raise ConfigError(key, f"{str(path)!r} lacks {missing}; expected a manifest `h2jax tokenize` wrote")
    return m


def _open_arrayrecord(folder: Path, key: str) -> TokenStore:
    import grain

    m = read_manifest(folder, key)
    lengths, files = [], []
    for s in m["shards"]:
        shard, lens = folder / s["file"], folder / s["lengths"]
        for f in (shard, lens):
            if not f.is_file():
                raise ConfigError(
                    key, f"{str(f)!r} does not exist; the manifest of {str(folder)!r} lists it (a missing shard)"
                )
        n = np.load(lens)
        if len(n) != s["documents"] or int(n.sum()) != s["tokens"]:
            raise ConfigError(
                key,
                f"{str(lens)!r} holds {len(n)} documents of {int(n.sum())} tokens, the manifest says "
                f"{s['documents']} of {s['tokens']}; expected the files `h2jax tokenize` wrote together",
            )
        lengths.append(n.astype(np.int64))
        files.append(str(shard))
    records = grain.sources.ArrayRecordDataSource(files)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if len(records) != len(lengths):
        raise ConfigError(
            key, f"{str(folder)!r}: the shards hold {len(records)} records, their lengths files {len(lengths)}"
        )
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenStore(
        str(folder),
        "arrayrecord",
        np.dtype(m["dtype"]).newbyteorder("<"),
        int(offsets[-1]),
        offsets,
        eod_id=m.get("eod_id"),
        vocab_size=int(m["vocab_size"]),
        tokenizer=m["tokenizer"],
        tokenizer_path=m.get("tokenizer_path"),
        _records=records,
    )


def read_megatron_index(idx: Path, key: str) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, byte pointers, document indices) of a Megatron ``.idx``."""
    try:
        raw = idx.read_bytes()
    except OSError as e:
        raise ConfigError(key, f"{str(idx)!r} cannot be read ({e.strerror or e})") from None
    head = len(_MEGATRON_HEADER) + 8 + 1 + 8 + 8
    if len(raw) < head or not raw.startswith(_MEGATRON_HEADER):
        raise ConfigError(key, f"{str(idx)!r} is not a Megatron index (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, len(_MEGATRON_HEADER))
    if version != 1 or code not in MEGATRON_DTYPES:
        raise ConfigError(
            key, f"{str(idx)!r}: index version {version}, dtype code {code}; expected version 1, a known code"
        )
    need = head + n_seq * (4 + 8) + n_doc * 8
    if len(raw) < need:
        raise ConfigError(key, f"{str(idx)!r} has {len(raw)} bytes, its header promises {need}: the index is cut short")
    lengths = np.frombuffer(raw, "<i4", n_seq, head)
    pointers = np.frombuffer(raw, "<i8", n_seq, head + 4 * n_seq)
    docs = np.frombuffer(raw, "<i8", n_doc, head + 12 * n_seq)
    return MEGATRON_DTYPES[code], lengths, pointers, docs


def _open_megatron(prefix: Path, key: str) -> TokenStore:
    idx, binf = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if not binf.is_file():
        raise ConfigError(key, f"{str(binf)!r} does not exist beside {str(idx)!r}; expected Megatron's .bin data")
    dtype, lengths, pointers, _ = read_megatron_index(idx, key)
    dt = np.dtype(dtype).newbyteorder("<")
    if dt.kind not in "ui":
        raise ConfigError(key, f"{str(idx)!r} holds {dtype} values; expected integer token ids")
    size = binf.stat().st_size
    expected = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * dt.itemsize)])
    if len(lengths) and (not np.array_equal(pointers, expected[:-1]) or expected[-1] != size):
        raise ConfigError(
            key,
            f"{str(idx)!r} does not match {str(binf)!r}: it indexes {int(expected[-1])} bytes in "
            f"{len(lengths)} sequences, the .bin has {size}; expected the pair one tool wrote",
        )
    flat = np.memmap(binf, dtype=dt, mode="r") if size else np.zeros(0, dt)
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
    return TokenStore(str(prefix), "megatron", dt, int(offsets[-1]), offsets, _flat=flat)


def write_megatron(prefix: str | Path, documents: list[np.ndarray], dtype: str = "uint16") -> None:
    """Write ``documents`` as a Megatron indexed dataset, by the format's documented layout (one
    sequence per document): what ``tools/preprocess_data.py`` writes."""
    prefix = Path(prefix)
    dt = np.dtype(dtype).newbyteorder("<")
    code = {v: k for k, v in MEGATRON_DTYPES.items()}[np.dtype(dtype).name]
    lengths = np.array([len(d) for d in documents], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * dt.itemsize)])[:-1]
    with open(prefix.with_name(prefix.name + ".bin"), "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dt).tobytes())
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as f:
        f.write(_MEGATRON_HEADER)
        f.write(struct.pack("<QBQQ", 1, code, len(documents), len(documents) + 1))
        f.write(lengths.tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(len(documents) + 1, dtype="<i8").tobytes())
