"""The one error every config problem becomes (the CLI turns it into exit code 2).

Defined in :mod:`h2jax._strict`, below ``h2jax.plan``, so that the planner's errors are the same class.
"""

from __future__ import annotations

from h2jax._strict import ConfigError

__all__ = ["ConfigError"]
