"""Where named configs are found: the config folders, chip and cluster profiles by name, and
experiment files by name. Below ``h2jax.plan`` and ``h2jax.config``, which both look there."""

from __future__ import annotations

import os
from pathlib import Path

from h2jax._strict import ConfigError


def config_dirs() -> list[Path]:
    """Where named configs are looked up: $H2JAX_CONFIG_DIR, ./configs, the repository's configs/."""
    dirs = []
    if env := os.environ.get("H2JAX_CONFIG_DIR"):
        dirs.append(Path(env))
    dirs.append(Path.cwd() / "configs")
    dirs.append(Path(__file__).resolve().parents[1] / "configs")
    return list(dict.fromkeys(d.resolve() for d in dirs))


def find_config(kind: str, name: str) -> Path | None:
    """``configs/<kind>/<name>.yaml`` (or ``name`` itself when it is a YAML path), or None."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for d in config_dirs():
        f = d / kind / f"{name}.yaml"
        if f.is_file():
            return f
    return None


def find_experiment(path: str | Path) -> Path:
    """The experiment file ``path`` names: as given, else in the config folders (``.yaml`` optional)."""
    p = Path(path)
    if not p.is_file():
        candidates = [d / p for d in config_dirs()] + [d / f"{p}.yaml" for d in config_dirs()]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ConfigError(
                "config", f"file {str(path)!r} not found (also looked in {[str(d) for d in config_dirs()]})"
            )
        p = found
    return p
