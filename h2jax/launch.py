"""Which launcher started this process, and its rank: Open MPI 4/5, SLURM, MPICH/Hydra.

JAX's own cluster detection misses Open MPI 5 (RECIPES.md), so h2jax reads the launchers'
environment itself. A plain ``h2jax train`` (no launcher) is the single-controller mode.

This module imports nothing heavy: the CLI uses it before JAX (and its threads) exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class LauncherError(RuntimeError):
    """Started by something that looks like a launcher h2jax does not know, or inconsistently."""


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "openmpi-5", "openmpi-4", "slurm", "mpich"
    rank: int
    size: int
    local_rank: int


# launcher -> (rank, size, local rank) variables
KNOWN = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
}
# variables that say "some launcher started me" even when it is none of the above
HINTS = (
    "PMIX_RANK",
    "PMI_RANK",
    "MV2_COMM_WORLD_RANK",
    "MPI_LOCALRANKID",
    "ALPS_APP_PE",
    "PALS_RANKID",
)  # SLURM_PROCID alone (sbatch's batch shell, no srun step) is a plain process


def _int(env: Mapping[str, str], key: str, launcher: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise LauncherError(f"{launcher}: expected an integer in ${key}, got {env.get(key)!r}") from None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """The launch of this process, or None for a plain single process.

    Raises LauncherError when launcher variables are present but match no known launcher,
    naming everything that was looked for.
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        rank_k, size_k, local_k = KNOWN["openmpi"]
        # Open MPI 5 runs on PRRTE (PRTE_* variables); Open MPI 4 on ORTE (OMPI_MCA_orte_*)
        v5 = (
            any(k.startswith("PRTE_") for k in env)
            or "OMPI_MCA_prte_launch_agent" in env
            or ("PMIX_RANK" in env and not any(k.startswith("OMPI_MCA_orte") for k in env))
        )
        return LaunchInfo(
            "openmpi-5" if v5 else "openmpi-4",
            _int(env, rank_k, "openmpi"),
            _int(env, size_k, "openmpi"),
            int(env.get(local_k, "0")),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return LaunchInfo(
            "slurm",
            _int(env, "SLURM_PROCID", "slurm"),
            _int(env, "SLURM_NTASKS", "slurm"),
            int(env.get("SLURM_LOCALID", "0")),
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return LaunchInfo(
            "mpich",
            _int(env, "PMI_RANK", "mpich"),
            _int(env, "PMI_SIZE", "mpich"),
            int(env.get("MPI_LOCALRANKID", "0")),
        )
    hints = [k for k in HINTS if k in env]
    if hints:
        looked = "; ".join(f"{name}: ${', $'.join(keys)}" for name, keys in KNOWN.items())
        raise LauncherError(
            f"started by an unrecognised launcher (found ${', $'.join(hints)}); h2jax recognises "
            f"{looked} (SLURM inside a job step, i.e. srun). Launch with mpirun (Open MPI 4/5), srun or "
            "mpiexec (MPICH/Hydra)"
        )
    return None


def find_mpirun() -> str | None:
    """The ``mpirun`` of the ``openmpi`` package h2jax installs (beside this Python), else from PATH."""
    import shutil
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.is_file() else shutil.which("mpirun")


ELASTIC_DIR_ENV = "H2JAX_ELASTIC_DIR"
"""Under ``h2jax train --elastic``: the folder where the job's processes leave records for the
supervisor (h2jax.elastic, h2jax.runtime._faults)."""
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
"""What asks a run to stop: SIGTERM and SIGINT as anywhere, and SIGUSR1 because ``mpirun``
forwards it to every rank without ending the job (module docstring of FailFast)."""
STOP_GRACE_ENV = "H2JAX_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 30.0
SAVE_GRACE_S = 600.0


def stop_grace_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds a stop signal gives the job to reach its next step boundary (``$H2JAX_STOP_GRACE_S``,
    default 30): longer than a step, shorter than the launcher's kill timeout."""
    env = os.environ if env is None else env
    raw = env.get(STOP_GRACE_ENV)
    if raw is None:
        return DEFAULT_STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise LauncherError(
            f"${STOP_GRACE_ENV}={raw!r}: expected a number of seconds > 0 (default {DEFAULT_STOP_GRACE_S:g})"
        )
    return value


def threads_taking(signals: set) -> list[int]:
    """The threads of this process (Linux thread ids) that do not block every one of ``signals``:
    the kernel may deliver a process-directed signal to any of them. Empty where /proc is absent."""
    from pathlib import Path

    want = sum(1 << (int(s) - 1) for s in signals)
    out = []
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended
            continue
        blocked = next((int(ln.split()[1], 16) for ln in text.splitlines() if ln.startswith("SigBlk:")), want)
        if blocked & want != want:
            out.append(int(status.parent.name))
    return out


class FailFast:
    """One line and a non-zero exit when the launcher ends this process (SIGTERM).

    When one rank dies, the launcher SIGTERMs the others. A Python signal handler runs
    only when the main thread is between bytecodes -- never while it waits inside XLA or
    MPI -- so the stop signals (SIGTERM, SIGINT, SIGUSR1) are blocked in every thread and
    a dedicated thread waits for them with ``sigwait``. Call :meth:`start` before JAX
    creates its thread pools (they inherit the mask).

    Graceful stop (a run that writes checkpoints turns it on, :meth:`allow_graceful_stop`):
    the first stop signal prints the one line saying so and sets :attr:`stop_signal`; the
    trainer's ranks agree on it at the next step boundary, save, and exit 0. If the job
    reaches no step boundary within the grace period -- a peer died, so the step's
    collectives never complete -- or a second signal arrives, the process still ends with
    its one line and exit status 1. What the launchers do (Open MPI 5, measured):
    ``mpirun`` forwards SIGTERM and SIGINT to every rank and SIGKILLs them about 0.25 s
    later, so a SIGTERM *to mpirun* (or a rank that dies) ends the job without a save;
    SIGUSR1 to ``mpirun`` is forwarded to every rank and nothing else happens, so it is the
    signal that makes an ``mpirun`` job save and stop: under Open MPI a SIGTERM or SIGINT
    ends the rank at once, its line saying why no save is attempted, what the checkpoints on
    disk hold (:attr:`saved`) and to send SIGUSR1 instead (the sender of a signal tells
    which: Open MPI's daemon is the rank's parent). A SIGTERM sent to the ranks
    themselves (``srun`` on cancellation, with KillWait before SIGKILL; a scheduler that
    signals every process; ``kill`` on one rank's pid) saves and stops the whole job.
    """

    def __init__(self, launch: LaunchInfo, *, stage: int | None = None):
        self.launch = launch
        self.stage = stage  # None until the plan has placed this rank
        self.last_completed_step = -1
        self.stop_signal: str | None = None  # the first stop signal, once graceful stop is allowed
        self._grace_s: float | None = None  # None: a signal ends the process at once
        self._deadline: float | None = None  # time.monotonic() by which the process must be done
        self._finished = False
        # every process of the job: (rank, stage, pid, host), to name a peer that died
        self.peers: list[tuple[int, int, int, str]] = []
        # what the checkpoints on disk hold, read when a line is printed (the trainer sets it)
        self.saved: Callable[[], str] | None = None

    def may_save_on(self, name: str, sender: int) -> bool:
        """Whether a stop signal ``name`` from process ``sender`` leaves time for a save: Open
        MPI's daemon (this rank's parent) follows a SIGTERM or SIGINT it sends with SIGKILL
        within a second (class docstring); SIGUSR1, any signal under the other launchers, and
        one sent by anyone else (``kill`` on a rank's pid, a scheduler) leave time."""
        return name == "SIGUSR1" or not self.launch.launcher.startswith("openmpi") or sender != os.getppid()

    def line(self, why: str) -> str:
        lc = self.launch
        who = f"rank {lc.rank}/{lc.size}, {lc.launcher}"
        who = f"stage {self.stage} ({who})" if self.stage is not None else who
        done = (
            f"last completed step {self.last_completed_step}" if self.last_completed_step >= 0 else "no step completed"
        )
        return f"h2jax: {who} {why}; {done}"

    @staticmethod
    def signals() -> set:
        import signal

        return {getattr(signal, name) for name in STOP_SIGNALS}

    @classmethod
    def block(cls) -> None:
        """Block the stop signals in the calling thread and in every thread it starts later.
        The CLI calls this first thing under a launcher: a thread that exists before (numpy's
        BLAS pool starts at import) would otherwise take a SIGTERM and end the process
        without its line."""
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, cls.signals())

    @classmethod
    def unblock(cls) -> None:
        """The calling thread takes the stop signals again (a command that starts no FailFast)."""
        import signal

        signal.pthread_sigmask(signal.SIG_UNBLOCK, cls.signals())

    def start(self) -> None:
        import sys
        import threading

        self.block()
        exposed = threads_taking(self.signals())
        threading.Thread(target=self._wait, name="h2jax-failfast", daemon=True).start()
        if exposed:
            sys.stderr.write(
                f"h2jax: warning: {len(exposed)} thread(s) started before the stop signals were blocked; "
                "a stop signal may end this process without its line\n"
            )

    def allow_graceful_stop(self, grace_s: float) -> None:
        """From now on the first stop signal asks for a save at the next step boundary
        (:attr:`stop_signal`) instead of ending the process; ``grace_s`` bounds the wait."""
        self._grace_s = grace_s

    def stopping(self, within_s: float = SAVE_GRACE_S) -> None:
        """No more step boundaries: the ranks agreed to stop (or the run is over) and save.
        A stop signal, past or future, now gives the process ``within_s`` to finish."""
        if self._grace_s is not None:
            self._grace_s = within_s
            if self._deadline is not None:
                import time

                self._deadline = time.monotonic() + within_s

    def watch(self, timeout_s: float) -> None:
        """Arm the progress watchdog: if no :meth:`heartbeat` comes for ``timeout_s`` seconds (a
        peer stopped or hangs, and a collective or a transfer waits for it forever), the process
        ends with its one line. The trainer beats at every step boundary and around saves."""
        import threading
        import time

        self._watch_s = float(timeout_s)
        self._beat = time.monotonic()
        if getattr(self, "_watchdog", None) is None:
            self._watchdog = threading.Thread(target=self._watch, name="h2jax-watchdog", daemon=True)
            self._watchdog.start()

    def unwatch(self) -> None:
        """The step loop is over (final save, outputs): the watchdog rests."""
        self._watch_s = float("inf")

    def heartbeat(self) -> None:
        import time

        self._beat = time.monotonic()

    def _watch(self) -> None:
        import time

        while not self._finished:
            time.sleep(0.5)
            if self._finished or self._deadline is not None:  # a stop is under way: the grace period rules
                continue
            idle = time.monotonic() - self._beat
            if idle > self._watch_s:
                self._exit(
                    f"made no progress for {idle:.0f} s (train.transfer_timeout_s and the slowest step so far): "
                    "another process of the job is stopped or hangs"
                )

    def dead_peers(self) -> list[tuple[int, int, int, str]]:
        """The peers on this host whose process is gone (other hosts cannot be seen from here)."""
        import socket

        host = socket.gethostname()
        out = []
        for rank, stage, pid, where in self.peers:
            if where != host or rank == self.launch.rank:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                out.append((rank, stage, pid, where))
            except PermissionError:
                pass  # alive, another user's
        return out

    def finish(self) -> None:
        """This process is about to exit on its own: a late signal ends it without a line."""
        self._finished = True

    def _record_dead(self, dead: list[tuple[int, int, int, str]]) -> None:
        """Under ``h2jax train --elastic`` (h2jax.elastic): the peers seen dead, as a record the
        supervisor reads (``lost-by-rank-<R>.json`` in ``$H2JAX_ELASTIC_DIR``), not a message."""
        import json
        import time

        d = os.environ.get(ELASTIC_DIR_ENV)
        if not d:
            return
        peers = [{"rank": r, "stage": st, "pid": pid, "host": host} for r, st, pid, host in dead]
        rec = {"seen_by": self.launch.rank, "time": time.time(), "peers": peers}
        path = os.path.join(d, f"lost-by-rank-{self.launch.rank}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(rec, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the line still goes out: the supervisor then knows less

    def _exit(self, why: str, *, to_launcher: bool = False) -> None:
        """Say the line and end this process. ``to_launcher``: the launcher itself is ending
        the job (Open MPI's daemon, this process's parent, sent the signal), and stops relaying
        the ranks' output as it does so (a SIGTERM to ``mpirun``: measured, no rank's line came
        out); the line goes to the launcher's own stderr, where the user reads the job's."""
        import sys

        if self.saved is not None:
            try:
                why = f"{why}; {self.saved()}"
            except Exception as e:  # noqa: BLE001 -- the line goes out whatever the disk says
                why = f"{why}; the checkpoints could not be read ({type(e).__name__}: {e})"
        text = self.line(why) + "\n"
        if to_launcher:
            try:
                with open(f"/proc/{os.getppid()}/fd/2", "w") as f:
                    f.write(text)
                os._exit(1)
            except OSError:  # another user's launcher, no /proc: this process's own stderr
                pass
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(1)

    def _wait(self) -> None:
        import signal
        import time

        sigs = self.signals()
        while True:
            deadline = self._deadline
            if deadline is None:
                info = signal.sigwaitinfo(sigs)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._exit(
                        f"stopped by {self.stop_signal}: the job reached no step boundary (or did not "
                        f"finish its save) in time (another process of the job failed or hangs)"
                    )
                info = signal.sigtimedwait(sigs, min(left, 1.0))
                if info is None:
                    continue
            signum, sender = info.si_signo, info.si_pid
            name = signal.Signals(signum).name
            if self._finished:
                os._exit(1)
            dead = self.dead_peers()
            if dead:  # no step boundary can come: say who, and end now
                self._record_dead(dead)
                who = ", ".join(f"rank {r} (stage {st}, pid {pid})" for r, st, pid, _ in dead)
                self._exit(
                    f"stopped by {name}: {who} of this host ended (killed or crashed), so the job cannot "
                    "continue; nothing more is saved"
                )
            if self._grace_s is None or self.stop_signal is not None:
                self._exit(f"stopped by {name} (another process of the job failed, or the job was cancelled)")
            if not self.may_save_on(name, sender):  # no promise of a save the launcher will not let it make
                self._exit(
                    f"stopped by {name}: mpirun follows a {name} with SIGKILL within a second (another rank of "
                    f"the job failed, or mpirun itself was signalled), so no save is attempted; to stop an mpirun "
                    f"job and save, send SIGUSR1 to mpirun",
                    to_launcher=True,
                )
            self.stop_signal = name
            self._deadline = time.monotonic() + self._grace_s
            import sys

            sys.stderr.write(
                self.line(
                    f"{name} received: asking every process to stop at the next step boundary and save a "
                    f"checkpoint there; exit 0 once that save is committed, else exit 1 with a line like this "
                    f"one within {self._grace_s:g} s"
                )
                + "\n"
            )
            sys.stderr.flush()
