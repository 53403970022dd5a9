"""Chip profiles: ``configs/chips/<name>.yaml`` files, overlaid by a cluster's inline keys."""

from __future__ import annotations

from typing import Any

import yaml

from h2jax.config._errors import ConfigError
from h2jax.plan._profiles import config_dirs, find_config  # one lookup for chips, clusters, experiments


def resolve_chip(name: str, inline: dict[str, Any], *, key: str = "cluster.chips"):
    """Build the ChipSpec of chip ``name``: its profile file, then ``inline`` on top."""
    from h2jax.config._build import build_dataclass
    from h2jax.config._schema import ChipSpec

    if not isinstance(inline, dict):
        raise ConfigError(f"{key}.{name}", f"got {inline!r}; expected a mapping of chip fields (e.g. {{nodes: 1}})")
    profile = inline.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise ConfigError(
            f"{key}.{name}.profile", f"got {profile!r}; expected a chip profile name (e.g. sim_a) or a YAML path"
        )
    profile_name = profile or name
    raw: dict[str, Any] = {}
    path = find_config("chips", profile_name)
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{key}.{name}.profile", f"{path} does not hold a mapping")
        raw.update(loaded)
    elif inline.get("profile"):
        raise ConfigError(
            f"{key}.{name}.profile",
            f"profile {profile_name!r} not found in {[str(d / 'chips') for d in config_dirs()]}",
        )
    raw.update(inline)
    return build_dataclass(ChipSpec, raw, f"{key}.{name}")
