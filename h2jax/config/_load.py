"""Load an experiment: defaults <- YAML file <- dotted ``key=value`` overrides, then validate.

Everything here runs before any device is touched, so a bad config costs nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from h2jax._paths import find_experiment
from h2jax._strict import VALUE_CHECKS, build_dataclass, read_yaml, to_raw
from h2jax.comm import ENGINES, PROCESS_TRANSPORTS, TRANSPORTS
from h2jax.config._chips import resolve_chip
from h2jax.config._errors import ConfigError
from h2jax.config._gin import read_gin
from h2jax.config._inputs import check_inputs
from h2jax.config._schema import ExperimentConfig
from h2jax.models import GPTConfig, tensor_divisible_dims
from h2jax.plan import PlanError, check_plan

TOKEN_DTYPES = ("uint16", "uint32")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
NONFINITE_POLICIES = ("abort", "skip")


def default_raw() -> dict[str, Any]:
    """The embedded default experiment as plain data (chips by name and node count)."""
    raw = to_raw(ExperimentConfig())
    raw["cluster"]["chips"] = {name: {"nodes": spec["nodes"]} for name, spec in raw["cluster"]["chips"].items()}
    return raw


def _merge(base: dict, top: dict, path: str = "") -> dict:
    out = dict(base)
    for k, v in top.items():
        here = f"{path}.{k}" if path else str(k)
        # a cluster lists its chips in full, a plan of several pipelines its pipelines: the
        # default chips, or the default one-pipeline plan's stages, must not leak into them
        whole = here == "cluster.chips" or (here == "plan" and isinstance(v, dict) and "pipelines" in v)
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not whole:
            out[k] = _merge(out[k], v, here)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``plan.stages.1.tensor=2`` -> (["plan", "stages", "1", "tensor"], 2)."""
    if "=" not in text:
        raise ConfigError(text, "override must look like key=value (e.g. plan.num_microbatches=16)")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(text, "override key must be a dotted path like train.steps")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {value!r} is not valid YAML: {e}") from e
    return key.split("."), parsed


def apply_override(raw: dict, parts: list[str], value: Any) -> None:
    node: Any = raw
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        key = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.lstrip("-").isdigit():
                raise ConfigError(key, f"{'.'.join(parts[:i])} is a list; expected an index, got {part!r}")
            idx = int(part)
            if not -len(node) <= idx < len(node):
                raise ConfigError(key, f"index {idx} out of range; the list has {len(node)} items")
            if last:
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if part not in node or node[part] is None:
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError(key, f"{'.'.join(parts[:i])} is {node!r}, not a mapping or list")


def load_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    raw = default_raw()
    if path is not None:
        p = find_experiment(path)
        if p.suffix == ".gin":
            user = read_gin(p).raw
        else:
            user = read_yaml(p, key="config") or {}
        if not isinstance(user, dict):
            raise ConfigError("config", f"{p} must hold a mapping at the top, got {type(user).__name__}")
        if "stages" in user and "plan" not in user:  # a plan file (h2jax plan's plan.yaml, a run's record)
            raise ConfigError(
                "config",
                f"{p} is a plan (top-level stages:), not an experiment; expected an experiment file: train "
                f"the experiment.yaml `h2jax plan --out` writes beside it, or put this file under `plan:`",
            )
        raw = _merge(raw, user)
    raw = copy.deepcopy(raw)
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return raw


def build(raw: dict[str, Any]) -> ExperimentConfig:
    raw = dict(raw)
    cluster = raw.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("chips"), dict):
        chips = {name: resolve_chip(str(name), spec) for name, spec in cluster["chips"].items()}
        raw["cluster"] = {**cluster, "chips": chips}
    return build_dataclass(ExperimentConfig, raw, "")


