"""What the tests share: tiny configs, "pipeline equals sequential for N steps", running the CLI,
running under mpirun, and reading a run's checkpoints. Test modules import from here (or use
conftest fixtures), never from each other.

pipeline == sequential, the check everything else rests on: for N steps the loss and every
parameter gradient equal a single-device ``jax.value_and_grad`` of the same model and batch
within ``TOL`` (fp32), and the parameters after the N optimizer steps equal those of a
single-device optax loop within ``TOL``.

Why the experiment's optimizer runs with eps=1e-3: gradients of the pipeline and of the
reference differ only by summation order (tensor-parallel all-reduces, microbatch
accumulation), e.g. 1.3650e-6 vs 1.3648e-6 on one element of blocks/3/attn/wo (2e-10
absolute). Adam divides by sqrt(v) + eps, and with eps=1e-8 an element whose gradient is
~1e-6 turns that 2e-10 into a 1.3e-5 parameter difference after one update (measured). With
eps=1e-3 such elements stay well-conditioned while every gradient above ~1e-3 is still
normalised as Adam does, so the check exercises the real AdamW + clipping + schedule path and
still sees any real error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from h2jax.launch import find_mpirun

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5

# -- tiny configs ---------------------------------------------------------------------------------

MODEL = ["model.vocab_size=256", "model.seq_len=16", "model.d_model=32", "model.n_heads=4", "model.d_ff=64"]
CLUSTER = "cluster.chips={sim_a: {nodes: 2}, sim_b: {nodes: 2}, sim_c: {nodes: 1}, sim_d: {nodes: 1}}"
TINY = str(REPO / "configs" / "tiny.yaml")  # the CLI's tiny job: 2 layers over sim_a and sim_b, 5 steps
QUIET = ["train.progress=false", "train.tensorboard=false", "train.timeline=false"]


def S(chip, layers, data=1, tensor=1, recompute=False) -> dict:
    """A one-range stage of a plan."""
    return {"chip": chip, "layers": list(layers), "data": data, "tensor": tensor, "recompute": recompute}


def C(chip, chunks, data=1, tensor=1, recompute=False) -> dict:
    """A stage of a chunked plan (interleaved, zb-v): several layer ranges on one mesh."""
    return {"chip": chip, "chunks": [list(c) for c in chunks], "data": data, "tensor": tensor, "recompute": recompute}


def plan_cfg(n_layers: int, schedule: str, stages: list, **extra: str):
    """The equivalence experiment: the small model on the test cluster under this plan, 3 steps
    of AdamW (eps=1e-3, see above) with clipping and a 1-step warm-up."""
    plan = {"global_batch": 16, "num_microbatches": 4, "schedule": schedule, "stages": stages}
    return experiment_cfg(n_layers, plan, **extra)


def experiment_cfg(n_layers: int, plan: dict, **extra: str):
    """plan_cfg's experiment under any plan (one pipeline, or ``{"pipelines": [...]}``)."""
    from h2jax.config import load_config

    overrides = MODEL + [
        CLUSTER,
        f"model.n_layers={n_layers}",
        f"plan={plan}",
        "train.progress=false",
        "train.tensorboard=false",
        "optimizer.warmup_steps=1",
        "optimizer.lr=1e-2",
        "optimizer.eps=1e-3",
        "train.steps=3",
        "optimizer.clip_norm=0.5",
    ]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


