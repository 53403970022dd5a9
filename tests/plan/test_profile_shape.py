"""Profiles made for another model shape are refused with both shapes named (a per-layer cost
of a d_model-32 model says nothing about a d_model-128 one, and the lookups would otherwise
fall back to the roofline without a word); profiles of the planned shape are used and the
output says the estimate comes from them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from h2jax.plan import ModelShape, ProfileError, ProfileTable, load_chip, roofline_costs

ROOT = Path(__file__).resolve().parents[2]
SIM_MIX = ROOT / "configs" / "clusters" / "sim_mix.yaml"


def _shape(path: Path) -> ModelShape:
    raw = yaml.safe_load(path.read_text())
    return ModelShape.from_config(raw["model"])


def _table(model: ModelShape, *, chips=("sim_a", "sim_b")) -> ProfileTable:
    """A table of every (tensor, sequences per device) the planner can look up on sim_mix, as
    if measured (the roofline's numbers, marked measured)."""
    table = ProfileTable()
    for name in chips:
        chip = load_chip(name)[0]
        for t in (1, 2, 4):
            for b in range(1, 33):
                parts = roofline_costs(model, chip, tensor=t, microbatch=b)
                table.add(
                    name, model.key(), t, b, {k: dataclasses.replace(v, estimated=False) for k, v in parts.items()}
                )
    return table


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_profiles_of_another_shape_are_refused_naming_both():
    tiny = _shape(ROOT / "configs" / "tiny.yaml")
    planned = _shape(SIM_MIX)
    table = _table(tiny, chips=("sim_a",))
    with pytest.raises(ProfileError) as e:
        table.check_model(planned)
    msg = str(e.value)
    assert "d_model 32" in msg and "d_model 128" in msg and "--profiles" in msg
    table.check_model(tiny)  # its own shape: accepted


def test_cli_plan_refuses_profiles_of_another_shape(tmp_path):
    tiny = _shape(ROOT / "configs" / "tiny.yaml")
    path = tmp_path / "prof.json"
    _table(tiny, chips=("sim_a",)).save(path)
    for cmd in (["plan", str(SIM_MIX)], ["simulate", str(tmp_path / "plan.yaml"), "--cluster", str(SIM_MIX)]):
        if cmd[0] == "simulate":
            ok = _cli("plan", str(SIM_MIX), "--out", str(tmp_path))
            assert ok.returncode == 0, ok.stderr
        r = _cli(*cmd, "--profiles", str(path))
        err = " ".join(r.stderr.split())
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "d_model 32" in err and "d_model 128" in err, err


def test_cli_plan_says_which_estimate_it_used(tmp_path):
    planned = _shape(SIM_MIX)
    both, one = tmp_path / "both.json", tmp_path / "one.json"
    _table(planned).save(both)
    _table(planned, chips=("sim_a",)).save(one)
    r = _cli("plan", str(SIM_MIX), "--profiles", str(both))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "(from measured profiles)" in out and "roofline" not in out
    r = _cli("plan", str(SIM_MIX), "--profiles", str(one))
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "no entry of this model shape for sim_b: priced by the roofline" in out, out
    r = _cli("plan", str(SIM_MIX))
    out = " ".join(r.stdout.split())
    assert "(roofline estimates: not a measurement)" in out, out
