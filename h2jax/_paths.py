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


def aside_path(path: str | Path) -> Path:
    """A free name beside ``path`` for an earlier version of it: ``<stem>.<YYYYmmdd-HHMMSS><suffix>``
    for a file, ``<name>.<YYYYmmdd-HHMMSS>`` for a folder (``-2``, ``-3``, ... when taken)."""
    import time

    p = Path(path)
    suffix = "" if p.is_dir() else p.suffix  # a folder keeps its whole name: model.v2.<stamp>
    stem = p.name[: len(p.name) - len(suffix)]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = p.with_name(f"{stem}.{stamp}{suffix}"), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = p.with_name(f"{stem}.{stamp}-{n}{suffix}")
    return candidate


def keep_aside(path: str | Path) -> Path | None:
    """Move the file or folder at ``path`` to :func:`aside_path`; returns where it went (None when
    nothing was there). The caller says so in one line: nothing a user had goes without a word."""
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return None
    dest = aside_path(p)
    p.rename(dest)
    return dest


def claim_folder(path: str | Path, *, key: str, overwrite: bool = False) -> Path | None:
    """Make ``path`` ready for a command to fill. A folder that does not exist or is empty is used
    as it is; one that holds anything is refused (ConfigError under ``key``, naming what it holds)
    unless ``overwrite``, which moves it aside whole (:func:`keep_aside`) and returns where it went.
    A file at ``path`` is refused either way."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(key, f"{p} is a file; expected a folder to write into (or a path that does not exist)")
    held = sorted(c.name for c in p.iterdir()) if p.is_dir() else []
    if not held:
        return None
    if not overwrite:
        shown = ", ".join(held[:4]) + (f", ... ({len(held)} entries)" if len(held) > 4 else "")
        raise ConfigError(
            key,
            f"{p} is not empty (holds {shown}); expected a new or empty folder "
            f"(--overwrite moves the old one aside, to {aside_path(p).name})",
        )
    return keep_aside(p)