# tied embeddings: the LLaMA-family model whose head reuses the embedding table, grouped-query attention
TIED = {"model.n_kv_heads": "2", "model.tie_embeddings": "true"}
TABLE = "embed/embedding"
TIED_PLANS = {
    # 2 stages: tensor 2 (x data 2) on sim_a, tensor 4 on sim_b (the kv heads replicated there):
    # the copies of the table are split into 2 and into 4 vocabulary slices
    "2st-1f1b": (4, "1f1b", [S("sim_a", (0, 3), 2, 2), S("sim_b", (3, 4), 1, 4)]),
    # 3 stages on 3 chip types, recompute in the middle, GPipe; the table on sim_a (data 2) and sim_c (2x2)
    "3st-gpipe": (5, "gpipe", [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 3), 1, 2, True), S("sim_c", (3, 5), 2, 2)]),
    # zero-bubble: the table's gradient of the head accumulates in W tasks
    "2st-zb-h1": (4, "zb-h1", [S("sim_c", (0, 2), 1, 2), S("sim_d", (2, 4), 2, 1)]),
    # under mpirun one process per device (-np 4): each copy of the table sharded over two processes
    "2st-per-device": (4, "1f1b", [S("sim_a", (0, 2), 1, 2), S("sim_b", (2, 4), 2, 1)]),
    # ... (-np 3): the owner's table on one process, the mirror's whole on each of two (data 2)
    "2st-one-to-two": (4, "1f1b", [S("sim_a", (0, 2), 1, 1), S("sim_b", (2, 4), 2, 1)]),
}


def tied_cfg(name: str, **extra: str):
    n_layers, schedule, stages = TIED_PLANS[name]
    return plan_cfg(n_layers, schedule, stages, **TIED, **extra)


# zero-bubble (split backward) plans: name -> (n_layers, stages); the schedule is an argument
SPLIT_PLANS = {
    # 2 stages, uneven split, tensor into data parallel, no recompute
    "2st-2x2-to-4x1": (4, [S("sim_a", (0, 3), 2, 2), S("sim_b", (3, 4), 4, 1)]),
    # tensor parallel first stage with recompute, data parallel second
    "2st-tp4-recompute": (4, [S("sim_a", (0, 1), 1, 4, True), S("sim_b", (1, 4), 2, 1)]),
    # 3 stages, recompute in the middle, vocab-parallel head
    "3st-mixed": (5, [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 3), 1, 2, True), S("sim_c", (3, 5), 2, 2)]),
    # 3 stages, all recompute, uneven 1/1/3, two stages of one chip type
    "3st-recompute": (5, [S("sim_c", (0, 1), 4, 1, True), S("sim_a", (1, 2), 1, 1, True), S("sim_a", (2, 5), 2, 2)]),
}


def split_cfg(name: str, schedule: str = "zb-h1", **extra: str):
    n_layers, stages = SPLIT_PLANS[name]
    return plan_cfg(n_layers, schedule, stages, **extra)


def P(global_batch, num_microbatches, schedule, stages) -> dict:
    """One pipeline of a plan."""
    return {"global_batch": global_batch, "num_microbatches": num_microbatches, "schedule": schedule, "stages": stages}


