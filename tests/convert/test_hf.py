"""Hugging Face interop: a tiny random LLaMA made locally by transformers, converted by
`h2jax convert`, gives transformers' logits; export -> re-import is bit-identical; broken
checkpoints exit 2 naming the tensor and the shapes.

The reference tests need ``transformers`` and ``torch`` (the ``hf-test`` extra: several GB
with torch's CUDA libraries) and skip cleanly without them; the rest needs only
``safetensors`` (the ``hf`` extra). Nothing is downloaded: every checkpoint is made here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from h2jax.models import GPTConfig, RopeScaling

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from h2jax.convert import load_model  # noqa: E402
from tests._harness import hand_made_hf  # noqa: E402
from tests._harness import models_cli as _run  # noqa: E402

SEQ = 24
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # head_dim 8: one blended, three divided frequencies
}


def _hf_llama(tmp: Path, *, tied: bool, rope_scaling: dict | None) -> tuple[Path, object]:
    """A random LlamaForCausalLM saved by transformers (safetensors), and the torch model."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
        initializer_range=0.2,  # logits of a few units: differences in the maths would show
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not all ones: a swapped norm would show
    out = tmp / ("hf_tied" if tied else "hf_untied")
    model.save_pretrained(out, safe_serialization=True)
    return out, model


@pytest.mark.parametrize(("tied", "scaling"), [(False, LLAMA3), (True, LLAMA3), (False, None)])
def test_converted_logits_equal_transformers(tmp_path, tied, scaling):
    torch = pytest.importorskip("torch")
    hf_dir, hf_model = _hf_llama(tmp_path, tied=tied, rope_scaling=scaling)
    assert _run("convert", str(hf_dir), str(tmp_path / "ckpt")) == 0
    cfg, model = load_model(tmp_path / "ckpt")
    assert cfg.tie_embeddings is tied and cfg.kv_heads == 2
    assert cfg.rope_scaling == (None if scaling is None else RopeScaling(original_max_position_embeddings=16))

    tokens = np.random.default_rng(0).integers(0, 128, (3, SEQ), dtype=np.int32)
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.double().numpy()
    ours = np.asarray(model.logits(tokens), dtype=np.float64)
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits
    assert np.abs(ours - ref).max() <= 1e-4
    log_p, log_q = (x - np.logaddexp.reduce(x, axis=-1, keepdims=True) for x in (ref, ours))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    assert kl.max() <= 1e-6


def test_export_reimport_is_bit_identical(tmp_path):
    hf_dir, _ = _hf_llama(tmp_path, tied=False, rope_scaling=LLAMA3)
    assert _run("convert", str(hf_dir), str(tmp_path / "a")) == 0
    assert _run("convert", str(tmp_path / "a"), str(tmp_path / "hf_out")) == 0
    assert _run("convert", str(tmp_path / "hf_out"), str(tmp_path / "b")) == 0
    cfg_a, a = load_model(tmp_path / "a")
    cfg_b, b = load_model(tmp_path / "b")
    assert cfg_a == cfg_b
    import jax
    from flax import nnx

    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    # and the exported tensors are transformers' own, bit for bit
    orig = safetensors_numpy.load_file(str(hf_dir / "model.safetensors"))
    back = safetensors_numpy.load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert orig.keys() == back.keys()
    for k in orig:
        assert orig[k].dtype == back[k].dtype == np.float32 and orig[k].tobytes() == back[k].tobytes(), k


# -- checkpoints made by hand (safetensors only, no transformers) ---------------------------
CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=24, n_kv_heads=2)


def _hand_made(tmp: Path, cfg: GPTConfig = CFG, **kw) -> Path:
    return hand_made_hf(tmp, cfg, **kw)


