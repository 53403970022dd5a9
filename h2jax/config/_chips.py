"""Chip types of an experiment's ``cluster.chips``: read by the planner's one chip parser."""

from __future__ import annotations

from typing import Any

from h2jax.plan import ChipProfile, load_chip


def resolve_chip(name: str, inline: Any, *, key: str = "cluster.chips") -> ChipProfile:
    """The chip type ``name`` of a cluster entry: its profile file, then ``inline`` on top
    (h2jax.plan.load_chip; errors name ``key.<name>.<field>``). A chip type with no profile
    file may leave the planner's numbers to the class's defaults (``priced=False``)."""
    return load_chip(name, inline, key=key, priced=False)[0]
