"""What ``h2jax align`` compares: the experiment's model and data, and the chip types under test.

The reference is always the host CPU in float64. A chip type under test is one device of
its backend (an emulated chip's first node, ``cpu`` for the host itself, or a vendor
backend such as ``cuda``) with its numerics policy: the chip entry's ``numerics`` once the
config carries one, else the exact policy, with ``--numerics CHIP.KEY=VALUE`` on top.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from h2jax._jaxpr import Fault, PolicyLike, ScopedPolicy, module_scopes
from h2jax.plan import NumericsError, NumericsPolicy, parse_numerics

HOST = "cpu"
"""Chip name of the host CPU itself (the fp32 baseline of the ratio rule)."""


class AlignInputError(ValueError):
    """Bad input to ``h2jax align`` (exit 2; the message is one line)."""


@dataclass(frozen=True)
class ChipTarget:
    """One chip type under test: a device of its backend and the policy it computes with."""

    name: str
    device: Any
    policy: PolicyLike
    fault: Fault | None = None  # TEST-ONLY fault hook

    def describe(self) -> str:
        pol = self.policy
        text = pol.describe() if isinstance(pol, NumericsPolicy) else "per stage"
        return text + (f", FAULT {self.fault.primitive} x(1{self.fault.rel_error:+g})" if self.fault else "")


@dataclass
class Experiment:
    """The experiment's model (params, graphdef) and the global batch of step 0."""

    cfg: Any
    graphdef: Any
    params: Any
    tokens: np.ndarray  # [num_microbatches, microbatch, seq_len]
    targets: np.ndarray
    dataset: Any

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        from h2jax.data import step_batch

        return step_batch(self.dataset, self.cfg, step)

    def whole_batch(self, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of ``step`` as one microbatch: [1, global_batch, seq_len]."""
        tokens, targets = self.batch(step) if step else (self.tokens, self.targets)
        return _whole(tokens), _whole(targets)


def _whole(tokens: np.ndarray) -> np.ndarray:
    return tokens.reshape(1, -1, tokens.shape[-1])


def load_experiment(cfg: Any) -> Experiment:
    """Build the GPT of ``cfg.model`` (seed ``cfg.seed``) and load its data."""
    from flax import nnx

    from h2jax.data import load_data
    from h2jax.models import build_model

    dataset = load_data(cfg)
    model = build_model(cfg.model, seed=cfg.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    exp = Experiment(cfg, graphdef, params, np.zeros(0), np.zeros(0), dataset)
    exp.tokens, exp.targets = exp.batch(0)
    return exp


def graphdef_for(exp: Experiment, policy: PolicyLike) -> Any:
    """The graphdef a chip computes with: the model rebuilt in the policy's compute dtype
    (same parameters: they are float32 whatever the dtype), else the experiment's."""
    if not isinstance(policy, NumericsPolicy):
        return exp.graphdef
    if policy.compute_dtype is None or policy.compute_dtype == exp.cfg.model.dtype:
        return exp.graphdef
    from flax import nnx

    from h2jax.models import build_model

    model = build_model(dataclasses.replace(exp.cfg.model, dtype=policy.compute_dtype), seed=exp.cfg.seed)
    return nnx.split(model, nnx.Param)[0]


def step_loss(graphdef: Any):
    """``loss(params, tokens[M, b, s], targets) -> mean of the microbatch losses`` (the trainer's
    step loss), with every module call inside its named scope."""
    import jax.numpy as jnp
    from flax import nnx

    def loss(params, tokens, targets):
        model = nnx.merge(graphdef, params)
        with module_scopes(model):
            losses = [model(tokens[i], targets[i]) for i in range(tokens.shape[0])]
        return jnp.mean(jnp.stack(losses))

    return loss


def step_hiddens(graphdef: Any):
    """``(params, tokens, targets) -> (loss, hiddens)``: the step loss, and the output of the
    embedding and of every block (microbatches stacked on a leading dim)."""
    import jax.numpy as jnp
    from flax import nnx

    def run(params, tokens, targets):
        model = nnx.merge(graphdef, params)
        per_mb_losses, per_mb_hiddens = [], []
        with module_scopes(model):
            for i in range(tokens.shape[0]):
                h = model.embed(tokens[i])
                hiddens = [h]
                for block in model.blocks:
                    h = block(h)
                    hiddens.append(h)
                per_mb_losses.append(model.head(h, targets[i]))
                per_mb_hiddens.append(hiddens)
        stacked = [jnp.stack([hs[k] for hs in per_mb_hiddens]) for k in range(len(per_mb_hiddens[0]))]
        return jnp.mean(jnp.stack(per_mb_losses)), stacked

    return run


def _parse_overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        chip, dot, field = key.partition(".")
        if not sep or not dot or not chip or not field:
            raise AlignInputError(
                f"--numerics {item!r}: expected CHIP.KEY=VALUE (e.g. sim_b.matmul_input_rounding=bf16)"
            )
        out.setdefault(chip, {})[field] = yaml.safe_load(value)
    return out


def chip_policy(cfg: Any, chip: str, extra: Mapping[str, Any] | None = None) -> NumericsPolicy:
    """The chip type's policy: its config entry's ``numerics`` (when the config has one), ``extra`` on top."""
    spec = cfg.cluster.chips.get(chip)
    base = getattr(spec, "numerics", None) if spec is not None else None
    raw = dataclasses.asdict(base) if isinstance(base, NumericsPolicy) else dict(base or {})
    raw.update(extra or {})
    try:
        return parse_numerics(raw, key=f"cluster.chips.{chip}.numerics")
    except NumericsError as e:
        raise AlignInputError(str(e)) from None


def chip_backends(cfg: Any) -> dict[str, list[str]]:
    """Chip type -> backend name per node, registering the emulated ones (as the runtime's
    ``setup_backends`` does; align needs only this, not the runtime)."""
    from xla_plugins import register_emulated_chips

    chips = cfg.cluster.chips
    emulated = {n: (c.nodes, c.devices_per_node) for n, c in chips.items() if c.emulated}
    backends = register_emulated_chips(emulated) if emulated else {}
    backends.update({n: [c.platform] for n, c in chips.items() if not c.emulated})
    return backends


def resolve_chips(
    cfg: Any,
    names: Sequence[str] | None,
    *,
    numerics: Sequence[str] = (),
    faults: Mapping[str, Fault] | None = None,
) -> list[ChipTarget]:
    """The chip types to compare (default: every chip type of the cluster), each on its first
    device; ``numerics`` are ``CHIP.KEY=VALUE`` policy overrides. Registers emulated backends."""
    import jax

    names = list(names) if names else list(cfg.cluster.chips)
    if len(set(names)) != len(names):
        raise AlignInputError(f"--chips {' '.join(names)}: a chip type is named twice")
    overrides = _parse_overrides(numerics)
    for chip in overrides:
        if chip not in names:
            raise AlignInputError(
                f"--numerics {chip}.*: {chip!r} is not among the chip types compared ({', '.join(names)})"
            )
    for chip in faults or {}:
        if chip not in names:
            raise AlignInputError(f"fault on {chip!r}: not among the chip types compared ({', '.join(names)})")
    backends = chip_backends(cfg)
    out = []
    for name in names:
        if name in backends:
            backend = backends[name][0]
        elif name == HOST or ":" not in name:
            backend = name  # the host, or a platform JAX knows (cuda, rocm, tpu)
        else:
            backend = name.split(":", 1)[0]
        try:
            device = jax.devices(backend)[0]
        except RuntimeError as e:
            known = ", ".join([*backends, HOST])
            raise AlignInputError(f"--chips {name}: no JAX backend {backend!r} here ({e}); known: {known}") from None
        policy = chip_policy(cfg, name, overrides.get(name))
        out.append(ChipTarget(name, device, policy, (faults or {}).get(name)))
    return out


def plan_policy(cfg: Any, chips: Sequence[ChipTarget]) -> ScopedPolicy:
    """The numerics of the experiment's heterogeneous plan: every layer under the policy of
    the chip type of its stage (embed: stage 0, head and the loss: the last stage)."""
    by_name = {c.name: c.policy for c in chips}

    def policy(chip: str) -> NumericsPolicy:
        pol = by_name.get(chip)
        if pol is None:
            pol = chip_policy(cfg, chip)
        if not isinstance(pol, NumericsPolicy):
            raise AlignInputError(f"chip {chip!r}: a scoped policy cannot be nested in a plan")
        if pol.compute_dtype not in (None, cfg.model.dtype):
            raise AlignInputError(
                f"cluster.chips.{chip}.numerics.compute_dtype={pol.compute_dtype}: a per-stage compute dtype "
                "is not emulated in the plan's run (align compares it per chip type)"
            )
        return pol

    stages = cfg.plan.stages
    scopes: list[tuple[str, NumericsPolicy]] = [("embed", policy(stages[0].chip))]
    last = stages[-1].chip  # the chip of the stage that holds the last layer (zb-v: stage 0), hence the head
    for spec in stages:
        for start, end in spec.layer_chunks:  # every chunk of a stage (interleaved, zb-v)
            scopes.extend((f"blocks.{layer}", policy(spec.chip)) for layer in range(start, end))
            if end == cfg.model.n_layers:
                last = spec.chip
    scopes.append(("head", policy(last)))
    return ScopedPolicy(default=policy(last), scopes=tuple(scopes))
