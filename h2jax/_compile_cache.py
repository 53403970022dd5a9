"""The ``h2jax`` commands keep XLA's compiled programs between runs (JAX's persistent cache).

Compiling the stage programs is most of a short run's start: the default job's first two
steps take about twice as long with an empty cache as with one its previous run filled. So
each command that may compile (train, align, profile, ...) points JAX at one folder:

- ``JAX_COMPILATION_CACHE_DIR``, when set (even empty: no cache), is JAX's own setting and
  is left as it is;
- else ``H2JAX_COMPILATION_CACHE``: a folder, or ``off`` (also ``0``, ``false``, ``none``);
- else ``$XDG_CACHE_HOME/h2jax/xla`` (``~/.cache/h2jax/xla``).

Every program is kept (no minimum compile time: on emulated chip types most compile in
under a second) up to :data:`MAX_BYTES`, beyond which JAX drops the least recently used
entries; a size limit also makes JAX lock the folder, so the ranks of an ``mpirun`` job on
one host share it safely. An entry is keyed by the program's HLO, the compile options, the
backend and the XLA flags, so a hit runs the program a compile would have produced. It is
set through the environment before JAX is imported, so processes the command starts inherit it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV = "H2JAX_COMPILATION_CACHE"
OFF = ("off", "0", "false", "none")
MAX_BYTES = 4 << 30
_enabled: list[str] = []  # the folder enable() set, if it set one


def cache_dir(env: Mapping[str, str] = os.environ) -> str | None:
    """The folder the commands use (module docstring), or None for no cache."""
    if "JAX_COMPILATION_CACHE_DIR" in env:
        return env["JAX_COMPILATION_CACHE_DIR"] or None
    value = env.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return os.path.expanduser(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "h2jax", "xla")


def enable() -> tuple[str | None, str]:
    """Set JAX's cache variables in this process's environment (before JAX is imported).
    Returns (folder or None, a note when the folder could not be made: the command then runs
    without a cache)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return cache_dir(), ""
    path = cache_dir()
    if path is None:
        return None, ""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = ""  # JAX's "no cache", for this process and its children
        return None, f"compilation cache off: cannot make {path}: {e.strerror or e} (set {ENV} to a folder, or off)"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    _enabled[:] = [path]
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(MAX_BYTES))
    if "jax" in sys.modules:  # imported already (main() called from Python): JAX read its variables then
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path, ""


def describe() -> str:
    """One line for a command's header: the folder in use and where the setting came from."""
    path = cache_dir()
    if path is None:
        return "XLA compilation cache: off"
    if _enabled == [path]:
        return f"XLA compilation cache: {path} (programs compiled once are reused by later runs; {ENV}=off: none)"
    return f"XLA compilation cache: {path} (JAX_COMPILATION_CACHE_DIR)"
