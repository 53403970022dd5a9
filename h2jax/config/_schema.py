"""The typed config tree of an h2jax experiment.

Every field carries its unit and, where it matters, the trade-off. YAML files in
``configs/`` are data for this tree; ``key=value`` overrides on the command line address
fields by dotted path (``plan.num_microbatches=16``, ``plan.stages.1.tensor=2``).
The defaults *are* the embedded default job: a small GPT across two emulated chip types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h2jax.models import GPTConfig
from h2jax.plan import ChipProfile, Plan, StageSpec

ChipSpec = ChipProfile
"""One chip type in the cluster: h2jax.plan's ChipProfile, read by h2jax.plan.load_chip (one
class and one parser for the config and the planner). A cluster entry is filled from
``configs/chips/<name>.yaml`` (or the file named by ``profile``); keys given inline override
the profile's."""


def _default_chips() -> dict[str, ChipSpec]:
    from h2jax.config._chips import resolve_chip

    return {name: resolve_chip(name, {"nodes": 1}) for name in ("sim_a", "sim_b")}


@dataclass(frozen=True)
class ClusterConfig:
    """The chips available to this job (single process: emulated or local backends)."""

    chips: dict[str, ChipSpec] = field(default_factory=_default_chips)
    """Chip type name -> spec. Emulated names (sim_a, ...) are registered as CPU clients."""


def _default_model() -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=6, d_ff=512)


