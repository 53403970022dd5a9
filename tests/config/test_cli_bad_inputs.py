"""Bad inputs beyond the config's own keys, through the real CLI (`python -m h2jax.cli` in a
subprocess, in an empty scratch folder): data files, tokenizers, output folders, config and
chip profile files, transports that need a launcher. Each must exit 2 with exactly one line
on stderr naming the key and the path, and no traceback -- `train` before touching a device.

A subprocess that fails in validation takes ~1 s (no JAX import), so the cases run
concurrently in one module-scoped batch and the tests only read its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

# validation exits in ~1 s; backend setup and the first compile take far longer
TRAIN_FAST_EXIT_S = 10.0


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "H2JAX_CONFIG_DIR") and not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))
    }
    env["COLUMNS"] = "200"
    return env


def h2jax(*args: str, cwd: Path) -> Result:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def _tokens(path: Path, ids, dtype: str = "uint16") -> None:
    np.asarray(ids, dtype=dtype).tofile(path)


def _bpe_tokenizer(path: Path) -> None:
    """A small BPE tokenizer.json trained in memory (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["pipelines move microbatches between stages", "every chip type runs one stage of the model"],
        trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]"]),
    )
    tok.save(str(path))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The bad (and a few good) input files every case refers to by absolute path."""
    d = tmp_path_factory.mktemp("inputs")
    _tokens(d / "odd.bin", [1, 2, 3])
    (d / "odd.bin").write_bytes((d / "odd.bin").read_bytes()[:5])  # 5 bytes: not a multiple of 2
    (d / "empty.bin").write_bytes(b"")
    _tokens(d / "six_bytes.bin", [1, 2, 3])  # 6 bytes: 3 uint16 ids, not a multiple of 4 for uint32
    _tokens(d / "big_id.bin", [5] * 500 + [300] + [7] * 500)  # id 300 >= the byte tokenizer's 256
    _tokens(d / "short.bin", list(range(10)))  # 10 tokens < seq_len + 1 = 129
    (d / "a_folder").mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes(("caf\u00e9 " * 100).encode("latin-1"))
    (d / "short.txt").write_text("too short", encoding="utf-8")
    (d / "garbage.json").write_bytes(b"\xff\xfe\x00 not a tokenizer")
    (d / "not_a_tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    _bpe_tokenizer(d / "tokenizer.json")
    (d / "a_file").write_text("not a folder")
    (d / "latin1.yaml").write_bytes("name: caf\u00e9\n".encode("latin-1"))
    (d / "syntax.yaml").write_text("name: x\nmodel:\n  n_layers: [2\ntrain:\n  steps: 3\n")
    (d / "twice.yaml").write_text("train:\n  steps: 3\nmodel:\n  n_layers: 2\ntrain:\n  log_every: 2\n")
    (d / "model.yaml").write_text(
        "model: {n_layers: 2, d_model: 32, n_heads: 4, d_ff: 64, vocab_size: 256, seq_len: 16}\n"
    )
    (d / "plan.yaml").write_text("global_batch: 8\nschedule: 1f1b\nstages:\n  - {chip: sim_a, layers: [0, 6]}\n")
    (d / "run" / "checkpoints" / "commits" / "3").mkdir(parents=True)  # a run folder, not its checkpoints/
    (d / "ckpt_other" / "commits" / "2").mkdir(parents=True)  # a converted checkpoint of a smaller model
    (d / "ckpt_other" / "model.yaml").write_text(
        "model: {n_layers: 2, d_model: 32, n_heads: 4, d_ff: 64, vocab_size: 256, seq_len: 16}\n"
    )
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text("{}")  # a Hugging Face folder, not converted
    (d / "configs" / "chips").mkdir(parents=True)
    (d / "configs" / "chips" / "sim_q.yaml").write_text("memory_gib: 8\nplatform: {cpu\n")
    return d


# id -> (command, arguments; "@" = a file of the inputs folder, substrings of the one error line)
CASES: dict[str, tuple[str, list[str], list[str]]] = {
    # -- data.token_file
    "token_file_missing": (
        "check-config",
        ["data.token_file=@nope.bin"],
        ["data.token_file: '", "nope.bin' does not exist; expected a flat binary file of uint16 token ids"],
    ),
    "token_file_folder": (
        "check-config",
        ["data.token_file=@a_folder"],
        ["data.token_file: '", "a_folder' is a folder"],
    ),
    "token_file_odd_size": (
        "check-config",
        ["data.token_file=@odd.bin"],
        ["data.token_file: '", "odd.bin' has 5 bytes, which is not a positive multiple of 2 bytes per uint16 token"],
    ),
    "token_file_empty": (
        "check-config",
        ["data.token_file=@empty.bin"],
        ["data.token_file: '", "empty.bin' has 0 bytes"],
    ),
    "token_file_wrong_dtype": (
        "check-config",
        ["data.token_file=@six_bytes.bin", "data.token_dtype=uint32"],
        ["data.token_file: '", "six_bytes.bin' has 6 bytes", "4 bytes per uint32 token; check data.token_dtype"],
    ),
    "token_id_beyond_vocab": (
        "check-config",
        ["data.token_file=@big_id.bin"],
        ["data.token_file: '", "big_id.bin' holds token id 300 at position 500, but the tokenizer's vocab_size is 256"],
    ),
    "token_file_shorter_than_a_sequence": (
        "check-config",
        ["data.token_file=@short.bin"],
        ["data.token_file: '", "short.bin' holds 10 tokens, fewer than model.seq_len + 1 = 129"],
    ),
    "token_dtype_unknown": (
        "check-config",
        ["data.token_file=@short.bin", "data.token_dtype=int8"],
        ["data.token_dtype: token_dtype='int8'; expected one of ['uint16', 'uint32']"],
    ),
    # -- data.corpus
    "corpus_missing": (
        "check-config",
        ["data.corpus=@nope.txt"],
        ["data.corpus: '", "nope.txt' does not exist; expected a UTF-8 text file (or 'pydoc')"],
    ),
    "corpus_folder": ("check-config", ["data.corpus=@a_folder"], ["data.corpus: '", "a_folder' is a folder"]),
    "corpus_empty": ("check-config", ["data.corpus=@empty.txt"], ["data.corpus: '", "empty.txt' is empty"]),
    "corpus_not_utf8": (
        "check-config",
        ["data.corpus=@latin1.txt"],
        ["data.corpus: '", "latin1.txt' is not UTF-8 text (byte 3: invalid"],
    ),
    "corpus_shorter_than_a_sequence": (
        "check-config",
        ["data.corpus=@short.txt"],
        ["data.corpus: '", "short.txt' has 9 bytes, fewer than the 129 tokens of one sequence"],
    ),
    # -- data.tokenizer
    "tokenizer_missing": (
        "check-config",
        ["data.tokenizer=@nope/tokenizer.json"],
        ["data.tokenizer: '", "nope/tokenizer.json' is not valid; expected 'byte'", "(no such file)"],
    ),
    "tokenizer_not_utf8": (
        "check-config",
        ["data.tokenizer=@garbage.json"],
        ["data.tokenizer: '", "garbage.json' is not a valid tokenizer.json ("],
    ),
    "tokenizer_not_a_tokenizer": (
        "check-config",
        ["data.tokenizer=@not_a_tokenizer.json"],
        ["data.tokenizer: '", "not_a_tokenizer.json' is not a valid tokenizer.json ("],
    ),
    "tokenizer_vocab_beyond_model": (
        "check-config",
        ["data.tokenizer=@tokenizer.json", "model.vocab_size=16"],
        ["model.vocab_size: vocab_size=16 is smaller than the tokenizer's", "tokenizer.json"],
    ),
    "byte_tokenizer_beyond_model": (
        "check-config",
        ["model.vocab_size=128"],
        ["model.vocab_size: vocab_size=128 is smaller than the tokenizer's 256 (data.tokenizer='byte')"],
    ),
    # -- output folders
    "out_dir_under_a_file": (
        "check-config",
        ["train.out_dir=@a_file/runs"],
        ["train.out_dir: '", "a_file/runs/default' cannot be a folder:", "a_file is a file"],
    ),
    "run_folder_is_a_file": (  # <train.out_dir>/<name> with name=a_file
        "check-config",
        ["name=a_file", "train.out_dir=@"],
        ["train.out_dir: '", "a_file' cannot be a folder:", "a_file is a file"],
    ),
    "out_dir_not_writable": (
        "check-config",
        ["train.out_dir=/sys/h2jax_runs"],
        ["train.out_dir: '/sys/h2jax_runs/default' is not writable (", "in /sys)"],
    ),
    "checkpoint_dir_under_a_file": (
        "check-config",
        ["checkpoint.dir=@a_file/ckpt"],
        ["checkpoint.dir: '", "a_file/ckpt' cannot be a folder:", "a_file is a file"],
    ),
    "no_room_for_a_checkpoint": (
        "check-config",
        ["model.d_model=262144", "train.out_dir=@runs"],
        ["train.out_dir: one checkpoint needs about", "(12 bytes x 1.65 T parameters", "free; expected room for it"],
    ),
    # -- config and chip profile files
    "config_not_utf8": (
        "check-config",
        ["@latin1.yaml"],
        ["config: ", "latin1.yaml is not UTF-8 text (byte 9: invalid"],
    ),
    "config_yaml_syntax": (
        "check-config",
        ["@syntax.yaml"],
        ["config: ", "syntax.yaml:4:6: not valid YAML (expected ',' or ']', but got ':')"],
    ),
    "chip_profile_yaml_syntax": (
        "check-config",
        ["cluster.chips.sim_b.profile=@configs/chips/sim_q.yaml"],
        ["cluster.chips.sim_b.profile: ", "sim_q.yaml:3:1: not valid YAML ("],
    ),
    # -- transports that need a launcher
    "transport_ffi_without_launcher": (
        "check-config",
        ["train.transport=ffi"],
        ["train.transport: 'ffi' moves tensors between processes; run one process per stage (mpirun -np 2"],
    ),
    "transport_host_without_launcher": (
        "check-config",
        ["train.transport=host"],
        ["train.transport: 'host' moves tensors between processes"],
    ),
    # -- train: the same refusals, before any device
    "train_token_file_missing": ("train", ["data.token_file=@nope.bin"], ["data.token_file: '", "nope.bin'"]),
    "train_sources_missing": (
        "train",
        ["data.sources={stores/web: 0.7, stores/code: 0.3}"],
        ["data.sources.stores/web: 'stores/web' does not exist; expected a token store folder"],
    ),
    "train_corpus_not_utf8": ("train", ["data.corpus=@latin1.txt"], ["data.corpus: '", "latin1.txt' is not UTF-8"]),
    "train_out_dir_under_a_file": ("train", ["train.out_dir=@a_file/runs"], ["train.out_dir: '", "a_file is a file"]),
    "train_transport_ffi": ("train", ["train.transport=ffi"], ["train.transport: 'ffi' moves tensors"]),
    "train_name_leaves_out_dir": ("train", ["name=../../escape"], ["name: name='../../escape'; expected one folder"]),
    # -- the checkpoint a run starts from, before any device, naming the fix
    "init_from_a_run_folder": ("train", ["--init-from", "@run"], ["run holds no h2jax checkpoint", "/run/checkpoints"]),
    "init_from_hf_unconverted": ("train", ["--init-from", "@hf"], ["Hugging Face model folder: convert it first"]),
    "init_from_another_model": (
        "train",
        ["--init-from", "@ckpt_other"],
        [
            "--init-from: ",
            "holds another model (checkpoint vs this run: d_model 32 vs 128, n_layers 2 vs 6, d_ff 64 vs 512",
        ],
    ),
    "init_from_nothing": ("train", ["--init-from", "@nope"], ["--init-from: ", "nope is not a folder"]),
    "restore_step_not_there": (
        "train",
        ["--init-from", "@run/checkpoints", "--restore-step", "7"],
        ["--restore-step: step 7 is not among the checkpoints of", "expected one of [3]"],
    ),
    "train_a_plan_file": ("train", ["@plan.yaml"], ["plan.yaml is a plan (top-level stages:), not an experiment"]),
    "config_section_twice": ("check-config", ["@twice.yaml"], ["twice.yaml:5: 'train' is given twice"]),
    # -- the planner's commands read YAML and chips as train does
    "simulate_plan_not_yaml": (
        "simulate",
        ["@syntax.yaml", "--cluster", "sim_mix"],
        ["plan: ", "syntax.yaml:4:6: not valid YAML"],
    ),
    "plan_prove_negative": ("plan", ["sim_mix", "--prove", "-1"], ["--prove: expected seconds >= 0", "got -1"]),
    "plan_no_pipelines": ("plan", ["sim_mix", "--max-pipelines", "0"], ["--max-pipelines: expected 1 or more, got 0"]),
    "plan_no_workers": ("plan", ["sim_mix", "--workers", "0"], ["--workers: expected 1 or more, got 0"]),
    "profile_measure_without_the_chip": (
        "profile",
        ["--chip", "h100_sxm", "--model", "@model.yaml", "--measure"],
        ["--chip: h100_sxm: --measure times the chip's own devices (cuda), and this host has none"],
    ),
    "train_elastic_bad_fault": (
        "train",
        ["--elastic", "--inject-fault", "node:sim_b@1"],
        ["--inject-fault: 'node:sim_b@1'; expected node:CHIP:NODE@STEP, kill:RANK@STEP, stop:RANK@STEP"],
    ),
    "train_tokenizer_vocab": (
        "train",
        ["data.tokenizer=@tokenizer.json", "model.vocab_size=16"],
        ["model.vocab_size: vocab_size=16 is smaller than the tokenizer's"],
    ),
}


def _args(args: list[str], inputs: Path) -> list[str]:
    out = []
    for a in args:
        if a.startswith("@"):
            out.append(str(inputs / a[1:]))
        elif "=@" in a:
            key, _, rest = a.partition("=@")
            out.append(f"{key}={inputs / rest}" if rest else f"{key}={inputs}")
        else:
            out.append(a)
    return out


@pytest.fixture(scope="module")
def results(inputs, tmp_path_factory) -> dict[str, tuple[Result, Path]]:
    runs = {}
    for name, (command, args, _) in CASES.items():
        cwd = tmp_path_factory.mktemp(name)  # empty: whatever appears here was written by the run
        runs[name] = ([command, *_args(args, inputs)], cwd)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(h2jax, *argv, cwd=cwd) for name, (argv, cwd) in runs.items()}
        return {name: (f.result(), runs[name][1]) for name, f in futures.items()}


def test_enough_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_exit_2(results, name):
    if name == "out_dir_not_writable" and _sys_is_writable():
        pytest.skip("/sys is writable here")
    if name == "profile_measure_without_the_chip" and _has_cuda():
        pytest.skip("this host has a CUDA device: --measure would time it")
    r, cwd = results[name]
    command, _, expected = CASES[name]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("h2jax: config error: "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for s in expected:
        assert s in r.stderr, (s, r.stderr)
    assert list(cwd.iterdir()) == [], "a refused run wrote into its folder"
    if command == "train":
        assert r.seconds < TRAIN_FAST_EXIT_S, f"train took {r.seconds:.1f} s to refuse a bad input"
        assert "h2jax train:" not in r.stderr  # the run banner comes after validation


def _has_cuda() -> bool:
    import jax

    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _sys_is_writable() -> bool:
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            return True
    except OSError:
        return False


def test_good_inputs_pass(inputs, tmp_path):
    """The same checks accept the good files: a token file of byte ids and a BPE tokenizer."""
    _tokens(tmp_path / "ok.bin", np.arange(1000) % 256)
    r = h2jax("check-config", f"data.token_file={tmp_path / 'ok.bin'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = h2jax("check-config", f"data.tokenizer={inputs / 'tokenizer.json'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["ok.bin"]  # check-config created nothing
