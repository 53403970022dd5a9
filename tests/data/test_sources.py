"""Token stores and the sequence stream of ``data.sources``: each format yields the documents
it holds (a Megatron .bin/.idx written by the format's layout, ArrayRecord through `h2jax
tokenize`, flat files); packed sequences are the stream's windows with document segment ids;
mixtures hold their weights over 10,000 sequences; the position is plan-free; bad stores are
one line naming the path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from h2jax._strict import ConfigError
from h2jax.config import load_config
from h2jax.data import load_data, load_validation, open_store, open_stream, step_batch, write_megatron
from h2jax.data._tokenize import tokenize_files

SEQ = 16


def _docs(n: int, seed: int, vocab: int = 250) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(3, 40))).astype(np.uint16) for _ in range(n)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("stores")
    docs_a, docs_b = _docs(400, 0), _docs(150, 1)
    write_megatron(d / "a", docs_a)
    text = "\n\n".join(f"document {i}: " + "word " * (i % 17 + 1) for i in range(300))
    (d / "b.txt").write_text(text)
    tokenize_files([d / "b.txt"], d / "b", tokenizer="byte", format="arrayrecord", shards=3, progress=False)
    np.concatenate(docs_b).astype("<u2").tofile(d / "c.bin")
    return {"dir": d, "a": docs_a, "b_text": text, "c": docs_b}


def test_megatron_documents_are_what_the_index_says(stores):
    st = open_store(stores["dir"] / "a.bin", key="k")  # the .bin, the .idx or the prefix name one store
    assert (st.kind, st.num_documents) == ("megatron", 400)
    assert all(np.array_equal(st.document(i), d) for i, d in enumerate(stores["a"]))
    stream = np.concatenate(stores["a"])
    ids, docs = st.read(100, 300)
    np.testing.assert_array_equal(ids, stream[100:300])
    lengths = np.array([len(d) for d in stores["a"]])
    np.testing.assert_array_equal(docs, np.searchsorted(np.cumsum(lengths), np.arange(100, 300), side="right"))


def test_arrayrecord_store_of_tokenize_holds_every_document_dealt_to_its_shards(stores):
    st = open_store(stores["dir"] / "b", key="k")
    manifest = json.loads((stores["dir"] / "b" / "manifest.json").read_text())
    assert (st.kind, st.tokenizer, len(manifest["shards"])) == ("arrayrecord", "byte", 3)
    paras = stores["b_text"].split("\n\n")
    # document i went to shard i % 3: the store reads shard 0's documents, then 1's, then 2's
    order = [i for s in range(3) for i in range(s, len(paras), 3)]
    got = [bytes(st.document(k).astype(np.uint8)).decode() for k in range(st.num_documents)]
    assert got == [paras[i] for i in order]
    ids, docs = st.read(0, st.num_tokens)
    assert bytes(ids.astype(np.uint8)).decode() == "".join(paras[i] for i in order)
    assert docs[-1] == st.num_documents - 1


def test_a_packed_sequence_is_its_window_of_the_stream_and_segments_follow_documents(stores):
    s = open_stream({str(stores["dir"] / "a"): 1.0}, seq_len=SEQ, seed=3)
    stream = np.concatenate(stores["a"])
    starts = np.cumsum([0] + [len(d) for d in stores["a"]])
    assert s.sizes == [(len(stream) - 1) // SEQ]
    b = s.batch(0, 50)
    assert sorted(set(b.sequence)) == sorted(b.sequence)  # no repeat inside an epoch
    for row, seg, k in zip(b.tokens, b.segments, b.sequence):
        lo = k * SEQ
        np.testing.assert_array_equal(row, stream[lo : lo + SEQ + 1])
        doc = np.searchsorted(starts, np.arange(lo, lo + SEQ + 1), side="right")
        np.testing.assert_array_equal(seg, doc - doc[0] + 1)


def test_one_epoch_reads_every_sequence_once_and_the_next_epoch_reshuffles(stores):
    s = open_stream({str(stores["dir"] / "a"): 1.0}, seq_len=SEQ, seed=0)
    n = s.sizes[0]
    first, second = s.ids(0, n)[:, 1], s.ids(n, n)[:, 1]
    assert sorted(first) == list(range(n)) == sorted(second)
    assert not np.array_equal(first, second) and not np.array_equal(first, np.arange(n))
    assert s.epoch(2 * n) == 2.0


def test_a_mixture_holds_its_weights_over_ten_thousand_sequences(stores):
    d = stores["dir"]
    s = open_stream({str(d / "a"): 3.0, str(d / "b"): 1.0, str(d / "c.bin"): 1.0}, seq_len=SEQ, seed=1)
    ids = s.ids(0, 10_000)
    share = np.bincount(ids[:, 0], minlength=3) / len(ids)
    np.testing.assert_allclose(share, [0.6, 0.2, 0.2], atol=0.01)
    # the same position gives the same sequence, whoever asks and in what pieces
    np.testing.assert_array_equal(np.concatenate([s.ids(0, 4_000), s.ids(4_000, 6_000)]), ids)


def _cfg(sources, **over):
    args = [f"data.sources={json.dumps(sources)}", f"model.seq_len={SEQ}"] + [f"{k}={v}" for k, v in over.items()]
    return load_config("configs/tiny.yaml", overrides=args)


def test_the_batches_are_the_run_sequences_whatever_the_microbatch_split(stores):
    src = {str(stores["dir"] / "a"): 1.0, str(stores["dir"] / "b"): 1.0}
    four = _cfg(src, **{"plan.num_microbatches": 4})
    two = _cfg(src, **{"plan.num_microbatches": 2})
    assert four.plan.global_batch == two.plan.global_batch and four.plan.microbatch_size != two.plan.microbatch_size
    data = load_data(four)
    for step in range(3):
        t4, y4 = step_batch(data, four, step)
        t2, y2 = step_batch(data, two, step)
        np.testing.assert_array_equal(t4.reshape(-1, SEQ), t2.reshape(-1, SEQ))
        np.testing.assert_array_equal(y4[..., :-1], t4[..., 1:])
    # a larger global batch after a checkpoint at step 2 continues at the sequences consumed
    big = _cfg(src, **{"plan.global_batch": 8, "plan.num_microbatches": 4})
    consumed = 2 * four.plan.global_batch
    t_big, _ = step_batch(data, big, 2, position=consumed)
    rows = data.batch(consumed, 8).tokens[:, :-1]
    np.testing.assert_array_equal(t_big.reshape(-1, SEQ), rows)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_shard", "a missing shard"),
        ("other_tokenizer", "was tokenized with"),
        ("idx_of_another_bin", "does not match"),
        ("weight_zero", "expected a finite weight > 0"),
        ("too_short", "fewer than one sequence"),
        ("no_idx", "does not exist"),
    ],
)
def test_a_bad_source_is_one_line_naming_it(stores, tmp_path, case, expect):
    import shutil

    d = stores["dir"]
    src = {str(d / "a"): 1.0}
    tokenizer = "byte"
    if case == "missing_shard":
        shutil.copytree(d / "b", tmp_path / "b")
        (tmp_path / "b" / "shard-00001-of-00003.array_record").unlink()
        src = {str(tmp_path / "b"): 1.0}
    elif case == "other_tokenizer":
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>")).save(str(tmp_path / "t.json"))
        src, tokenizer = {str(d / "b"): 1.0}, str(tmp_path / "t.json")
    elif case == "idx_of_another_bin":
        shutil.copy(d / "a.idx", tmp_path / "x.idx")
        (tmp_path / "x.bin").write_bytes((d / "a.bin").read_bytes()[:-2])
        src = {str(tmp_path / "x"): 1.0}
    elif case == "weight_zero":
        src = {str(d / "a"): 1.0, str(d / "c.bin"): 0.0}
    elif case == "too_short":
        write_megatron(tmp_path / "s", [np.arange(1, 8, dtype=np.uint16)])
        src = {str(tmp_path / "s"): 1.0}
    elif case == "no_idx":
        (tmp_path / "y.bin").write_bytes(b"")
        src = {str(tmp_path / "y"): 1.0}
    with pytest.raises(ConfigError) as e:
        open_stream(src, seq_len=SEQ, seed=0, tokenizer=tokenizer)
    assert expect in str(e.value) and str(e.value).count("\n") == 0
    assert str(tmp_path) in str(e.value) or case == "weight_zero"


def test_the_reader_that_runs_ahead_gives_what_random_access_gives(stores):
    d = stores["dir"]
    s = open_stream({str(d / "a"): 2.0, str(d / "b"): 1.0}, seq_len=SEQ, seed=5)
    for start in (0, 8, 16, 1000, 24):  # continuing, jumping ahead, and back (a restore)
        a, b = s.batch(start, 8), s.next_batch(start, 8)
        for f in ("tokens", "segments", "source", "sequence"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_held_out_sequences_are_never_trained_on(stores):
    d = stores["dir"]
    src = {str(d / "a"): 1.0, str(d / "b"): 1.0}
    train = open_stream(src, seq_len=SEQ, seed=2, holdout=0.1)
    val = open_stream(src, seq_len=SEQ, seed=2, holdout=0.1, split="val")
    whole = open_stream(src, seq_len=SEQ, seed=2)
    for j, n in enumerate(whole.sizes):
        held = -(-n // 10)
        assert (train.sizes[j], val.sizes[j]) == (n - held - 1, held)
        seen_train = set(train.ids(0, 4 * train.epoch_length)[:, 1][train.ids(0, 4 * train.epoch_length)[:, 0] == j])
        seen_val = set(val.ids(0, 2 * val.epoch_length)[:, 1][val.ids(0, 2 * val.epoch_length)[:, 0] == j])
        assert seen_train == set(range(n - held - 1)) and seen_val == set(range(n - held, n))
        # no token is in both: the last training window ends before the first validation window starts
        assert (n - held - 2) * SEQ + SEQ + 1 <= (n - held) * SEQ


def test_unpacked_each_document_is_one_sequence_cut_or_padded_and_padding_has_no_loss(stores, tmp_path):
    from h2jax.data import PAD, loss_weights, split_rows, step_segments

    d, docs = stores["dir"], stores["a"]
    flat = tmp_path / "e.bin"  # stores["c"], each document ended by id 0
    np.concatenate([np.append(x, 0) for x in stores["c"]]).astype("<u2").tofile(flat)
    cfg = _cfg({str(d / "a"): 1.0, str(flat): 1.0}, **{"data.packing": False, "data.eod_id": 0})
    s = load_data(cfg)
    assert s.sizes == [400, 150] and "one document per sequence" in s.describe()
    assert f"400 documents ({sum(len(x) > SEQ + 1 for x in docs)} cut to {SEQ + 1} tokens)" in s.describe()
    for k in (0, 7, 399):  # document k, cut to SEQ + 1 tokens or padded after its end
        ids, seg = s.sequence(0, k)
        n = min(len(docs[k]), SEQ + 1)
        np.testing.assert_array_equal(ids[:n], docs[k][:n])
        assert (ids[n:] == PAD).all() and seg.tolist() == [1] * n + [0] * (SEQ + 1 - n)
    for k in (0, 149):  # a flat file's documents end at data.eod_id (which they keep)
        want = np.append(stores["c"][k], 0)[: SEQ + 1]
        np.testing.assert_array_equal(s.sequence(1, k)[0][: len(want)], want)
    ids = s.ids(0, s.epoch_length)
    assert sorted(ids[ids[:, 0] == 0, 1].tolist()) == list(range(400))  # one epoch: every document once
    tokens, targets = step_batch(s, cfg, 0)
    rows = s.batch(0, cfg.plan.global_batch).tokens.reshape(tokens.shape[0], tokens.shape[1], -1)
    assert (targets == rows[..., 1:]).all() and (tokens == np.where(rows[..., :-1] == PAD, 0, rows[..., :-1])).all()
    assert step_segments(s, cfg, 0) is None  # one document a row: causal attention is enough
    w = loss_weights(targets)
    real = (targets >= 0).sum(axis=(1, 2))
    assert (targets < 0).any() and np.allclose(w, real / real.sum()) and abs(w.sum() - 1) < 1e-6
    assert loss_weights(split_rows(np.arange(2 * 3 * 5).reshape(2, 3, 5))[1]) is None  # nothing padded
    with pytest.raises(ConfigError, match="has no document boundaries; expected data.eod_id"):
        load_data(_cfg({str(d / "c.bin"): 1.0}, **{"data.packing": False}))
    held = load_data(_cfg({str(d / "a"): 1.0}, **{"data.packing": False, "data.holdout": 0.1}))
    val = load_validation(_cfg({str(d / "a"): 1.0}, **{"data.packing": False, "data.holdout": 0.1}))
    assert (held.sizes, val.sizes, val.first) == ([360], [40], [360])  # documents, no gap needed


def test_a_resume_with_another_mixture_says_so_in_one_line(stores):
    from h2jax.runtime._state import checkpoint_meta, data_position

    d = stores["dir"]
    before = _cfg({str(d / "a"): 3.0, str(d / "b"): 1.0})
    after = _cfg({str(d / "a"): 1.0, str(d / "b"): 1.0})
    meta = checkpoint_meta(before, 2, 0, 16)
    step, _, consumed, warning = data_position(meta, after, "ckpt step 2")
    assert (step, consumed) == (2, 16)
    assert "the stream continues at sequence 16 of the new mixture" in warning and "\n" not in warning
    assert data_position(meta, before, "ckpt step 2")[3] is None


def test_data_inspect_says_what_a_store_holds_and_decodes_documents(stores, capsys):
    import argparse

    from h2jax import cli_models

    args = argparse.Namespace(
        paths=[str(stores["dir"] / "b"), str(stores["dir"] / "a")],
        tokenizer=None,
        samples=2,
        chars=30,
        token_dtype="uint16",
    )
    assert cli_models.cmd_data_inspect(args) == 0
    out = capsys.readouterr().out
    paras = stores["b_text"].split("\n\n")
    assert "arrayrecord, 300 documents" in out and "megatron, 400 documents" in out
    assert repr(paras[0][:30]) in out and repr(paras[3][:30]) in out  # shard 0 holds documents 0, 3, ...
    assert "(no tokenizer to decode with: --tokenizer)" in out  # a Megatron store records none
    args.paths = [str(stores["dir"] / "nothing")]
    assert cli_models.cmd_data_inspect(args) == 2
    assert "nothing' does not exist" in capsys.readouterr().err