def _default_plan() -> Plan:
    # uneven split across two chip types with different mesh shapes
    return Plan(
        stages=(
            StageSpec(chip="sim_a", data=2, tensor=2, layers=(0, 4)),
            StageSpec(chip="sim_b", data=4, tensor=1, layers=(4, 6)),
        ),
        global_batch=32,
        num_microbatches=8,
        schedule="1f1b",
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up then cosine decay, and global gradient-norm clipping."""

    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr, reached at the last step (cosine)."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norm scales)."""
    b1: float = 0.9
    """Adam first-moment decay."""
    b2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_norm: float = 1.0
    """Clip the gradient to this global L2 norm (over ALL stages). <= 0: no clipping."""


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Batches are a pure function of (seed, step, microbatch)."""

    corpus: str = "pydoc"
    """Text corpus: "pydoc" (the stdlib's pydoc_data topics, on every Python install) or a path to a text file."""
    token_file: str | None = None
    """Pre-tokenised flat binary file (nanoGPT layout). Wins over corpus when set."""
    token_dtype: str = "uint16"
    """Dtype of token_file: uint16 or uint32."""
    tokenizer: str = "byte"
    """"byte" (vocab 256) or a path to a local HF tokenizer.json."""
    sources: dict[str, float] | None = None
    """Token stores mixed by weight, path -> weight (> 0; normalised): folders `h2jax tokenize
    --format arrayrecord` writes, Megatron .bin/.idx prefixes or flat token files. Wins over
    token_file and corpus. Documents are packed into sequences and shuffled per epoch; a run's
    position is the count of sequences consumed, kept in every checkpoint, so a resume under
    another plan neither skips nor repeats one."""
    val_sources: dict[str, float] | None = None
    """Validation token stores (path -> weight, as sources), read by train.eval_every."""
    holdout: float = 0.0
    """Fraction of each source's sequences kept out of training (the last ones in stored order,
    one sequence apart so no token is in both); with val_sources null they are the validation
    sequences. 0: none."""
    eod_id: int | None = None
    """The end-of-document id of flat token files in sources (their documents end with it);
    null: a flat file is one document. Stores with an index know their documents."""
    packing: bool = True
    """sources: true packs documents into sequences (a per-token segment id keeps attention
    inside each document); false makes each document one sequence: its first seq_len + 1
    tokens (longer documents are cut, the run header counts them), padded after its end,
    with no loss on the padding (the step's loss is the mean over its real targets)."""


@dataclass(frozen=True)
class TrainConfig:
    """The training loop and its outputs."""

    steps: int = 200
    """Optimizer steps to run."""
    log_every: int = 1
    """Write metrics every N steps (the loss is fetched only then)."""
    out_dir: str = "runs"
    """Parent folder of the run folder runs/<name>/ (relative to the current directory)."""
    transport: str = "auto"
    """How boundary tensors cross stages: "local" (jax.device_put; one process), or between processes
    (mpirun/srun): "ffi" (XLA FFI send/recv inside the stage programs), "ffi-call" (the same handlers,
    one small program per transfer) or "host" (numpy + mpi4py: the CPU-mediated baseline). "auto"
    (the default) is "local" in one process and "ffi" under a launcher; the run's config.yaml
    records the one chosen."""
    transfer_timeout_s: float = 60.0
    """Seconds a process waits for one boundary tensor from another before it fails naming the peer
    (between processes only). Longer than the slowest stage's step part; a peer that hangs (or is
    stopped) ends the job after this long."""
    timeline: bool = True
    """Record a Chrome/Perfetto trace of every fwd/bwd/transfer, and a Gantt PNG."""
    gantt_step: int = -1
    """Step drawn in the Gantt PNG; -1: the last step."""
    tensorboard: bool = True
    """Write TensorBoard scalars to <run>/tb."""
    progress: bool = True
    """Show a progress bar."""
    memory_check: bool = True
    """Refuse plans whose per-device memory exceeds the chip's memory_gib."""
    nonfinite: str = "abort"
    """What a NaN/inf loss or gradient norm does: "abort" (exit non-zero naming the step and
    stage; the last checkpoint stays the restart point) or "skip" (the step updates nothing --
    parameters, optimizer state and its step count stay as they were -- the data moves on,
    and metrics count it as ``skipped_steps``)."""
    inject_nonfinite_steps: tuple[int, ...] = ()
    """Fault injection for testing the policy: at these steps the accumulated gradients and the
    loss are made NaN after the backward passes, as a diverging step would. Empty: none."""
    eval_every: int = 0
    """Every N steps (and after the last), the loss on the validation sequences of
    data.val_sources: forward only, through the same stages, schedule order and programs; it
    changes no parameter or optimizer state. Metrics `eval_loss`, TensorBoard, summary.json.
    0: no evaluation."""
    eval_batches: int = 1
    """Global batches of validation sequences per evaluation: the first eval_batches x
    plan.global_batch sequences of data.val_sources, the same ones at every evaluation."""


@dataclass(frozen=True)
class CommConfig:
    """The links between stages: what a run measures and requires of them (the transport
    itself is ``train.transport``)."""

    probe: bool = True
    """Time every link at start-up (an 8-byte and a 4 MiB message, round trips halved) for the
    link table of the run header, ranks.json and summary.json. False: each link's path is
    still named, not timed."""
    engine: str = "auto"
    """What moves the bytes under the in-program transports (``ffi``, ``ffi-call``): ``mpi`` (the
    MPI library mpi4py loaded; device pointers go straight to it only where it is CUDA/ROCm-aware),
    ``ucx`` (UCX's tag API on the buffer's memory type: shared memory, cma, tcp, cuda_ipc, verbs;
    a system UCX where h2jax was built against one, else the libucx wheel), or ``auto``: ``mpi``
    where every device stage's memory goes direct through it (CPU and emulated stages included),
    else ``ucx`` where its handlers for those stages have run on such hardware
    (h2jax.runtime._links.UCX_AUTO; its CUDA handlers have not yet), else ``mpi``. Every link's
    line says which engine carried it."""
    require_device_direct: bool = False
    """Refuse to train (exit 2, one line naming the link, why and the fix) when a link between
    two device stages copies through host memory (path "staged"). CPU stages and emulated chip
    types have nothing to stage: they train."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: asynchronous orbax saves in a layout independent of the plan.

    Parameters and optimizer state are stored by model layer (not by stage), so a
    checkpoint written under one plan restores under another. ``h2jax train`` with a
    checkpoint directory that holds a committed step continues from the latest one.
    """

    enabled: bool = True
    """Save checkpoints (and resume from them). False: no saves; SIGTERM/SIGINT exit without saving."""
    dir: str | None = None
    """Checkpoint directory. None: <run folder>/checkpoints."""
    every_steps: int = 50
    """Save every N optimizer steps (the state after step N, 2N, ...). 0: only at the end and on
    SIGTERM/SIGINT. Frequent saves lose less work on a failure; each costs a device-to-host copy."""
    keep_last: int = 3
    """Committed steps kept: the last K (>= 1). Older ones are deleted after a newer one commits."""
    keep_every: int = 0
    """Also keep every step that is a multiple of M for good, whatever keep_last says. 0: none."""
    async_save: bool = True
    """True: training continues while the files are written (only the device-to-host copy
    blocks). False: every save blocks until it is written and committed."""


@dataclass(frozen=True)
class ExperimentConfig:
    """One training experiment: model, cluster, plan, optimizer, data, loop."""

    name: str = "default"
    """Run name; outputs go to <train.out_dir>/<name>/."""
    seed: int = 0
    """Seed of parameter init and of the data stream."""
    model: GPTConfig = field(default_factory=_default_model)
    """The model (h2jax.models.GPTConfig)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Chip types available."""
    plan: Plan = field(default_factory=_default_plan)
    """Stages, batch sizes and schedule (see DESIGN.md, "The Plan")."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    """The links between stages: their probe and what is required of them."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint saving, retention and resume."""
