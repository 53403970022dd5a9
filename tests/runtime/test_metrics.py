"""MetricsLogger: JSON lines, TensorBoard event files, progress output."""

from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest
from rich.console import Console

from h2jax.runtime._metrics import MetricsLogger, read_metrics


def _tb_event_files(run_dir):
    return sorted((run_dir / "tb").glob("events.out.tfevents.*"))


def test_jsonl_lines_and_read_back(tmp_path) -> None:
    with MetricsLogger(tmp_path, total_steps=3, progress=False) as logger:
        logger.log(0, {"loss": 2.5, "tokens_per_s": 1000, "tgs/sim_a": 12.5, "note": "warm-up"})
        # flushed at once: readable before close
        assert read_metrics(tmp_path / "metrics.jsonl") == [
            {"step": 0, "loss": 2.5, "tokens_per_s": 1000, "tgs/sim_a": 12.5, "note": "warm-up"}
        ]
        logger.log(1, {"loss": 2.25})
        logger.log(2, {"loss": np.float32(2.0), "grad_norm": np.float64(0.5), "ok": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    records = read_metrics(tmp_path)  # the run directory works too
    assert records[1] == {"step": 1, "loss": 2.25}
    assert records[2] == {"step": 2, "loss": 2.0, "grad_norm": 0.5, "ok": True}


def test_appends_on_resume(tmp_path) -> None:
    with MetricsLogger(tmp_path, total_steps=4, progress=False, tensorboard=False) as logger:
        logger.log(0, {"loss": 1.0})
    with MetricsLogger(tmp_path, total_steps=4, progress=False, tensorboard=False) as logger:
        logger.log(1, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_tensorboard_event_file(tmp_path) -> None:
    with MetricsLogger(tmp_path, total_steps=2, progress=False) as logger:
        logger.log(0, {"loss": 3.0, "tgs/sim_a": 10.0, "note": "text is not a scalar"})
        logger.log(1, {"loss": 2.0, "tgs/sim_a": 11.0})
    files = _tb_event_files(tmp_path)
    assert len(files) == 1
    data = files[0].read_bytes()
    assert len(data) > 100
    assert b"loss" in data and b"tgs/sim_a" in data
    assert b"note" not in data


def test_tensorboard_is_written_without_importing_torch(tmp_path) -> None:
    """tensorboardX imports torch where it is installed (2 s a training process); the logger
    keeps it out, and leaves `import torch` working afterwards."""
    import importlib.util
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from h2jax.runtime._metrics import MetricsLogger\n"
        f"with MetricsLogger({str(tmp_path)!r}, total_steps=1, progress=False) as logger:\n"
        "    logger.log(0, {'loss': 3.0})\n"
        "print('torch' in sys.modules)\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('torch') is not None)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", str(importlib.util.find_spec("torch") is not None)]
    (events,) = _tb_event_files(tmp_path)
    assert b"loss" in events.read_bytes()


def test_tensorboard_off(tmp_path) -> None:
    with MetricsLogger(tmp_path, total_steps=1, progress=False, tensorboard=False) as logger:
        logger.log(0, {"loss": 1.0})
    assert not (tmp_path / "tb").exists()


def test_progress_false_prints_nothing(tmp_path, capsys) -> None:
    with MetricsLogger(tmp_path, total_steps=3, progress=False) as logger:
        for step in range(3):
            logger.log(step, {"loss": 1.0 / (step + 1), "tokens_per_s": 5000.0})
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


def test_progress_bar_shows_step_loss_and_throughput(tmp_path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=140)
    with MetricsLogger(tmp_path, total_steps=4, tensorboard=False, console=console) as logger:
        for step in range(4):
            logger.log(step, {"loss": 1.2345, "tokens_per_s": 123456.0})
    out = buf.getvalue()
    assert "4/4" in out
    assert "1.2345" in out
    assert "123,456" in out


def test_a_log_gets_a_line_per_period_with_mfu_per_chip_and_eta(tmp_path) -> None:
    """Not on a terminal (nohup, SLURM, CI): one line per period, naming the step, the loss,
    tokens/s, MFU (and per chip type) and the time left."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=140)
    with MetricsLogger(tmp_path, total_steps=4, tensorboard=False, console=console, progress_every_s=0) as logger:
        for step in range(4):
            logger.log(step, {"loss": 1.5, "tokens_per_s": 2000.0, "mfu": 0.125, "mfu/sim_a": 0.2, "mfu/sim_b": 0.05})
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith(
        "h2jax: train: at 1/4 (loss 1.5000, 2,000 tok/s, MFU 12.5 % (sim_a 20.0 %, sim_b 5.0 %))"
    )
    assert ", eta " in lines[0]
    assert lines[-1].startswith("h2jax: train: done 4/4") and "eta" not in lines[-1]


def test_close_is_idempotent_and_log_after_close_fails(tmp_path) -> None:
    logger = MetricsLogger(tmp_path, total_steps=1, progress=False)
    logger.log(0, {"loss": 1.0})
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"loss": 1.0})


def test_step_key_rejected(tmp_path) -> None:
    with MetricsLogger(tmp_path, total_steps=1, progress=False, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="step"):
            logger.log(0, {"step": 3})


def test_read_metrics_drops_cut_short_last_line_only(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n\n{"step": 1, "lo')
    assert read_metrics(path) == [{"step": 0, "loss": 1.0}]
    path.write_text('{"step": 0, "lo\n{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=":1:"):
        read_metrics(path)


def test_concurrent_logging(tmp_path) -> None:
    with MetricsLogger(tmp_path, total_steps=400, progress=False, tensorboard=False) as logger:
        threads = [
            threading.Thread(target=lambda k=k: [logger.log(k * 100 + i, {"loss": float(i)}) for i in range(100)])
            for k in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(r["step"] for r in read_metrics(tmp_path)) == list(range(400))


def test_a_console_to_a_file_is_wide_enough_for_the_tables(monkeypatch) -> None:
    """rich cuts tables at 80 columns when not on a terminal (``h100_s…``); h2jax's consoles are
    160 wide there, and a user's COLUMNS still wins."""
    from h2jax._console import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert make_console().width == LOG_WIDTH == 160
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100
