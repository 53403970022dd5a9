"""`h2jax align` on a 3-layer GPT across emulated chip types: what it reports, and its exit codes.

Two runs of the command (op and layer levels) are shared by the tests: one where both chip
types compute as the host does, one where four chip types each differ in one way:
sim_a exact, sim_b with bf16-rounded matmul inputs, sim_c with a test-only fault on the
forward ``rsqrt`` of blocks.1 (its attention RMSNorm), sim_d with a fault on every ``mul`` of
blocks.1's backward.
"""

import json
from pathlib import Path

import pytest

from h2jax.cli_align import main

pytestmark = pytest.mark.slow  # the align tool end to end on the default model: the full suite, not the fast lane

CONFIG = str(Path(__file__).with_name("align_small.yaml"))
FAULT_FWD = "sim_c=rsqrt:1e-3:blocks.1.attn_norm:fwd"
FAULT_BWD = "sim_d=mul:1e-3:blocks.1:bwd"


@pytest.fixture(scope="module")
def identical(tmp_path_factory):
    out = tmp_path_factory.mktemp("identical")
    code = main([CONFIG, "--chips", "sim_a", "sim_b", "--out", str(out)])
    return code, json.loads((out / "align.json").read_text()), out


@pytest.fixture(scope="module")
def differing(tmp_path_factory):
    out = tmp_path_factory.mktemp("differing")
    argv = [CONFIG, "--chips", "sim_a", "sim_b", "sim_c", "sim_d", "--out", str(out)]
    argv += ["--numerics", "sim_b.matmul_input_rounding=bf16", "--inject-fault", FAULT_FWD, FAULT_BWD]
    code = main(argv)
    return code, json.loads((out / "align.json").read_text()), out


def test_identical_numerics_pass_every_gate(identical):
    code, report, out = identical
    assert code == 0
    assert report["passed"] and report["gates"] == {"op": True, "layer": True}
    ops = report["op_level"]
    assert ops["compared"] > 300 and ops["first_fail"] == {}
    assert ops["counts"]["sim_b"] == {"pass": ops["compared"], "warn": 0, "fail": 0}
    assert not list(out.glob("replay_*.npz"))
    for row in report["layer_level"]["rows"]:
        assert all(s == "pass" for s in row["status"].values()), row
        assert max(row["rel_l2"].values()) < 1e-5  # fp32 against float64


def test_bf16_matmul_inputs_are_reported_as_the_divergent_matmuls(differing):
    code, report, _ = differing
    assert code == 1 and report["gates"]["op"] is False
    failing = [op for op in report["op_level"]["ops"] if op["chips"]["sim_b"]["status"] == "fail"]
    assert failing and {op["primitive"] for op in failing} == {"dot_general"}
    assert {op["direction"] for op in failing} == {"fwd", "bwd"}
    modules = {op["module"] for op in failing}
    assert {f"blocks.{i}.{m}" for i in range(3) for m in ("attn", "mlp")} <= modules
    assert "head" in modules
    # every matmul fails on sim_b, none on the exact sim_a; msprobe's ratio sim_b / sim_a says fail too
    assert all(op["chips"]["sim_a"]["status"] == "pass" and op["pair"]["status"] == "fail" for op in failing)
    first = report["op_level"]["first_fail"]["sim_b"]
    assert (first["primitive"], first["direction"]) == ("dot_general", "fwd") and first["module"].startswith("blocks.0")
    # layer level: bf16 inputs are ~2^-9 relative error per element, a few 1e-3 per layer
    rows = {(r["layer"], r["direction"]): r for r in report["layer_level"]["rows"]}
    assert 1e-4 < rows[("blocks.0", "fwd")]["rel_l2"]["sim_b"] < 2e-2
    assert rows[("blocks.0", "fwd")]["rel_l2"]["sim_a"] < 1e-6
    assert report["layer_level"]["first_divergent"]["sim_b"] == {"fwd": "blocks.0", "bwd": "head"}


def test_the_same_chip_with_an_fp32_policy_passes(tmp_path, capsys):
    """... into a folder holding an earlier report, which is kept beside it with a line (it was
    replaced without one)."""
    out = tmp_path / "align"
    out.mkdir()
    (out / "align.json").write_text('{"earlier": true}')
    argv = [CONFIG, "--chips", "sim_a", "sim_b", "--out", str(out), "--levels", "op"]
    argv += ["--numerics", "sim_b.matmul_input_rounding=none", "sim_b.matmul_precision=highest"]
    assert main(argv) == 0
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("align.")]
    assert json.loads((kept / "align.json").read_text()) == {"earlier": True}
    assert "op_level" in json.loads((out / "align.json").read_text())
    assert f"the earlier report in {out} is kept in {kept}" in capsys.readouterr().err


