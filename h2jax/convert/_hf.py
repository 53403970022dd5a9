"""Hugging Face LLaMA checkpoints <-> h2jax's plan-independent checkpoint layout.

Tensor names (Hugging Face ``LlamaForCausalLM``; its Linear weights are [out, in], h2jax's
matrices [in, out], so every projection is transposed):

====================================================  =================================
Hugging Face                                          h2jax (``params/`` + model path)
====================================================  =================================
model.embed_tokens.weight [vocab, d]                  embed/embedding [vocab, d]
model.layers.{i}.input_layernorm.weight [d]           blocks/{i}/attn_norm/scale
model.layers.{i}.self_attn.{q,k,v}_proj.weight        blocks/{i}/attn/{wq,wk,wv} (T)
model.layers.{i}.self_attn.o_proj.weight              blocks/{i}/attn/wo (T)
model.layers.{i}.post_attention_layernorm.weight      blocks/{i}/mlp_norm/scale
model.layers.{i}.mlp.{gate,up,down}_proj.weight       blocks/{i}/mlp/{w_gate,w_up,w_down} (T)
model.norm.weight [d]                                 head/norm/scale
lm_head.weight [vocab, d] (untied only)               head/lm_head [d, vocab] (T)
====================================================  =================================

Both sides use rotate-half rotary positions on the same head layout (Hugging Face's
conversion of Meta's weights already permuted q and k into it), so no permutation is
needed. h2jax keeps parameters in float32: bfloat16/float16 tensors are widened exactly on
import; export writes float32 (bit-identical on re-import) or, on request, rounds to
bfloat16/float16.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from h2jax.models import GPTConfig, RopeScaling

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
"""Hugging Face classes whose tensors and maths are h2jax's LLaMA (Mistral: without a sliding
window shorter than the training context)."""
SAFETENSORS_HINT = "the safetensors package is needed: pip install 'h2jax[hf]'"


class ConvertError(ValueError):
    """A checkpoint that cannot be converted: names the tensor or config key, and the shapes."""


# -- configs ---------------------------------------------------------------------------------
def _hf_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from a config.json: transformers 4's rope_theta + rope_scaling,
    or transformers 5's rope_parameters."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling, where = dict(params), "rope_parameters"
    else:
        theta, scaling, where = hf.get("rope_theta", 10000.0), hf.get("rope_scaling"), "rope_scaling"
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling(type="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        try:
            return float(theta), RopeScaling(
                type="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConvertError(f"config.json: {where} of type llama3 lacks {e.args[0]}") from None
    raise ConvertError(f"config.json: {where}.rope_type={kind!r}; h2jax computes 'default', 'linear' and 'llama3'")


def config_from_hf(hf: Mapping[str, Any], *, seq_len: int | None = None, dtype: str = "float32") -> GPTConfig:
    """The h2jax model config of a Hugging Face LLaMA config.json (a dict).

    `seq_len`: the training context (default: max_position_embeddings, at most 4096); the
    weights do not depend on it."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if not any(a in ARCHITECTURES for a in archs) and hf.get("model_type") not in ("llama", "mistral"):
        raise ConvertError(f"config.json: architectures={archs}; h2jax converts {', '.join(ARCHITECTURES)}")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise ConvertError(f"config.json: {key}={hf[key]!r}; h2jax's LLaMA supports {key}={ok!r} only")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        theta, scaling = _hf_rope(hf)
        head_dim = hf.get("head_dim")
        if head_dim is not None and int(head_dim) != d // heads:
            raise ConvertError(
                f"config.json: head_dim={head_dim} but hidden_size / num_attention_heads = {d} / {heads}; "
                "h2jax's LLaMA has head_dim = hidden_size / num_attention_heads"
            )
        max_pos = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        context = int(seq_len if seq_len is not None else min(max_pos, 4096))
        if window is not None and int(window) < context:
            raise ConvertError(
                f"config.json: sliding_window={window} is shorter than the training context {context} "
                "(--seq-len): h2jax's attention is full causal, so only --seq-len <= sliding_window is exact"
            )
        return GPTConfig(
            vocab_size=int(hf["vocab_size"]),
            seq_len=context,
            d_model=d,
            n_heads=heads,
            n_layers=int(hf["num_hidden_layers"]),
            d_ff=int(hf["intermediate_size"]),
            rope_theta=theta,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            dtype=dtype,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConvertError):
            raise
        raise ConvertError(f"config.json: {e}") from None


