"""The tree is clean under ruff (lint and format), as configured in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.fail("ruff is not installed; it comes with the test extra: pip install -e '.[test]'")
    return [exe]


@pytest.mark.parametrize(
    "args", [["check", "--output-format", "concise"], ["format", "--check"]], ids=["check", "format"]
)
def test_ruff(args):
    proc = subprocess.run([*_ruff(), *args, "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