# plans of several pipelines: name -> (n_layers, pipelines) (tests/runtime/test_pipelines.py)
PIPELINE_PLANS = {
    # 2 pipelines, shares 6 + 10 (microbatches of 2 sequences each), 1f1b beside gpipe; tensor 2 on
    # one, recompute and data 2 on the other; 4 chip types
    "2p-1f1b-gpipe": (
        4,
        [
            P(6, 3, "1f1b", [S("sim_a", (0, 2)), S("sim_b", (2, 4), 1, 2)]),
            P(10, 5, "gpipe", [S("sim_c", (0, 3), 2, 1, True), S("sim_d", (3, 4))]),
        ],
    ),
    # 2 pipelines, shares 4 + 12 with microbatches of 1 and 4 sequences; zb-h1 (split backward)
    # beside a one-stage pipeline (the whole model on one mesh: tensor 2 x data 2)
    "2p-zbh1-one-stage": (
        4,
        [
            P(4, 4, "zb-h1", [S("sim_a", (0, 1)), S("sim_b", (1, 3), 1, 2), S("sim_a", (3, 4))]),
            P(12, 3, "1f1b", [S("sim_c", (0, 4), 2, 2)]),
        ],
    ),
    # zb-v (two chunks per stage, the V placement) beside 1f1b with an uneven split
    "2p-zbv-1f1b": (
        4,
        [
            P(8, 4, "zb-v", [C("sim_a", [(0, 1), (3, 4)]), C("sim_b", [(1, 2), (2, 3)], 1, 2)]),
            P(8, 2, "1f1b", [S("sim_c", (0, 3), 1, 1, True), S("sim_d", (3, 4), 2, 1)]),
        ],
    ),
    # under mpirun: one process per stage (3), a one-stage pipeline beside two stages
    "2p-mpirun": (
        4,
        [
            P(6, 3, "1f1b", [S("sim_a", (0, 2)), S("sim_b", (2, 4), 1, 2)]),
            P(10, 5, "zb-h1", [S("sim_c", (0, 4), 2, 1, True)]),
        ],
    ),
    # 3 pipelines on three chip types, shares 2 + 6 + 8, microbatches of 1, 2 and 4 sequences
    "3p-three-types": (
        5,
        [
            P(2, 2, "1f1b", [S("sim_a", (0, 2)), S("sim_a", (2, 5))]),
            P(6, 3, "zb-h1", [S("sim_b", (0, 1), 2, 1), S("sim_b", (1, 5), 1, 2, True)]),
            P(8, 2, "gpipe", [S("sim_c", (0, 4), 2, 2), S("sim_d", (4, 5))]),
        ],
    ),
}


def pipelines_cfg(pipelines, n_layers: int, **extra: str):
    """plan_cfg's experiment with a plan of several pipelines."""
    return experiment_cfg(n_layers, {"pipelines": pipelines}, **extra)


def named_cfg(plan: str, **extra: str):
    """The experiment of a named plan: of several pipelines (PIPELINE_PLANS) or tied (TIED_PLANS)."""
    if plan in PIPELINE_PLANS:
        n_layers, pipelines = PIPELINE_PLANS[plan]
        return pipelines_cfg(pipelines, n_layers, **extra)
    return tied_cfg(plan, **extra)


# -- pipeline == sequential ---------------------------------------------------------------------


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def differing(got: dict, want: dict, tol: float = TOL) -> dict[str, float]:
    """{path: max |got - want|} of every array of ``want`` that differs by more than ``tol``;
    ``got`` must hold exactly ``want``'s paths."""
    assert sorted(got) == sorted(want), "the pipeline must hold exactly the model's parameters (a tied table once)"
    return {k: d for k in want if (d := max_diff(got[k], want[k])) > tol}


def reference_update(tx):
    """One optax step of the single-device reference, (grads, opt_state, params) -> (params,
    opt_state), as one jitted program (op by op it takes seconds a step)."""
    import jax
    import optax

    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update)


class Sequential:
    """The single-device reference of ``cfg``: its model, and the job's optimizer (with the global
    norm clip) as one optax loop. ``grads`` gives the loss and flat gradients at the current
    parameters; ``update`` applies the last ones."""

    def __init__(self, cfg):
        import jax
        import optax
        from flax import nnx

        from h2jax.models import build_model
        from h2jax.runtime import make_optimizer

        tx, _ = make_optimizer(cfg)
        tx = optax.chain(optax.clip_by_global_norm(cfg.optimizer.clip_norm), tx)
        self.graphdef, params = nnx.split(build_model(cfg.model, seed=cfg.seed), nnx.Param)
        self.params = jax.device_put(params, jax.devices("cpu")[0])
        self.opt_state = tx.init(self.params)
        self._update = reference_update(tx)
        self.grads_tree = None

    def model(self):
        from flax import nnx

        return nnx.merge(self.graphdef, self.params)

    def grads(self, tokens, targets, segments=None) -> tuple[float, dict]:
        from h2jax.runtime import flatten, reference_loss_and_grads

        loss, self.grads_tree = reference_loss_and_grads(self.model(), tokens, targets, segments=segments)
        return float(loss), flatten(self.grads_tree)

    def norm(self) -> float:
        import optax

        return float(optax.tree.norm(self.grads_tree))

    def update(self) -> None:
        self.params, self.opt_state = self._update(self.grads_tree, self.opt_state, self.params)

    def flat_params(self) -> dict:
        from h2jax.runtime import flatten

        return flatten(self.params)


