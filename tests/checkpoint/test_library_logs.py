"""When orbax's concurrent writes fail together (a full disk), the save raises the first failure
and asyncio logs each other one with a traceback when its task is collected. The CLI reports the
failed save once, in one line; those asyncio records show only with H2JAX_DEBUG=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# the shape of orbax's failure: two writes fail, gather() raises the first, the second is orphaned
SCRIPT = """
import asyncio, gc, logging
logging.basicConfig()
from h2jax.cli import _quiet_libraries
_quiet_libraries()

async def write(n):
    await asyncio.sleep(0.01)  # both fail before wait() returns
    raise OSError(27, f"File too large: fragment {n}")

async def save():
    tasks = [asyncio.ensure_future(write(n)) for n in (1, 2)]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    tasks[0].result()

try:
    asyncio.run(save())
except OSError as e:
    print("save failed:", e)
gc.collect()
logging.getLogger("asyncio").error("another asyncio error")
"""


@pytest.mark.parametrize("debug", ["", "1"])
def test_orphaned_write_failures_log_no_traceback(debug):
    env = {**os.environ, "H2JAX_DEBUG": debug}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "save failed: [Errno 27] File too large: fragment 1" in proc.stdout
    assert "another asyncio error" in proc.stderr  # the filter drops only the orphaned-task records
    orphaned = "Task exception was never retrieved" in proc.stderr
    assert orphaned == bool(debug), proc.stderr
    assert ("Traceback" in proc.stderr) == bool(debug), proc.stderr