def test_the_host_itself_is_a_chip_to_compare(tmp_path):
    """`cpu` (the host, as on a GPU machine: `--chips cpu cuda`) is compared against the exact host
    baseline, not mistaken for it: with bf16 matmul inputs it diverges and the gate says so."""
    argv = [CONFIG, "--chips", "cpu", "sim_a", "--out", str(tmp_path), "--levels", "layer"]
    argv += ["--numerics", "cpu.matmul_input_rounding=bf16"]
    assert main(argv) == 1
    layer = json.loads((tmp_path / "align.json").read_text())["layer_level"]
    rows = {(r["layer"], r["direction"]): r for r in layer["rows"]}
    assert 1e-4 < rows[("blocks.0", "fwd")]["rel_l2"]["cpu"] < 2e-2
    assert rows[("blocks.0", "fwd")]["rel_l2"]["sim_a"] < 1e-6
    assert layer["first_divergent"]["cpu"]["fwd"] == "blocks.0"
    assert layer["loss"]["host"] != layer["loss"]["cpu"]


def test_a_forward_fault_is_the_first_divergent_op(differing):
    _, report, _ = differing
    first = report["op_level"]["first_fail"]["sim_c"]
    assert (first["primitive"], first["module"], first["direction"]) == ("rsqrt", "blocks.1.attn_norm", "fwd")
    assert first["source"].endswith(".py:" + first["source"].rsplit(":", 1)[1]) and "_" in first["source"]
    fails = [op for op in report["op_level"]["ops"] if op["chips"]["sim_c"]["status"] == "fail"]
    assert [(op["primitive"], op["module"]) for op in fails] == [("rsqrt", "blocks.1.attn_norm")]
    ratio = first["chips"]["sim_c"]["ratio_to_host"]
    assert ratio > 100  # 1e-3 against fp32 rounding
    lay = report["layer_level"]["first_divergent"]["sim_c"]
    assert lay["fwd"] == "blocks.1"  # errors compound from there on


def test_a_backward_fault_in_one_block_is_named_by_the_layer_level(differing):
    _, report, _ = differing
    first = report["op_level"]["first_fail"]["sim_d"]
    assert (first["primitive"], first["direction"]) == ("mul", "bwd") and first["module"].startswith("blocks.1")
    layer = report["layer_level"]
    assert layer["first_divergent"]["sim_d"] == {"fwd": None, "bwd": "blocks.1"}
    rows = {(r["layer"], r["direction"]): r for r in layer["rows"]}
    for later in ("head", "blocks.2"):  # the backward reaches blocks.1 after these: untouched
        assert rows[(later, "bwd")]["status"]["sim_d"] == "pass"
        assert rows[(later, "bwd")]["ratio_to_host"]["sim_d"] == 1.0


def test_the_plan_is_compared_layer_by_layer(differing):
    _, report, _ = differing
    rows = {(r["layer"], r["direction"]): r for r in report["layer_level"]["rows"]}
    # stage 0 (blocks 0-1) on sim_a, exact; stage 1 (block 2, head) on sim_b, bf16
    assert rows[("blocks.1", "fwd")]["status"]["plan"] == "pass"
    assert rows[("blocks.2", "fwd")]["rel_l2"]["plan"] > 1e-4
    assert rows[("head", "bwd")]["rel_l2"]["plan"] > 1e-4


def test_replay_reruns_the_dumped_op(differing, capsys):
    _, report, out = differing
    dump = report["op_level"]["replay"]["sim_b"]
    assert Path(dump).exists()
    capsys.readouterr()
    assert main(["--replay", dump, "--chip", "sim_b"]) == 1  # the dump remembers sim_b's bf16 policy
    again = json.loads(capsys.readouterr().out)
    assert again["metrics"]["rel_l2"] == pytest.approx(again["dumped_metrics"]["rel_l2"], rel=1e-12)
    assert main(["--replay", dump, "--chip", "sim_a"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["status"] == "pass" and fixed["metrics"]["rel_l2"] < 1e-6
    assert main(["--replay", dump, "--chip", "sim_b", "--numerics", "sim_b.matmul_input_rounding=none"]) == 0


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--chips", "sim_z"], "sim_z"),
        (["--numerics", "sim_a.matmul_input_rounding=fp8"], "cluster.chips.sim_a.numerics.matmul_input_rounding"),
        (["--numerics", "sim_a.matmul_precison=high"], "unknown key"),
        (["--numerics", "sim_q.matmul_precision=high"], "sim_q"),
        (["--tol", "dot_general"], "--tol"),
        (["model.n_layers=x"], "model.n_layers"),
        (["--replay", "/nonexistent.npz", "--chip", "sim_a"], "/nonexistent.npz"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, capsys):
    assert main([CONFIG, *argv] if argv[0] != "--replay" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
