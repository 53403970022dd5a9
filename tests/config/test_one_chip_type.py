"""One chip type, one parser: an experiment's ``cluster.chips`` and the planner's clusters read
the same ``configs/chips/*.yaml`` into the same class with the same rules.

The in-process tests take milliseconds; the CLI tests run `check-config` and `plan` in
subprocesses (~2-3 s each, concurrently) because the two commands are what users compare.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from h2jax.config import ChipSpec, ConfigError, load_config
from h2jax.plan import ChipProfile, Cluster, ProfileError, load_chip

PROFILE = {
    "platform": "cpu",
    "emulated": True,
    "devices_per_node": 4,
    "memory_gib": 6.0,
    "peak_tflops": 0.2,
    "mem_bw_gbps": 30.0,
    "intra_node_gbps": 12.0,
    "inter_node_gbps": 3.0,
    "host": "box1",
    "host_cores": 8,  # a field the planner reads; the config used to refuse it
}


def _setup(tmp_path: Path, profile: dict) -> tuple[Path, Path]:
    """configs/chips/sim_q.yaml, a cluster file of it, and an experiment on it, in tmp_path."""
    (tmp_path / "configs" / "chips").mkdir(parents=True)
    (tmp_path / "configs" / "chips" / "sim_q.yaml").write_text(yaml.safe_dump(profile))
    model = {"vocab_size": 256, "seq_len": 32, "d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64}
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"chips": {"sim_q": {"nodes": 2}}, "model": model, "global_batch": 8}))
    exp = tmp_path / "exp.yaml"
    stages = [{"chip": "sim_q", "data": 2, "layers": [0, 1]}, {"chip": "sim_q", "data": 2, "layers": [1, 2]}]
    exp.write_text(
        yaml.safe_dump(
            {
                "model": model,
                "cluster": {"chips": {"sim_q": {"nodes": 2}}},
                "plan": {"global_batch": 8, "num_microbatches": 2, "stages": stages},
            }
        )
    )
    return cluster, exp


def test_the_config_and_the_planner_hold_one_class():
    assert ChipSpec is ChipProfile


def test_same_profile_loads_identically(tmp_path, monkeypatch):
    cluster, exp = _setup(tmp_path, PROFILE)
    monkeypatch.setenv("H2JAX_CONFIG_DIR", str(tmp_path / "configs"))
    from_config = load_config(exp).cluster.chips["sim_q"]
    from_planner = Cluster.load(cluster).profile("sim_q")
    assert from_config == from_planner
    assert (from_config.host, from_config.host_cores, from_config.nodes, from_config.num_devices) == ("box1", 8, 2, 8)


def test_count_stands_for_nodes_in_both(tmp_path, monkeypatch):
    _setup(tmp_path, PROFILE)
    monkeypatch.setenv("H2JAX_CONFIG_DIR", str(tmp_path / "configs"))
    chip, nodes = load_chip("sim_q", {"count": 8})
    assert (chip.nodes, nodes) == (2, 2)
    cfg = load_config(None, ["cluster.chips={sim_a: {nodes: 1}, sim_b: {count: 8}}"])
    assert cfg.cluster.chips["sim_b"].nodes == 2
    with pytest.raises(
        ConfigError, match=r"cluster.chips.sim_b.count: count=6 is not a multiple of devices_per_node=4"
    ):
        load_config(None, ["cluster.chips={sim_a: {nodes: 1}, sim_b: {count: 6}}"])


@pytest.mark.parametrize(
    "change, key, expected",
    [
        ({"memory_gb": 8}, "memory_gb", "unknown key (in "),
        ({"host_cores": "many"}, "host_cores", "got 'many'; expected an integer"),
        ({"host_cores": 0}, "host_cores", "host_cores=0; expected >= 1"),
        ({"peak_tflops": -1}, "peak_tflops", "peak_tflops=-1.0; expected > 0"),
        ({"emulated": "yes"}, "emulated", "got 'yes'; expected true or false"),
    ],
)
def test_bad_profile_fails_both_naming_the_same_key(tmp_path, monkeypatch, change, key, expected):
    cluster, exp = _setup(tmp_path, {**PROFILE, **change})
    monkeypatch.setenv("H2JAX_CONFIG_DIR", str(tmp_path / "configs"))
    with pytest.raises(ConfigError) as config_error:
        load_config(exp)
    with pytest.raises(ProfileError) as plan_error:
        Cluster.load(cluster)
    assert config_error.value.key == f"cluster.chips.sim_q.{key}"
    assert plan_error.value.key == f"chips.sim_q.{key}"
    assert config_error.value.message == plan_error.value.message
    assert expected in config_error.value.message


def test_profile_file_that_is_not_yaml_names_file_line_and_column(tmp_path, monkeypatch):
    cluster, exp = _setup(tmp_path, PROFILE)
    (tmp_path / "configs" / "chips" / "sim_q.yaml").write_text("memory_gib: 8\nplatform: [cpu\n")
    monkeypatch.setenv("H2JAX_CONFIG_DIR", str(tmp_path / "configs"))
    for call in (lambda: load_config(exp), lambda: Cluster.load(cluster)):
        with pytest.raises(ConfigError, match=r"sim_q.profile: .*sim_q.yaml:3:1: not valid YAML"):
            call()


def test_the_planner_refuses_an_unpriced_chip_type():
    """The planner prices a chip by its numbers, so a typo'd name with no profile fails there;
    training needs only memory, so a config may declare a real chip by platform and devices."""
    with pytest.raises(ProfileError, match=r"chips.h100: no profile configs/chips/h100.yaml found"):
        Cluster.from_dict({"chips": {"h100": {"count": 8}}})
    with pytest.raises(ProfileError, match=r"chips.nope: no profile"):
        load_chip("nope")  # as `h2jax profile --chip nope`
    cfg = load_config(
        None,
        [
            "cluster.chips={sim_a: {nodes: 1}, 'cpu:cpu': {emulated: false, platform: cpu, devices_per_node: 8}}",
            "plan.stages.1.chip=cpu:cpu",
        ],
    )
    assert (cfg.cluster.chips["cpu:cpu"].num_devices, cfg.cluster.chips["cpu:cpu"].host) == (8, None)


def _h2jax(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "H2JAX_CONFIG_DIR")}
    env["COLUMNS"] = "200"
    cmd = [sys.executable, "-m", "h2jax.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_cli_check_config_and_plan_agree(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    g_cluster, g_exp = _setup(good, PROFILE)
    b_cluster, b_exp = _setup(bad, {**PROFILE, "memory_gb": 8})
    runs = {
        "good-check": (["check-config", str(g_exp)], good),
        "good-plan": (["plan", str(g_cluster)], good),
        "bad-check": (["check-config", str(b_exp)], bad),
        "bad-plan": (["plan", str(b_cluster)], bad),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = {k: pool.submit(_h2jax, *args, cwd=cwd) for k, (args, cwd) in runs.items()}
        r = {k: f.result() for k, f in done.items()}
    assert r["good-check"].returncode == 0, r["good-check"].stderr
    assert r["good-plan"].returncode == 0, r["good-plan"].stderr
    for name, key in (("bad-check", "cluster.chips.sim_q.memory_gb"), ("bad-plan", "chips.sim_q.memory_gb")):
        err = r[name].stderr
        assert r[name].returncode == 2, (name, err)
        assert err.startswith(f"h2jax: config error: {key}: unknown key (in "), (name, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (name, err)


def test_a_planned_cluster_becomes_the_same_config_chips(tmp_path, monkeypatch):
    """`h2jax plan --out` writes the cluster into experiment.yaml: inline keys of the cluster
    file (here host_cores and a memory override) survive, so the run sees the planned chips."""
    _setup(tmp_path, PROFILE)
    monkeypatch.setenv("H2JAX_CONFIG_DIR", str(tmp_path / "configs"))
    cluster = Cluster.from_dict(
        {"chips": {"sim_q": {"nodes": 2, "host_cores": 2}, "big": {"profile": "sim_b", "count": 8, "memory_gib": 9.0}}}
    )
    chips = cluster.to_config_chips()
    assert chips == {"sim_q": {"nodes": 2, "host_cores": 2}, "big": {"profile": "sim_b", "nodes": 2, "memory_gib": 9.0}}
    stages = "[{chip: sim_q, data: 4, layers: [0, 3]}, {chip: big, data: 4, layers: [3, 6]}]"
    cfg = load_config(None, [f"cluster.chips={chips}", f"plan.stages={stages}"])
    assert cfg.cluster.chips == cluster.profiles
