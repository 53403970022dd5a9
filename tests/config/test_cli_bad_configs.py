"""Bad configs through the real CLI (`python -m h2jax.cli` in a subprocess): exit code 2,
one line on stderr naming the key and the numbers, and -- for `train` -- no device touched.

Each subprocess costs ~2 s (importing JAX), so the check-config cases run concurrently in
one module-scoped batch and the tests only read its results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

# a cold import of JAX takes ~2 s; compiling and running the first step of any plan takes
# far longer, so a config error that returns within this bound never reached the devices
FAST_EXIT_S = 15.0


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "H2JAX_CONFIG_DIR")}
    env["COLUMNS"] = "200"  # keep rich from wrapping the table
    return env


def h2jax(*args: str, cwd: Path) -> Result:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


# id -> (arguments after the command, substrings the error line must contain); one subprocess each
BAD = {
    "unknown_key": (["model.n_layer=4"], ["model.n_layer: unknown key", "n_layers"]),
    "wrong_type": (["train.steps=true"], ["train.steps: got True; expected an integer"]),
    "too_many_devices": (
        ["plan.stages.1.data=8"],
        ["plan.stages: stages on chip sim_b need 8 devices, the cluster has 4", "stage 1: 8x1"],
    ),
    "layers_gap": (
        ["plan.stages.0.layers=[0,3]"],
        ["plan.stages[1].layers: stage 1 starts at layer 4, expected 3", "[0, 3), [4, 6)"],
    ),
    "layers_overlap": (
        ["plan.stages.1.layers=[3,6]"],
        ["plan.stages[1].layers: stage 1 starts at layer 3, expected 4", "[0, 4), [3, 6)"],
    ),
    "layers_beyond_model": (
        ["plan.stages.1.layers=[4,8]"],
        ["plan.stages: stages end at layer 8, the model has num_layers=6"],
    ),
    "batch_not_divisible": (
        ["plan.global_batch=30"],
        ["plan.num_microbatches: num_microbatches=8 does not divide global_batch=30"],
    ),
    "microbatch_vs_data": (
        ["plan.num_microbatches=16"],
        ["plan.stages[1].data: data=4 does not divide microbatch_size=2", "global_batch=32 / num_microbatches=16"],
    ),
    "tensor_vs_heads": (
        ["plan.stages.0.tensor=3", "plan.stages.0.data=1"],
        ["plan.stages[0].tensor: tensor=3 does not divide model.n_heads=4"],
    ),
    "tensor_vs_d_ff": (
        ["model.d_ff=510", "plan.stages.0.tensor=4", "plan.stages.0.data=1"],
        ["plan.stages[0].tensor: tensor=4 does not divide model.d_ff=510"],
    ),
    "tensor_vs_vocab": (
        ["model.vocab_size=257"],
        ["plan.stages[0].tensor: tensor=2 does not divide model.vocab_size=257"],
    ),
    "missing_file": (["no_such_config.yaml"], ["config: file 'no_such_config.yaml' not found"]),
    "unknown_schedule": (
        ["plan.schedule=zero_bubble"],
        ["plan.schedule: schedule='zero_bubble' is not one of gpipe, 1f1b"],
    ),
    "unknown_chip": (
        ["plan.stages.1.chip=sim_z"],
        ["plan.stages[1].chip: chip 'sim_z' is not in the cluster; known chips: sim_a, sim_b"],
    ),
}

# `train` exits on the same checks before any device is touched
BAD_TRAIN = ["unknown_key", "too_many_devices", "missing_file"]

# more cases through the same entry point, in-process (h2jax.cli.main), to spare subprocesses
BAD_IN_PROCESS = {
    "unknown_key_in_file": (
        ["@unknown_stage_key.yaml"],
        ["plan.stages[1].dp: unknown key", "'data', 'layers', 'recompute', 'tensor'"],
    ),
    "unknown_key_markup": (["model.[bold]x=1"], ["model.[bold]x: unknown key"]),  # rich must not eat "[bold]"
    "string_for_int": (["model.n_layers=six"], ["model.n_layers: got 'six'; expected an integer"]),
    "list_for_mapping": (["optimizer=[1]"], ["optimizer: got [1]; expected a mapping"]),
    "stage_spans_nodes": (
        ["cluster.chips.sim_b.nodes=2", "plan.num_microbatches=4", "plan.stages.1.data=8"],
        ["plan.stages[1]: stage 1 needs data*tensor = 8*1 = 8 devices of chip sim_b, a node has 4"],
    ),
    "layers_short_of_model": (["model.n_layers=8"], ["plan.stages: stages end at layer 6, the model has num_layers=8"]),
    "model_value": (["model.n_layers=0"], ["model.n_layers: n_layers=0; expected >= 1"]),
    "profile_not_a_string": (["cluster.chips.sim_a.profile=5"], ["cluster.chips.sim_a.profile: got 5"]),
    "two_config_files": (
        ["@unknown_stage_key.yaml", "other.yaml"],  # used to exit 1
        ["other.yaml: got 'other.yaml' after the config file; expected key=value"],
    ),
}


def _args(args: list[str], folder: Path) -> list[str]:
    return [str(folder / a[1:]) if a.startswith("@") else a for a in args]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    stages = [{"chip": "sim_a", "layers": [0, 4], "data": 2, "tensor": 2}, {"chip": "sim_b", "layers": [4, 6], "dp": 4}]
    (folder / "unknown_stage_key.yaml").write_text(yaml.safe_dump({"plan": {"stages": stages}}))
    return folder


@pytest.fixture(scope="module")
def check_config_results(folder) -> dict[str, Result]:
    runs = {name: ["check-config", *_args(args, folder)] for name, (args, _) in BAD.items()}
    runs["default"] = ["check-config"]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(h2jax, *argv, cwd=folder) for name, argv in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def _assert_config_error(r: Result, expected: list[str]) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("h2jax: config error: "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line, wherever the terminal wraps
    for s in expected:
        assert s in r.stderr, (s, r.stderr)


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_config_rejects(check_config_results, name):
    _assert_config_error(check_config_results[name], BAD[name][1])
    assert check_config_results[name].stdout == ""


def test_check_config_default(check_config_results):
    r = check_config_results["default"]
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "plan: 2 stages, 1f1b, global batch 32 = 8 x 4" in out
    for row in (
        ["0", "sim_a (emulated)", "2 x 2", "0-3", "16 GiB"],
        ["1", "sim_b (emulated)", "4 x 1", "4-5", "8 GiB"],
    ):
        line = next((ln for ln in out.splitlines() if row[1] in ln), "")
        assert all(cell in line for cell in row), (row, out)
    assert "config ok: default, model 6 layers x d_model 128" in out


@pytest.mark.parametrize("name", BAD_TRAIN)
def test_train_rejects_before_touching_devices(folder, tmp_path, name):
    args, expected = BAD[name]
    r = h2jax("train", *_args(args, folder), cwd=tmp_path)
    _assert_config_error(r, expected)
    assert r.seconds < FAST_EXIT_S, f"train took {r.seconds:.1f} s to reject a bad config"
    assert "h2jax train:" not in r.stderr  # the run banner comes after validation
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, nothing written


@pytest.mark.parametrize("name", sorted(BAD_IN_PROCESS))
def test_cli_main_rejects(folder, capsys, monkeypatch, name):
    from h2jax.cli import main

    args, expected = BAD_IN_PROCESS[name]
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(folder)
    with pytest.raises(SystemExit) as info:
        main(["check-config", *_args(args, folder)])
    out, err = capsys.readouterr()
    _assert_config_error(Result(info.value.code, out, err, 0.0), expected)
    assert out == ""
