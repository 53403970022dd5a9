"""Progress of long work, for people: a bar on a terminal, a periodic line in a log file.

Training, ``h2jax profile --measure``, ``h2jax plan`` at scale, ``h2jax align`` and
``h2jax tokenize`` run for minutes. When the console writes to a terminal (default: stderr)
they show a rich progress bar; when it goes to a file they print one line every ``every_s``
seconds (and at the end), so a log shows they are alive and how far they got::

    with Progress("profile sim_a", total=12) as p:
        for row in rows:
            ...
            p.advance(note=f"tensor {t}, microbatch {b}")
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from h2jax._console import make_console


class Progress:
    """One piece of long work: ``done`` of ``total`` units, with a short ``note`` (e.g. the
    loss and throughput of the last training step) on the bar and in every line."""

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        every_s: float = 10.0,
        console: Console | None = None,
        enabled: bool = True,
    ):
        self.label, self.total, self.every_s, self.enabled = label, total, every_s, enabled
        self.console = console or make_console(stderr=True)
        self.done = 0
        self.note = ""
        self._bar: Any = None
        self._t0 = self._last = time.monotonic()

    @property
    def tty(self) -> bool:
        """Whether the console writes to a terminal (then a bar, else lines)."""
        isatty = getattr(self.console.file, "isatty", None)
        try:
            return bool(isatty is not None and isatty())
        except ValueError:  # a closed file
            return False

    def __enter__(self) -> Progress:
        if self.enabled and self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            eta = (TextColumn("eta"), TimeRemainingColumn()) if self.total is not None else ()
            self._bar = Bar(
                TextColumn(f"[bold]{self.label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"),
                TimeElapsedColumn(),
                *eta,
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task(self.label, total=self.total, note="")
            self._bar.start()
        return self

    def advance(self, n: int = 1, *, note: str = "") -> None:
        self.set(self.done + n, note=note)

    def set(self, done: int, *, note: str = "") -> None:
        """The work done so far is ``done`` (of ``total``)."""
        self.done = done
        self.note = note or self.note
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, note=self.note)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._line()

    def _line(self, end: bool = False) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        note = f" ({self.note})" if self.note else ""
        state = "done" if end else "at"
        elapsed = time.monotonic() - self._t0
        eta = ""
        if not end and self.total is not None and 0 < self.done < self.total:
            eta = f", eta {elapsed / self.done * (self.total - self.done):.0f} s"
        f = self.console.file
        f.write(f"h2jax: {self.label}: {state} {self.done}{of}{note}, {elapsed:.0f} s{eta}\n")
        f.flush()

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif exc[0] is None and self.enabled:
            self._line(end=True)
