"""Checkpoints on orbax's CheckpointManager, keyed by model path, committed per step.

Directory layout (``<dir>`` is ``checkpoint.dir``, by default ``<run folder>/checkpoints``)::

    <dir>/parts/<part>/<step>/state/   orbax PyTree item: {"params": ..., "opt_state": ...}
    <dir>/parts/<part>/<step>/meta/    orbax JSON item: step, data position, RNG, config, plan
    <dir>/commits/<step>/<part>.json   commit marker, written after the part's save is final
    <dir>/config.yaml                  the resolved config of the run that last saved here

A *part* is what one writer saves: in a single-controller run there is one part
(``main``) holding every stage; in a multi-process run each process saves its own stage
as its own part (``stage0``, ``stage1``, ...). Every tree inside a part is keyed by model
path (``params/blocks/5/attn/wq``), never by stage, so any plan restores any checkpoint,
in either mode: a reader collects the keys it needs from whichever parts hold them.

A step counts (is *committed*) only when every part listed in its markers has written its
marker, and a part writes its marker only after orbax has finalised that part's save
(orbax writes into a temporary directory and renames it into place). A process killed
at any point therefore leaves either a committed step or leftovers: temporary
directories, a finalised but unmarked step, a marker without its step. ``cleanup()``
removes them, so the next save of that step number starts clean.

Retention (keep the last K committed steps, and every M-th for good) runs here, after a
commit, never inside orbax: orbax would delete an old step as soon as the new one is
finalised, before its commit marker exists, and a kill in between could leave nothing to
restore. With several writers each one deletes its own part of a step, judged against
the newest step that every part has committed and this writer saved (so the step a
restart would read is never the one deleted); a part whose peers already deleted their
share of a step is removed by the next retention pass. The *lead* writer (the only one
in one process; rank 0 in a multi-process run) also removes the parts of other writer
sets -- a directory that a run of the other mode, or another process count, wrote
before -- when retention or a re-save of the same step number replaces them.

A part written by several processes (``shared=True``: a stage sharded over the processes
of its own ``jax.distributed`` cluster, one process per device) is one orbax multi-host
save: every process of that cluster calls ``save`` and ``wait`` together and writes the
shards it holds, orbax's primary process (the cluster's process 0) finalises, and that
process alone keeps the books (commit marker, retention, clean-up); the others only
write. Reading never coordinates: every reader is a one-process orbax manager, so one
process may read metadata alone, and each process restores the shards its own devices
need.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from h2jax.checkpoint._faults import failpoint

PARTS_DIR = "parts"
ASIDE_DIR = "aside"  # uncommitted steps newer than every committed one, moved here by cleanup()
_SYNC_SAVES = threading.Lock()  # synchronous saves of one process, one at a time (see save())
COMMITS_DIR = "commits"
DEFAULT_PART = "main"


class CheckpointError(RuntimeError):
    """A checkpoint could not be read, or does not fit the model."""


_REPR = re.compile(r"<[^<>]*(?:bound method |function | object at 0x)[^<>]*>")


def _without_reprs(text: str) -> str:
    """``text`` without Python object reprs (``<bound method X.read of <... at 0x7f..>>``, which
    tensorstore's errors quote): they name nothing a user can act on."""
    while (shorter := _REPR.sub("...", text)) != text:
        text = shorter
    return text


class CheckpointCorruptError(CheckpointError):
    """A committed step whose files cannot be read (truncated or damaged)."""

    def __init__(self, directory: Path, step: int, cause: BaseException):
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        first = _without_reprs(first)
        super().__init__(
            f"{directory} step {step} is damaged: its files cannot be read ({type(cause).__name__}: {first[:300]})"
        )
        self.dir, self.step = directory, step


class CheckpointSaveError(CheckpointError):
    """Saving a step failed; earlier committed steps are untouched."""

    def __init__(self, path: Path, step: int, cause: BaseException):
        super().__init__(f"saving step {step} to {path} failed: {type(cause).__name__}: {cause}")
        self.path, self.step = path, step


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (orbax stores nested dicts as directories of keys)."""
    out: dict[str, Any] = {}
    for name, leaf in flat.items():
        node = out
        *head, last = name.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = leaf
    return out


def unnest(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The inverse of :func:`nest`."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(unnest(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def retained(steps: Iterable[int], *, keep_last: int, keep_every: int) -> set[int]:
    """The committed steps retention keeps: the last ``keep_last``, plus every multiple of
    ``keep_every`` (0: none)."""
    steps = sorted(steps)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set(steps)
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}


def _alone() -> ocp.options.MultiprocessingOptions:
    """orbax options for a manager that only this process uses (no barriers with the other
    processes of its JAX cluster, if it has any)."""
    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me} if jax.process_count() > 1 else None
    )


class _DropClosedLoopTracebacks:
    """A stderr that drops the tracebacks of "RuntimeError: Event loop is closed": after one
    read of a damaged step fails (or one write of a save, on a full disk), orbax stops waiting
    and closes its event loop while TensorStore's other reads or writes are still landing, and
    each prints that traceback from its own thread (62-108 copies were seen). The failure
    itself is reported once, as a CheckpointCorruptError or CheckpointSaveError."""

    def __init__(self, stream: Any):
        self.stream, self._lock = stream, threading.Lock()
        self._local = threading.local()  # each thread's lines apart: several print at once

    def write(self, text: str) -> int:
        me = self._local
        buf = getattr(me, "buf", "") + text
        pending: list[str] = getattr(me, "pending", [])
        out: list[str] = []
        while buf:
            if not pending and not "Traceback (most recent call last):".startswith(buf[:34]):
                # not (the start of) a traceback: through at once, partial lines too
                cut = buf.find("\nTraceback (most recent call last):")
                head, buf = (buf, "") if cut < 0 else (buf[: cut + 1], buf[cut + 1 :])
                out.append(head)
                continue
            if "\n" not in buf:
                break
            line, buf = buf.split("\n", 1)
            pending.append(line)
            if len(pending) > 1 and not line.startswith(" "):  # the exception line ends the block
                block, pending = pending, []
                if line != "RuntimeError: Event loop is closed":
                    out.append("\n".join(block) + "\n")
        me.buf, me.pending = buf, pending
        if out:
            with self._lock:
                self.stream.write("".join(out))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    @classmethod
    def install(cls) -> None:
        """For the rest of the process (the reads land whenever they land)."""
        if not isinstance(sys.stderr, cls):
            sys.stderr = cls(sys.stderr)


def _rmdir_if_empty(d: Path) -> None:
    """Remove an empty directory; another writer may be emptying (or removing) it at the same time."""
    try:
        if not any(d.iterdir()):
            d.rmdir()
    except OSError:
        pass


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_ASIDE_NAME = re.compile(r"^.+-step(\d+)-\d{8}-\d{6}")  # <part>-step<N>-<YYYYmmdd-HHMMSS>


def leftover_steps(removed: Sequence[str]) -> list[int]:
    """The steps whose leftovers :meth:`CheckpointStore.cleanup` removed: orbax's temporary
    ``<step>.orbax-checkpoint-tmp-<n>``, an uncommitted ``<step>`` folder, a marker
    ``commits/<step>/<part>.json``."""
    steps = set()
    for r in removed:
        p = Path(r)
        m = re.match(r"^(\d+)(\.|$)", p.name)
        if m:
            steps.add(int(m.group(1)))
        elif p.parent.name.isdigit():
            steps.add(int(p.parent.name))
    return sorted(steps)


def listed_steps(directory: str | Path) -> list[int]:
    """The steps ``directory``'s ``commits/`` lists, read from the file names alone (no JAX, no
    orbax: usable before any device); a listed step may still lack a part's commit."""
    d = Path(directory) / COMMITS_DIR
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def on_disk(directory: str | Path, *, steps_done: int | None = None) -> str:
    """What a failure line says was saved: read from the disk when it is printed, never assumed
    (a run folder deleted under a job takes its checkpoints with it). `steps_done`: the steps
    the job had trained when it ended; the line then says which of them a rerun trains again."""
    d = Path(directory)
    if not d.is_dir():
        return f"no checkpoint is left: {d} is gone"
    steps = CheckpointStore(d).committed_steps()  # every part's marker there (reads the markers only)
    text = f"committed steps on disk: {', '.join(map(str, steps))} in {d}" if steps else f"no committed step in {d}"
    start = steps[-1] if steps else 0
    if steps_done is not None and steps_done > start:
        again = (
            f"step {start} of this run is"
            if steps_done - start == 1
            else f"steps {start}-{steps_done - 1} of this run are"
        )
        text += f" (a rerun resumes from step {start}: {again} trained again)"
    return text


