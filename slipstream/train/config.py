"""The training run's configuration: one frozen, keyword-only dataclass per concern.

A run is configured by an optional TOML file plus `--section.key=value` overrides, resolved into
a `TrainConfig` and written to the run directory as `config.toml`:

    [model]                          # what to train
    preset = "tiny"
    [data]
    path = "runs/data"
    seq_len = 256
    [optimizer]
    lr = 1e-3
    [training]
    steps = 500
    global_batch_size = 16
    micro_batch_size = 8

Every value is checked when its dataclass is built (`ValueError` naming `section.key`); an unknown
section or key is an error naming the closest valid one. Checks that need the running world (the
number of ranks, whether the data directory exists) are in `check_run(config, world_size)`, which
the trainer calls before it builds anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if typing.TYPE_CHECKING:
    from slipstream.model import ModelConfig

DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
STRATEGIES = ("fsdp", "ddp")
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")
LOOPED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules of v >= 2 stages per rank placed in a loop: rank r holds stages r, r + pp, ..."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules of exactly 2 stages per rank placed in a V: rank r holds stages r and 2 pp - 1 - r."""
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that run a stage's backward as two passes, the input gradients and later the weight
gradients (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), which torch's compile cannot split."""
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
DECAYS = ("cosine", "linear", "constant")
TOKENIZER_DIR = "tokenizer"
"""The tokenizer's folder, in a dataset and in a training run (the run's is a copy of its data's)."""
MAX_PREFETCH = 64
"""Most batches the data thread may prepare ahead (each is held in memory until its step)."""
MAX_TIMEOUT_S = 30 * 24 * 3600.0
"""The longest supervisor timeout or backoff: 30 days (the watchdog's timer takes no more)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Which model to train: a preset initialised from a seed, or a Hugging Face model dir."""

    preset: str = "tiny"
    """A name from `slipstream.model.presets` (tiny, tiny-moe, tiny-gemma2, small, medium); ignored
    when `path` is set."""
    path: str | None = None
    """Start from this Hugging Face model directory's config and weights instead."""
    init_std: float = 0.02
    init_seed: int = 0

    def __post_init__(self) -> None:
        _check(self.init_std > 0 and math.isfinite(self.init_std), "model.init_std", self.init_std,
               "a positive number")
        _check_seed("model.init_seed", self.init_seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = ""
    """A directory written by `slipstream data prepare` (required)."""
    seq_len: int = 256
    """Tokens per training sequence (windows of seq_len + 1 tokens give inputs and targets)."""
    seed: int = 0
    """Seeds the order of windows (a new permutation every epoch)."""
    prefetch: int = 2
    """Batches the background thread prepares ahead of the step."""

    def __post_init__(self) -> None:
        _check_positive_int("data.seq_len", self.seq_len)
        _check_seed("data.seed", self.seed)
        _check_non_negative_int("data.prefetch", self.prefetch)
        _check(self.prefetch <= MAX_PREFETCH, "data.prefetch", self.prefetch, f"at most {MAX_PREFETCH}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay, applied to matrices only, not to norms or biases)."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of the warm-up."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "auto"
    """auto (fused where available, else foreach), fused, foreach or for_loop."""

    def __post_init__(self) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), "optimizer.lr", self.lr, "a positive number")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas", self.betas, "two numbers in [0, 1)",
        )
        _check(self.eps > 0 and math.isfinite(self.eps), "optimizer.eps", self.eps, "a positive number")
        _check(self.weight_decay >= 0 and math.isfinite(self.weight_decay), "optimizer.weight_decay",
               self.weight_decay, "a number >= 0")
        _check_choice("optimizer.implementation", self.implementation, OPTIMIZER_IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning rate: linear warm-up from lr / (warmup_steps + 1), then decay to min_lr_ratio * lr."""

    warmup_steps: int = 100
    decay: str = "cosine"
    """cosine, linear or constant, over the steps after the warm-up."""
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check_non_negative_int("schedule.warmup_steps", self.warmup_steps)
        _check_choice("schedule.decay", self.decay, DECAYS)
        _check(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    steps: int = 1000
    """Optimizer steps to run."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all ranks: micro_batch_size x ranks x accumulation."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    dtype: str = "float32"
    """float32, or bfloat16 (autocast: bf16 matmuls, fp32 weights, optimizer state and loss)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    seed: int = 0
    deterministic: bool = False
    """Deterministic algorithms and seeded RNGs: the same run gives the same bits."""
    fast_kernels: bool = True
    """On CPU: oneDNN matmuls for the linear layers' forward and backward (`train.cpu_kernels`)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size"):
            _check_positive_int(f"training.{name}", getattr(self, name))
        _check(
            self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm), "training.max_grad_norm",
            self.max_grad_norm, "a number >= 0 (0 disables clipping)",
        )
        _check_choice("training.dtype", self.dtype, DTYPES)
        _check_choice("training.device", self.device, DEVICES)
        _check_seed("training.seed", self.seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is executed over ranks; applied by `train.parallel.parallelize`."""

    strategy: str = "fsdp"
    """With more than one rank: fsdp (FSDP2 fully_shard per layer) or ddp (replicate)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass."""
    compile: bool = False
    """torch.compile each decoder layer."""
    tensor_parallel_degree: int = 1
    """Ranks that split each layer's matrices (torchtitan's name): the job's ranks form a 2-D
    mesh of world / degree data-parallel replicas of `degree` tensor-parallel ranks; 1 is none."""
    sequence_parallel: bool = True
    """With tensor parallelism: the norms and the residual stream are split along the sequence
    between the tensor-parallel ranks (Korthikanti et al. 2022) instead of held whole by each."""
    loss_parallel: bool = True
    """With tensor parallelism: the logits stay split by vocabulary between the tensor-parallel
    ranks and the cross-entropy is computed on the shards (torch's `loss_parallel`, on by default
    as torchtitan has it), so no rank holds the whole (batch, seq, vocab) logits."""
    context_parallel_degree: int = 1
    """Ranks that split each sequence (torchtitan's name; `train.context_parallel`): each holds
    2 of 2 x degree chunks of every sequence and attends to the keys and values gathered from the
    others; they read the same batches, and FSDP / DDP run over data-parallel x context-parallel
    ranks. data.seq_len must divide into 2 x degree chunks; 1 is none."""
    pipeline_parallel_degree: int = 1
    """Ranks that split the decoder's layers into consecutive stages (torchtitan's name;
    `train.pipeline`): the outermost mesh dimension, each pipeline's ranks reading the same
    batches, FSDP / DDP running per stage over its data-parallel replicas. The step's
    accumulation micro-batches (global_batch_size / (replicas x micro_batch_size)) are the
    pipeline's micro-batches. Not for mixture-of-experts models; 1 is none."""
    pipeline_parallel_schedule: str = "1F1B"
    """With pipeline parallelism, torch's schedule by torchtitan's name: 1F1B (needs at least
    as many micro-batches as stages), GPipe, Interleaved1F1B (several stages per rank, and
    micro-batches a multiple of the degree, Megatron's rule), or the zero-bubble schedules, which
    split each backward into input and weight gradients: InterleavedZeroBubble (several stages
    per rank in a loop), ZBVZeroBubble and DualPipeV (two stages per rank in a V)."""
    pipeline_parallel_stages_per_rank: int = 1
    """Stages each pipeline rank holds (Megatron's virtual stages, v): 1; at least 2 with
    Interleaved1F1B and InterleavedZeroBubble; 2 with ZBVZeroBubble and DualPipeV."""

    def __post_init__(self) -> None:
        _check_choice("parallel.strategy", self.strategy, STRATEGIES)
        _check_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _check_positive_int("parallel.tensor_parallel_degree", self.tensor_parallel_degree)
        _check_positive_int("parallel.context_parallel_degree", self.context_parallel_degree)
        self._check_pipeline()
        if self.compile and self.tensor_parallel_degree > 1:
            # torch 2.13 on CPU: AOTAutograd hands the backward of the tensor-parallel layers a plain
            # gradient where DTensor's redistribution expects a DTensor (AttributeError).
            raise ValueError(f"parallel.compile does not work with parallel.tensor_parallel_degree "
                             f"({self.tensor_parallel_degree}) here (the compiled backward fails in "
                             "DTensor's redistribution); set parallel.compile=false")

    def _check_pipeline(self) -> None:
        pp, v = self.pipeline_parallel_degree, self.pipeline_parallel_stages_per_rank
        _check_positive_int("parallel.pipeline_parallel_degree", pp)
        schedule = _canonical_schedule(self.pipeline_parallel_schedule)
        object.__setattr__(self, "pipeline_parallel_schedule", schedule)  # frozen; keep torch's spelling
        _check_positive_int("parallel.pipeline_parallel_stages_per_rank", v)
        if pp == 1 and v > 1:
            raise ValueError(f"parallel.pipeline_parallel_stages_per_rank ({v}) needs parallel.pipeline_"
                             "parallel_degree > 1 (it is 1: no pipeline); set it to 1")
        if pp == 1 and schedule not in ("1F1B", "GPipe"):
            raise ValueError(f"parallel.pipeline_parallel_schedule {schedule!r} needs parallel.pipeline_"
                             "parallel_degree > 1 (it is 1: no pipeline)")
        if schedule in LOOPED_SCHEDULES and v < 2:
            raise ValueError(f"parallel.pipeline_parallel_stages_per_rank ({v}) must be at least 2 with "
                             f"parallel.pipeline_parallel_schedule {schedule!r}")
        if schedule in V_SCHEDULES and v != 2:
            raise ValueError(f"parallel.pipeline_parallel_stages_per_rank ({v}) must be 2 with "
                             f"parallel.pipeline_parallel_schedule {schedule!r} (its stages form a V)")
        if schedule in ("1F1B", "GPipe") and v != 1:
            raise ValueError(f"parallel.pipeline_parallel_stages_per_rank ({v}) must be 1 with "
                             f"parallel.pipeline_parallel_schedule {schedule!r}; several stages per rank "
                             f"need one of {', '.join(LOOPED_SCHEDULES + V_SCHEDULES)}")
        if self.compile and schedule in SPLIT_BACKWARD_SCHEDULES:
            raise ValueError(f"parallel.compile does not work with parallel.pipeline_parallel_schedule "
                             f"{schedule!r}: torch cannot split a compiled backward into its input and "
                             "weight gradients; set parallel.compile=false or take another schedule")


