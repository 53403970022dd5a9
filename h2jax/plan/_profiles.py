"""Planner inputs: chip profiles, clusters, model shapes and per-layer cost tables.

Everything the cost model needs to price a stage, and nothing that needs a device:

- :class:`ChipProfile` -- one chip type's node count, memory, peak FLOP/s and bandwidths,
  read from ``configs/chips/<name>.yaml`` by :func:`load_chip`: the one chip type and the
  one parser of h2jax (``h2jax.config`` holds these in ``cluster.chips`` as ``ChipSpec``,
  the same class), kept here so that ``h2jax.plan`` stays pure and below ``h2jax.config``;
- :class:`Cluster` -- chip type -> profile and device count, from ``configs/clusters/*.yaml``;
- :class:`ModelShape` -- the model dims that fix FLOPs, bytes and parameter counts;
- :class:`LayerCost` / :class:`ProfileTable` -- per-layer forward/backward seconds and
  bytes for one (chip, model shape, tensor degree, microbatch): measured by
  ``h2jax profile`` (cached as JSON) or estimated from the roofline here and marked
  ``estimated``; a measured table also holds the fixed cost of one program call (the
  pseudo-part ``"program"``), how many host cores each part keeps busy, and the core
  count of the host it was measured on.

Shared hosts: an emulated chip type is CPU clients of the machine that runs the job, so
every emulated chip node shares that machine's cores (``ChipProfile.host``, default
``"local"`` for ``emulated: true``); real chips have hosts of their own (``host`` None)
and never slow each other down. The cost model and the simulator charge the work of all
stages on one host against its ``host_cores`` (see ``h2jax.plan._cost``).

Units: seconds, bytes, FLOPs; GiB = 2**30 bytes; bandwidths in the YAML are GB/s (1e9 B/s).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from h2jax._paths import config_dirs, find_config
from h2jax._strict import VALUE_CHECKS, ConfigError, build_dataclass, read_yaml
from h2jax._units import GB, GIB
from h2jax.plan._numerics import NumericsPolicy
from xla_plugins import PLATFORMS, fused_attention

LOCAL_HOST = "local"  # the machine that runs the job: where every emulated chip computes


def local_cores() -> int:
    """CPU cores this process may run on (its affinity mask; the planner's machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


class ProfileError(ConfigError):
    """A chip profile, cluster or model file that cannot be used; names the key and value.

    ``ProfileError("chips.x.count", "expected ...")``, or one ``"key: message"`` text (the
    key ``plan`` when the text names none: the planner's own inputs).
    """

    def __init__(self, key: str, message: str | None = None) -> None:
        if message is None:
            text = key
            key, sep, message = text.partition(": ")
            if not sep or " " in key:
                key, message = "plan", text
        super().__init__(key, message)


@dataclass(frozen=True)
class ChipProfile:
    """One chip type: how many nodes of it a job has, its memory, speed and links.

    The one chip type of h2jax: ``cluster.chips`` of an experiment config and the planner's
    clusters hold it, both read by :func:`load_chip` from ``configs/chips/<name>.yaml``
    (or the file named by ``profile``) with a cluster entry's inline keys on top. Numbers are
    per device unless said otherwise; speeds are planner inputs the runtime never enforces.
    """

    name: str
    """Chip type name: the key of the cluster entry (e.g. sim_a, cuda:H100). Not a YAML key."""
    memory_gib: float = 16.0
    """Memory per device, GiB. Enforced by the runtime's memory check; the planner's limit."""
    peak_tflops: float = 0.05
    """Dense peak per device, TFLOP/s. Planner input; never used to slow anything down."""
    mem_bw_gbps: float = 20.0
    """Memory bandwidth per device, GB/s (planner input)."""
    intra_node_gbps: float = 10.0
    """Device-to-device bandwidth inside a node (NVLink, Infinity Fabric, ICI, HCCS...), GB/s."""
    inter_node_gbps: float = 5.0
    """Bandwidth one device gets to a device of another node or chip type (its share of the NICs), GB/s."""
    devices_per_node: int = 4
    """Devices per node. In one process a stage lives inside one node."""
    nodes: int = 1
    """Nodes of this chip type in the cluster (a cluster file may say ``count:`` devices instead).
    Emulated chips get one PJRT client per node."""
    platform: str = "cpu"
    """PJRT platform serving the chip: cpu, cuda, rocm, tpu, xpu."""
    emulated: bool = False
    """True: an emulated chip (CPU clients registered by h2jax, sharing the host CPU)."""
    host: str | None = None
    """The machine whose CPU cores the devices compute on, when several chip nodes share one
    (emulated chips: ``"local"``, the machine running the job). None: hosts of its own, which
    no other stage slows down."""
    host_cores: int | None = None
    """That machine's cores. None: as measured by ``h2jax profile`` (ProfileTable.host_cores),
    else this machine's."""
    profile: str | None = None
    """Chip profile to start from: a name in configs/chips/ or a YAML path. None: the chip's
    own name if such a profile exists."""
    numerics: NumericsPolicy = field(default_factory=NumericsPolicy)
    """How the chip computes (matmul precision, matmul input rounding): applied by the runtime to
    this chip type's stage programs and measured by ``h2jax align``; see h2jax/plan/_numerics.py."""

    def __post_init__(self) -> None:
        check_chip_values({f.name: getattr(self, f.name) for f in fields(self)}, f"chip {self.name}")
        if self.emulated and self.host is None:
            object.__setattr__(self, "host", LOCAL_HOST)

    @property
    def num_devices(self) -> int:
        """Devices of this chip type in the cluster: nodes * devices_per_node."""
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def to_dict(self) -> dict[str, Any]:
        """The YAML fields of a cluster entry (all but ``name``, which is the entry's key)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}
        out["numerics"] = self.numerics.to_dict()
        return out


def check_chip_values(values: Mapping[str, Any], key: str) -> None:
    """A chip's value checks (ProfileError naming ``key.<field>``); run by the strict parser
    before the constructor, so that the message names the dotted key of the file or entry."""
    for f in ("memory_gib", "peak_tflops", "mem_bw_gbps", "intra_node_gbps", "inter_node_gbps"):
        if not values[f] > 0:
            raise ProfileError(f"{key}.{f}", f"{f}={values[f]}; expected > 0")
    for f in ("nodes", "devices_per_node"):
        if values[f] < 1:
            raise ProfileError(f"{key}.{f}", f"{f}={values[f]}; expected >= 1")
    if values["host_cores"] is not None and values["host_cores"] < 1:
        raise ProfileError(f"{key}.host_cores", f"host_cores={values['host_cores']}; expected >= 1 or null")
    if not values["emulated"] and values["platform"] not in PLATFORMS:
        raise ProfileError(
            f"{key}.platform", f"platform={values['platform']!r}; expected one of {', '.join(PLATFORMS)}"
        )


VALUE_CHECKS[ChipProfile] = check_chip_values

# what a cluster entry or profile file may say: the fields, and `count` (devices, for nodes)
CHIP_KEYS = tuple(sorted({f.name for f in fields(ChipProfile)} - {"name"} | {"count"}))


def _check_chip_keys(raw: Mapping[str, Any], where: str, source: Path | None = None) -> None:
    unknown = sorted(set(raw) - set(CHIP_KEYS), key=str)  # YAML keys may be ints
    if unknown:
        in_file = f" (in {source})" if source is not None else ""
        raise ProfileError(f"{where}.{unknown[0]}", f"unknown key{in_file}; a chip has keys {list(CHIP_KEYS)}")


def chip_from_dict(name: str, raw: Mapping[str, Any], *, where: str = "chip") -> tuple[ChipProfile, int]:
    """(profile, nodes) from the fields of a chip profile plus inline keys: the one strict parser.

    Unknown keys and wrong types fail naming ``where.<key>``; ``count`` (devices) stands for
    ``nodes`` and must be a multiple of ``devices_per_node``.
    """
    if not isinstance(raw, Mapping):
        raise ProfileError(where, f"got {raw!r}; expected a mapping of chip fields (e.g. {{nodes: 1}})")
    _check_chip_keys(raw, where)
    raw = dict(raw)
    count = raw.pop("count", None)
    try:
        chip = build_dataclass(ChipProfile, {**raw, "name": str(name)}, where)
    except ProfileError:
        raise
    except ConfigError as e:  # a wrong type: the planner's error class, the same key and words
        raise ProfileError(e.key, e.message) from None
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ProfileError(f"{where}.count", f"got {count!r}; expected a positive integer (devices)")
        if count % chip.devices_per_node:
            raise ProfileError(
                f"{where}.count", f"count={count} is not a multiple of devices_per_node={chip.devices_per_node}"
            )
        chip = replace(chip, nodes=count // chip.devices_per_node)
    return chip, chip.nodes


def load_chip(
    name: str, inline: Mapping[str, Any] | None = None, *, key: str = "chips", priced: bool = True
) -> tuple[ChipProfile, int]:
    """(profile, nodes) of chip type `name`: ``configs/chips/<profile or name>.yaml`` (when it
    exists), then the cluster entry's `inline` keys on top. Errors name ``key.<name>.<field>``
    (``key`` is ``cluster.chips`` in an experiment config, ``chips`` in a cluster file), and
    the profile file when the bad key is in it.

    `priced`: a chip type with no profile file must give memory_gib and peak_tflops inline --
    what the planner prices it by, where the defaults would price a typo. An experiment config
    passes False: training needs only the memory limit, and a real chip may be declared by
    its platform and device count alone (the class's defaults fill the rest).
    """
    where = f"{key}.{name}"
    inline = {} if inline is None else inline
    if not isinstance(inline, Mapping):
        raise ProfileError(where, f"got {inline!r}; expected a mapping of chip fields (e.g. {{nodes: 1}})")
    profile = inline.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise ProfileError(
            f"{where}.profile", f"got {profile!r}; expected a chip profile name (e.g. sim_a) or a YAML path"
        )
    raw: dict[str, Any] = {}
    path = find_config("chips", profile or name)
    if path is not None:
        loaded = read_yaml(path, key=f"{where}.profile")
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ProfileError(f"{where}.profile", f"{path} holds {type(loaded).__name__}; expected a mapping")
        _check_chip_keys(loaded or {}, where, path)
        raw.update(loaded or {})
    elif profile is not None:
        raise ProfileError(
            f"{where}.profile", f"profile {profile!r} not found in {[str(d / 'chips') for d in config_dirs()]}"
        )
    elif priced and not {"memory_gib", "peak_tflops"} <= set(inline):
        raise ProfileError(
            where,
            f"no profile configs/chips/{name}.yaml found in {[str(d) for d in config_dirs()]} and the entry does "
            "not give memory_gib and peak_tflops, which the planner prices the chip by",
        )
    raw.update(inline)
    return chip_from_dict(name, raw, where=where)


@dataclass(frozen=True)
class Cluster:
    """Chip types available to one job: (profile, nodes) pairs in the file's order.

    The pair's node count is the one the planner uses (a loaded cluster's profiles carry the
    same number as ``nodes``; a search may pair a profile with fewer nodes).
    """

    chips: tuple[tuple[ChipProfile, int], ...]
    name: str = "cluster"

    def profile(self, chip: str) -> ChipProfile:
        for p, _ in self.chips:
            if p.name == chip:
                return p
        raise KeyError(f"chip {chip!r} is not in cluster {self.name}; it has {', '.join(self.names)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p, _ in self.chips)

    def devices(self, chip: str) -> int:
        for p, n in self.chips:
            if p.name == chip:
                return n * p.devices_per_node
        raise KeyError(chip)

    @property
    def num_devices(self) -> int:
        return sum(n * p.devices_per_node for p, n in self.chips)

    @property
    def profiles(self) -> dict[str, ChipProfile]:
        return {p.name: p for p, _ in self.chips}

    def only(self, *chips: str) -> Cluster:
        """The same cluster with only the chip types `chips` (one: a homogeneous baseline; several:
        the chips of one pipeline of a plan of several), in the cluster's order."""
        return Cluster(tuple((p, n) for p, n in self.chips if p.name in chips), name=f"{self.name}[{'+'.join(chips)}]")

    def to_config_chips(self) -> dict[str, dict[str, Any]]:
        """``cluster.chips`` of an experiment config: each chip's profile by name, its node
        count, and whatever differs from the profile file (the cluster file's inline keys),
        so that the experiment's chips equal these."""
        out: dict[str, dict[str, Any]] = {}
        for p, n in self.chips:
            base, _ = load_chip(p.name, {"profile": p.profile} if p.profile else {}, priced=False)
            entry: dict[str, Any] = {"profile": p.profile} if p.profile else {}
            entry["nodes"] = n
            entry.update({k: v for k, v in p.to_dict().items() if k != "nodes" and v != base.to_dict()[k]})
            out[p.name] = entry
        return out

    @classmethod
    def from_dict(cls, raw: Any, *, name: str = "cluster") -> Cluster:
        """The cluster of a cluster file's data: ``chips:`` (chip type -> profile keys, with
        ``nodes`` or ``count``), each read by :func:`load_chip` (priced)."""
        if not isinstance(raw, Mapping) or not isinstance(raw.get("chips"), Mapping) or not raw["chips"]:
            raise ProfileError(
                "chips",
                f"{name} has no non-empty `chips:` mapping; expected chip type -> {{nodes: N}} or {{count: N}}",
            )
        chips = []
        for chip, inline in raw["chips"].items():
            if not isinstance(inline, Mapping):
                raise ProfileError(f"chips.{chip}", f"got {inline!r}; expected a mapping like {{nodes: 2}}")
            chips.append(load_chip(str(chip), inline, key="chips"))
        return cls(tuple(chips), name=name)

    @classmethod
    def load(cls, path_or_name: str | os.PathLike[str]) -> Cluster:
        path = find_config("clusters", str(path_or_name))
        if path is None:
            raise ProfileError(
                "cluster", f"{str(path_or_name)!r} not found (a YAML path or a name in configs/clusters/)"
            )
        return cls.from_dict(read_yaml(path, key="cluster") or {}, name=path.stem)


@dataclass(frozen=True)
class ModelShape:
    """The dims of the stageable LLaMA-family model that fix its FLOPs, bytes and parameter counts.

    `act_bytes` is the compute dtype's size (2: bf16, 4: fp32). Parameters, gradients and
    the two AdamW moments are fp32 as in the runtime: 4 + 4 + 8 = 16 bytes per parameter.
    `n_kv_heads` None means n_heads (multi-head attention); `tie_embeddings` drops the
    lm_head matrix (the head reuses the embedding); `attention` is the model config's kernel
    choice ("auto": cuDNN's fused kernel on cuda chips in bf16/fp16, XLA's elsewhere).
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    act_bytes: int = 2
    n_kv_heads: int | None = None
    tie_embeddings: bool = False
    attention: str = "auto"

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """From a GPTConfig (or any object/mapping with its fields)."""
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        act = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(get("dtype", "bfloat16")), 2)
        return cls(
            n_layers=get("n_layers"),
            d_model=get("d_model"),
            n_heads=get("n_heads"),
            d_ff=get("d_ff"),
            vocab_size=get("vocab_size"),
            seq_len=get("seq_len"),
            act_bytes=act,
            n_kv_heads=get("n_kv_heads"),
            tie_embeddings=bool(get("tie_embeddings", False)),
            attention=str(get("attention", "auto")),
        )

    @functools.cached_property
    def _key(self) -> str:
        return self._make_key()

    def key(self) -> str:
        return self._key

    def _make_key(self) -> str:
        """Short stable id of the shape a per-layer profile depends on (not n_layers).

        Fields at their defaults stay out of the hashed text, so a model of the original
        fields keeps the key its cached profiles were stored under."""
        d = asdict(self)
        d.pop("n_layers")
        for f in fields(self):
            if f.default is not MISSING and d.get(f.name) == f.default and f.name != "act_bytes":
                d.pop(f.name)
        text = json.dumps(d, sort_keys=True)
        return (
            f"d{self.d_model}h{self.n_heads}f{self.d_ff}v{self.vocab_size}s{self.seq_len}a{self.act_bytes}-"
            + hashlib.sha1(text.encode()).hexdigest()[:8]
        )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def block_params(self) -> int:
        d, kv = self.d_model, self.kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * self.d_ff + 2 * d  # wq, wo; wk, wv; SwiGLU; two norms

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        return self.d_model + (0 if self.tie_embeddings else self.d_model * self.vocab_size)

    def num_params(self) -> int:
        return self.embed_params + self.n_layers * self.block_params + self.head_params

    def train_flops_per_token(self) -> dict[str, float]:
        """Model FLOPs of one token's forward and backward (3x the forward's matmul FLOPs), per
        part: ``block`` (its weight matmuls plus attention's q.k^T and p.v over all seq_len keys,
        as PaLM's MFU counts them, 6N + 12 L d s), ``head`` (the logits matmul), ``embed`` (a
        lookup: 0). What MFU divides by peak; recomputation is not counted (model FLOPs)."""
        d, kv = self.d_model, self.kv_heads * self.head_dim
        weights = 2 * d * d + 2 * d * kv + 3 * d * self.d_ff
        return {
            "embed": 0.0,
            "block": 3.0 * (2 * weights + 4 * self.seq_len * d),
            "head": 3.0 * 2 * d * self.vocab_size,
        }

    def tensor_degrees(self, limit: int) -> list[int]:
        """Tensor degrees up to `limit` that divide heads, d_ff and vocab (as check_plan requires)."""
        return [
            t for t in range(1, limit + 1) if self.n_heads % t == 0 and self.d_ff % t == 0 and self.vocab_size % t == 0
        ]


PART_KINDS = ("embed", "block", "head")
PROGRAM = "program"  # pseudo-part of a measured table: the fixed cost of one program call
TRANSFER = "transfer"  # pseudo-part: one boundary tensor moved to another client of the same host
EXCHANGE = "exchange"  # pseudo-part: a block's share of the exchange across pipelines between two clients of a host
EXCHANGE_CALL = "exchange_call"  # pseudo-part: the exchange's fixed seconds per list of parameters


@dataclass(frozen=True)
class LayerCost:
    """Cost of one part of the model ("embed", one "block", or "head") on one device.

    Times are seconds per microbatch on a (data=1, tensor=t) mesh fed `microbatch`
    sequences; `tp_comm_s` is the part of fwd+bwd spent in tensor-parallel collectives
    (already inside fwd_s/bwd_s). Bytes are per device: `param_bytes` of the fp32
    parameters, `act_bytes` kept from forward to backward per microbatch, `input_bytes`
    the stage input (what recompute keeps), `temp_bytes` the largest transient buffer.

    Measured only (0 = not measured): `fwd_cores` / `bwd_cores`, the host CPU cores the
    part keeps busy on average while it runs alone (CPU seconds of the process / wall
    seconds) -- what it takes from a host that other stages share; `update_s`, seconds of
    its share of the optimizer step (gradient norm + AdamW update), else the roofline.

    The pseudo-part ``"program"`` of a measured table holds what one program call costs
    whatever its layers (dispatch from Python, launch, synchronisation): a stage program
    pays it once, however many parts it fuses. The pseudo-part ``"transfer"`` (emulated
    chips) holds the seconds to move one boundary tensor of that microbatch to another
    client of the same host (``fwd_s`` activation, ``bwd_s`` gradient). The pseudo-parts
    ``"exchange"`` (per block, `param_bytes` the block's) and ``"exchange_call"`` (fixed, per
    list of parameters) hold the exchange across pipelines between two clients of one host, as
    h2jax.runtime._tied runs it: ``fwd_s`` the gradient sum (a mirror's share moved to the owner
    and added), ``bwd_s`` the copy back (the values).
    """

    fwd_s: float
    bwd_s: float
    param_bytes: float
    act_bytes: float
    input_bytes: float
    temp_bytes: float
    tp_comm_s: float = 0.0
    estimated: bool = True
    fwd_cores: float = 0.0
    bwd_cores: float = 0.0
    update_s: float = 0.0


@dataclass(frozen=True)
class DriverCost:
    """What the runtime's driver costs on a shared host beyond the programs themselves:
    measured by ``h2jax.runtime._profile.profile_driver`` with a model whose programs cost
    next to nothing, through the real trainer.

    `step_s`: seconds a step takes outside its pipeline (batch to devices, threads, loss,
    gradient norm); `step_cpu_s`, `op_cpu_s`, `transfer_cpu_s`: host CPU seconds per step,
    per forward or backward beyond its program call, and per boundary transfer.
    """

    step_s: float = 0.0
    step_cpu_s: float = 0.0
    op_cpu_s: float = 0.0
    transfer_cpu_s: float = 0.0


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the spec sheet a real kernel reaches (roofline estimates only).

    Dense matmuls of a large transformer typically reach 40-55 % of peak (MFU); memory-
    bound kernels ~70-80 % of bandwidth; collectives ~70 % of link bandwidth.
    """

    flops: float = 0.45
    mem_bw: float = 0.75
    link: float = 0.7
    collective_latency_s: float = 10e-6


