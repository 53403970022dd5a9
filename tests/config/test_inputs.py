"""check_inputs and the launcher rule of validate(), in-process (milliseconds each); the CLI's
one-line refusals of the same inputs are in test_cli_bad_inputs.py."""

from __future__ import annotations

import numpy as np
import pytest

from h2jax.config import ConfigError, check_inputs, format_bytes, format_count, load_config

OMPI_RANK_1_OF_2 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"),
        (512, "512"),
        (999, "999"),
        (1_234, "1.23 k"),
        (52_864, "52.9 k"),
        (999_999, "1.00 M"),
        (2_690_000, "2.69 M"),
        (101e9, "101 B"),
        (1.65e12, "1.65 T"),
    ],
)
def test_format_count(n, text):
    assert format_count(n) == text


def test_format_bytes():
    assert (format_bytes(512), format_bytes(3 * 2**20), format_bytes(1.5 * 2**40)) == ("512 B", "3.0 MiB", "1.5 TiB")


def test_multiprocess_transports_need_a_launcher(monkeypatch):
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    for transport in ("ffi", "host"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"train.transport={transport}"])
        assert info.value.key == "train.transport" and "mpirun -np 2" in info.value.message
    for k, v in OMPI_RANK_1_OF_2.items():
        monkeypatch.setenv(k, v)
    assert load_config(None, ["train.transport=ffi"]).train.transport == "ffi"  # rank 1 of an mpirun job
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="train.transport: 'host' moves tensors between processes"):
        load_config(None, ["train.transport=host"])


def test_check_files_false_checks_the_config_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.token_file=missing.bin"], check_files=False)
    with pytest.raises(ConfigError, match="data.token_file: 'missing.bin' does not exist"):
        check_inputs(cfg)


def test_run_dir_is_checked_under_its_own_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    cfg = load_config(None)
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg, run_dir=tmp_path / "a_file" / "run")
    assert info.value.key == "--run-dir" and "a_file is a file" in info.value.message
    assert check_inputs(cfg, run_dir=tmp_path / "new" / "run") is cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing created


def test_checkpoint_room_only_when_checkpoints_are_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    huge = ["model.d_model=262144"]  # ~1.6e12 parameters: 12 bytes each is ~19 TiB
    with pytest.raises(
        ConfigError, match=r"train.out_dir: one checkpoint needs about .* TiB \(12 bytes x 1.65 T parameters"
    ):
        load_config(None, huge)
    load_config(None, [*huge, "checkpoint.enabled=false"])


def test_token_file_checks_use_the_tokenizer_vocabulary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match="data.token_file: 't.bin' holds token id 256 at position 256"):
        load_config(None, ["data.token_file=t.bin", "model.vocab_size=512"])
    np.arange(256, dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert load_config(None, ["data.token_file=t.bin"]).data.token_file == "t.bin"
