"""Every command the README shows, run in order in a scratch folder, so the README cannot drift
from the code.

What is adjusted, and why (the table ``ADJUST`` below, each with its reason):
- training commands get ``train.steps=2`` (the README's own override mechanism; the last
  override wins), measuring commands ``--repeats 1``, the alignment run level 3 steps;
- ``h2jax align`` without a config file runs on ``configs/tiny.yaml`` (2 layers, the default
  job's chip types sim_a and sim_b): its op level evaluates every operator of a step on every
  chip type (990 on the default 6-layer model, 374 on the tiny one) and what the commands
  prove here is that they run and exit as the README says (0, 1 for the bf16 matmuls, 0);
- the install prefix ``python3 -m pip install -e . &&`` is dropped: the package is already
  installed in the environment running this test (the fresh-clone install itself is what CI's
  ``.ci/run`` does);
- the test commands are skipped: they are this suite;
- a Python block that starts with ``# <name>.py`` is written to that file (the commands that
  follow run it by name, in one process and under ``mpirun``); ``python`` is this
  environment's interpreter;
- ``srun`` lines run only where SLURM is installed;
- benchmark scripts run with ``--help`` (each takes minutes on a quiet machine; their
  numbers are measured by hand and logged in docs/LOG.md).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from h2jax.launch import find_mpirun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", text, flags=re.S)]


def commands(body: str) -> list[tuple[str, int]]:
    """(command, expected exit status) of every line of a bash block: comments and continuations
    handled by shlex; a comment saying ``exit N`` (e.g. ``# exit 1: sim_b diverges``) is the
    status the README promises, else 0."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            code = re.search(r"#.*\bexit (\d+)", line)
            out.append((" ".join(w if w == "&&" else shlex.quote(w) for w in words), int(code.group(1)) if code else 0))
    return out


def adjust(cmd: str) -> tuple[list[str] | None, str]:
    """(the argv to run, or None to skip; why it differs from the README, or "")."""
    if "pytest" in cmd:
        return None, "the test suite itself"
    why = []
    if cmd.startswith("python3 -m pip install -e . && "):
        cmd = cmd.split("&& ", 1)[1]
        why.append("already installed")
    argv = shlex.split(cmd)
    if argv[0] == "srun" and shutil.which("srun") is None:
        return None, "no SLURM here"
    if argv[0] == "mpirun":
        argv[0] = find_mpirun() or "mpirun"
    if argv[0] == "python" and argv[1].startswith("benchmarks/"):
        return [sys.executable, argv[1], "--help"], "benchmark: --help only"
    argv = [sys.executable if w == "python" else w for w in argv]  # this environment's interpreter
    if "h2jax" in argv and argv[argv.index("h2jax") + 1] == "train":
        argv.append("train.steps=2")
        why.append("2 steps")
    if "h2jax" in argv and argv[argv.index("h2jax") + 1] == "align":
        at = argv.index("h2jax") + 2
        if at == len(argv) or argv[at].startswith("-") or "=" in argv[at]:  # no config file: the default job
            argv.insert(at, "configs/tiny.yaml")
            why.append("the tiny model")
    if "--measure" in argv:
        argv += ["--repeats", "1"]
        why.append("1 round")
    if "--steps" in argv:
        argv[argv.index("--steps") + 1] = "3"
        why.append("3 steps")
    return argv, ", ".join(why)


def steps() -> list[tuple[str, list[str] | None, str, int]]:
    out = []
    for lang, body in blocks(README.read_text()):
        if lang == "bash":
            for cmd, code in commands(body):
                argv, why = adjust(cmd)
                out.append((cmd, argv, why, code))
        elif lang == "python":
            name = re.match(r"# (\w+\.py)\n", body)
            if name:  # a script the README runs by its name: written where the commands run
                out.append((f"python block {name.group(1)}", ["write", name.group(1), body], "", 0))
            else:
                out.append(("python block", [sys.executable, "-c", body], "", 0))
    return out


def test_the_readme_has_the_two_commands_first():
    first = [cmd for cmd, _, _, _ in steps()][:2]
    assert first == [
        "python3 -m pip install -e . && h2jax train",
        "python3 -m pip install -e '.[test]' && python3 -m pytest -q",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert first[1] in ci, "CI runs exactly the README's test command"


@pytest.mark.timeout(3600)  # some twenty commands, each a short run (about 8 minutes on a quiet machine)
def test_every_readme_command_runs_in_order(tmp_path):
    for name in ("configs", "benchmarks", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONUNBUFFERED"] = "1"
    ran = 0
    for cmd, argv, why, code in steps():
        if argv is None:
            continue
        if argv[0] == "write":
            (tmp_path / argv[1]).write_text(argv[2])
            continue
        if argv[0] == "h2jax":
            argv = [sys.executable, "-m", "h2jax.cli", *argv[1:]]
        if argv[0].endswith("mpirun"):
            argv = [argv[0], "--allow-run-as-root", *argv[1:]] if "--allow-run-as-root" not in argv else argv
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == code, (
            f"README command: {cmd}\n({why}) exited {proc.returncode}, the README says {code}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
        assert "Traceback" not in proc.stderr, f"{cmd}\n{proc.stderr[-4000:]}"
        ran += 1
    assert ran >= 15, ran