def roofline_costs(
    model: ModelShape, chip: ChipProfile, *, tensor: int, microbatch: int, eff: Efficiency = Efficiency()
) -> dict[str, LayerCost]:
    """Estimated per-part costs from FLOPs, bytes and the chip profile (marked estimated).

    `microbatch` is sequences per device (a stage's microbatch / its data degree).
    Forward time = max(FLOPs / (peak x eff), bytes / (mem_bw x eff)) + tensor-parallel
    all-reduces (2 per block in forward, 2 in backward, ring over `tensor` devices on the
    intra-node link); backward = 2x the forward's FLOPs and bytes.
    """
    t, b, s, d, f, v = tensor, microbatch, model.seq_len, model.d_model, model.d_ff, model.vocab_size
    a = model.act_bytes
    tokens = b * s
    flops_rate = chip.peak_tflops * 1e12 * eff.flops
    bw = chip.mem_bw_gbps * GB * eff.mem_bw
    link = chip.intra_node_gbps * GB * eff.link

    def allreduce(nbytes: float, n: int) -> float:
        return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / link + eff.collective_latency_s

    def compute(flops: float, nbytes: float) -> float:
        return max(flops / flops_rate, nbytes / bw)

    hidden = tokens * d * a  # one [b, s, d] activation
    h, hd = model.n_heads, d / model.n_heads
    kv = model.kv_heads
    t_kv = t if kv % t == 0 else 1  # key/value heads split only when t divides them (else replicated)
    # block: wq, wo, w_gate, w_up, w_down (sharded by t), wk, wv (by t_kv); attention's q.k^T
    # and p.v over all s keys (XLA does not skip the masked half)
    w_block = (2 * d * d + 3 * d * f) / t + 2 * d * kv * hd / t_kv
    fl_attn = 4 * tokens * s * d / t
    fl_block = 2 * tokens * w_block + fl_attn
    # What the forward keeps for the backward: JAX's residuals of this model's block, counted
    # array by array (jax.vjp of h2jax.models' Block; tests/models/test_activation_memory.py
    # compares with XLA's compiled memory analysis): per token the two RMSNorms (3 fp32 [d]
    # arrays + 2 scalars each, the normed input in the compute dtype), the rotated q and k,
    # v, the attention output, six [d_ff] arrays of the MLP; per position the four rotary
    # tables [hd/2] (fp32); once per microbatch the weights cast to the compute dtype; plus
    # the block's output (as the profiler counts: the forward program's outputs). Nothing per
    # score: the attention recomputes its scores in the backward (h2jax.models' `attend`), and
    # a fused kernel (cuDNN: cuda chips in bf16/fp16) adds only its fp32 softmax statistics.
    fused = model.attention == "auto" and fused_attention(chip.platform) and a == 2 and hd <= 128 and hd % 8 == 0
    per_token = 24 * d + 16 + 2 * a * d + (2 * a * d + 6 * a * f + (4 * h if fused else 0)) / t + 2 * a * kv * hd / t_kv
    act_block = tokens * per_token + s * 8 * hd + w_block * a + hidden
    by_block = w_block * a + act_block + 2 * hidden
    ar_block = allreduce(hidden, t)
    blk_f = compute(fl_block, by_block) + 2 * ar_block
    blk_b = compute(2 * fl_block + fl_attn / 2, 2 * by_block) + 2 * ar_block  # + the q.k^T recomputed
    block = LayerCost(
        fwd_s=blk_f,
        bwd_s=blk_b,
        param_bytes=4 * (w_block + 2 * d),
        act_bytes=act_block,
        input_bytes=hidden,
        temp_bytes=act_block,
        tp_comm_s=4 * ar_block,
    )
    # embed: a gather of [b, s] rows of d/t columns, then an all-gather of [b, s, d]
    ag = 0.0 if t <= 1 else (t - 1) / t * hidden / link + eff.collective_latency_s
    emb_f = compute(0.0, 2 * hidden / t + hidden) + ag
    emb_b = compute(0.0, 2 * hidden / t + 4 * v * d / t) + ag
    embed = LayerCost(
        fwd_s=emb_f,
        bwd_s=emb_b,
        param_bytes=4 * v * d / t,
        act_bytes=tokens * 4,
        input_bytes=tokens * 4,
        temp_bytes=hidden,
        tp_comm_s=2 * ag,
    )
    # head: norm, [b, s, d] x [d, v/t] logits in fp32, cross-entropy reduced across t
    fl_head = 2 * tokens * d * v / t
    logits = tokens * v / t * 4
    hd_f = compute(fl_head, d * v / t * a + 2 * logits + hidden) + 2 * allreduce(tokens * 4, t)
    hd_b = compute(2 * fl_head, 2 * (d * v / t * a + 2 * logits + hidden)) + allreduce(hidden, t)
    # kept for the backward: the norm (fp32 parts, the normed input), one fp32 [v] array of the
    # cross-entropy per token, and the weight in the compute dtype (as the block's); less the
    # last block's output, which the block's count holds and the head consumes (the program
    # of a last stage outputs a loss, not that [b, s, d] array)
    act_head = tokens * ((12 + a) * d + 4 * v / t + 20) + d * v / t * a - hidden
    head = LayerCost(
        fwd_s=hd_f,
        bwd_s=hd_b,
        param_bytes=4 * (d * v / t + d),
        act_bytes=act_head,
        input_bytes=hidden,
        temp_bytes=2 * logits,
        tp_comm_s=2 * allreduce(tokens * 4, t),
    )
    return {"embed": embed, "block": block, "head": head}