def assert_pipeline_equals_sequential(
    cfg,
    trainer,
    steps: int = 3,
    *,
    check_norm: bool = False,
    on_grads: Callable[[int, dict], None] | None = None,
    after_update: Callable[[int], None] | None = None,
) -> None:
    """``steps`` steps of ``trainer`` against ``Sequential(cfg)``: each step's loss and every
    gradient within ``TOL``; with ``check_norm`` the global norm ``finish_step`` returns too
    (relative to max(1, norm)); then the parameters after the last update.

    Hooks: ``on_grads(step, want_grads)`` after a step's gradients matched (e.g. their
    shardings), ``after_update(step)`` after each update (e.g. the tied copies still equal)."""
    ref = Sequential(cfg)
    for step in range(steps):
        loss = float(trainer.forward_backward(step))
        tokens, targets = trainer.batch(step)
        ref_loss, want = ref.grads(tokens, targets, trainer.segments(step))
        assert abs(loss - ref_loss) <= TOL, (step, loss, ref_loss)
        bad = differing(trainer.grads_by_layer(), want)
        assert not bad, f"gradients of step {step} differ: {bad}"
        if on_grads is not None:
            on_grads(step, want)
        grad_norm = trainer.finish_step()
        if check_norm:
            ref_norm = ref.norm()
            assert abs(grad_norm - ref_norm) <= TOL * max(1.0, ref_norm), (step, grad_norm, ref_norm)
        ref.update()
        if after_update is not None:
            after_update(step)
    bad = differing(trainer.params_by_layer(), ref.flat_params())
    assert not bad, f"parameters after {steps} steps differ: {bad}"


def sequential_steps(cfg, steps: int = 3) -> tuple[list[tuple[float, dict, float]], dict]:
    """The reference on the job's own data stream (what a CLI or mpirun run trains on): per step
    (loss, flat gradients, global norm), and the flat parameters after ``steps`` updates."""
    from h2jax.data import load_data, step_batch, step_segments

    dataset = load_data(cfg)
    ref = Sequential(cfg)
    out = []
    for step in range(steps):
        loss, grads = ref.grads(*step_batch(dataset, cfg, step), step_segments(dataset, cfg, step))
        out.append((loss, grads, ref.norm()))
        ref.update()
    return out, ref.flat_params()


def assert_recorded_equals_sequential(cfg, grads_by_step: list[dict], params: dict, histories) -> None:
    """A run recorded elsewhere (other processes, mpirun ranks) against ``sequential_steps``:
    every gradient of each step within ``TOL``, the parameters after the last update, and each
    process's (losses, global norms) in ``histories`` (every process knows both)."""
    steps, want_params = sequential_steps(cfg, len(grads_by_step))
    for r, (losses, norms) in enumerate(histories):
        np.testing.assert_allclose(losses, [s[0] for s in steps], atol=TOL, rtol=0, err_msg=f"process {r}")
        np.testing.assert_allclose(norms, [s[2] for s in steps], atol=TOL, rtol=TOL, err_msg=f"process {r}")
    for step, (_, want, _) in enumerate(steps):
        bad = differing(grads_by_step[step], want)
        assert not bad, f"gradients of step {step} differ: {bad}"
    bad = differing(params, want_params)
    assert not bad, f"parameters after {len(steps)} steps differ: {bad}"


# -- running the CLI ------------------------------------------------------------------------------


