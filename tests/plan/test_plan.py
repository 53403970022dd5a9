"""Plan: serialisation, strict parsing, validation messages, device placement, purity."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from h2jax.plan import Plan, PlanError, StageSpec, assign_devices, check_plan, even_layers

GOOD = {
    "model": "configs/models/gpt_small.yaml",
    "global_batch": 64,
    "num_microbatches": 16,
    "schedule": "1f1b",
    "stages": [
        {"chip": "sim_a", "data": 2, "tensor": 2, "layers": [0, 7], "recompute": False},
        {"chip": "sim_b", "data": 4, "tensor": 1, "layers": [7, 12], "recompute": True},
    ],
}
CLUSTER = {"sim_a": 8, "sim_b": 8}
PER_NODE = {"sim_a": 4, "sim_b": 4}


def _plan(stages, global_batch=8, num_microbatches=4, schedule="1f1b") -> Plan:
    return Plan(tuple(stages), global_batch, num_microbatches, schedule)


def _error(fn, *args, **kwargs) -> PlanError:
    with pytest.raises(PlanError) as info:
        fn(*args, **kwargs)
    return info.value


# -- the dataclasses and serialisation -------------------------------------------------


def test_properties():
    plan = Plan.from_dict(GOOD)
    assert plan.num_stages == 2
    assert plan.microbatch_size == 4
    assert plan.stages[0] == StageSpec("sim_a", (0, 7), data=2, tensor=2)
    assert plan.stages[0].num_devices == 4 and plan.stages[0].num_layers == 7
    assert plan.stages[1].recompute is True
    assert StageSpec("x", [1, 3]).layers == (1, 3)  # lists are stored as tuples


def test_dict_round_trip():
    plan = Plan.from_dict(GOOD)
    assert plan.to_dict() == GOOD
    assert Plan.from_dict(plan.to_dict()) == plan


def test_yaml_round_trip(tmp_path):
    plan = Plan.from_dict({**GOOD, "stages": [{**GOOD["stages"][0], "chip": "cuda:H100"}, GOOD["stages"][1]]})
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    text = path.read_text()
    assert text.startswith("#")
    assert "# sequences per optimizer step" in text
    assert "microbatch = 4 sequences" in text
    assert Plan.from_yaml(path) == plan


def test_yaml_defaults_and_null_model(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("global_batch: 4\nnum_microbatches: 2\nstages:\n  - {chip: cpu, layers: [0, 2]}\n")
    plan = Plan.from_yaml(path)
    assert plan == Plan((StageSpec("cpu", (0, 2)),), 4, 2)
    plan.to_yaml(path)
    assert Plan.from_yaml(path) == plan


def test_plan_error_format_and_pickle():
    err = PlanError("plan.stages[1].tensor", "tensor=3 does not divide n_heads=4")
    assert str(err) == "plan.stages[1].tensor: tensor=3 does not divide n_heads=4"
    assert isinstance(err, ValueError)
    assert (err.key, err.message) == ("plan.stages[1].tensor", "tensor=3 does not divide n_heads=4")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.key == err.key


@pytest.mark.parametrize(
    "mutate,key,text",
    [
        (lambda d: d.update(extra=1), "plan.extra", "unknown key"),
        (lambda d: d.pop("global_batch"), "plan.global_batch", "required key is missing"),
        (lambda d: d.pop("stages"), "plan.stages", "required key is missing"),
        (lambda d: d.update(global_batch="64"), "plan.global_batch", "got '64'; expected an integer"),
        (lambda d: d.update(num_microbatches=True), "plan.num_microbatches", "got True; expected an integer"),
        (lambda d: d.update(global_batch=64.0), "plan.global_batch", "got 64.0; expected an integer"),
        (lambda d: d.update(schedule=1), "plan.schedule", "got 1; expected a string: one of gpipe, 1f1b"),
        (lambda d: d.update(model=3), "plan.model", "got 3; expected a string"),
        (lambda d: d.update(stages={"chip": "a"}), "plan.stages", "got {'chip': 'a'}; expected a list"),
        (lambda d: d["stages"].__setitem__(0, "sim_a"), "plan.stages[0]", "got 'sim_a'; expected a mapping"),
        (lambda d: d["stages"][0].update(layers=[0, 7, 9]), "plan.stages[0].layers", "got [0, 7, 9]; expected 2 items"),
        (lambda d: d["stages"][0].update(layers="0-7"), "plan.stages[0].layers", "got '0-7'; expected a list"),
        (lambda d: d["stages"][0].update(layers=[0, 7.5]), "plan.stages[0].layers[1]", "got 7.5; expected an integer"),
        (lambda d: d["stages"][1].update(data=True), "plan.stages[1].data", "got True; expected an integer"),
        (lambda d: d["stages"][1].update(tensor="2"), "plan.stages[1].tensor", "got '2'; expected an integer"),
        (lambda d: d["stages"][1].update(recompute=1), "plan.stages[1].recompute", "got 1; expected true or false"),
        (lambda d: d["stages"][1].update(chip=None), "plan.stages[1].chip", "got None; expected a string"),
        (lambda d: d["stages"][1].pop("chip"), "plan.stages[1].chip", "required key is missing"),
        (lambda d: d["stages"][1].update(pipeline=2), "plan.stages[1].pipeline", "unknown key"),
    ],
)
def test_from_dict_is_strict(mutate, key, text):
    d = {**GOOD, "stages": [dict(s) for s in GOOD["stages"]]}
    mutate(d)
    err = _error(Plan.from_dict, d)
    assert err.key == key
    assert text in err.message, str(err)


def test_from_dict_key_prefix_and_not_a_mapping():
    assert _error(Plan.from_dict, [1], key_prefix="pipeline.plan").key == "pipeline.plan"
    d = {**GOOD, "stages": [{**GOOD["stages"][0], "data": "x"}]}
    assert _error(Plan.from_dict, d, key_prefix="cfg.plan").key == "cfg.plan.stages[0].data"


# -- check_plan: every error case ------------------------------------------------------


def test_check_plan_accepts_good_plan():
    plan = Plan.from_dict(GOOD)
    check_plan(
        plan,
        num_layers=12,
        chip_devices=CLUSTER,
        devices_per_node=PER_NODE,
        divisible_by_tensor={"model.n_heads": 4, "model.d_ff": 512, "model.vocab_size": 256},
    )


A = StageSpec("sim_a", (0, 2))
B = StageSpec("sim_b", (2, 4))


@pytest.mark.parametrize(
    "plan,kwargs,key,texts",
    [
        (_plan([]), {}, "plan.stages", ["0 stages", "at least 1"]),
        (_plan([StageSpec("sim_a", (0, 4), data=0)]), {}, "plan.stages[0].data", ["data=0", ">= 1"]),
        (_plan([A, StageSpec("sim_b", (2, 4), tensor=-1)]), {}, "plan.stages[1].tensor", ["tensor=-1"]),
        (
            _plan([StageSpec("sim_a", (1, 4))]),
            {},
            "plan.stages[0].layers",
            ["starts at layer 1, expected 0", "[1, 4)", "cover [0, 4)"],
        ),
        (
            _plan([A, StageSpec("sim_b", (3, 4))]),
            {},
            "plan.stages[1].layers",
            ["starts at layer 3, expected 2", "stage 0 ends at layer 2", "[0, 2), [3, 4)"],
        ),
        (
            _plan([A, StageSpec("sim_b", (1, 4))]),
            {},
            "plan.stages[1].layers",
            ["starts at layer 1, expected 2", "[0, 2), [1, 4)"],
        ),
        (
            _plan([A, StageSpec("sim_b", (2, 2)), StageSpec("sim_b", (2, 4))]),
            {},
            "plan.stages[1].layers",
            ["[2, 2) hold no layer", "at least one"],
        ),
        (
            _plan([A, StageSpec("sim_b", (2, 3))]),
            {},
            "plan.stages",
            ["end at layer 3", "num_layers=4", "[0, 2), [2, 3)"],
        ),
        (_plan([A, StageSpec("sim_b", (2, 6))]), {}, "plan.stages", ["end at layer 6", "num_layers=4"]),
        (_plan([A, B], global_batch=0), {}, "plan.global_batch", ["global_batch=0"]),
        (_plan([A, B], num_microbatches=0), {}, "plan.num_microbatches", ["num_microbatches=0"]),
        (
            _plan([A, B], global_batch=10, num_microbatches=4),
            {},
            "plan.num_microbatches",
            ["num_microbatches=4 does not divide global_batch=10"],
        ),
        (
            _plan([A, StageSpec("sim_b", (2, 4), data=3)], global_batch=24, num_microbatches=6),
            {},
            "plan.stages[1].data",
            ["data=3 does not divide microbatch_size=4", "global_batch=24 / num_microbatches=6"],
        ),
        (
            _plan([A, StageSpec("sim_b", (2, 4), tensor=3)]),
            {"divisible_by_tensor": {"n_heads": 4}},
            "plan.stages[1].tensor",
            ["tensor=3 does not divide n_heads=4"],
        ),
        (
            _plan([StageSpec("sim_a", (0, 2), tensor=2), StageSpec("sim_b", (2, 4), tensor=4)]),
            {"divisible_by_tensor": {"model.n_heads": 4, "model.vocab_size": 255}},
            "plan.stages[0].tensor",
            ["tensor=2 does not divide model.vocab_size=255"],
        ),
        (
            _plan([A, StageSpec("sim_x", (2, 4))]),
            {"chip_devices": CLUSTER},
            "plan.stages[1].chip",
            ["'sim_x' is not in the cluster", "known chips: sim_a, sim_b"],
        ),
        (
            _plan([A, StageSpec("sim_x", (2, 4))]),
            {"devices_per_node": PER_NODE},
            "plan.stages[1].chip",
            ["'sim_x' is not in the cluster"],
        ),
        (
            _plan(
                [StageSpec("sim_a", (0, 1)), StageSpec("sim_b", (1, 2), data=4), StageSpec("sim_b", (2, 4), data=2)],
                global_batch=16,
            ),
            {"chip_devices": {"sim_a": 4, "sim_b": 4}},
            "plan.stages",
            ["stages on chip sim_b need 4+2 = 6 devices, the cluster has 4", "stage 1: 4x1", "stage 2: 2x1"],
        ),
        (
            _plan([A, StageSpec("sim_b", (2, 4), data=2, tensor=4)], global_batch=8, num_microbatches=4),
            {"chip_devices": {"sim_a": 1, "sim_b": 16}, "devices_per_node": PER_NODE},
            "plan.stages[1]",
            ["data*tensor = 2*4 = 8 devices of chip sim_b, a node has 4"],
        ),
        (_plan([A, B], schedule="zb-v"), {}, "plan.stages[0].chunks", ["schedule zb-v needs exactly 2"]),
    ],
)
def test_check_plan_errors(plan, kwargs, key, texts):
    err = _error(check_plan, plan, num_layers=4, **kwargs)
    assert err.key == key, str(err)
    for text in texts:
        assert text in err.message, str(err)
    assert str(err).startswith(f"{key}: ")


def test_an_unknown_schedule_is_refused_where_the_plan_is_read():
    # the schedule is an object from the start: a name no family has is no plan at all
    err = _error(_plan, [A, B], schedule="zb-x")
    assert (err.key, err.message) == (
        "plan.schedule",
        "schedule='zb-x' is not one of gpipe, 1f1b, zb-h1, interleaved, zb-v, nor a schedule file (a path ending .csv)",
    )
    raw = _plan([A, B]).to_dict() | {"schedule": "x"}
    assert _error(Plan.from_dict, raw, key_prefix="run.plan").key == "run.plan.schedule"


def test_check_plan_key_prefix():
    err = _error(check_plan, _plan([A], schedule="zb-v"), num_layers=4, key_prefix="run.plan")
    assert err.key == "run.plan.stages[0].chunks"


# -- assign_devices ---------------------------------------------------------------------


def _chip_plan(*sizes_and_chips: tuple[str, int]) -> Plan:
    stages = [StageSpec(chip, (i, i + 1), data=n) for i, (chip, n) in enumerate(sizes_and_chips)]
    return _plan(stages, global_batch=4 * 16, num_microbatches=4)


def test_assign_spreads_consecutive_stages_over_nodes():
    plan = _chip_plan(("sim_a", 2), ("sim_a", 2), ("sim_b", 4))
    got = assign_devices(plan, nodes={"sim_a": 2, "sim_b": 1}, devices_per_node={"sim_a": 4, "sim_b": 4})
    assert got == ((0, (0, 1)), (1, (0, 1)), (0, (0, 1, 2, 3)))


def test_assign_spreads_then_packs():
    plan = _chip_plan(("sim_a", 2), ("sim_a", 2), ("sim_a", 1), ("sim_a", 1))
    got = assign_devices(plan, nodes={"sim_a": 2}, devices_per_node={"sim_a": 4})
    assert got == ((0, (0, 1)), (1, (0, 1)), (0, (2,)), (0, (3,)))


def test_assign_packs_when_spreading_does_not_fit():
    # spreading puts 2 and 2 on separate nodes and leaves no room for 4
    plan = _chip_plan(("sim_a", 2), ("sim_a", 2), ("sim_a", 4))
    got = assign_devices(plan, nodes={"sim_a": 2}, devices_per_node={"sim_a": 4})
    assert got == ((0, (0, 1)), (0, (2, 3)), (1, (0, 1, 2, 3)))


def test_assign_searches_when_first_fit_fails():
    # first-fit in order: 3 -> n0, 2 -> n1, 2 -> n1, 3 -> nowhere; 3+2 | 3+2 fits
    plan = _chip_plan(("sim_a", 3), ("sim_a", 2), ("sim_a", 2), ("sim_a", 3))
    got = assign_devices(plan, nodes={"sim_a": 2}, devices_per_node={"sim_a": 5})
    per_node = [0, 0]
    for node, devs in got:
        per_node[node] += len(devs)
        assert devs == tuple(range(devs[0], devs[0] + len(devs)))
    assert per_node == [5, 5]
    # no device is given to two stages
    assert len({(n, d) for n, devs in got for d in devs}) == 10


def test_assign_single_node_cluster():
    plan = _chip_plan(("cpu", 1), ("cpu", 1), ("cpu", 2))
    got = assign_devices(plan, nodes={"cpu": 1}, devices_per_node={"cpu": 4})
    assert got == ((0, (0,)), (0, (1,)), (0, (2, 3)))


@pytest.mark.parametrize(
    "sizes,nodes,per_node,key,text",
    [
        ([5], 2, 4, "plan.stages[0]", "needs 5*1 = 5 devices of chip sim_a, a node has 4"),
        ([4, 4, 2], 2, 4, "plan.stages", "need 4+4+2 = 10 devices, the cluster has 2 nodes x 4 = 8"),
        ([3, 3, 2], 2, 4, "plan.stages", "3+3+2 devices, which do not fit on 2 nodes of 4"),
    ],
)
def test_assign_errors(sizes, nodes, per_node, key, text):
    plan = _chip_plan(*[("sim_a", n) for n in sizes])
    err = _error(assign_devices, plan, nodes={"sim_a": nodes}, devices_per_node={"sim_a": per_node})
    assert err.key == key
    assert text in err.message, str(err)


def test_assign_unknown_chip():
    err = _error(assign_devices, _chip_plan(("sim_z", 1)), nodes={"sim_a": 1}, devices_per_node={"sim_a": 4})
    assert err.key == "plan.stages[0].chip"
    assert "'sim_z' is not in the cluster" in err.message


# -- helpers and purity -------------------------------------------------------------------


def test_even_layers():
    assert even_layers(12, 2) == [(0, 6), (6, 12)]
    assert even_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]
    for n in range(1, 20):
        for s in range(1, n + 1):
            ranges = even_layers(n, s)
            plan = _plan([StageSpec("c", r) for r in ranges])
            check_plan(plan, num_layers=n)
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="num_layers=2 into num_stages=3"):
        even_layers(2, 3)


def test_importing_plan_does_not_import_jax():
    code = "import sys, h2jax.plan; assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_and_profile_errors_are_config_errors():
    """Every command prints a ConfigError as one line of its own key: no 'plan: plan:' prefix."""
    from h2jax._strict import ConfigError
    from h2jax.plan import ProfileError

    err = PlanError("plan.stages[0].chip", "chip 'x' is not in the cluster")
    assert isinstance(err, ConfigError) and str(err) == "plan.stages[0].chip: chip 'x' is not in the cluster"
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    assert (ProfileError("plan: no plan fits").key, ProfileError("plan: no plan fits").message) == (
        "plan",
        "no plan fits",
    )
    assert str(ProfileError("file 'c.yaml' not found")) == "plan: file 'c.yaml' not found"
    assert str(pickle.loads(pickle.dumps(ProfileError("chips.a", "bad")))) == "chips.a: bad"


def test_plan_file_that_is_not_yaml_names_file_line_and_column(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("global_batch: 8\nstages: [{chip: a, layers: [0, 1]}\n")
    with pytest.raises(PlanError, match=r"plan: .*plan.yaml:3:1: not valid YAML"):
        Plan.from_yaml(path)
    path.write_bytes(b"global_batch: \xff\n")
    with pytest.raises(PlanError, match=r"plan: .*plan.yaml is not UTF-8 text \(byte 14"):
        Plan.from_yaml(path)
