"""One run of parameters several stages hold, for test_tied_mpirun.py: ``python tied_job.py OUT PLAN
[key=value ...]``, under ``mpirun`` (one process per stage or per device). 3 steps of the tied
experiment ``PLAN`` (tests/_harness.py TIED_PLANS), or of the plan of several pipelines ``PLAN``
(PIPELINE_PLANS: every layer held by every pipeline), with checkpoints on; every process writes ``OUT/rank<r>.npz``: the loss and global norm
of each step, the gradients of its stages before each update (``grads/<step>/<path>``), its
parameters after the run (``params/<path>``), its copies of the tied table
(``copy/<stage>``) and the bytes its exchange posted to other processes (``exchange_bytes``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from h2jax.runtime._procgroup import fetch
from tests._harness import TABLE, named_cfg


def main() -> None:
    out, plan = Path(sys.argv[1]), sys.argv[2]
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    cfg = named_cfg(plan, **{"checkpoint.enabled": "true", "train.steps": "3", **extra})
    from h2jax.runtime import Trainer

    trainer = Trainer(cfg, run_dir=out / "run")
    arrays: dict[str, np.ndarray] = {}
    update = trainer._apply

    def recording_apply(grad_norm: float) -> None:  # the gradients the update is about to use
        step = trainer.step
        for k, v in fetch(trainer.grads_by_layer()).items():
            arrays[f"grads/{step}/{k}"] = v
        update(grad_norm)

    trainer._apply = recording_apply
    history = trainer.run()
    arrays["losses"] = np.array([h.loss for h in history])
    arrays["norms"] = np.array([h.grad_norm for h in history])
    for k, v in fetch(trainer.params_by_layer()).items():
        arrays[f"params/{k}"] = v
    tied = trainer.tied
    arrays["exchange_bytes"] = np.array(tied.bytes_posted)
    for name, copies in tied.copies().items():
        if name != TABLE:  # the tied table's copies; a plan of pipelines ties every layer
            continue
        for stage, x in copies.items():
            arrays[f"copy/{stage}"] = fetch(x)
    trainer.close()
    group = getattr(trainer.world, "group", None)
    if group is not None:
        trainer.world.barrier()
        group.close()
    np.savez(out / f"rank{int(os.environ.get('OMPI_COMM_WORLD_RANK', '0'))}.npz", **arrays)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # end the whole job at once (h2jax train does it in h2jax.runtime._job), not hang it
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
