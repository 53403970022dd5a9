"""The ``h2jax`` command's exit statuses and its one-line error.

Every command reports a failure the same way: one line on stderr, ``h2jax: <what>: <message>``
(the message names the key or path, the value and what was expected), and an exit status
from this module. A traceback follows only when asked for (``H2JAX_DEBUG=1``).
"""

from __future__ import annotations

import os
from typing import Any

from h2jax._console import make_console

EXIT_OK = 0
EXIT_FAIL = 1  # anything else failed (training, a checkpoint, an align gate)
EXIT_CONFIG = 2  # bad input: a config key, a file, an argument -- before any device is touched
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


def debug() -> bool:
    """Tracebacks wanted (``H2JAX_DEBUG`` set to anything but ``""`` or ``"0"``)."""
    return os.environ.get("H2JAX_DEBUG", "") not in ("", "0")


def say(what: str | None, message: str, *, console: Any = None, style: str = "bold red", prog: str = "h2jax") -> None:
    """Print ``<prog>: <what>: <message>`` as one line on stderr (or ``console``).

    ``what`` None leaves the line ``<prog>: <message>``.
    """
    from rich.markup import escape

    head = f"{prog}: {what}:" if what else f"{prog}:"
    # escape: keys and values come from the user, and rich would read "[red]" as markup
    (console or make_console(stderr=True)).print(
        f"[{style}]{head}[/] {escape(message)}", highlight=False, soft_wrap=True
    )


def fail(what: str | None, message: str, *, console: Any = None, prog: str = "h2jax") -> int:
    """Say the bad-input line; returns ``EXIT_CONFIG`` for the command to exit with."""
    say(what, message, console=console, prog=prog)
    return EXIT_CONFIG