SHARE_CORES = ("PRTE_MCA_hwloc_default_binding_policy", "OMPI_MCA_mpi_yield_when_idle")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI or job process: a plain run, with none of the test process's
    device flags, fault injections or launcher variables (an MPI import may have left some);
    unbuffered output; this repository importable (job scripts import ``tests._harness``)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "H2JAX_FAULT", "H2JAX_FAULTS", "H2JAX_ELASTIC_DIR")
        and not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_"))
    }
    for k in SHARE_CORES:  # the suite's two settings for mpirun jobs (tests/conftest.py)
        if k in os.environ:
            env[k] = os.environ[k]
    if os.environ.get("H2JAX_TEST_XLA_FLAGS"):  # the suite's compile flags (tests/conftest.py)
        env["XLA_FLAGS"] = os.environ["H2JAX_TEST_XLA_FLAGS"]
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_cli(args, cwd, *, env=None, timeout: float = 600, max_file_kib: int | None = None):
    """``h2jax ARGS`` in ``cwd`` as a user runs it: a CompletedProcess with text output. With
    ``max_file_kib`` files may not grow past that size (writes fail with EFBIG, as on a full disk)."""
    cmd = [sys.executable, "-m", "h2jax.cli", *args]
    if max_file_kib is not None:
        cmd = ["bash", "-c", f'ulimit -f {max_file_kib} && exec "$@"', "bash", *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env or cli_env(), capture_output=True, text=True, timeout=timeout)


def train_cli(args, cwd, **kw):
    """``h2jax train ARGS``: see ``run_cli``."""
    return run_cli(["train", *args], cwd, **kw)


# -- running under mpirun -------------------------------------------------------------------------

MPIRUN = find_mpirun()


def mpirun_cmd(np_: int, argv: list[str]) -> list[str]:
    return [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np_), *argv]


def mpirun(np_: int, argv: list[str], cwd, *, env=None, timeout: float = 900):
    """``mpirun -np NP ARGV`` to the end: a CompletedProcess with text output."""
    return subprocess.run(
        mpirun_cmd(np_, argv), cwd=cwd, env=env or cli_env(), capture_output=True, text=True, timeout=timeout
    )


def mpirun_train(np_: int, args: list[str], cwd, *, env=None, **kw) -> subprocess.Popen:
    """``mpirun -np NP h2jax train ARGS``, started (the caller may signal or kill it)."""
    cmd = mpirun_cmd(np_, [sys.executable, "-m", "h2jax.cli", "train", *args])
    return subprocess.Popen(
        cmd, cwd=cwd, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


# the mpirun experiment: the small model, 3 steps, and plans whose stages fit one process each
MP_BASE = [
    "model.vocab_size=256",
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.n_layers=4",
    "plan.global_batch=16",
    "plan.num_microbatches=4",
    "train.steps=3",
    "train.gantt_step=2",
    "train.progress=false",
    "train.tensorboard=false",
    "optimizer.warmup_steps=1",
]
MP_PLANS = {
    # 2 stages: 2x2 -> 4x1 (activations) and 4x1 -> 2x2 (gradients: pieces + all-gather)
    "2st": [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        "plan.stages=[{chip: sim_a, data: 2, tensor: 2, layers: [0, 3]}, "
        "{chip: sim_b, data: 4, tensor: 1, layers: [3, 4]}]",
    ],
    # 3 stages, a middle stage that receives and sends in one program, recompute, GPipe
    "3st": [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}, sim_c: {nodes: 1}}",
        "plan.schedule=gpipe",
        "plan.stages=[{chip: sim_a, data: 1, tensor: 2, layers: [0, 1]}, "
        "{chip: sim_b, data: 2, tensor: 1, layers: [1, 3], recompute: true}, "
        "{chip: sim_c, data: 1, tensor: 4, layers: [3, 4]}]",
    ],
    # one process per device (-np 4): stage 0 (tensor 2) and stage 1 (data 2) each span two
    # processes, each stage its own jax.distributed cluster
    "2st-per-device": [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        "plan.stages=[{chip: sim_a, data: 1, tensor: 2, layers: [0, 2]}, "
        "{chip: sim_b, data: 2, tensor: 1, layers: [2, 4]}]",
    ],
}