def config_to_hf(cfg: GPTConfig, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config.json (transformers 4 keys, which 5 also reads)."""
    rs = cfg.rope_scaling
    scaling = None
    if rs is not None and rs.type == "linear":
        scaling = {"rope_type": "linear", "factor": rs.factor}
    elif rs is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max(cfg.seq_len, rs.original_max_position_embeddings if rs else 0),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
    }


# -- tensor names ----------------------------------------------------------------------------
def _layer_names(i: int) -> dict[str, tuple[str, bool]]:
    """h2jax model path -> (Hugging Face name, transposed) of block i."""
    hf = f"model.layers.{i}"
    return {
        f"blocks/{i}/attn_norm/scale": (f"{hf}.input_layernorm.weight", False),
        f"blocks/{i}/attn/wq": (f"{hf}.self_attn.q_proj.weight", True),
        f"blocks/{i}/attn/wk": (f"{hf}.self_attn.k_proj.weight", True),
        f"blocks/{i}/attn/wv": (f"{hf}.self_attn.v_proj.weight", True),
        f"blocks/{i}/attn/wo": (f"{hf}.self_attn.o_proj.weight", True),
        f"blocks/{i}/mlp_norm/scale": (f"{hf}.post_attention_layernorm.weight", False),
        f"blocks/{i}/mlp/w_gate": (f"{hf}.mlp.gate_proj.weight", True),
        f"blocks/{i}/mlp/w_up": (f"{hf}.mlp.up_proj.weight", True),
        f"blocks/{i}/mlp/w_down": (f"{hf}.mlp.down_proj.weight", True),
    }


def hf_tensor_names(cfg: GPTConfig) -> dict[str, tuple[str, bool]]:
    """h2jax model path (without ``params/``) -> (Hugging Face tensor name, transposed)."""
    names = {"embed/embedding": ("model.embed_tokens.weight", False)}
    for i in range(cfg.n_layers):
        names |= _layer_names(i)
    names["head/norm/scale"] = ("model.norm.weight", False)
    if not cfg.tie_embeddings:
        names["head/lm_head"] = ("lm_head.weight", True)
    return names


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Model path -> shape of every parameter of the model `cfg` builds (abstractly: no arrays)."""
    import jax
    from flax import nnx

    from h2jax.models import build_model

    abstract = nnx.eval_shape(lambda: build_model(cfg, seed=0))
    _, params = nnx.split(abstract, nnx.Param)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if keys and keys[-1] == "value":
            keys = keys[:-1]
        out["/".join(keys)] = tuple(leaf.shape)
    return out


# -- reading and writing safetensors ---------------------------------------------------------
def _safetensors():
    try:
        import safetensors.numpy as stn
        from safetensors import safe_open
    except ImportError:
        raise ConvertError(SAFETENSORS_HINT) from None
    return stn, safe_open


def read_hf_params(hf_dir: str | Path, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """The float32 parameters of a Hugging Face directory, keyed by h2jax model path.

    Every tensor the model needs must be there with the shape the config implies; tensors the
    model does not use are refused too (except a tied lm_head equal to the embedding, and
    rotary caches), so a checkpoint of another architecture never half-loads."""
    _, safe_open = _safetensors()
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no *.safetensors files (h2jax reads safetensors, not PyTorch .bin)")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():
                where[name] = f
    names = hf_tensor_names(cfg)
    shapes = param_shapes(cfg)
    wanted = {hf for hf, _ in names.values()}
    ignorable = re.compile(r".*rotary_emb\.inv_freq$")
    extra = sorted(n for n in where if n not in wanted and not ignorable.match(n))
    if cfg.tie_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # checked below: must equal the embedding
    if extra:
        raise ConvertError(
            f"{hf_dir}: tensor {extra[0]} is not part of a {ARCHITECTURES[0]} with this config.json "
            f"({len(extra)} unexpected tensors)"
        )
    out: dict[str, np.ndarray] = {}
    handles: dict[Path, Any] = {}
    try:
        for path, (hf_name, transposed) in names.items():
            if hf_name not in where:
                raise ConvertError(f"{hf_dir}: tensor {hf_name} is missing (h2jax {path}, shape {shapes[path]})")
            f = where[hf_name]
            if f not in handles:
                handles[f] = safe_open(f, framework="flax").__enter__()
            array = _to_f32(_get(handles[f], hf_name), hf_name)
            want = shapes[path][::-1] if transposed else shapes[path]
            if array.shape != want:
                raise ConvertError(
                    f"{hf_dir}: tensor {hf_name} has shape {list(array.shape)}, the config implies {list(want)}"
                )
            out[path] = np.ascontiguousarray(array.T) if transposed else array
        if cfg.tie_embeddings and "lm_head.weight" in where:
            f = where["lm_head.weight"]
            if f not in handles:
                handles[f] = safe_open(f, framework="flax").__enter__()
            head = _to_f32(_get(handles[f], "lm_head.weight"), "lm_head.weight")
            if head.shape != out["embed/embedding"].shape or not np.array_equal(head, out["embed/embedding"]):
                raise ConvertError(
                    f"{hf_dir}: tie_word_embeddings=true but lm_head.weight {list(head.shape)} differs from "
                    "model.embed_tokens.weight"
                )
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out


def _get(handle, name: str) -> np.ndarray:
    """One tensor as a numpy array (bfloat16 as ml_dtypes'). Read through safetensors' JAX
    loader, which knows bfloat16 (its numpy loader does not), onto the host CPU so that a
    large checkpoint never lands in accelerator memory."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(handle.get_tensor(name))


def _to_f32(array: np.ndarray, name: str) -> np.ndarray:
    if array.dtype in (np.float32, np.dtype(ml_dtypes.bfloat16), np.float16):
        return array.astype(np.float32)
    raise ConvertError(f"tensor {name} has dtype {array.dtype}; expected float32, bfloat16 or float16")


HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
"""A Hugging Face folder's files besides the weights and config.json that ``AutoTokenizer`` and
``generate`` read: import keeps them beside the checkpoint, export writes them back."""
HF_SOURCE_CONFIG = "hf_config.json"  # the source's config.json, kept by import for export
_FROM_SOURCE = ("bos_token_id", "eos_token_id", "pad_token_id")


def _side_dir(ckpt_dir: Path) -> Path | None:
    """Where a checkpoint's Hugging Face side files are: beside it (a converted checkpoint), or
    beside the tokenizer its run trained with (the run folder's config.yaml ``data.tokenizer``:
    a fine-tuning run of a converted checkpoint)."""
    import yaml

    if any((ckpt_dir / n).is_file() for n in (*HF_SIDE_FILES, HF_SOURCE_CONFIG)):
        return ckpt_dir
    run_config = ckpt_dir.parent / "config.yaml"
    try:
        tokenizer = ((yaml.safe_load(run_config.read_text()) or {}).get("data") or {}).get("tokenizer")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if tokenizer and Path(tokenizer).is_file():
        return Path(tokenizer).parent
    return None


def import_hf(
    hf_dir: str | Path, out_dir: str | Path, *, seq_len: int | None = None, dtype: str = "float32"
) -> GPTConfig:
    """Write step 0 of an h2jax checkpoint directory from a Hugging Face LLaMA directory.

    `out_dir` gets the checkpoint (``parts/``, ``commits/``), ``model.yaml`` (``model:`` and,
    when the source has one, ``data.tokenizer``: paste or merge into an experiment) and a copy
    of ``tokenizer.json``. Returns the model config."""
    import jax
    import yaml

    from h2jax.checkpoint import CheckpointStore
    from h2jax.config import config_to_dict

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{cfg_path}: not valid JSON: {e}") from None
    cfg = config_from_hf(hf, seq_len=seq_len, dtype=dtype)
    params = read_hf_params(hf_dir, cfg)
    store = CheckpointStore(out_dir, async_save=False)
    if store.latest_committed() is not None:
        raise ConvertError(f"{out_dir} already holds a checkpoint; convert into a new directory")
    cpu = jax.devices("cpu")[0]
    state = {f"params/{k}": jax.device_put(params.pop(k), cpu) for k in list(params)}  # one copy at a time
    model = _model_dict(cfg, config_to_dict)
    store.save(0, state, {"step": 0, "model": model, "source": {"huggingface": str(hf_dir.absolute())}})
    store.close()
    experiment: dict[str, Any] = {"model": model}
    for name in HF_SIDE_FILES:  # what an export needs to make a usable model folder again
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
    (out_dir / HF_SOURCE_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    if (hf_dir / "tokenizer.json").is_file():
        experiment["data"] = {"tokenizer": str((out_dir / "tokenizer.json").absolute())}
    (out_dir / "model.yaml").write_text(yaml.safe_dump(experiment, sort_keys=False))
    return cfg


def _model_dict(cfg: GPTConfig, config_to_dict) -> dict[str, Any]:
    """The model section as an experiment's config.yaml and checkpoint meta hold it."""
    from h2jax.config import ExperimentConfig

    return config_to_dict(replace(ExperimentConfig(), model=cfg))["model"]


def _model_from_meta(raw: Mapping[str, Any], where: str) -> GPTConfig:
    from h2jax._strict import build_dataclass

    try:
        return build_dataclass(GPTConfig, dict(raw), "model")
    except ValueError as e:
        raise ConvertError(f"{where}: {e}") from None


def export_hf(
    ckpt_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str = "float32"
) -> tuple[GPTConfig, list[str]]:
    """Write a committed step of an h2jax checkpoint directory as a Hugging Face LLaMA directory:
    config.json, model.safetensors, and the side files (``HF_SIDE_FILES``) found beside the
    checkpoint or beside the tokenizer its run trained with; the source model's context length
    and special token ids come back from the config import kept. Returns the model config and
    the files written."""
    import jax

    from h2jax.checkpoint import CheckpointError, CheckpointStore

    stn, _ = _safetensors()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"--dtype {dtype}: expected float32, bfloat16 or float16")
    store = CheckpointStore(ckpt_dir)
    try:
        step = store.latest_committed() if step is None else step
        if step is None:
            raise ConvertError(f"{ckpt_dir}: holds no committed checkpoint")
        meta = store.read_meta(step)
        if "model" not in meta:
            raise ConvertError(f"{ckpt_dir} step {step}: its meta records no model config")
        cfg = _model_from_meta(meta["model"], f"{ckpt_dir} step {step}")
        have = store.shapes(step)
        names = hf_tensor_names(cfg)
        shapes = param_shapes(cfg)
        for path in names:
            got = have.get(f"params/{path}")
            if got is None:
                raise ConvertError(f"{ckpt_dir} step {step}: params/{path} is missing (shape {shapes[path]})")
            if tuple(got[0]) != shapes[path]:
                raise ConvertError(
                    f"{ckpt_dir} step {step}: params/{path} has shape {list(got[0])}, the model {list(shapes[path])}"
                )
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        targets = {f"params/{p}": jax.ShapeDtypeStruct(shapes[p], np.float32, sharding=cpu) for p in names}
        arrays = store.restore(step, targets)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    finally:
        store.close()
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    tensors = {}
    for path, (hf_name, transposed) in names.items():
        a = np.asarray(arrays[f"params/{path}"])
        tensors[hf_name] = np.ascontiguousarray(a.T if transposed else a).astype(np_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stn.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg, torch_dtype=dtype)
    side = _side_dir(Path(ckpt_dir))
    copied: list[str] = []
    if side is not None:
        source = side / HF_SOURCE_CONFIG
        if source.is_file():  # the source model's context and special tokens, which training keeps
            src = json.loads(source.read_text())
            hf["max_position_embeddings"] = max(
                hf["max_position_embeddings"], int(src.get("max_position_embeddings", 0))
            )
            hf.update({k: src[k] for k in _FROM_SOURCE if k in src})
        for name in HF_SIDE_FILES:
            if (side / name).is_file():
                shutil.copyfile(side / name, out / name)
                copied.append(name)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return cfg, ["config.json", "model.safetensors", *copied]


def load_model(ckpt_dir: str | Path, *, step: int | None = None):
    """The model of a committed step of an h2jax checkpoint directory (e.g. `import_hf`'s), on
    the host: for evaluation, inference and tests. Returns (config, model)."""
    import jax
    from flax import nnx

    from h2jax.checkpoint import CheckpointError, CheckpointStore
    from h2jax.models import build_model

    store = CheckpointStore(ckpt_dir)
    try:
        step = store.latest_committed() if step is None else step
        if step is None:
            raise ConvertError(f"{ckpt_dir}: holds no committed checkpoint")
        cfg = _model_from_meta(store.read_meta(step).get("model") or {}, f"{ckpt_dir} step {step}")
        model = build_model(cfg, seed=0)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        shapes = param_shapes(cfg)
        targets = {f"params/{p}": jax.ShapeDtypeStruct(s, np.float32, sharding=cpu) for p, s in shapes.items()}
        arrays = store.restore(step, targets)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    finally:
        store.close()
    leaves = [arrays[f"params/{p}"] for p in shapes]  # param_shapes walks the State in leaf order
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)
    return cfg, nnx.merge(graphdef, params, rest)
