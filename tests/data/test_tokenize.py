"""`h2jax tokenize`: the parallel, streamed token file equals encoding every document alone
in one process; the vocabulary must fit the dtype; jsonl fields; the file reads back as
data.token_file."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from h2jax import cli_models
from h2jax.data import _tokenize
from h2jax.data._dataset import TokenDataset
from h2jax.data._tokenize import _split_docs, tokenize_files

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu naïve café 東京 🙂".split()


def _text(n_paragraphs: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    paras = []
    for _ in range(n_paragraphs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 4))]
        paras.append("\n".join(lines))
    seps = ["\n\n", "\n\n\n", "\n  \n", "\n\n    "]
    return "".join(p + rng.choice(seps) for p in paras)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<unk>", "<s>"])
    tok.train_from_iterator([_text(200, seed=1)], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _reference(docs: list[str], tokenizer_file, dtype=np.uint16, eos="<|endoftext|>") -> np.ndarray:
    tok = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for d in docs:  # one document at a time, one process
        ids += tok.encode(d, add_special_tokens=False).ids + [tok.token_to_id(eos)]
    return np.asarray(ids, dtype=dtype)


@pytest.mark.parametrize("split", ["paragraph", "line", "file"])
def test_equals_one_process_encoding(tmp_path, tokenizer_file, monkeypatch, split):
    monkeypatch.setattr(_tokenize, "_READ_BYTES", 997)  # many block boundaries, inside characters too
    texts = [_text(300, seed=2), _text(50, seed=3)]
    paths = []
    for i, t in enumerate(texts):
        paths.append(tmp_path / f"part{i}.txt")
        paths[-1].write_text(t, encoding="utf-8")
    out = tmp_path / "tokens.bin"
    stats = tokenize_files(paths, out, tokenizer=tokenizer_file, split=split, batch_bytes=500, progress=False)
    docs = [d for t in texts for d in _split_docs(t, split)]
    expected = _reference(docs, tokenizer_file)
    got = np.fromfile(out, dtype=np.uint16)
    assert stats.documents == len(docs) and stats.tokens == got.size and stats.dtype == "uint16"
    np.testing.assert_array_equal(got, expected)
    assert TokenDataset.from_file(out, dtype="uint16", vocab_size=400).tokens.size == expected.size


def test_jsonl_field_bos_and_uint32(tmp_path, tokenizer_file):
    rows = [{"text": _text(3, seed=i), "id": i} for i in range(40)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.bin"
    tokenize_files([src], out, tokenizer=tokenizer_file, dtype="uint32", bos="<s>", batch_bytes=300, progress=False)
    tok = Tokenizer.from_file(str(tokenizer_file))
    expected = []
    for r in rows:
        expected += [tok.token_to_id("<s>")] + tok.encode(r["text"], add_special_tokens=False).ids
        expected += [tok.token_to_id("<|endoftext|>")]
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint32), np.asarray(expected, np.uint32))


def test_parquet_and_folders(tmp_path, tokenizer_file, capsys):
    """A Parquet file's text column over several row groups (empty rows skipped), within a
    folder of inputs (its files in path order, other suffixes left out), gives what encoding
    each document alone gives; a missing or non-text column is one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [_text(2, seed=10 + i) for i in range(30)] + [""]
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(31)), "body": texts}), corpus / "b.parquet", row_group_size=7)
    (corpus / "sub" / "c.jsonl").write_text(json.dumps({"body": "omega psi"}) + "\n")
    (corpus / "a.txt").write_text("alpha beta\n\ngamma")
    (corpus / "notes.csv").write_text("not,an,input\n")
    out = tmp_path / "t.bin"
    stats = tokenize_files([corpus], out, tokenizer=tokenizer_file, field="body", progress=False, batch_bytes=200)
    docs = ["alpha beta", "gamma", *texts[:-1], "omega psi"]  # a.txt, b.parquet, sub/c.jsonl
    assert stats.documents == len(docs)
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint16), _reference(docs, tokenizer_file))
    args = ["--tokenizer", str(tokenizer_file), "--no-progress", "--out", str(tmp_path / "x.bin")]
    assert _run("tokenize", str(corpus / "b.parquet"), *args) == 2
    assert "no column 'text' (--field); the file has ['id', 'body']" in capsys.readouterr().err
    assert _run("tokenize", str(corpus / "b.parquet"), *args, "--field", "id") == 2
    assert "column 'id' holds int64; expected text (string)" in capsys.readouterr().err
    assert _run("tokenize", str(corpus / "sub"), *args, "--field", "body") == 0


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="h2jax")
    cli_models.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_refuses_a_vocabulary_that_does_not_fit(tmp_path, capsys):
    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w5\n\nw7\n")
    out = tmp_path / "t.bin"
    assert _run("tokenize", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "big.json"), "--out", str(out),
                "--dtype", "uint16", "--no-progress") == 2  # fmt: skip
    assert "70,001 ids, more than uint16 holds (65,536)" in capsys.readouterr().err
    assert not out.exists()
    assert _run("tokenize", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "big.json"), "--out", str(out),
                "--eos", "none", "--no-progress") == 0  # fmt: skip
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint32), [1, 69999, 5, 7])  # auto: uint32


def test_bad_inputs_exit_2(tmp_path, tokenizer_file, capsys):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    args = ["--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "t.bin"), "--no-progress"]
    assert _run("tokenize", str(tmp_path / "a.jsonl"), *args) == 2
    assert "no string field 'text'" in capsys.readouterr().err
    assert _run("tokenize", str(tmp_path / "a.jsonl"), *args, "--field", "body", "--eos", "<nope>") == 2
    assert "'<nope>' is not a token" in capsys.readouterr().err
    assert _run("tokenize", str(tmp_path / "missing.txt"), *args) == 2


def test_progress_lines_when_not_a_terminal(tmp_path, tokenizer_file, capsys, monkeypatch):
    monkeypatch.setattr(_tokenize, "_READ_BYTES", 2000)
    (tmp_path / "a.txt").write_text(_text(400, seed=5))
    real = _tokenize._Report.__init__

    def every_call(self, total, *, enabled, every_s=10.0):
        real(self, total, enabled=enabled, every_s=0.0)

    monkeypatch.setattr(_tokenize._Report, "__init__", every_call)
    tokenize_files([tmp_path / "a.txt"], tmp_path / "t.bin", tokenizer=tokenizer_file, batch_bytes=1000)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("h2jax: tokenize: ")]
    total = (tmp_path / "a.txt").stat().st_size
    assert (
        len(lines) >= 3 and lines[-1].startswith(f"h2jax: tokenize: done {total}/{total}") and "tokens/s" in lines[-1]
    )