# -- a run's results ------------------------------------------------------------------------------


def load_step(ckpt_dir: Path, step: int | None = None) -> dict[str, np.ndarray]:
    """Every array of a committed step (default: the latest), on the host, from whichever
    parts hold it: what any plan in any mode would restore."""
    import jax

    from h2jax.checkpoint import CheckpointStore

    store = CheckpointStore(ckpt_dir)
    step = store.latest_committed() if step is None else step
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    targets = {
        k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=cpu)
        for k, (shape, dtype) in store.shapes(step).items()
    }
    got = {k: np.asarray(v) for k, v in store.restore(step, targets).items()}
    store.close()
    return got


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    """The parameters a run ended with: its last checkpoint (saved at the end of every run)."""
    return {k[len("params/") :]: v for k, v in load_step(run_dir / "checkpoints").items() if k.startswith("params/")}


def run_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of a run's metrics file."""
    from h2jax.runtime import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


# -- ranks as threads -----------------------------------------------------------------------------


def on_thread_ranks(rank, hub, n: int = 2) -> None:
    """``rank(r)`` for r = 0..n-1, each on its own thread (the ranks of a job); then closes the
    hub they share and fails with every rank's exception, if any raised."""
    errors: list = []

    def run(r: int) -> None:
        try:
            rank(r)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append((r, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    hub.close()
    assert not errors, errors


# -- Hugging Face checkpoints made by hand (safetensors only, no transformers) --------------------


def models_cli(*argv: str) -> int:
    """``h2jax convert`` / ``export`` in this process (argv after ``h2jax``); the exit code."""
    import argparse

    from h2jax import cli_models

    parser = argparse.ArgumentParser(prog="h2jax")
    cli_models.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def hand_made_hf(tmp: Path, cfg, *, edit=None, config_edit=None, dtype=np.float32) -> Path:
    """A Hugging Face LLaMA directory ``tmp/hf`` of the model shape ``cfg`` (a GPTConfig): random
    tensors under the names transformers gives them, its config.json and an empty tokenizer.
    ``edit(tensors)`` / ``config_edit(config)`` change them before they are written."""
    import json

    from safetensors import numpy as safetensors_numpy

    from h2jax.convert import config_to_hf, hf_tensor_names
    from h2jax.convert._hf import param_shapes

    rng = np.random.default_rng(0)
    shapes = param_shapes(cfg)
    tensors = {}
    for path, (name, transposed) in hf_tensor_names(cfg).items():
        shape = shapes[path][::-1] if transposed else shapes[path]
        tensors[name] = rng.normal(size=shape).astype(dtype)
    if edit:
        edit(tensors)
    out = tmp / "hf"
    out.mkdir()
    safetensors_numpy.save_file(tensors, str(out / "model.safetensors"))
    hf = config_to_hf(cfg)
    if config_edit:
        config_edit(hf)
    (out / "config.json").write_text(json.dumps(hf))
    (out / "tokenizer.json").write_text("{}")
    return out


def measured_table(model, rows: dict[str, list[tuple[int, int]]], *, slow: float = 1.0):
    """A table holding the roofline's numbers (times x `slow`) as if measured, at `rows`."""
    import dataclasses

    from h2jax.plan import ProfileTable, load_chip, roofline_costs

    table = ProfileTable()
    for name, pairs in rows.items():
        chip = load_chip(name)[0]
        for t, b in pairs:
            parts = roofline_costs(model, chip, tensor=t, microbatch=b)
            table.add(
                name,
                model.key(),
                t,
                b,
                {
                    k: dataclasses.replace(v, estimated=False, fwd_s=v.fwd_s * slow, bwd_s=v.bwd_s * slow)
                    for k, v in parts.items()
                },
            )
    return table
