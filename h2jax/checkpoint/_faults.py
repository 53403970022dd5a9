"""Fault injection for the checkpoint tests: die at a named point of a save.

``H2JAX_FAULT=kill:<point>:<step>`` makes the process SIGKILL itself when it reaches
``<point>`` while saving ``<step>``. Points, in the order a save passes them:

- ``save_started``: orbax has the arrays and is writing them (in the background, if async);
- ``save_finalized``: orbax has finalised the step directory, no commit marker yet;
- ``committed``: the commit marker is written, retention has not run;
- ``committed_all`` (multi-process runs): at the first step boundary where every rank has
  committed ``<step>``, every rank kills itself -- the whole job dies right after a step
  that counts, as in a power cut.

SIGKILL cannot be caught: nothing after the point runs, as in a real node failure.
"""

from __future__ import annotations

import os
import signal

ENV = "H2JAX_FAULT"
POINTS = ("save_started", "save_finalized", "committed", "committed_all")


def failpoint(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, _, rest = spec.partition(":")
    where, _, at = rest.partition(":")
    if action == "kill" and where == point and at == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
