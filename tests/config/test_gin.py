"""gin experiment files: the same typed config as YAML, the same errors (exit 2, one line), and a
user's own model class selected by reference and trained from the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import h2jax
from h2jax.cli import main
from h2jax.config import ConfigError, model_factory, read_gin
from h2jax.runtime import Trainer

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# a 2-layer user model over two stages, 2 steps; the model's blocks come from its own argument
USER_GIN = """\
experiment.name = 'gin_user'
experiment.model = @gin_user_model.MyModel
MyModel.width = 40
MyModel.n_blocks = 2

model.n_layers = 2
model.seq_len = 32
train:
  steps = %STEPS
  progress = False
  tensorboard = False
STEPS = 2  # a macro may be defined below its use, as in gin
plan.stages = [
    {'chip': 'sim_a', 'data': 2, 'tensor': 1, 'layers': (0, 1)},
    {'chip': 'sim_b', 'data': 2, 'tensor': 1, 'layers': (1, 2)},
]
"""


def test_tiny_gin_equals_its_yaml_twin():
    assert h2jax.load_config(REPO / "configs/tiny.gin") == h2jax.load_config(REPO / "configs/tiny.yaml")
    over = ["train.steps=3", "plan.stages.1.tensor=1"]
    a, b = (h2jax.load_config(REPO / f"configs/tiny.{ext}", over) for ext in ("gin", "yaml"))
    assert a == b and a.train.steps == 3 and a.plan.stages[1].tensor == 1


def test_user_model_class_is_selected_with_its_arguments(tmp_path, monkeypatch):
    (tmp_path / "exp.gin").write_text(USER_GIN)
    monkeypatch.syspath_prepend(str(HERE))
    exp = read_gin(tmp_path / "exp.gin")
    from gin_user_model import MyModel

    assert exp.model_class is MyModel and exp.model_kwargs == {"width": 40, "n_blocks": 2}
    assert exp.raw["train"] == {"steps": 2, "progress": False, "tensorboard": False}
    assert exp.raw["plan"]["stages"][1]["layers"] == [1, 2]  # gin's tuple is YAML's list
    cfg = h2jax.load_config(tmp_path / "exp.gin")
    model = h2jax.config.model_factory(tmp_path / "exp.gin", cfg)()
    assert isinstance(model, MyModel) and model.width == 40 and len(model.blocks) == 2


BAD_GIN = {
    "unknown_key": ("train.stepz = 5\n", ["train.stepz: unknown key"]),
    "unknown_section": ("trian.steps = 5\n", ["trian.steps", "bad.gin:1: unknown binding"]),
    "wrong_type": ("model.n_layers = 'six'\n", ["model.n_layers: got 'six'; expected an integer"]),
    "syntax": ("train.steps = = 5\n", ["bad.gin:1:15: not valid gin"]),
    "validation": ("model.n_layers = 0\n", ["model.n_layers: n_layers=0; expected >= 1"]),
    "undefined_macro": ("train.steps = %N\n", ["train.steps", "macro %N is not defined"]),
    "scope": ("s/train.steps = 5\n", ["s/train.steps", "scoped bindings"]),
    "reference_elsewhere": ("train.steps = @os.getcwd\n", ["train.steps", "only allowed as experiment.model"]),
    "missing_module": ("experiment.model = @no_such_mod.M\n", ["experiment.model", "cannot import 'no_such_mod'"]),
    "not_a_class": ("experiment.model = @os.path.nope\n", ["experiment.model", "has no class 'nope'"]),
    "unknown_model_arg": (
        "experiment.model = @gin_user_model.MyModel\nMyModel.depth = 3\n",
        ["MyModel.depth", "bad.gin:2: MyModel takes no argument 'depth'"],
    ),
}


def test_check_config_names_the_model_a_gin_file_selects(tmp_path, monkeypatch, capsys):
    (tmp_path / "exp.gin").write_text(USER_GIN)
    monkeypatch.chdir(HERE)  # the user's module is found in the working directory
    assert main(["check-config", str(tmp_path / "exp.gin")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "config ok: gin_user, model gin_user_model.MyModel(width=40, n_blocks=2) from" in out, out
    assert "parameters" not in out, out  # the built-in model's count is not the user's model's


@pytest.mark.parametrize("case", sorted(BAD_GIN))
def test_bad_gin_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    text, expected = BAD_GIN[case]
    (tmp_path / "bad.gin").write_text(text)
    monkeypatch.chdir(HERE)  # the user's module is found in the working directory
    with pytest.raises(SystemExit) as info:
        main(["check-config", str(tmp_path / "bad.gin")])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for part in expected:
        assert part in lines[0], (part, lines[0])
    with pytest.raises(ConfigError):
        h2jax.load_config(tmp_path / "bad.gin")


def test_cli_trains_a_user_model_from_a_gin_file(tmp_path):
    """No driver script: `python -m h2jax.cli train exp.gin` builds the class the file names."""
    (tmp_path / "exp.gin").write_text(USER_GIN)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "H2JAX_CONFIG_DIR")}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "h2jax.cli", "train", str(tmp_path / "exp.gin"), "--run-dir", str(run_dir)],
        cwd=HERE,  # where gin_user_model.py lives, as a user's module would
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and all(math.isfinite(x) for x in summary["losses"])
    # the run folder records which model trained (its config.yaml alone read as the built-in model)
    first = (run_dir / "config.yaml").read_text().splitlines()[0]
    assert first == f"# model: gin_user_model.MyModel(width=40, n_blocks=2) from {tmp_path / 'exp.gin'}", first
    # the checkpoint holds the user's model (width 40, 2 blocks), not the built-in GPT
    gin = tmp_path / "exp.gin"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        cfg = h2jax.load_config(gin)
        trainer = Trainer(cfg, model=model_factory(gin, cfg), run_dir=run_dir)
    assert "step 2" in trainer.resume()
    params = {k: v.shape for k, v in trainer.gathered_params().items()}
    trainer.close()
    assert params["embed/table"] == (256, 40), params
    assert sorted(k for k in params if k.startswith("blocks/")) == ["blocks/0/lin/kernel", "blocks/1/lin/kernel"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_gin_selected_model_trains_under_mpirun(tmp_path):
    """One process per stage: each rank builds the gin-selected class once its stage's chip type
    is registered; the run equals the one-process run of the same file (losses to 1e-6)."""
    from h2jax.launch import find_mpirun

    if find_mpirun() is None:
        pytest.skip("mpirun not installed")
    (tmp_path / "exp.gin").write_text(USER_GIN)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "H2JAX_CONFIG_DIR", "XLA_FLAGS")}
    env["XLA_FLAGS"] = os.environ.get("H2JAX_TEST_XLA_FLAGS", "")  # the suite's compile flags (tests/conftest.py)
    losses = {}
    for name, prefix, extra in (
        ("one", [], []),
        ("mpi", [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2"], ["train.transport=host"]),
    ):
        run_dir = tmp_path / name
        cmd = [*prefix, sys.executable, "-m", "h2jax.cli", "train", str(tmp_path / "exp.gin"), "--run-dir"]
        proc = subprocess.run(
            [*cmd, str(run_dir), *extra], cwd=HERE, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        losses[name] = json.loads((run_dir / "summary.json").read_text())["losses"]
    assert len(losses["mpi"]) == 2
    assert losses["mpi"] == pytest.approx(losses["one"], abs=1e-6)