# the model fields that set the parameters' shapes: a checkpoint of other values is another model
SHAPE_KEYS = ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff")


def model_difference(have: Mapping[str, Any] | None, want: Mapping[str, Any]) -> str:
    """Empty when a checkpoint's model section (`have`; None: not recorded) has this run's
    shapes (the keys it records), else "d_model 32 vs 128, ..." (checkpoint vs this run)."""
    if have is None:
        return ""
    return ", ".join(f"{k} {have[k]} vs {want.get(k)}" for k in SHAPE_KEYS if k in have and have[k] != want.get(k))


def saved_model(directory: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The model section a checkpoint folder records, read from the files written beside its
    steps (a run's ``config.yaml``, ``h2jax convert``'s ``model.yaml``), and the file; None
    where neither is there or readable (the restore checks each step's own record)."""
    import yaml

    for name in ("config.yaml", "model.yaml"):
        f = Path(directory) / name
        try:
            raw = yaml.safe_load(f.read_text(encoding="utf-8")) if f.is_file() else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            raw = None
        if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
            return raw["model"], f
    return None


def check_start(
    checkpoint_dir: str | Path,
    *,
    restore_step: int | None,
    init_from: str | Path | None,
    model: Mapping[str, Any] | None = None,
) -> None:
    """The checkpoint ``h2jax train`` is told to start from, checked on the disk before any
    device: ConfigError naming the option, the path and the fix (a run folder given for its
    ``checkpoints/``, a Hugging Face folder not converted yet, a step that is not there, a
    checkpoint of another model than `model`, the experiment's model section)."""
    from h2jax._strict import ConfigError

    if init_from is not None:
        d = Path(init_from)
        if not d.is_dir():
            raise ConfigError(
                "--init-from", f"{d} is not a folder; expected an h2jax checkpoint folder (a run's checkpoints/)"
            )
        if not (d / COMMITS_DIR).is_dir():
            if (d / "checkpoints" / COMMITS_DIR).is_dir():
                fix = f"it is a run folder: --init-from {d / 'checkpoints'}"
            elif (d / "config.json").is_file():
                fix = f"it is a Hugging Face model folder: convert it first (h2jax convert {d} CKPT), then --init-from CKPT"
            else:
                fix = "expected a run's checkpoints/ folder or the output of h2jax convert"
            raise ConfigError("--init-from", f"{d} holds no h2jax checkpoint (no {COMMITS_DIR}/); {fix}")
    where, option = (Path(init_from), "--init-from") if init_from is not None else (Path(checkpoint_dir), "")
    if restore_step is not None:
        steps = listed_steps(where)
        if restore_step not in steps:
            raise ConfigError(
                "--restore-step",
                f"step {restore_step} is not among the checkpoints of {where}{' (' + option + ')' if option else ''}; "
                f"expected one of {steps or 'none: it holds no checkpoint'}",
            )
    saved = saved_model(where) if model is not None and listed_steps(where) else None
    diff = model_difference(saved[0], model) if saved else ""
    if diff:
        fix = (
            "start from a checkpoint of this model, or give the experiment the checkpoint's model"
            if init_from is not None
            else "a run folder holds one model: give this run another name (name=...) or --run-dir"
        )
        raise ConfigError(
            option or "checkpoint",
            f"{where} holds another model (checkpoint vs this run: {diff}; recorded in {saved[1]}); {fix}",
        )


class CheckpointStore:
    """Save, commit, list, restore and clean up the checkpoints of one directory.

    Args:
        directory: the checkpoint directory (created on the first save).
        part: the part this writer saves (one per process; ``main`` in one process).
        parts: every part that must commit a step before it counts.
        keep_last, keep_every: retention of committed steps (see :func:`retained`).
        async_save: ``save`` returns once the arrays are copied off the devices and the
            files are written in the background (orbax's async checkpointing); commit
            happens at a later ``poll``/``wait``. False: ``save`` returns after the commit.
        lead: this writer also removes what writers of *other* part sets left in the
            directory (module docstring). Exactly one writer of a run should lead.
        shared: every process of this JAX cluster writes this part together (module
            docstring); the cluster's process 0 keeps its books.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        part: str = DEFAULT_PART,
        parts: Sequence[str] = (DEFAULT_PART,),
        keep_last: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
        lead: bool = True,
        shared: bool = False,
    ):
        self.dir = Path(directory).absolute()
        self.shared = shared
        # who keeps the books of this part: its only writer, or the shared part's process 0
        self.keeper = not shared or jax.process_index() == 0
        self.part, self.parts = part, tuple(parts)
        if part not in self.parts:
            raise ValueError(f"part {part!r} is not one of the parts {self.parts}")
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save = async_save
        self.lead = lead and self.keeper
        self._mgr: ocp.CheckpointManager | None = None
        self._pending: int | None = None  # a step saved but not yet committed
        self._stale = False  # steps were deleted while a save was in flight: reload before the next
        self._committed_here: dict[int, int] = {}  # step -> order of its (last) commit by this writer
        self._commits = 0
        self._readers: dict[str, ocp.CheckpointManager] = {}
        self.last_commit_s = 0.0  # time the last commit waited for the background write
        self.kept_aside: list[str] = []  # what cleanup() moved to <dir>/aside, one line each
        self.pruned_aside: list[str] = []  # what cleanup() deleted from <dir>/aside, one line each

    # -- paths ------------------------------------------------------------------------------
    def part_dir(self, part: str | None = None) -> Path:
        return self.dir / PARTS_DIR / (part or self.part)

    def _commit_dir(self, step: int) -> Path:
        return self.dir / COMMITS_DIR / str(step)

    def _manager(self) -> ocp.CheckpointManager:
        if self._mgr is None:
            try:
                self.part_dir().mkdir(parents=True, exist_ok=True)
                (self.dir / COMMITS_DIR).mkdir(exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"cannot create checkpoint directory {self.dir}: {e}") from e
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None,  # retention is ours, after the commit (module docstring)
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
                create=False,  # made above
                # a shared part: orbax's multi-host save over this JAX cluster; else this process alone
                multiprocessing_options=(ocp.options.MultiprocessingOptions() if self.shared else _alone()),
            )
            self._mgr = ocp.CheckpointManager(self.part_dir(), item_handlers=_handlers(), options=options)
        return self._mgr

    # -- what is there ----------------------------------------------------------------------
    def _part_steps(self, part: str) -> set[int]:
        d = self.part_dir(part)
        if not d.is_dir():
            return set()
        return {int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()}

    def _markers(self, step: int) -> dict[str, dict[str, Any]]:
        d = self._commit_dir(step)
        out = {}
        if d.is_dir():
            for p in d.glob("*.json"):
                try:
                    out[p.stem] = json.loads(p.read_text())
                except (OSError, json.JSONDecodeError):
                    continue  # a marker cut short is no marker
        return out

    def step_parts(self, step: int) -> tuple[str, ...] | None:
        """The parts of a committed ``step`` (None: the step is not committed).

        Markers of two writer sets may share a step number (a run of the other mode wrote
        into this directory); the newest complete set counts."""
        markers = self._markers(step)
        best, best_time = None, None
        for parts in {tuple(m.get("parts", ())) for m in markers.values()}:
            if not parts or any(p not in markers for p in parts):
                continue
            if any(step not in self._part_steps(p) for p in parts):
                continue
            t = max(float(markers[p].get("time", 0.0)) for p in parts)
            if best is None or t > best_time:
                best, best_time = parts, t
        return best

    def _foreign_parts(self) -> list[str]:
        """Parts in the directory that are not this run's (another mode or process count)."""
        d = self.dir / PARTS_DIR
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir() and p.name not in self.parts)

    def committed_steps(self) -> list[int]:
        """Steps every part has committed, ascending."""
        d = self.dir / COMMITS_DIR
        if not d.is_dir():
            return []
        steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())
        return [s for s in steps if self.step_parts(s) is not None]

    def latest_committed(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    @property
    def last_committed_here(self) -> int | None:
        """The step this writer committed last (its own part; other parts may lag)."""
        return max(self._committed_here, key=self._committed_here.get) if self._committed_here else None

    # -- saving -----------------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        """Remove this part's leftovers of interrupted saves; returns what was removed.

        Call it when no save of this part is in flight (at start-up): orbax's temporary
        directories, finalised steps that were never committed, markers whose step data
        is gone. Only the part's keeper removes anything (the other writers of a shared part
        return [])."""
        removed: list[str] = []
        if not self.keeper:
            self._mgr = None
            return removed
        committed = set(self.committed_steps())
        newest = max(committed, default=-1)
        tidy = [self.part, *(self._foreign_parts() if self.lead else ())]
        for part in tidy:
            part_dir = self.part_dir(part)
            if not part_dir.is_dir():
                continue
            for p in sorted(part_dir.iterdir()):
                if not p.is_dir():
                    continue
                if p.name.isdigit() and int(p.name) not in committed and int(p.name) > newest:
                    # a finished save whose commit never came, newer than anything committed: it may
                    # be all that is left of the run's work -- kept aside, never deleted
                    aside = self.dir / ASIDE_DIR / f"{part}-step{p.name}-{time.strftime('%Y%m%d-%H%M%S')}"
                    aside.parent.mkdir(parents=True, exist_ok=True)
                    p.rename(aside)
                    self.kept_aside.append(f"step {p.name} of part {part} (no commit marker) -> {aside}")
                    continue
                # orbax's "<step>.orbax-checkpoint-tmp-<n>" (a write cut short), or an uncommitted step
                # older than a committed one
                if not p.name.isdigit() or int(p.name) not in committed:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(str(p))
        commits = self.dir / COMMITS_DIR
        if commits.is_dir():
            for d in list(commits.iterdir()):
                if not d.name.isdigit() or int(d.name) in committed:
                    continue
                for part in tidy:
                    marker = d / f"{part}.json"
                    if marker.exists():
                        marker.unlink(missing_ok=True)
                        removed.append(str(marker))
                    (d / f"{part}.json.tmp").unlink(missing_ok=True)
                _rmdir_if_empty(d)
        if self.lead:
            self._prune_aside()
        self._mgr = None  # orbax caches the step list; reopen after the files changed
        return removed

    def _prune_aside(self) -> None:
        """``aside/`` under the retention of the committed steps: the parts of the ``keep_last``
        newest steps kept aside stay; older ones are deleted, each with a line
        (``pruned_aside``)."""
        d = self.dir / ASIDE_DIR
        if not d.is_dir():
            return
        entries = [(int(m.group(1)), e) for e in d.iterdir() if (m := _ASIDE_NAME.match(e.name))]
        keep = set(sorted({step for step, _ in entries})[-self.keep_last :])
        for step, e in sorted(entries, key=lambda x: (x[0], x[1].name)):
            if step not in keep:
                shutil.rmtree(e, ignore_errors=True)
                self.pruned_aside.append(
                    f"{e} (uncommitted step {step}: aside/ keeps the {self.keep_last} newest, as checkpoint.keep_last)"
                )

    def save(self, step: int, state: Mapping[str, jax.Array], meta: Mapping[str, Any]) -> None:
        """Start saving ``state`` (flat dict keyed by model path) and ``meta`` as ``step``.

        Commits the previous save first. With ``async_save`` this returns once the arrays
        are off the devices; :meth:`poll` or :meth:`wait` commits it."""
        self.wait()
        # a failing write (a full disk) closes orbax's loop while its other writes still land,
        # each printing that traceback from its thread: the failure is reported once, by the job
        _DropClosedLoopTracebacks.install()
        mgr = self._manager()
        if not self.keeper or self._stale:
            # orbax caches the step list: steps deleted since (the keeper: retention, a re-save; the
            # keeper's own delete() of a step it saves again while an earlier save was in flight)
            mgr.reload()
            self._stale = False
        # one synchronous save at a time per process: two orbax managers finalising at once in one
        # process (simulated ranks on threads) race on their temporary directories
        with _SYNC_SAVES if not self.async_save else contextlib.nullcontext():
            try:
                # a part may hold no array (a process whose stages hold only copies others own and
                # save: the pipelines of a job after the first): its meta alone
                items = {"state": ocp.args.PyTreeSave(nest(state))} if state else {}
                mgr.save(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(dict(meta))), force=True)
            except Exception as e:  # noqa: BLE001 -- any failure of the write names the path and step
                raise CheckpointSaveError(self.part_dir() / str(step), step, e) from e
            self._pending = step
            failpoint("save_started", step)
            if not self.async_save:
                self.wait()

    def poll(self) -> int | None:
        """Commit a finished background save without waiting; returns the step committed."""
        if self._pending is None or self._mgr is None or self._mgr.is_saving_in_progress():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Wait for the save in flight and commit it; returns the step committed (or None)."""
        if self._pending is None:
            return None
        step, self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            self._manager().wait_until_finished()
            self._manager().check_for_errors()
            if not self.keeper:  # a shared part's other writers: their shards are written
                self.last_commit_s = time.perf_counter() - t0
                self._commits += 1
                self._committed_here[step] = self._commits
                return step
            if step not in self._part_steps(self.part):
                raise OSError(f"orbax reported no error, but {self.part_dir() / str(step)} is missing")
            failpoint("save_finalized", step)
            d = self._commit_dir(step)
            d.mkdir(parents=True, exist_ok=True)
            _write_atomic(
                d / f"{self.part}.json",
                json.dumps({"step": step, "part": self.part, "parts": list(self.parts), "time": time.time()}),
            )
        except CheckpointSaveError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointSaveError(self.part_dir() / str(step), step, e) from e
        self.last_commit_s = time.perf_counter() - t0
        self._commits += 1
        self._committed_here[step] = self._commits
        failpoint("committed", step)
        self.apply_retention()
        return step

    def _holders(self) -> list[str]:
        """The parts whose files this writer may delete: its own, and (the lead) other writer sets'."""
        return [self.part, *(self._foreign_parts() if self.lead else ())]

    def holds(self, step: int) -> bool:
        """Whether this writer (the lead: or another writer set) has anything of ``step`` on disk
        (False for a shared part's writers other than its keeper: they delete nothing)."""
        return self.keeper and any(
            step in self._part_steps(p) or (self._commit_dir(step) / f"{p}.json").exists() for p in self._holders()
        )

    def delete(self, step: int) -> None:
        """Remove this part of ``step`` (the lead: and other writer sets' parts): the commit
        markers first, so a half-deleted step is never chosen."""
        d = self._commit_dir(step)
        holders = self._holders()
        for part in holders:
            (d / f"{part}.json").unlink(missing_ok=True)
        for part in holders:
            shutil.rmtree(self.part_dir(part) / str(step), ignore_errors=True)
        if d.is_dir():
            _rmdir_if_empty(d)
        if self._mgr is not None and self._pending is None:
            self._mgr.reload()  # orbax caches the step list
        elif self._mgr is not None:
            self._stale = True  # a save is in flight: save() reloads once it has committed

    def clear(self, step: int) -> bool:
        """Before saving ``step`` again (a run resumed from an earlier step reaches it): remove
        what this writer holds of it. Returns whether there was anything."""
        if not self.holds(step):
            return False
        self.delete(step)
        return True

    def apply_retention(self) -> list[int]:
        """Delete this writer's share of the committed steps retention does not keep; returns them.

        Judged up to the newest step that every part of this writer's set has committed, this
        writer in this process: with several writers, a step this one committed may not count
        yet, and steps of an older run's future (``--restore-step``) are not this run's to
        judge. Shares of older steps that no longer count (a peer deleted its share first) go
        as well. Only the part's keeper deletes."""
        if not self.keeper:
            return []
        committed = self.committed_steps()
        mine = [s for s in committed if s in self._committed_here and self.step_parts(s) == self.parts]
        if not mine:
            return []
        horizon = max(mine)
        view = [s for s in committed if s <= horizon]
        keep = retained(view, keep_last=self.keep_last, keep_every=self.keep_every)
        gone = [s for s in view if s not in keep]
        # orphans: shares of steps below the horizon that no longer count
        shares = self._part_steps(self.part)
        commits = self.dir / COMMITS_DIR
        if commits.is_dir():
            shares |= {
                int(d.name) for d in commits.iterdir() if d.name.isdigit() and (d / f"{self.part}.json").exists()
            }
        order = self._committed_here
        gone += [
            s
            for s in shares
            if s < horizon and s not in committed and s != self._pending and order.get(s, -1) < order[horizon]
        ]  # not one this writer saved again after the horizon
        for step in sorted(set(gone)):
            self.delete(step)
        return sorted(set(gone))

    def close(self) -> None:
        """Commit the save in flight, then release orbax's threads."""
        try:
            self.wait()
        finally:
            mgrs = [m for m in (self._mgr, *self._readers.values()) if m is not None]
            self._mgr, self._readers = None, {}
            for m in mgrs:
                try:
                    m.close()
                except Exception:  # noqa: BLE001 -- a failed save was already reported by wait()
                    pass

    # -- restoring --------------------------------------------------------------------------
    def _reader(self, part: str) -> ocp.CheckpointManager:
        _DropClosedLoopTracebacks.install()  # a damaged step's reads may land after orbax gave up on them
        if part == self.part and self._mgr is not None and not self.shared:
            return self._mgr
        if part not in self._readers:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, multiprocessing_options=_alone())
            self._readers[part] = ocp.CheckpointManager(self.part_dir(part), item_handlers=_handlers(), options=options)
        else:
            self._readers[part].reload()
        return self._readers[part]

    def _committed_parts(self, step: int) -> tuple[str, ...]:
        parts = self.step_parts(step)
        if parts is None:
            have = self.committed_steps()
            raise CheckpointError(
                f"{self.dir}: step {step} is not a committed checkpoint (committed steps: {have or 'none'})"
            )
        return parts

    def read_meta(self, step: int) -> dict[str, Any]:
        part = self._committed_parts(step)[0]
        try:
            got = self._reader(part).restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 -- a damaged step is named, with its directory
            raise CheckpointCorruptError(self.dir, step, e) from e
        return dict(got)

    def shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Model path -> (shape, dtype) of every array of committed ``step``, over all parts."""
        out = {}
        for part in self._committed_parts(step):
            for name, m in self._array_metadata(part, step).items():
                out[name] = (tuple(m.shape), str(m.dtype))
        return out

    def _array_metadata(self, part: str, step: int) -> dict[str, Any]:
        try:
            items = self._reader(part).item_metadata(step)
            meta = items["state"] if "state" in items else None
            if meta is None:  # a part saved with no array (save); what it lacks, restore names
                return {}
            return unnest(dict(meta.tree) if hasattr(meta, "tree") else dict(meta))
        except Exception as e:  # noqa: BLE001 -- a damaged step is named, with its directory
            raise CheckpointCorruptError(self.dir, step, e) from e

    def restore(self, step: int, targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """The arrays ``targets`` names, each placed on its target's sharding.

        Reads only what is asked for, from whichever parts hold it."""
        shapes = {}
        owner: dict[str, str] = {}
        for part in self._committed_parts(step):
            for name, m in self._array_metadata(part, step).items():
                shapes[name] = tuple(m.shape)
                owner[name] = part
        missing = sorted(set(targets) - set(shapes))
        if missing:
            raise CheckpointError(
                f"{self.dir} step {step} lacks {len(missing)} arrays the model needs, e.g. {missing[:3]}"
            )
        bad = [(n, shapes[n], tuple(t.shape)) for n, t in targets.items() if shapes[n] != tuple(t.shape)]
        if bad:
            n, have, want = bad[0]
            raise CheckpointError(
                f"{self.dir} step {step}: {n} has shape {have} in the checkpoint, "
                f"{want} in the model ({len(bad)} arrays differ)"
            )
        out: dict[str, jax.Array] = {}
        for part in sorted(set(owner[n] for n in targets)):
            want = {n: t for n, t in targets.items() if owner[n] == part}
            item = nest(want)
            restore_args = jax.tree.map(
                lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype), item
            )
            try:
                got = self._reader(part).restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
                    ),
                )
            except Exception as e:  # noqa: BLE001 -- a damaged step is named, with its directory
                raise CheckpointCorruptError(self.dir, step, e) from e
            out.update(unnest(dict(got["state"])))
        return out
