"""A profile measured while other work kept the host busy is named, at measure and plan time.

Its times are slower than the chip alone would be, and the planner, comparing it with other
chip types' profiles, leans away from it: the plan's ratio was seen to fall to 52.7 % without
a word. ``h2jax._hostload.OtherWork`` counts the cores other processes kept busy (the kernel's
busy time less this process's own), the profile records it, and ``h2jax plan`` names every
chip type measured so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

import h2jax._hostload as hostload
from h2jax.plan import ModelShape, ProfileTable
from tests._harness import measured_table

ROOT = Path(__file__).resolve().parents[2]
SIM_MIX = ROOT / "configs" / "clusters" / "sim_mix.yaml"


def test_other_work_is_the_hosts_busy_time_less_this_process(monkeypatch):
    clock = iter([10.0, 14.0])  # 4 s of wall time
    host = iter([100.0, 109.0])  # every core busy 9 s in all
    own = iter([1.0, 4.0])  # of which this process 3 s
    monkeypatch.setattr(hostload, "_host_busy_s", lambda: next(host))
    monkeypatch.setattr(hostload.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(hostload.time, "process_time", lambda: next(own))
    with hostload.OtherWork() as w:
        pass
    assert w.cores == (9.0 - 3.0) / 4.0
    assert hostload.loaded(w.cores, 2) and not hostload.loaded(0.4, 2) and not hostload.loaded(None, 2)


def test_other_work_counts_another_process_busy_beside_it():
    if hostload._host_busy_s() is None:  # pragma: no cover - not Linux
        return
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.5: pass"
    with hostload.OtherWork() as w:
        subprocess.run([sys.executable, "-c", spin], check=True)
    assert w.cores is not None and w.cores >= 0.6, w.cores


def test_plan_names_the_profiles_measured_on_a_loaded_host(tmp_path):
    raw = yaml.safe_load(SIM_MIX.read_text())
    model = ModelShape.from_config(raw["model"])
    table = measured_table(model, {n: [(1, 2), (1, 4)] for n in ("sim_a", "sim_b")}, slow=5.0)
    table.host_cores = {"sim_a": 2, "sim_b": 2}
    table.other_cores = {"sim_a": 0.1, "sim_b": 1.2}
    path = tmp_path / "prof.json"
    table.save(path)
    assert ProfileTable.load(path).loaded_chips(["sim_a", "sim_b"]) == {"sim_b": (1.2, 2)}
    r = subprocess.run(
        [sys.executable, "-m", "h2jax.cli", "plan", str(SIM_MIX), "--profiles", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "sim_b's profile was measured while other work kept 1.2 of its host's 2 cores busy" in out, out
    assert "measure it again on a quiet host (`h2jax profile --chip sim_b --measure`)" in out
    assert "sim_a's profile was measured" not in out
