"""h2jax.config: defaults, YAML + dotted overrides, strict types, chip profiles, round trip.

Everything here is in-process and touches no device; each test runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from h2jax.config import (
    ConfigError,
    ExperimentConfig,
    TrainConfig,
    config_to_dict,
    load_config,
    load_raw,
    save_config,
    validate,
)
from h2jax.plan import StageSpec

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))


def _error(path=None, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value


def _write(tmp_path: Path, data, name: str = "exp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return p


# -- the default job -------------------------------------------------------------------


def test_default_job():
    cfg = load_config()
    assert cfg.train.transport == "local"  # 'auto' in one process
    default = ExperimentConfig()
    assert default.train.transport == "auto"
    assert cfg == dataclasses.replace(default, train=dataclasses.replace(default.train, transport="local"))
    assert set(cfg.cluster.chips) == {"sim_a", "sim_b"}
    assert cfg.plan.stages == (
        StageSpec(chip="sim_a", data=2, tensor=2, layers=(0, 4)),
        StageSpec(chip="sim_b", data=4, tensor=1, layers=(4, 6)),
    )
    assert cfg.model.n_layers == 6
    assert (cfg.plan.global_batch, cfg.plan.num_microbatches, cfg.plan.schedule.name) == (32, 8, "1f1b")
    # chips come from their profile files
    assert cfg.cluster.chips["sim_a"].memory_gib == 16.0
    assert cfg.cluster.chips["sim_b"].memory_gib == 8.0
    assert all(c.num_devices == 4 for c in cfg.cluster.chips.values())
    assert validate(ExperimentConfig()) == cfg


def test_validate_checks_configs_built_in_python():
    cfg = dataclasses.replace(load_config(), train=TrainConfig(steps=0))
    with pytest.raises(ConfigError, match=r"^train\.steps: steps=0; expected >= 1$"):
        validate(cfg)


# -- YAML files and overrides ----------------------------------------------------------


def test_yaml_file_merges_with_defaults(tmp_path):
    p = _write(tmp_path, "train:\n  steps: 7\noptimizer:\n  lr: 1e-3\n  eps: 1.0e-6\n")
    cfg = load_config(p)
    assert cfg.train.steps == 7
    assert cfg.train.log_every == 1  # untouched sibling keeps its default
    assert cfg.optimizer.lr == 0.001 and isinstance(cfg.optimizer.lr, float)  # PyYAML reads 1e-3 as a string
    assert cfg.optimizer.eps == 1e-6
    assert cfg.plan == ExperimentConfig().plan


def test_a_section_given_twice_is_refused_naming_the_line(tmp_path):
    """PyYAML keeps the last of two equal keys: the first section was dropped without a word."""
    p = _write(tmp_path, "train:\n  steps: 7\noptimizer:\n  lr: 1e-3\ntrain:\n  log_every: 2\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:5: 'train' is given twice in one mapping; expected it once"):
        load_config(p)
    p = _write(tmp_path, "optimizer:\n  lr: 1e-3\n  lr: 2e-3\n")
    with pytest.raises(ConfigError, match=r":3: 'lr' is given twice"):
        load_config(p)


def test_named_config_is_found_in_configs_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: found via the package's configs/
    assert load_config("tiny").name == "tiny"
    assert load_config("tiny.yaml") == load_config(REPO / "configs" / "tiny.yaml")


def test_overrides_on_top_of_file(tmp_path):
    p = _write(tmp_path, {"train": {"steps": 7}})
    cfg = load_config(p, ["train.steps=9", "optimizer.lr=1e-3", "name=x", "model.dtype=bfloat16"])
    assert (cfg.train.steps, cfg.optimizer.lr, cfg.name, cfg.model.dtype) == (9, 0.001, "x", "bfloat16")


def test_override_list_index():
    cfg = load_config(None, ["plan.stages.0.tensor=1", "plan.stages.0.data=4", "plan.stages.1.recompute=true"])
    assert cfg.plan.stages[0] == StageSpec(chip="sim_a", data=4, tensor=1, layers=(0, 4))
    assert cfg.plan.stages[1].recompute is True
    cfg = load_config(None, ["plan.stages.-1.layers=[3,6]", "plan.stages.0.layers.1=3"])
    assert [s.layers for s in cfg.plan.stages] == [(0, 3), (3, 6)]


def test_override_whole_list():
    cfg = load_config(None, ["plan.stages=[{chip: sim_a, layers: [0, 6], data: 4}]"])
    assert cfg.plan.stages == (StageSpec(chip="sim_a", layers=(0, 6), data=4),)


def test_override_adds_a_chip_to_the_cluster():
    cfg = load_config(None, ["cluster.chips.sim_c.nodes=2", "plan.stages.1.chip=sim_c"])
    assert set(cfg.cluster.chips) == {"sim_a", "sim_b", "sim_c"}
    assert cfg.cluster.chips["sim_c"].num_devices == 8


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("plan.stages.2.data=1", r"^plan\.stages\.2: index 2 out of range; the list has 2 items$"),
        ("plan.stages.x.data=1", r"^plan\.stages\.x: plan\.stages is a list; expected an index, got 'x'$"),
        ("train.steps.x=1", r"^train\.steps\.x: train\.steps is 200, not a mapping or list$"),
        ("train.steps", r"^train\.steps: override must look like key=value"),
        ("a..b=1", r"^a\.\.b=1: override key must be a dotted path"),
        ("plan.stages=[", r"^plan\.stages: value '\[' is not valid YAML"),
    ],
)
def test_bad_override_syntax(override, pattern):
    assert re.search(pattern, str(_error(None, [override])))


# -- floats --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("5E+2", 500.0), ("-2.5e-1", -0.25), ("3", 3.0), (".5", 0.5)])
def test_float_spellings(text, value):
    cfg = load_config(None, [f"optimizer.weight_decay={text}"])
    assert cfg.optimizer.weight_decay == value and isinstance(cfg.optimizer.weight_decay, float)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("nan", "got 'nan'; expected a number"),  # a string: Python's float() would take it
        ("inf", "got 'inf'; expected a number"),
        ("abc", "got 'abc'; expected a number"),
        (".nan", "got nan; expected a finite number"),  # YAML's own NaN and infinity
        (".inf", "got inf; expected a finite number"),
        ("true", "got True; expected a number"),
    ],
)
def test_float_rejects(text, expected):
    assert str(_error(None, [f"optimizer.lr={text}"])) == f"optimizer.lr: {expected}"


# -- unknown keys, at every depth ---------------------------------------------------------


@pytest.mark.parametrize(
    "data, key, expected",
    [
        ({"stepz": 1}, "stepz", "ExperimentConfig has keys ['checkpoint', 'cluster', 'comm', 'data', 'model'"),
        ({"model": {"n_layer": 6}}, "model.n_layer", "'n_layers'"),
        ({"optimizer": {"learning_rate": 1.0}}, "optimizer.learning_rate", "'lr'"),
        ({"train": {"log": {"every": 1}}}, "train.log", "'log_every'"),
        (
            {"plan": {"microbatches": 4}},
            "plan.microbatches",
            "Plan has keys ['global_batch', 'model', 'num_microbatches'",
        ),
        (
            {"plan": {"stages": [{"chip": "sim_a", "layers": [0, 6], "dp": 2}]}},
            "plan.stages[0].dp",
            "StageSpec has keys ['chip', 'chunks', 'data', 'layers', 'recompute', 'tensor']",
        ),
        (
            {"cluster": {"chips": {"sim_a": {"nodes": 1, "memory": 4}}}},
            "cluster.chips.sim_a.memory",
            "a chip has keys ['count', 'devices_per_node', 'emulated'",
        ),
        ({"cluster": {"nodes": 1}}, "cluster.nodes", "ClusterConfig has keys ['chips']"),
        ({1: 2, "zz": 3}, "1", "ExperimentConfig has keys"),  # non-string YAML keys: no TypeError
    ],
)
def test_unknown_keys(tmp_path, data, key, expected):
    e = _error(_write(tmp_path, data))
    assert e.key == key
    assert "unknown key" in e.message and expected in e.message


def test_unknown_key_in_a_chip_profile_file(tmp_path):
    (tmp_path / "chips").mkdir()
    (tmp_path / "chips" / "typo.yaml").write_text("devices_per_node: 4\nmemory_gb: 8\n")
    e = _error(None, [f"cluster.chips.sim_b.profile={tmp_path / 'chips' / 'typo.yaml'}"])
    assert e.key == "cluster.chips.sim_b.memory_gb" and "unknown key" in e.message


# -- wrong types -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, key, expected",
    [
        ({"train": {"steps": True}}, "train.steps", "got True; expected an integer"),  # bool for int
        ({"model": {"n_layers": "6"}}, "model.n_layers", "got '6'; expected an integer"),  # string for int
        ({"seed": 1.5}, "seed", "got 1.5; expected an integer"),
        ({"optimizer": [1, 2]}, "optimizer", "got [1, 2]; expected a mapping with keys ['b1'"),  # list for mapping
        ({"cluster": {"chips": ["sim_a"]}}, "cluster.chips", "got ['sim_a']; expected a mapping"),
        ({"cluster": {"chips": {"sim_a": [1]}}}, "cluster.chips.sim_a", "got [1]; expected a mapping of chip fields"),
        ({"train": {"timeline": 1}}, "train.timeline", "got 1; expected true or false"),
        ({"name": None}, "name", "got None; expected a string"),
        ({"data": {"token_file": 5}}, "data.token_file", "got 5; expected a string or null"),
        ({"plan": {"global_batch": True}}, "plan.global_batch", "got True; expected an integer"),
        ({"plan": {"stages": {"chip": "sim_a"}}}, "plan.stages", "got {'chip': 'sim_a'}; expected a list"),
        (
            {"plan": {"stages": [{"chip": "sim_a", "layers": [0, 6.0]}]}},
            "plan.stages[0].layers[1]",
            "got 6.0; expected an integer",
        ),
        (
            {"cluster": {"chips": {"sim_a": {"profile": 5}}}},
            "cluster.chips.sim_a.profile",
            "got 5; expected a chip profile name",
        ),  # was a TypeError from pathlib
    ],
)
def test_wrong_types(tmp_path, data, key, expected):
    e = _error(_write(tmp_path, data))
    assert e.key == key
    assert expected in e.message


def test_bad_files(tmp_path):
    e = _error(tmp_path / "missing.yaml")
    assert e.key == "config" and "missing.yaml" in e.message and "not found" in e.message
    e = _error(_write(tmp_path, "- 1\n- 2\n"))
    assert e.key == "config" and "must hold a mapping at the top, got list" in e.message
    e = _error(_write(tmp_path, "model:\n\tn_layers: 2\n"))
    assert e.key == "config" and e.message.endswith(
        "exp.yaml:2:1: not valid YAML (found character '\\t' that cannot start any token)"
    )
    assert load_config(_write(tmp_path, "")) == load_config()  # empty file: the defaults


# -- model values: named by their own key (GPTConfig's __post_init__ used to say "model: ...") --


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layers=0"], "model.n_layers: n_layers=0; expected >= 1"),
        (["model.vocab_size=-1"], "model.vocab_size: vocab_size=-1; expected >= 1"),
        (["model.d_model=130"], "model.n_heads: n_heads=4 does not divide d_model=130"),
        (["model.d_model=12"], "model.d_model: head_dim = d_model/n_heads = 12/4 = 3; rotary positions need it even"),
        (["model.norm_eps=0"], "model.norm_eps: norm_eps=0.0; expected > 0"),
        (["model.dtype=int8"], "model.dtype: dtype='int8'; expected one of ['float32', 'bfloat16', 'float16']"),
    ],
)
def test_model_values(overrides, message):
    assert str(_error(None, overrides)) == message


# -- cluster and chip profiles -----------------------------------------------------------


def test_cluster_chips_in_a_file_replace_the_defaults(tmp_path):
    p = _write(
        tmp_path,
        {
            "cluster": {"chips": {"sim_c": {"nodes": 2}}},
            "plan": {
                "stages": [
                    {"chip": "sim_c", "data": 4, "layers": [0, 3]},
                    {"chip": "sim_c", "data": 4, "layers": [3, 6]},
                ]
            },
        },
    )
    cfg = load_config(p)
    assert set(cfg.cluster.chips) == {"sim_c"}  # sim_a and sim_b did not leak in
    assert cfg.cluster.chips["sim_c"].nodes == 2
    # the default plan still names sim_a, which the file's cluster no longer has
    e = _error(_write(tmp_path, {"cluster": {"chips": {"sim_c": {"nodes": 1}}}}, "bad.yaml"))
    assert str(e) == "plan.stages[0].chip: chip 'sim_a' is not in the cluster; known chips: sim_c"


def test_chip_profile_by_name_and_inline_overrides(tmp_path):
    p = _write(
        tmp_path,
        {
            "cluster": {
                "chips": {
                    "sim_a": {"nodes": 1},
                    "big_b": {"profile": "sim_b", "nodes": 2, "memory_gib": 12.0},
                }
            },
            "plan": {
                "stages": [
                    {"chip": "sim_a", "data": 4, "layers": [0, 3]},
                    {"chip": "big_b", "data": 4, "layers": [3, 6]},
                ]
            },
        },
    )
    big = load_config(p).cluster.chips["big_b"]
    assert (big.nodes, big.memory_gib, big.peak_tflops, big.mem_bw_gbps) == (2, 12.0, 0.1, 40.0)
    assert big.profile == "sim_b"


def test_chip_profile_by_path_and_by_config_dir(tmp_path, monkeypatch):
    (tmp_path / "chips").mkdir()
    (tmp_path / "chips" / "sim_q.yaml").write_text("devices_per_node: 2\nmemory_gib: 3.5\n")
    cfg = load_config(
        None, [f"cluster.chips.sim_b.profile={tmp_path / 'chips' / 'sim_q.yaml'}", "plan.stages.1.data=2"]
    )
    assert (cfg.cluster.chips["sim_b"].devices_per_node, cfg.cluster.chips["sim_b"].memory_gib) == (2, 3.5)
    monkeypatch.setenv("H2JAX_CONFIG_DIR", str(tmp_path))
    cfg = load_config(None, ["cluster.chips.sim_q.nodes=1", "plan.stages.1.chip=sim_q", "plan.stages.1.data=2"])
    assert cfg.cluster.chips["sim_q"].memory_gib == 3.5


def test_missing_profile():
    e = _error(None, ["cluster.chips.sim_a.profile=sim_nope"])
    assert e.key == "cluster.chips.sim_a.profile"
    assert "profile 'sim_nope' not found in" in e.message and "chips" in e.message


# -- resolved config round trip --------------------------------------------------------------


@pytest.mark.parametrize(
    "path, overrides",
    [
        (None, []),
        (
            None,
            [
                "cluster.chips.big={profile: sim_b, nodes: 2}",
                "plan.stages.1.chip=big",
                "optimizer.lr=1e-4",
                "model.norm_eps=1e-6",
                "data.token_file=tokens.bin",
            ],
        ),
        *[(p, []) for p in CONFIG_FILES],
    ],
    ids=lambda v: v.name if isinstance(v, Path) else None,
)
def test_round_trip(tmp_path, monkeypatch, path, overrides):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokens.bin").write_bytes(b"".join(i.to_bytes(2, "little") for i in range(256)))  # uint16 ids
    cfg = load_config(path, overrides)
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    (tmp_path / "resolved.yaml").write_text(text)
    assert load_config(tmp_path / "resolved.yaml") == cfg
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg


def test_load_raw_is_a_fresh_copy():
    raw = load_raw(None, ["plan.stages.0.data=4"])
    raw["plan"]["stages"][0]["data"] = 99
    assert load_raw(None)["plan"]["stages"][0]["data"] == 2


# -- the experiment files in configs/ ------------------------------------------------------


def test_configs_exist():
    assert {p.name for p in CONFIG_FILES} >= {"default.yaml", "tiny.yaml", "four_chips.yaml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_file_loads(path):
    assert isinstance(load_config(path), ExperimentConfig)


def test_default_yaml_is_the_embedded_default():
    path = REPO / "configs" / "default.yaml"
    assert load_config(path) == load_config()
    # it spells out every key (chips by name and node count, as the embedded default does)
    written = yaml.safe_load(path.read_text())
    resolved = config_to_dict(load_config())
    resolved["cluster"]["chips"] = {name: {"nodes": 1} for name in resolved["cluster"]["chips"]}
    resolved["train"]["transport"] = "auto"  # the file keeps the default; loading resolves it
    assert written == resolved


def test_default_yaml_comments_every_key():
    lines = (REPO / "configs" / "default.yaml").read_text().splitlines()
    commented: dict[str, bool] = {}
    for line in lines:
        m = re.match(r"^\s*(?:- )?(\w+):", line)
        if m:
            commented[m.group(1)] = commented.get(m.group(1), False) or "#" in line
    assert commented and not [k for k, ok in commented.items() if not ok]


def test_tiny():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    m, p = cfg.model, cfg.plan
    assert (m.n_layers, m.d_model, m.seq_len) == (2, 32, 32)
    assert [s.chip for s in p.stages] == ["sim_a", "sim_b"]
    assert (p.global_batch, p.num_microbatches, cfg.train.steps) == (8, 4, 5)


def test_four_chips():
    cfg = load_config(REPO / "configs" / "four_chips.yaml")
    stages = cfg.plan.stages
    assert set(cfg.cluster.chips) == {"sim_a", "sim_b", "sim_c", "sim_d"}
    assert [s.chip for s in stages] == ["sim_a", "sim_b", "sim_c", "sim_d"]
    assert len({s.num_layers for s in stages}) > 1  # uneven
    assert len({s.recompute for s in stages}) == 2  # mixed


def test_a_warmup_longer_than_the_run_is_said_once():
    """warmup_steps=100 with steps=5 was accepted silently: the rate never passed 5 % of its peak."""
    from h2jax.config import config_warnings

    (line,) = config_warnings(load_config(None, ["optimizer.warmup_steps=100", "train.steps=5"], check_files=False))
    assert "optimizer.warmup_steps=100 is longer than train.steps=5" in line and "rises to 5% of" in line
    assert config_warnings(load_config(None, check_files=False)) == []


def test_reading_a_config_imports_no_array_library():
    """check-config and plan read a config without jax or ml_dtypes (ml_dtypes' import alone
    takes most of a second, paid by every command that only reads a config)."""
    code = (
        "import sys; from h2jax.config import load_config; load_config(None, []); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'ml_dtypes', 'flax')); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