def check_model_values(values: dict[str, Any], key: str = "model") -> None:
    """The model's own value checks, on plain field values (before GPTConfig exists)."""
    for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
        if values[name] < 1:
            raise ConfigError(f"{key}.{name}", f"{name}={values[name]}; expected >= 1")
    for name in ("rope_theta", "norm_eps", "init_std"):
        if values[name] <= 0:
            raise ConfigError(f"{key}.{name}", f"{name}={values[name]}; expected > 0")
    d_model, n_heads = values["d_model"], values["n_heads"]
    if d_model % n_heads:
        raise ConfigError(f"{key}.n_heads", f"n_heads={n_heads} does not divide d_model={d_model}")
    if (d_model // n_heads) % 2:
        raise ConfigError(
            f"{key}.d_model",
            f"head_dim = d_model/n_heads = {d_model}/{n_heads} = {d_model // n_heads}; rotary positions need it even",
        )
    if values["dtype"] not in MODEL_DTYPES:
        raise ConfigError(f"{key}.dtype", f"dtype={values['dtype']!r}; expected one of {list(MODEL_DTYPES)}")
    if "dropout" in values and not 0 <= values["dropout"] < 1:
        raise ConfigError(f"{key}.dropout", f"dropout={values['dropout']!r}; expected a probability 0 <= dropout < 1")


VALUE_CHECKS[GPTConfig] = check_model_values


AUTO_TRANSPORT = "auto"


def auto_transport() -> str:
    """What ``train.transport: auto`` stands for in this process: 'local' in one process, 'ffi'
    (the transfers inside the stage programs) in one of several a launcher started. Reads the
    launcher's environment variables only (h2jax.launch); nothing is started."""
    from h2jax.launch import LauncherError, detect_launch

    try:
        launch = detect_launch()
    except LauncherError as e:
        raise ConfigError("train.transport", f"'auto' reads the launcher's environment: {e}") from None
    return "ffi" if launch is not None and launch.size >= 2 else "local"


def check_launcher(transport: str, num_stages: int, *, launched: bool | None = None) -> None:
    """The launcher rule: a transport between processes (``PROCESS_TRANSPORTS``) needs this
    process to be one of several started by a launcher (mpirun, srun), one per stage; 'local'
    moves tensors inside one process. ``launched``: whether this process is one of several a
    launcher started (the trainer knows it from its world); None reads the launcher's
    environment variables (h2jax.launch; nothing is started): a transport inside one process
    under a launcher is refused as early as a transport between processes without one."""
    if launched is None:
        from h2jax.launch import LauncherError, detect_launch

        try:
            launch = detect_launch()
        except LauncherError as e:
            if transport not in PROCESS_TRANSPORTS:
                return
            raise ConfigError("train.transport", f"{transport!r} needs a launcher h2jax recognises: {e}") from None
        launched = launch is not None and launch.size >= 2
    if transport in PROCESS_TRANSPORTS and not launched:
        raise ConfigError(
            "train.transport",
            f"{transport!r} moves tensors between processes; run one process per stage (mpirun -np "
            f"{num_stages} h2jax train ...) or use transport 'local'",
        )
    if transport not in PROCESS_TRANSPORTS and launched:
        between = [repr(t) for t in PROCESS_TRANSPORTS]
        raise ConfigError(
            "train.transport",
            f"{transport!r} moves tensors inside one process; under mpirun use "
            f"{', '.join(between[:-1])} or {between[-1]}",
        )


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Cross-field checks; raises ConfigError naming the key and the numbers."""
    if cfg.name in ("", ".", "..") or "/" in cfg.name or "\\" in cfg.name or "\0" in cfg.name:
        raise ConfigError(
            "name",
            f"name={cfg.name!r}; expected one folder name (no '/', not '.' or '..'): the run folder is "
            f"<train.out_dir>/<name>",
        )
    m = cfg.model
    check_model_values(dataclasses.asdict(m))
    chips = cfg.cluster.chips
    if not chips:
        raise ConfigError("cluster.chips", "no chip types given; expected at least one (e.g. {sim_a: {nodes: 1}})")
    for name, spec in chips.items():
        if spec.name != name:
            raise ConfigError(f"cluster.chips.{name}", f"holds chip {spec.name!r}; expected the entry's own name")
    try:
        check_plan(
            cfg.plan,
            num_layers=m.n_layers,
            chip_devices={n: c.num_devices for n, c in chips.items()},
            devices_per_node={n: c.devices_per_node for n, c in chips.items()},
            divisible_by_tensor=tensor_divisible_dims(m),
        )
    except PlanError as e:
        raise ConfigError(e.key, e.message) from e
    t = cfg.train
    if t.steps < 1:
        raise ConfigError("train.steps", f"steps={t.steps}; expected >= 1")
    if t.log_every < 1:
        raise ConfigError("train.log_every", f"log_every={t.log_every}; expected >= 1")
    if not t.transfer_timeout_s > 0:
        raise ConfigError("train.transfer_timeout_s", f"transfer_timeout_s={t.transfer_timeout_s}; expected > 0")
    if t.transport == AUTO_TRANSPORT:
        cfg = replace(cfg, train=dataclasses.replace(t, transport=auto_transport()))
        t = cfg.train
    if t.transport not in TRANSPORTS:
        raise ConfigError(
            "train.transport", f"transport={t.transport!r}; expected one of {[AUTO_TRANSPORT, *TRANSPORTS]}"
        )
    check_launcher(t.transport, cfg.plan.num_stages)
    if cfg.comm.engine not in ENGINES:
        raise ConfigError("comm.engine", f"engine={cfg.comm.engine!r}; expected one of {list(ENGINES)}")
    if t.gantt_step != -1 and not 0 <= t.gantt_step < t.steps:
        raise ConfigError("train.gantt_step", f"gantt_step={t.gantt_step}; expected -1 or 0..{t.steps - 1}")
    if t.nonfinite not in NONFINITE_POLICIES:
        raise ConfigError("train.nonfinite", f"nonfinite={t.nonfinite!r}; expected one of {list(NONFINITE_POLICIES)}")
    bad = [s for s in t.inject_nonfinite_steps if not 0 <= s < t.steps]
    if bad:
        raise ConfigError("train.inject_nonfinite_steps", f"step {bad[0]} is outside 0..{t.steps - 1}")
    if t.eval_every < 0 or t.eval_batches < 1:
        key, v, want = (
            ("train.eval_every", t.eval_every, ">= 0 (0: none)")
            if t.eval_every < 0
            else ("train.eval_batches", t.eval_batches, ">= 1")
        )
        raise ConfigError(key, f"{key.split('.')[1]}={v}; expected {want}")
    d = cfg.data
    if not 0.0 <= d.holdout < 1.0:
        raise ConfigError("data.holdout", f"holdout={d.holdout}; expected a fraction 0 <= holdout < 1")
    if not d.packing and not d.sources:
        raise ConfigError("data.packing", "packing=false makes documents of data.sources sequences; it is not set")
    if d.holdout and not d.sources:
        raise ConfigError("data.holdout", f"holdout={d.holdout} holds out sequences of data.sources, which is not set")
    if t.eval_every and not (d.val_sources or (d.sources and d.holdout)):
        raise ConfigError(
            "train.eval_every",
            f"eval_every={t.eval_every} needs validation data; expected data.val_sources={{path: weight}}, "
            "data.holdout > 0 with data.sources, or eval_every=0",
        )
    if t.eval_every and cfg.model.dropout > 0:
        raise ConfigError(
            "train.eval_every",
            f"eval_every={t.eval_every} with model.dropout={cfg.model.dropout}: the evaluation forward would "
            "drop units (no evaluation mode yet); expected model.dropout=0 or eval_every=0",
        )
    c = cfg.checkpoint
    if c.dir is not None and not c.dir.strip():
        raise ConfigError("checkpoint.dir", "dir is empty; give a path, or null for <run folder>/checkpoints")
    if c.every_steps < 0:
        raise ConfigError("checkpoint.every_steps", f"every_steps={c.every_steps}; expected >= 0 (0: only at the end)")
    if c.keep_last < 1:
        raise ConfigError(
            "checkpoint.keep_last", f"keep_last={c.keep_last}; expected >= 1 (the latest step is the restart point)"
        )
    if c.keep_every < 0:
        raise ConfigError("checkpoint.keep_every", f"keep_every={c.keep_every}; expected >= 0 (0: none)")
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError("optimizer.lr", f"lr={o.lr}; expected > 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError("optimizer.min_lr_ratio", f"min_lr_ratio={o.min_lr_ratio}; expected 0..1")
    if o.warmup_steps < 0:
        raise ConfigError("optimizer.warmup_steps", f"warmup_steps={o.warmup_steps}; expected >= 0")
    d = cfg.data
    if d.token_dtype not in TOKEN_DTYPES:
        raise ConfigError("data.token_dtype", f"token_dtype={d.token_dtype!r}; expected one of {list(TOKEN_DTYPES)}")
    return cfg


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """What a valid config says that is probably not meant: one line each, naming the keys
    (``h2jax check-config`` and ``h2jax train`` print them; nothing is refused)."""
    out = []
    o, t = cfg.optimizer, cfg.train
    if o.warmup_steps > t.steps:
        out.append(
            f"optimizer.warmup_steps={o.warmup_steps} is longer than train.steps={t.steps}: the learning rate "
            f"rises to {t.steps / o.warmup_steps:.0%} of optimizer.lr={o.lr:g} and never decays"
        )
    return out


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, check_files: bool = True
) -> ExperimentConfig:
    """The validated experiment from ``path`` (None: the embedded default) and overrides.

    ``check_files``: also check what the run reads and writes (:func:`check_inputs`: data and
    tokenizer files, output folders), so that a bad path fails here and not after the
    backends start. False: the config alone (e.g. to inspect an experiment of another machine).
    """
    cfg = validate(build(load_raw(path, overrides)))
    return check_inputs(cfg) if check_files else cfg


def config_to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    return to_raw(cfg)


def save_config(cfg: ExperimentConfig, path: str | Path, *, model: str | None = None) -> None:
    """The config as YAML; ``model``: the user's model class that trains instead of the built-in
    model (a gin selection), recorded as the file's first lines."""
    head = ""
    if model is not None:
        head = (
            f"# model: {model}\n# -- this class trains, not the built-in model: of the model keys below "
            f"only vocab_size, seq_len and n_layers (its blocks) apply to it\n"
        )
    Path(path).write_text(head + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def replace(cfg: ExperimentConfig, **changes: Any) -> ExperimentConfig:
    return dataclasses.replace(cfg, **changes)
