"""Per-step training metrics: a JSON-lines file, TensorBoard scalars, progress.

``metrics.jsonl`` is the record of truth: one JSON object per :meth:`MetricsLogger.log`
call, flushed at once so a crash loses nothing already logged. TensorBoard and the
progress report (h2jax._progress: a bar on a terminal, a line every few seconds in a log)
are views of the same numbers.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console

from h2jax._console import make_console
from h2jax._progress import Progress

__all__ = ["METRICS_FILENAME", "TB_DIRNAME", "MetricsLogger", "read_metrics"]

METRICS_FILENAME = "metrics.jsonl"
"""Name of the JSON-lines metrics file inside a run directory."""

TB_DIRNAME = "tb"
"""Name of the TensorBoard log directory inside a run directory."""


def _summary_writer() -> type:
    """tensorboardX's ``SummaryWriter``, imported without torch: tensorboardX imports torch at
    module level where it is installed (to accept its tensors), 2.2 s and a few hundred MB in
    every training process here, and h2jax writes only Python floats. Where torch is imported
    already it is used as it is."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _plain(value: Any) -> Any:
    """A JSON-friendly Python scalar for numpy / JAX 0-d values; others unchanged."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):  # not a single element: leave it to json
            return value
    return value


def _is_numeric(value: Any) -> bool:
    return isinstance(value, numbers.Real)


class MetricsLogger:
    """Write one step's metrics to ``run_dir/metrics.jsonl``, TensorBoard and the console.

    Args:
        run_dir: directory of the run (created if missing). The JSONL file is opened
            in append mode, so a resumed run continues the same file.
        total_steps: steps in the run; the progress bar's total.
        tensorboard: also write every numeric metric as a scalar under ``run_dir/tb``.
        progress: report progress (step/total, loss, tokens/s, times): a rich bar when
            ``console`` writes to a terminal, else a line every ``progress_every_s``
            seconds and one at the end. When ``False`` nothing is printed at all.
        console: rich console to report on; default: a new ``make_console()`` on stdout.
        loss_key: metric shown as "loss".
        throughput_key: metric shown as "tok/s".
        progress_every_s: seconds between two lines when not on a terminal.

    ``step`` in :meth:`log` is the 0-based index of the step just finished; the report
    then shows ``step + 1`` of ``total_steps`` done.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        console: Console | None = None,
        loss_key: str = "loss",
        throughput_key: str = "tokens_per_s",
        progress_every_s: float = 10.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = int(total_steps)
        self.loss_key = loss_key
        self.throughput_key = throughput_key
        self._lock = threading.Lock()
        self._closed = False
        self._file = (self.run_dir / METRICS_FILENAME).open("a", encoding="utf-8")

        self._writer = None
        if tensorboard:
            self._writer = _summary_writer()(str(self.run_dir / TB_DIRNAME))

        self._progress: Progress | None = None
        if progress:
            console = console if console is not None else make_console()
            self._progress = Progress("train", total=self.total_steps, every_s=progress_every_s, console=console)
            self._progress.__enter__()

    @property
    def path(self) -> Path:
        """The JSON-lines file this logger appends to."""
        return self.run_dir / METRICS_FILENAME

    def log(self, step: int, metrics: Mapping[str, float | int | str]) -> None:
        """Record ``metrics`` for ``step``: one JSONL line, TB scalars, progress.

        Numeric values (including numpy / JAX scalars) become TensorBoard scalars under
        their key as tag (``"loss"``, ``"tgs/sim_a"``); strings go to the JSONL only.
        A key named ``"step"`` is rejected: the line's ``step`` is the argument.

        Raises:
            RuntimeError: the logger is closed.
            ValueError: ``metrics`` contains ``"step"``.
        """
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; pass it as the step argument")
        record: dict[str, Any] = {"step": int(step)}
        record.update({str(k): _plain(v) for k, v in metrics.items()})
        line = json.dumps(record)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
            self._file.write(line + "\n")
            self._file.flush()
            if self._writer is not None:
                for tag, value in record.items():
                    if tag != "step" and _is_numeric(value):
                        self._writer.add_scalar(tag, float(value), int(step))
                self._writer.flush()
            if self._progress is not None:
                loss = _fmt(record.get(self.loss_key), "{:.4f}")
                tps = _fmt(record.get(self.throughput_key), "{:,.0f}")
                note = f"loss {loss}, {tps} tok/s"
                if _is_numeric(record.get("mfu")):  # the model's FLOPs over the devices' declared peak
                    per_chip = [
                        f"{k.split('/', 1)[1]} {100 * float(v):.1f} %"
                        for k, v in record.items()
                        if k.startswith("mfu/") and _is_numeric(v)
                    ]
                    note += f", MFU {100 * float(record['mfu']):.1f} %"
                    note += f" ({', '.join(per_chip)})" if per_chip else ""
                self._progress.set(min(int(step) + 1, self.total_steps), note=note)

    def close(self) -> None:
        """End the progress report and close the files; calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._progress is not None:
                self._progress.__exit__(None, None, None)
            if self._writer is not None:
                self._writer.close()
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _fmt(value: Any, spec: str) -> str:
    if not _is_numeric(value):
        return "-" if value is None else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return spec.format(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file (or the run directory holding one) into dicts.

    Blank lines are skipped. A final line cut short by a crash mid-write is dropped;
    a malformed line anywhere else raises ``ValueError`` with its line number.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILENAME
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    # Every complete line ends in "\n" (written whole, then flushed); one that does not
    # is the tail of a write a crash interrupted.
    cut_short = bool(text) and not text.endswith("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if cut_short and number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line: {err}") from err
    return records
