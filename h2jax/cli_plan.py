"""``h2jax plan | simulate | profile``: the planner's commands (HeteroAuto)."""

from __future__ import annotations

import argparse


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register the planner's subcommands on the ``h2jax`` parser."""
