"""The data loader against what training consumes: sequences/s of ``data.sources`` read alone
(packed from ArrayRecord shards and from a Megatron indexed dataset) and the sequences/s the
default job (``h2jax train``, its defaults, on two weighted ArrayRecord stores) consumes, with
the fraction of its step spent reading the batch (metrics.jsonl ``data_wait_fraction``).

The corpus is the standard library's pydoc topics and code, tokenized with the byte tokenizer
by ``h2jax tokenize --format arrayrecord`` (and written as Megatron .bin/.idx from the same
documents). The job reads its batches through Grain threads that run ahead of the step
(``SequenceStream.next_batch``); the data-wait fraction is what is left on the step's path.

    python benchmarks/data.py [--steps 12] [--rounds 3]

Last line: ``RESULT {"loader_over_consumption": x, "data_wait_fraction": w, ...}`` (medians).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def corpus(d: Path) -> dict[str, float]:
    import json as js
    import pydoc_data.topics

    (d / "help.txt").write_text("\n\n".join(pydoc_data.topics.topics.values()))
    (d / "code.txt").write_text("\n\n".join(inspect.getsource(m) for m in (js.decoder, js.encoder, inspect)))
    for name, shards in (("help", 4), ("code", 2)):
        cmd = [sys.executable, "-m", "h2jax.cli", "tokenize", f"{name}.txt", "--tokenizer", "byte"]
        cmd += ["--format", "arrayrecord", "--shards", str(shards), "--out", name, "--no-progress"]
        subprocess.run(cmd, cwd=d, check=True, capture_output=True)
    from h2jax.data import open_store, write_megatron

    st = open_store(d / "help", key="help")
    write_megatron(d / "help_mg", [st.document(i) for i in range(st.num_documents)])
    return {str(d / "help"): 0.7, str(d / "code"): 0.3}


def loader_rate(sources: dict[str, float], seq_len: int, n: int) -> float:
    """Sequences/s of the stream read alone, from a position past the first epoch."""
    from h2jax.data import open_stream

    s = open_stream(sources, seq_len=seq_len, seed=0)
    start = 3 * s.epoch_length + 17
    t = time.perf_counter()
    s.batch(start, n)
    return n / (time.perf_counter() - t)


def train(d: Path, sources: dict[str, float], steps: int, name: str) -> dict[str, float]:
    arg = "data.sources=" + json.dumps(sources)
    cmd = [sys.executable, "-m", "h2jax.cli", "train", arg, f"train.steps={steps}", f"name={name}"]
    cmd += ["train.progress=false", "checkpoint.enabled=false", "train.timeline=false", "train.tensorboard=false"]
    subprocess.run(cmd, cwd=d, check=True, capture_output=True)
    rows = [json.loads(line) for line in (d / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:]  # the first step compiles
    step_s = statistics.median(r["step_time_s"] for r in rows)
    return {"step_s": step_s, "wait": statistics.median(r["data_wait_fraction"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from h2jax.config import load_config

    cfg = load_config(None, check_files=False)
    seq_len, batch = cfg.model.seq_len, cfg.plan.global_batch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        sources = corpus(d)
        mg = {str(d / "help_mg"): 0.7, str(d / "code"): 0.3}
        for r in range(args.rounds):  # interleaved: the loader and the job see the same host load
            ar = loader_rate(sources, seq_len, 2048)
            meg = loader_rate(mg, seq_len, 2048)
            job = train(d, sources, args.steps, f"round{r}")
            rows.append({"arrayrecord": ar, "megatron": meg, "consumed": batch / job["step_s"], "wait": job["wait"]})
    print(f"{'round':>5} {'arrayrecord seq/s':>18} {'megatron seq/s':>15} {'job consumes seq/s':>19} {'data wait':>10}")
    for i, r in enumerate(rows):
        print(f"{i:>5} {r['arrayrecord']:>18,.0f} {r['megatron']:>15,.0f} {r['consumed']:>19,.1f} {r['wait']:>10.4f}")
    ratio = [min(r["arrayrecord"], r["megatron"]) / r["consumed"] for r in rows]
    med = statistics.median(ratio)
    wait = statistics.median(r["wait"] for r in rows)
    print(
        f"loader / consumption: median {med:.1f}x (spread {min(ratio):.1f}-{max(ratio):.1f}), "
        f"data wait {wait:.4f} of a step (target: >= 10x, <= 0.01)"
    )
    result = {
        "loader_over_consumption": round(med, 2),
        "data_wait_fraction": round(wait, 5),
        "loader_seq_per_s_arrayrecord": round(statistics.median(r["arrayrecord"] for r in rows)),
        "loader_seq_per_s_megatron": round(statistics.median(r["megatron"] for r in rows)),
        "consumed_seq_per_s": round(statistics.median(r["consumed"] for r in rows), 2),
        "rounds": len(rows),
        "spread_loader_over_consumption": [round(min(ratio), 2), round(max(ratio), 2)],
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
