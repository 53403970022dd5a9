"""The one way h2jax makes a rich console: a terminal's own width, or 160 columns where the
output goes to a file or a pipe (nohup, SLURM, CI), where rich would otherwise cut tables at 80
(``h100_s…``). ``COLUMNS`` set in the environment wins, as rich reads it."""

from __future__ import annotations

import os
import sys
from typing import Any

LOG_WIDTH = 160


def make_console(*, stderr: bool = False, **kwargs: Any) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if "width" not in kwargs and "COLUMNS" not in os.environ and not _isatty(stream):
        kwargs["width"] = LOG_WIDTH
    return Console(stderr=stderr, **kwargs)


def _isatty(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