def _canonical_schedule(name: Any) -> str:
    """The name of PIPELINE_SCHEDULES that `name` spells in any case (as torch's
    `get_schedule_class` matches it); ValueError naming the key for another."""
    canonical = {choice.lower(): choice for choice in PIPELINE_SCHEDULES}.get(str(name).lower())
    _check(isinstance(name, str) and canonical is not None, "parallel.pipeline_parallel_schedule", name,
           f"one of {', '.join(PIPELINE_SCHEDULES)} (in any case)")
    return canonical


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    interval: int = 100
    """Evaluate on the held-out split every this many steps and after the last; 0 disables."""
    num_batches: int = 8
    """Global batches (training.global_batch_size sequences each) per evaluation, from the start
    of the held-out split: the same windows at every world size (fewer if the split is smaller)."""

    def __post_init__(self) -> None:
        _check_non_negative_int("eval.interval", self.interval)
        _check_positive_int("eval.num_batches", self.num_batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Sharded torch.distributed.checkpoint saves, committed by a checksummed manifest."""

    interval: int = 0
    """Save every this many steps; 0 saves only at the end (if `save_final`)."""
    keep_last: int = 2
    """Committed checkpoints to keep; older ones are deleted (except those `keep_every` keeps)."""
    keep_every: int = 0
    """Also keep, forever, every checkpoint whose step is a multiple of this; 0 keeps none."""
    save_final: bool = True
    async_save: bool = True
    """Stage the state to host memory and write it in a background thread (the step waits only
    for the copy); false writes before the step continues."""

    def __post_init__(self) -> None:
        _check_non_negative_int("checkpoint.interval", self.interval)
        _check_positive_int("checkpoint.keep_last", self.keep_last)
        _check_non_negative_int("checkpoint.keep_every", self.keep_every)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    """What a rank does about hangs, non-finite losses and restarts (see `train.supervisor`)."""

    hang_timeout_s: float = 0.0
    """Seconds without step progress (from the end of one step to the end of the next) after
    which a rank dumps every thread's Python stack to RUN_DIR/stacks/ and exits, so the launcher
    restarts the job; 0 disables the watchdog."""
    first_step_timeout_s: float = 600.0
    """With the watchdog on, the seconds the first step may take instead (it compiles, warms
    up allocators and makes the first collectives), as torchtitan gives its first step a longer
    timeout (`comm.init_timeout_seconds`)."""
    restart_backoff_s: float = 1.0
    """A restarted attempt waits this long before it starts when the attempt before it committed
    no checkpoint, doubling with every further such attempt, up to `max_backoff_s`."""
    max_backoff_s: float = 30.0
    max_rollbacks: int = 3
    """Non-finite losses the run recovers from (roll back to the last checkpoint, skip the
    step's batches) before it fails."""

    def __post_init__(self) -> None:
        for name in ("hang_timeout_s", "first_step_timeout_s", "restart_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            _check(0 <= value <= MAX_TIMEOUT_S, f"supervisor.{name}", value,
                   f"a number of seconds in [0, {MAX_TIMEOUT_S:g}]")
        _check_non_negative_int("supervisor.max_rollbacks", self.max_rollbacks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Injected faults for tests and drills (`train.faults`); each fires once per run dir.
    A step of 0 disables that fault."""

    crash_at_step: int = 0
    """Exit the process abruptly after this step (before its checkpoint)."""
    hang_at_step: int = 0
    """Stop making progress after this step (sleep forever)."""
    nan_at_step: int = 0
    """Poison a weight with NaN just before this step, so its loss is non-finite."""
    kill_during_checkpoint: int = 0
    """SIGKILL the process while the checkpoint of this step is being written: on rank 0 when
    its data files are on disk and the manifest has not committed them, on other ranks before
    their shards are written."""
    preempt_at_step: int = 0
    """Send the process SIGTERM after this step, as a scheduler preempting the job would."""
    rank: int = 0
    """The rank the faults hit."""

    def __post_init__(self) -> None:
        for name in ("crash_at_step", "hang_at_step", "nan_at_step", "kill_during_checkpoint",
                     "preempt_at_step", "rank"):
            _check_non_negative_int(f"faults.{name}", getattr(self, name))

    @property
    def any(self) -> bool:
        return any((self.crash_at_step, self.hang_at_step, self.nan_at_step,
                    self.kill_during_checkpoint, self.preempt_at_step))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    interval: int = 10
    """Print a console line every this many steps (every step goes to metrics.jsonl)."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""
    peak_flops_per_s: float | None = None
    """MFU denominator per device; default: the calibrated (CPU) or tabled (GPU) peak."""

    def __post_init__(self) -> None:
        _check_positive_int("logging.interval", self.interval)
        if self.peak_flops_per_s is not None:
            _check(0 < self.peak_flops_per_s < math.inf, "logging.peak_flops_per_s", self.peak_flops_per_s,
                   "a positive number of FLOP/s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfilingConfig:
    """torch.profiler traces of some training steps, with torchtitan's keys and schedule
    (`train.profiling`): in every `profile_freq` steps the profiler idles, warms up for
    `profiler_warmup` steps and records the last `profiler_active`, so traces end at steps
    profile_freq, 2 x profile_freq, ..."""

    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    """Where traces go, relative to run.dir (an absolute path is taken as it is): a folder
    iteration_N per trace, N the step it ends at, holding rankR_trace.json from every rank R."""
    profile_freq: int = 10
    """A trace every this many steps."""
    profiler_warmup: int = 3
    """Steps the profiler runs before the active ones, their events discarded (so the profiler's
    start-up cost stays out of the trace)."""
    profiler_active: int = 1
    """Steps each trace records."""
    profile_memory: bool = False
    """Record the allocator's events too (`torch.profiler.profile(profile_memory=True)`), for
    `slipstream perf trace`'s memory timeline; it slows the recorded steps further."""

    def __post_init__(self) -> None:
        _check(isinstance(self.save_traces_folder, str) and self.save_traces_folder.strip() != "",
               "profiling.save_traces_folder", self.save_traces_folder,
               "a folder path (an empty one would put the traces' folders in run.dir itself)")
        _check_positive_int("profiling.profile_freq", self.profile_freq)
        _check_non_negative_int("profiling.profiler_warmup", self.profiler_warmup)
        _check_positive_int("profiling.profiler_active", self.profiler_active)
        # As torchtitan, the cycle is checked only when it is used: wait = freq - (warmup + active).
        cycle = self.profiler_warmup + self.profiler_active
        if self.enable_profiling and self.profile_freq < cycle:
            raise ValueError(
                f"profiling.profile_freq ({self.profile_freq}) must be at least profiling.profiler_warmup "
                f"+ profiling.profiler_active ({self.profiler_warmup} + {self.profiler_active} = {cycle}): "
                "every trace takes its warm-up and active steps out of profile_freq steps"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    dir: str = "runs/train"
    """Where config.toml, metrics.jsonl, checkpoints and TensorBoard events go."""

    def __post_init__(self) -> None:
        _check(isinstance(self.dir, str) and self.dir.strip() != "", "run.dir", self.dir,
               "a directory path (an empty one would be the working directory)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)
    faults: FaultConfig = dataclasses.field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        cp, seq_len = self.parallel.context_parallel_degree, self.data.seq_len
        if cp > 1 and seq_len % (2 * cp):  # without context parallelism any length is one chunk
            raise ValueError(f"parallel.context_parallel_degree ({cp}) needs data.seq_len ({seq_len}) "
                             f"divisible by 2 x {cp} = {2 * cp}: each sequence is cut into 2 x degree "
                             "chunks, two per rank")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """TOML text that `load_config` reads back to an equal config (None values are omitted,
        which is their default)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None]
            lines.append("")
        return "\n".join(lines)

    def replace(self, **sections: Mapping[str, Any]) -> TrainConfig:
        """A copy with some keys changed (and checked again): `replace(training={"steps": 10})`."""
        return dataclasses.replace(self, **{
            name: dataclasses.replace(getattr(self, name), **values)
            for name, values in sections.items()
        })


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config from an optional TOML file plus `--section.key=value` overrides (later wins).

    Override values are TOML values (`1e-3`, `true`, `[0.9, 0.95]`, `"text"`); anything that is
    not valid TOML is taken as a string, so `--data.path=runs/data` needs no quotes. The config
    is checked once, with the overrides applied (a flag may fix a value the file gets wrong); an
    error that the overrides alone do not make names the file (it may be the run dir's saved
    config.toml, which the command line does not name).
    """
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        values = _read_toml(Path(path))
    flags: dict[str, dict[str, Any]] = {}
    for override in overrides:
        section, key, value = parse_override(override)
        values.setdefault(section, {})[key] = value
        flags.setdefault(section, {})[key] = value
    try:
        return from_dict(values)
    except ValueError as e:
        if path is None or _error_of(flags) == str(e):
            raise
        raise ValueError(f"{path}: {e}") from e


def _error_of(values: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The message of the ValueError `from_dict(values)` raises, or None."""
    try:
        from_dict(values)
    except ValueError as e:
        return str(e)
    return None


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    """The sections of a TOML config file (not yet checked as a config: `load_config` checks it
    with the overrides); every error names the file."""
    try:
        values = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (TOML files are): {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from e
    for section, table in values.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {section!r} must be a [section] table, not a value")
    return values


def parse_override(text: str) -> tuple[str, str, Any]:
    """("optimizer", "lr", 0.001) from "--optimizer.lr=1e-3"."""
    name, sep, raw = text.removeprefix("--").partition("=")
    section, dot, key = name.partition(".")
    if not (sep and dot and section and key):
        raise ValueError(f"override {text!r} must look like --section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def from_dict(values: Mapping[str, Mapping[str, Any]]) -> TrainConfig:
    """Build and validate a TrainConfig from {section: {key: value}}; missing keys keep defaults."""
    section_types = _section_types()
    sections = {}
    for section, table in values.items():
        if section not in section_types:
            raise ValueError(f"unknown config section [{section}]{_suggest(section, section_types)}")
        cls = section_types[section]
        hints = typing.get_type_hints(cls)
        for key in table:
            if key not in hints:
                raise ValueError(
                    f"unknown config key {section}.{key}{_suggest(f'{section}.{key}', _all_keys())}"
                )
        kwargs = {key: _coerce(f"{section}.{key}", value, hints[key]) for key, value in table.items()}
        sections[section] = cls(**kwargs)
    return TrainConfig(**sections)


def check_run(config: TrainConfig, world_size: int) -> None:
    """Checks that need the running job: the pipeline-, tensor- and context-parallel degrees
    against the ranks, batch divisibility by the data-parallel replicas (world / (pp x tp x cp)),
    the pipeline schedule against the step's micro-batches, the data dir,
    the model dir's config.json, and a run.dir apart from the dataset (`_check_run_dir_apart`).
    The model's shape is checked against the tensor- and pipeline-parallel degrees by
    `check_tensor_parallel` and `check_pipeline_parallel`, once the model's config is known."""
    tp, cp = config.parallel.tensor_parallel_degree, config.parallel.context_parallel_degree
    pp = config.parallel.pipeline_parallel_degree
    degrees = [(f"parallel.{name}_parallel_degree", degree) for name, degree in
               (("pipeline", pp), ("context", cp), ("tensor", tp)) if degree > 1]
    if world_size % (pp * tp * cp):
        named = " x ".join(f"{key} ({degree})" for key, degree in degrees)
        raise ValueError(f"{named} must divide the job's number of ranks ({world_size})")
    if tp > 1 and world_size // pp > tp and config.parallel.strategy == "ddp":  # per pipeline stage
        raise ValueError("parallel.strategy 'ddp' does not compose with parallel.tensor_parallel_degree "
                         f"({tp}) over {world_size // (pp * tp)} replicas (DDP does not take tensor-parallel "
                         "DTensor parameters); use parallel.strategy=fsdp")
    replicas = world_size // (pp * tp * cp)
    per_step = replicas * config.training.micro_batch_size
    if config.training.global_batch_size % per_step:
        split = " x ".join(key for key, _ in degrees)
        across = f"world size / {split} ({world_size} / {pp * tp * cp})" if split else "world size"
        raise ValueError(
            f"training.global_batch_size ({config.training.global_batch_size}) must be divisible "
            f"by {across} x training.micro_batch_size ({replicas} x "
            f"{config.training.micro_batch_size} = {per_step})"
        )
    _check_pipeline_microbatches(config.parallel, config.training.global_batch_size // per_step)
    data_dir = Path(config.data.path) if config.data.path else None
    if data_dir is None:
        raise ValueError("data.path is required: a directory written by `slipstream data prepare`")
    if not (data_dir / "meta.json").is_file():
        raise ValueError(
            f"data.path {str(data_dir)!r} holds no prepared dataset (no meta.json); "
            f"run `slipstream data prepare --out {data_dir}` first"
        )
    if config.model.path is not None and not (Path(config.model.path) / "config.json").is_file():
        raise ValueError(f"model.path {config.model.path!r} has no config.json")
    _check_run_dir_apart(config)


def _check_pipeline_microbatches(parallel: ParallelConfig, num_microbatches: int) -> None:
    """ValueError when the schedule cannot run the step's m micro-batches: 1F1B needs m >= pp
    (torch's rule), the interleaved schedule a multiple of pp (Megatron's, which the perf model
    prices; torch's own is weaker)."""
    pp, schedule = parallel.pipeline_parallel_degree, parallel.pipeline_parallel_schedule
    if pp == 1:
        return
    m = num_microbatches
    where = ("(m = training.global_batch_size / (data-parallel replicas x training.micro_batch_size) "
             f"= {m})")
    if schedule == "1F1B" and m < pp:
        raise ValueError(f"parallel.pipeline_parallel_schedule '1F1B' needs at least parallel."
                         f"pipeline_parallel_degree ({pp}) micro-batches per step {where}")
    if schedule == "Interleaved1F1B" and m % pp:
        raise ValueError(f"parallel.pipeline_parallel_schedule 'Interleaved1F1B' needs a multiple of "
                         f"parallel.pipeline_parallel_degree ({pp}) micro-batches per step {where}")
    if schedule == "InterleavedZeroBubble" and m % max(1, m // pp):
        raise ValueError(f"parallel.pipeline_parallel_schedule 'InterleavedZeroBubble' needs the "
                         f"micro-batches per step to be a multiple of their rounds (m // parallel.pipeline_"
                         f"parallel_degree ({pp}) = {m // pp}: torch's rule) {where}")
    if schedule == "DualPipeV" and m < 2 * pp:
        raise ValueError(f"parallel.pipeline_parallel_schedule 'DualPipeV' needs at least as many "
                         f"micro-batches per step as stages (2 x parallel.pipeline_parallel_degree = "
                         f"{2 * pp}) {where}")


def check_pipeline_parallel(config: TrainConfig, model_config: ModelConfig) -> None:
    """ValueError naming parallel.pipeline_parallel_degree when the model cannot be cut into
    pp x v stages of whole layers, or is a mixture-of-experts model (its load-balancing loss and
    expert-load records span every layer, which no stage sees)."""
    parallel = config.parallel
    pp, v = parallel.pipeline_parallel_degree, parallel.pipeline_parallel_stages_per_rank
    if pp == 1:
        return
    if model_config.moe_layers:
        raise ValueError(f"parallel.pipeline_parallel_degree ({pp}) is not supported for mixture-of-experts "
                         f"models ({model_config.model_type!r}): their load-balancing loss spans all layers")
    if pp * v > model_config.num_hidden_layers:
        raise ValueError(f"parallel.pipeline_parallel_degree ({pp}) x parallel.pipeline_parallel_stages_per_"
                         f"rank ({v}) stages exceed the model's num_hidden_layers "
                         f"({model_config.num_hidden_layers})")


def check_tensor_parallel(config: TrainConfig, model_config: ModelConfig) -> None:
    """ValueError naming parallel.tensor_parallel_degree when the model's shape cannot be split
    that many ways: every rank holds heads / degree query heads and K/V heads / degree K/V heads
    (Megatron's query groups), intermediate_size / degree MLP columns and vocab_size / degree
    rows of the embedding and output projection; with sequence parallelism data.seq_len / degree
    positions. Mixture-of-experts layers split each expert's (and a shared expert's) width the
    same way; Mixtral's router jitter is refused, since each rank would draw its own noise and
    route otherwise. OLMo 2 is refused: its q and k norms take statistics over all heads, which
    the ranks would each hold a part of."""
    tp = config.parallel.tensor_parallel_degree
    if tp == 1:
        return
    name = f"parallel.tensor_parallel_degree ({tp})"
    if model_config.qk_norm_across_heads:
        raise ValueError(f"{name} is not supported for model_type {model_config.model_type!r}, whose q and k "
                         "norms span all heads; train it with data parallelism (FSDP or DDP)")
    fields = ["num_attention_heads", "num_key_value_heads", "vocab_size"]
    if len(model_config.moe_layers) < model_config.num_hidden_layers:
        fields.append("intermediate_size")
    if model_config.moe_layers:
        fields.append("moe_intermediate_size")
        if model_config.shared_expert_intermediate_size is not None:
            fields.append("shared_expert_intermediate_size")
        if model_config.router_jitter_noise:
            raise ValueError(f"{name} does not work with router_jitter_noise "
                             f"({model_config.router_jitter_noise}): each rank would draw its own noise "
                             "and route its tokens otherwise")
    for field in fields:
        value = getattr(model_config, field)
        if value % tp:
            raise ValueError(f"{name} must divide the model's {field} ({value})")
    cp = config.parallel.context_parallel_degree
    if config.parallel.sequence_parallel and config.data.seq_len // cp % tp:
        held = (f"data.seq_len / parallel.context_parallel_degree ({config.data.seq_len} / {cp})" if cp > 1
                else f"data.seq_len ({config.data.seq_len})")
        raise ValueError(f"{name} must divide {held} with "
                         "parallel.sequence_parallel, which splits each sequence between the ranks")


def _check_run_dir_apart(config: TrainConfig) -> None:
    """ValueError when run.dir would write over the dataset: the trainer replaces RUN_DIR/tokenizer
    with a copy of DATA/tokenizer, so the two must not be one folder or lie inside each other
    (symbolic links resolved)."""
    run_dir, data_dir = Path(config.run.dir).resolve(), Path(config.data.path).resolve()
    data_tokenizer, run_tokenizer = data_dir / TOKENIZER_DIR, run_dir / TOKENIZER_DIR
    if (run_dir == data_dir or run_dir.is_relative_to(data_tokenizer)
            or data_dir.is_relative_to(run_tokenizer)):
        raise ValueError(f"run.dir {config.run.dir!r} and data.path {config.data.path!r} overlap (the run "
                         f"would write over the dataset's tokenizer, {data_tokenizer}); choose a run.dir "
                         "outside the dataset")


RESUME_IDENTITY = (
    "model.preset", "model.path", "model.init_std", "model.init_seed", "data.seq_len", "data.seed",
    "training.global_batch_size",
)
"""Keys a rerun in a run dir that already holds a run must keep: they fix the weights' shapes,
the initial state, and which windows every step reads (loader positions count global windows
of `training.global_batch_size` sequences). Everything else may change on a rerun and is
reported (extending `training.steps`, another world size or micro-batch, a lower learning
rate); changing the optimizer, schedule or seeds loses bit-exactness with the original run."""

_NOT_COMPARED = ("run", "faults")


def resume_changes(saved: TrainConfig, new: TrainConfig) -> list[str]:
    """"section.key: old -> new" for every compared key a rerun changes; ValueError naming the
    keys when one of `RESUME_IDENTITY` changed (the run dir holds another run)."""
    changes, conflicts = [], []
    old_values, new_values = saved.to_dict(), new.to_dict()
    for section, values in new_values.items():
        if section in _NOT_COMPARED:
            continue
        for key, value in values.items():
            old = old_values[section][key]
            if old != value:
                name = f"{section}.{key}"
                (conflicts if name in RESUME_IDENTITY else changes).append(f"{name}: {old!r} -> {value!r}")
    if conflicts:
        raise ValueError(
            f"run.dir {new.run.dir!r} holds a run with another config ({'; '.join(conflicts)}); "
            "rerun with the same values to resume it, or choose a new run.dir"
        )
    return changes


# ---- helpers ----------------------------------------------------------------------------------


def _section_types() -> dict[str, type]:
    return typing.get_type_hints(TrainConfig)


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in _section_types().items() for k in typing.get_type_hints(cls)]


def _suggest(name: str, valid: Sequence[str]) -> str:
    """"; did you mean X?" for the closest valid name; a key put in the wrong section (training.lr)
    points to the section that has it."""
    same_key = [v for v in valid if v.rpartition(".")[2] == name.rpartition(".")[2]]
    close = same_key or difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(valid)}"


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """`value` as the annotated type, or a ValueError naming the field."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(annotation) is tuple:
        if isinstance(value, (list, tuple)):
            item_types = typing.get_args(annotation)
            if len(value) == len(item_types):
                return tuple(_coerce(name, v, t) for v, t in zip(value, item_types, strict=True))
    if typing.get_origin(annotation) is tuple:
        item_types = typing.get_args(annotation)
        expected = f"a list of {len(item_types)} values ({', '.join(t.__name__ for t in item_types)})"
    else:
        expected = getattr(annotation, "__name__", str(annotation))
    raise ValueError(f"{name} must be {expected}, got {value!r}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return _toml_string(value)
    return repr(value)


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(value: str) -> str:
    """`value` as a TOML basic string: quotes, backslashes and control characters (which TOML
    does not allow raw, DEL included) escaped, other characters as they are (the file is UTF-8).
    A lone surrogate (an undecodable byte of a file name) has no TOML form: ValueError."""
    parts = []
    for char in value:
        if char in _TOML_ESCAPES:
            parts.append(_TOML_ESCAPES[char])
        elif char < " " or char == "\x7f":
            parts.append(f"\\u{ord(char):04x}")
        elif "\ud800" <= char <= "\udfff":
            raise ValueError(f"{value!r} holds a character that is not Unicode text ({char!r}) and "
                             "cannot be written to the run's config.toml")
        else:
            parts.append(char)
    return '"' + "".join(parts) + '"'


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_positive_int(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           name, value, "a positive integer")


def _check_seed(name: str, value: Any) -> None:
    """An integer in [0, 2**32): what every RNG the run seeds (numpy's among them) takes."""
    _check(isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32,
           name, value, "an integer in [0, 2**32)")


def _check_non_negative_int(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
           name, value, "an integer >= 0")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    _check(value in choices, name, value, f"one of {', '.join(choices)}")