_MODEL_KEY_FIELDS = (("d", "d_model"), ("h", "n_heads"), ("f", "d_ff"), ("v", "vocab_size"), ("s", "seq_len"))


def describe_model_key(key: str) -> str:
    """A ``ModelShape.key()`` in words: "d_model 32, n_heads 4, d_ff 128, vocab_size 256, seq_len 32"."""
    m = re.fullmatch(r"d(\d+)h(\d+)f(\d+)v(\d+)s(\d+)a(\d+)-\w+", key)
    if not m:
        return repr(key)
    words = [f"{name} {value}" for (_, name), value in zip(_MODEL_KEY_FIELDS, m.groups())]
    return ", ".join(words) + f", {m.group(6)}-byte activations"


@dataclass
class ProfileTable:
    """Per-part costs keyed by (chip, model shape key, tensor degree, microbatch).

    Filled from ``h2jax profile`` JSON caches; a lookup that misses falls back to the
    roofline estimate (``estimated: True``) so a plan can always be priced.
    `grad_sync_in_bwd` records that measured backward times already include the runtime's
    data-parallel gradient reduction (the current runtime reduces per microbatch).
    """

    entries: dict[tuple[str, str, int, int], dict[str, LayerCost]] = field(default_factory=dict)
    eff: Efficiency = field(default_factory=Efficiency)
    host_cores: dict[str, int] = field(default_factory=dict)  # chip -> cores of the host it was measured on
    # chip -> host cores other work kept busy while it was measured (h2jax._hostload.OtherWork)
    other_cores: dict[str, float] = field(default_factory=dict)
    driver: dict[str, DriverCost] = field(default_factory=dict)  # shared host -> the driver's own costs there
    _estimates: dict[tuple, dict[str, LayerCost]] = field(default_factory=dict, repr=False, compare=False)
    # the same estimates by the identity of (chip, model), which it holds (so the ids stay theirs):
    # a search looks them up thousands of times, and hashing two dataclasses of ~10 fields each
    # time cost more than the lookup
    _by_identity: dict[tuple[int, int], tuple[Any, Any, dict]] = field(default_factory=dict, repr=False, compare=False)

    def add(
        self,
        chip: str,
        model_key: str,
        tensor: int,
        microbatch: int,
        parts: Mapping[str, LayerCost],
        *,
        host_cores: int | None = None,
        other_cores: float | None = None,
    ) -> None:
        self.entries[(chip, model_key, tensor, microbatch)] = dict(parts)
        if host_cores is not None:
            self.host_cores[chip] = int(host_cores)
        if other_cores is not None:
            self.other_cores[chip] = float(other_cores)

    def loaded_chips(self, chips: Sequence[str]) -> dict[str, tuple[float, int]]:
        """{chip: (other work's cores, host cores)} of the chip types of `chips` measured while
        other work kept :data:`h2jax._hostload.LOADED_SHARE` or more of the host busy."""
        from h2jax._hostload import loaded

        return {
            c: (self.other_cores[c], self.host_cores[c])
            for c in chips
            if c in self.other_cores
            and c in self.host_cores
            and self.measured(c)
            and loaded(self.other_cores[c], self.host_cores[c])
        }

    def costs(self, model: ModelShape, chip: ChipProfile, *, tensor: int, microbatch: int) -> dict[str, LayerCost]:
        if self.entries:
            hit = self.entries.get((chip.name, model.key(), tensor, microbatch))
            if hit is not None:
                return hit
        held = self._by_identity.get((id(chip), id(model)))
        if held is None:
            held = self._by_identity[id(chip), id(model)] = (chip, model, {})
        est = held[2].get((tensor, microbatch))
        if est is None:
            key = (chip, model, tensor, microbatch)
            est = self._estimates.get(key)
            if est is None:
                est = self._estimates[key] = roofline_costs(
                    model, chip, tensor=tensor, microbatch=microbatch, eff=self.eff
                )
            held[2][tensor, microbatch] = est
        return est

    def measured(self, chip: str) -> bool:
        return any(k[0] == chip and not v["block"].estimated for k, v in self.entries.items())

    def measured_rows(self, chip: str, model: ModelShape) -> frozenset[tuple[int, int]]:
        """The (tensor degree, sequences per device) of `chip` measured for `model`'s shape:
        the lookups whose costs are a measurement, not the roofline's estimate."""
        key = model.key()
        return frozenset(
            (k[2], k[3]) for k, v in self.entries.items() if k[0] == chip and k[1] == key and not v["block"].estimated
        )

    def model_keys(self) -> set[str]:
        """The model shapes (``ModelShape.key()``) the entries were made for."""
        return {k[1] for k in self.entries}

    def check_model(self, model: ModelShape, *, source: str = "--profiles") -> None:
        """Refuse a table that holds profiles, none of them for `model`'s shape: every lookup
        would silently fall back to the roofline, and a per-layer cost of another shape
        says nothing about this one (both shapes are named)."""
        keys = self.model_keys()
        if keys and model.key() not in keys:
            made = "; ".join(describe_model_key(k) for k in sorted(keys))
            raise ProfileError(
                f"{source}: the profiles were made for the model shape {made}, not the model being planned "
                f"({describe_model_key(model.key())}); profile this model (`h2jax profile --model ...`) or "
                f"leave {source} out"
            )

    def unprofiled(self, model: ModelShape, chips: Sequence[str]) -> list[str]:
        """Chip types of `chips` with no entry for `model`'s shape (priced by the roofline)."""
        have = {k[0] for k in self.entries if k[1] == model.key()}
        return [c for c in chips if c not in have]

    # -- JSON cache (the profiler writes, the planner reads) --------------------------------------
    def to_json(self) -> dict[str, Any]:
        rows = []
        for (chip, mkey, t, b), parts in sorted(self.entries.items()):
            rows.append(
                {
                    "chip": chip,
                    "model": mkey,
                    "tensor": t,
                    "microbatch": b,
                    "parts": {k: asdict(v) for k, v in parts.items()},
                }
            )
        out: dict[str, Any] = {"version": 1, "entries": rows}
        if self.host_cores:
            out["host_cores"] = dict(sorted(self.host_cores.items()))
        if self.other_cores:
            out["other_cores"] = {c: round(v, 3) for c, v in sorted(self.other_cores.items())}
        if self.driver:
            out["driver"] = {h: asdict(d) for h, d in sorted(self.driver.items())}
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def merge_json(self, data: Mapping[str, Any]) -> None:
        names = {f.name for f in fields(LayerCost)}
        for row in data.get("entries", []):
            parts = {k: LayerCost(**{kk: vv for kk, vv in v.items() if kk in names}) for k, v in row["parts"].items()}
            self.add(row["chip"], row["model"], int(row["tensor"]), int(row["microbatch"]), parts)
        for chip, cores in (data.get("host_cores") or {}).items():
            self.host_cores[str(chip)] = int(cores)
        for chip, cores in (data.get("other_cores") or {}).items():
            self.other_cores[str(chip)] = float(cores)
        for host, d in (data.get("driver") or {}).items():
            self.driver[str(host)] = DriverCost(
                **{k: float(v) for k, v in d.items() if k in {f.name for f in fields(DriverCost)}}
            )

    @classmethod
    def load(cls, *paths: str | os.PathLike[str], eff: Efficiency | None = None) -> ProfileTable:
        table = cls(eff=eff or Efficiency())
        for p in paths:
            if Path(p).is_file():
                table.merge_json(json.loads(Path(p).read_text()))
        return table