def test_hand_made_checkpoint_converts(tmp_path):
    src = _hand_made(tmp_path)
    assert _run("convert", str(src), str(tmp_path / "ckpt"), "--seq-len", "8") == 0
    cfg, model = load_model(tmp_path / "ckpt")
    assert cfg == CFG
    wq = safetensors_numpy.load_file(str(src / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(model.blocks[1].attn.wq[...]), wq.T)
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    assert "tokenizer" in (tmp_path / "ckpt" / "model.yaml").read_text()


def test_bfloat16_checkpoints_in_and_out(tmp_path):
    """Published checkpoints are mostly bfloat16: widened exactly on import; export can round back."""
    import ml_dtypes

    src = _hand_made(tmp_path, dtype=ml_dtypes.bfloat16)
    assert _run("convert", str(src), str(tmp_path / "ckpt")) == 0
    _, model = load_model(tmp_path / "ckpt")
    assert _run("convert", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "bfloat16") == 0
    import safetensors.flax  # numpy's loader cannot read bfloat16

    orig = {k: np.asarray(v) for k, v in safetensors.flax.load_file(str(src / "model.safetensors")).items()}
    back = {
        k: np.asarray(v) for k, v in safetensors.flax.load_file(str(tmp_path / "back" / "model.safetensors")).items()
    }
    assert orig.keys() == back.keys()
    for k in orig:
        assert back[k].dtype == ml_dtypes.bfloat16 and orig[k].tobytes() == back[k].tobytes(), k
    wq = orig["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.blocks[0].attn.wq[...]), wq.T)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("edit", "config_edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), None, "model.layers.1.mlp.up_proj.weight is missing"),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 16), np.float32)}),
            None,
            "k_proj.weight has shape [16, 16], the config implies [8, 16]",
        ),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(16, np.float32)}), None, "q_proj.bias"),
        (None, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "architectures"),
        (None, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (None, lambda c: c.update(num_key_value_heads=3), "n_kv_heads=3"),
        (
            None,
            lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4),
            "sliding_window=4 is shorter than the training context 8",
        ),
    ],
)
def test_broken_checkpoints_exit_2_naming_the_tensor(tmp_path, capsys, edit, config_edit, message):
    src = _hand_made(tmp_path, edit=edit, config_edit=config_edit)
    assert _run("convert", str(src), str(tmp_path / "ckpt")) == 2
    err = capsys.readouterr().err
    assert message in err.replace("\n", " "), err
    assert not (tmp_path / "ckpt" / "commits").exists()


def test_mistral_without_a_short_window_converts(tmp_path):
    src = _hand_made(
        tmp_path, config_edit=lambda c: c.update(architectures=["MistralForCausalLM"], sliding_window=None)
    )
    assert _run("convert", str(src), str(tmp_path / "ckpt"), "--seq-len", "8") == 0
    assert load_model(tmp_path / "ckpt")[0] == CFG


def test_neither_kind_of_directory_exits_2(tmp_path, capsys):
    assert _run("convert", str(tmp_path), str(tmp_path / "out")) == 2
    assert "neither a Hugging Face model directory" in capsys.readouterr().err


def test_convert_refuses_a_folder_that_holds_files_and_overwrite_keeps_it_aside(tmp_path, capsys):
    """Export into an existing Hugging Face folder used to overwrite its weights and config and
    leave the old tokenizer mixed in (exit 0, no line); import and export refuse it now."""
    src = _hand_made(tmp_path)
    assert _run("convert", str(src), str(tmp_path / "ckpt"), "--seq-len", "8") == 0
    old = tmp_path / "hf_existing"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"theirs")
    (old / "tokenizer.json").write_text("{}")
    capsys.readouterr()
    for args in ((str(tmp_path / "ckpt"), str(old)), (str(src), str(old))):  # export, then import
        assert _run("convert", *args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "OUT" in err and "not empty" in err and "--overwrite" in err
        assert (old / "model.safetensors").read_bytes() == b"theirs"
    assert _run("convert", str(tmp_path / "ckpt"), str(old), "--overwrite") == 0
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("hf_existing.")]
    assert len(kept) == 1 and (kept[0] / "model.safetensors").read_bytes() == b"theirs"
    assert f"kept in {kept[0]}" in capsys.readouterr().err
    assert sorted(p.name for p in old.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((old / "tokenizer.json").read_text()) == json.loads((src / "tokenizer.json").read_text())


def test_an_export_is_a_model_folder_transformers_loads_whole(tmp_path):
    """The export of a converted checkpoint -- and of a run trained from it -- carries the
    source's tokenizer and generation files, context length and special token ids (it used to
    drop the tokenizer files, write the training seq_len as max_position_embeddings, and lose
    bos/eos)."""
    transformers = pytest.importorskip("transformers")
    import shutil

    import yaml
    from tokenizers import Tokenizer, models, pre_tokenizers

    def source(hf):
        hf.update(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)

    hf_dir = _hand_made(tmp_path, config_edit=source)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 32)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    (hf_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert _run("convert", str(hf_dir), str(tmp_path / "ckpt")) == 0
    # a run folder trained from it: its checkpoints/ beside a config.yaml naming the tokenizer
    run = tmp_path / "runs" / "ft"
    top = str(tmp_path / "ckpt")  # the checkpoint alone: not the files import keeps beside it
    shutil.copytree(top, run / "checkpoints", ignore=lambda d, names: [n for n in names if d == top and "." in n])
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(tmp_path / "ckpt" / "tokenizer.json")}}))
    for src, out in ((tmp_path / "ckpt", tmp_path / "out_a"), (run / "checkpoints", tmp_path / "out_b")):
        assert _run("convert", str(src), str(out)) == 0
        hf = json.loads((out / "config.json").read_text())
        assert (hf["max_position_embeddings"], hf["bos_token_id"], hf["eos_token_id"]) == (2048, 1, 2), out
        assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
        loaded = transformers.AutoTokenizer.from_pretrained(str(out))
        assert loaded("w3 w4")["input_ids"][-2:] == [3, 4] and loaded.eos_token == "</s>"
