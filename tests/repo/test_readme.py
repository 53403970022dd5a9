"""Every command the README and docs/*.md show, run in order in a scratch folder (one per README
section and per docs file), so the docs cannot drift from the code.

What is adjusted, and why (the table ``ADJUST`` below, each with its reason):
- training commands get ``train.steps=2`` (the README's own override mechanism; the last
  override wins), the alignment run level 3 steps; measuring commands run as written (their
  default five rounds and the profiler's extra rounds: with three, a block's optimizer step
  still fitted below 0 s on a loaded host and the profile was, rightly, refused);
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
  numbers are measured by hand and logged in docs/LOG.md);
- a docs command that stands for the user's own input (a model they downloaded, their
  experiment, their hosts) or needs what this machine lacks is skipped with its reason
  (``PLACEHOLDERS``), and one the README test runs already is not run twice.
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

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# the docs whose commands are run: docs/LOG.md is history (its commands ran then, on that code)
DOCS = sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "LOG.md")
# a docs command holding one of these is not run, for the reason given
PLACEHOLDERS = {
    "configs/x.yaml": "stands for the user's experiment",
    "--chips cpu cuda": "needs a GPU",
    "--replay runs/default/align/replay_": "a replay file that a failing align run names",
    "~/models/": "a model the user downloaded",
    "runs/ft/checkpoints": "the user's fine-tuning run",
    "corpus/*.txt": "the user's text files",
    "shard-*.jsonl": "the user's JSON-lines files",
    "<hosts>": "the number of the user's hosts",
    "h2jax.load_config(": "a fragment of a script (the README's own-model script runs in full)",
}


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


def placeholder(text: str) -> str:
    """Why a docs command or block is not run (``PLACEHOLDERS``), or ""."""
    return next((reason for pattern, reason in PLACEHOLDERS.items() if pattern in text), "")


def adjust(cmd: str) -> tuple[list[str] | None, str]:
    """(the argv to run, or None to skip; why it differs from the README, or "")."""
    if "pytest" in cmd:
        return None, "the test suite itself"
    if reason := placeholder(cmd):
        return None, reason
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
    if "--steps" in argv:
        argv[argv.index("--steps") + 1] = "3"
        why.append("3 steps")
    elif "align" in argv and "run" in argv:  # the run level's default 300 steps
        argv += ["--steps", "3"]
        why.append("3 steps")
    return argv, ", ".join(why)


def steps() -> list[tuple[str, str, list[str] | None, str, int]]:
    """(section, command, argv or None, why, expected exit status) of every command of the
    README and then of docs/*.md, in order; a README section is the ``## `` heading above
    the command, a docs file is a section of its own."""
    out = []
    for path in (README, *DOCS):
        text = path.read_text()
        heads = [(m.start(), m.group(1).strip()) for m in re.finditer(r"^## (.+)$", text, flags=re.M)]
        for m in re.finditer(r"```(\w+)\n(.*?)```", text, flags=re.S):
            lang, body = m.group(1), m.group(2)
            if path == README:
                section = next((h for at, h in reversed(heads) if at < m.start()), "")
            else:
                section = f"docs/{path.name}"
            if lang == "bash":
                for cmd, code in commands(body):
                    argv, why = adjust(cmd)
                    out.append((section, cmd, argv, why, code))
            elif lang == "python":
                name = re.match(r"# (\w+\.py)\n", body)
                if name:  # a script the docs run by its name: written where the commands run
                    out.append((section, f"python block {name.group(1)}", ["write", name.group(1), body], "", 0))
                elif reason := placeholder(body):
                    out.append((section, "python block", None, reason, 0))
                else:
                    out.append((section, "python block", [sys.executable, "-c", body], "", 0))
    # a docs command the README runs already (as adjusted) is not run again
    seen = {tuple(argv) for sec, _, argv, _, _ in out if argv is not None and not sec.startswith("docs/")}
    return [
        (sec, cmd, None, "run by the README's section", code)
        if sec.startswith("docs/") and argv is not None and tuple(argv) in seen
        else (sec, cmd, argv, why, code)
        for sec, cmd, argv, why, code in out
    ]


def sections() -> list:
    """One test per README section and docs file that runs a command: its commands run in
    order, in a folder of their own (no section reads what another wrote), so the sections can
    run side by side in two workers; a section with an ``mpirun`` command joins the mpirun group."""
    out = []
    for section in dict.fromkeys(sec for sec, _, argv, _, _ in steps() if argv is not None):
        mpi = any(argv and argv[0].endswith("mpirun") for sec, _, argv, _, _ in steps() if sec == section)
        slug = re.sub(r"\W+", "-", section.lower()).strip("-")
        marks = [pytest.mark.multiproc] if mpi else [pytest.mark.xdist_group(f"readme-{slug}")]
        out.append(pytest.param(section, id=slug, marks=marks))
    return out


def executes(argv: list[str]) -> bool:
    """Whether a command mostly executes programs rather than compiles them: it runs with XLA's
    default flags, the others with the suite's (``H2JAX_TEST_XLA_FLAGS``, tests/conftest.py:
    LLVM's -O0 compiles a tiny model's programs faster). ``h2jax profile --measure`` times the
    stage programs (numbers of unoptimised code are not what a user's planner reads), and
    ``h2jax train`` on the default job's model (no config file: 6 layers, d_model 128, 128
    tokens) executes more than it compiles even in 2 steps (paired, one run each: the default
    job 21.0 s with -O0 against 9.8 s; the eager-1F1B schedule 14.3 against 9.9 s)."""
    if "h2jax.cli" not in argv and "h2jax" not in argv:
        return False
    at = argv.index("h2jax.cli" if "h2jax.cli" in argv else "h2jax") + 1
    command, rest = argv[at], argv[at + 1 :]
    if command == "profile":
        return "--measure" in rest
    return command == "train" and not any(w.endswith((".yaml", ".gin")) and "=" not in w for w in rest)


def test_the_readme_has_the_two_commands_first():
    first = [cmd for _, cmd, _, _, _ in steps()][:2]
    assert first == [
        "python3 -m pip install -e . && h2jax train",
        "python3 -m pip install -e '.[test]' && python3 -m pytest -q",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert first[1] in ci, "CI runs exactly the README's test command"


@pytest.mark.timeout(1800)  # a few commands, each a short run
@pytest.mark.parametrize("section", sections())
def test_every_readme_command_runs_in_order(section, tmp_path):
    for name in ("configs", "benchmarks", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONUNBUFFERED"] = "1"
    ran = 0
    for _, cmd, argv, why, code in (st for st in steps() if st[0] == section):
        if argv is None:
            continue
        if argv[0] == "write":
            (tmp_path / argv[1]).write_text(argv[2])
            continue
        if argv[0] == "h2jax":
            argv = [sys.executable, "-m", "h2jax.cli", *argv[1:]]
        if argv[0].endswith("mpirun"):
            argv = [argv[0], "--allow-run-as-root", *argv[1:]] if "--allow-run-as-root" not in argv else argv
        env["XLA_FLAGS"] = "" if executes(argv) else os.environ.get("H2JAX_TEST_XLA_FLAGS", "")
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == code, (
            f"README command: {cmd}\n({why}) exited {proc.returncode}, the README says {code}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
        assert "Traceback" not in proc.stderr, f"{cmd}\n{proc.stderr[-4000:]}"
        ran += 1
    assert ran >= 1, section


def test_the_readme_commands_are_all_run():
    """Every README and docs command is in a section the test above runs, or skipped for a
    stated reason; every docs file with a command is read."""
    run = {p.values[0] for p in sections()}
    for section, cmd, argv, why, _ in steps():
        assert argv is None and why or section in run, (section, cmd)
    assert sum(argv is not None and argv[0] != "write" for _, _, argv, _, _ in steps()) >= 15
    assert {sec for sec, *_ in steps() if sec.startswith("docs/")} >= {"docs/ALIGN.md", "docs/GIN.md", "docs/MODELS.md"}
