"""Readers for slipstream's own metrics records, turned into what the model predicts.

Training: a run directory holds `metrics.jsonl` (one JSON object per line; the trainer writes
`kind: "train"` records with torchtitan-like names: `step`, `loss`, `tokens_per_s`, `step_s`)
and the resolved config (`config.toml` or `config.json`). The reader is tolerant: it skips lines
that do not parse, accepts other spellings of the fields (`step_time_s`, `time_s`, `tps`, ...),
derives the step time from tokens/s when only that is logged, and drops warm-up steps (the first
two of each attempt).

Serving: engine step records (`kind: "engine_step"`), which the engine writes to
`<metrics_dir>/metrics.jsonl` (`slipstream/serve/records.py`) and
`benchmarks/perf_local_validation.py` builds by hand, say what one `Engine.step()` did (`phase`
prefill or decode, `batch_size`, `prompt_len` or `context_len`) and how long it took (`step_s`;
over `num_forward_passes` decode steps run at once, where the engine ran several). Steps the
model cannot price as one shape (phase "mixed": prompt chunks with decodes, or decodes with
speculative guesses; prefill chunks that do not all start at position 0 with one length, which
the engine writes with `prompt_len` null) are skipped quietly, counted in one log line. The
engine's header record (`kind: "engine_config"`) names its model directory, dtype and device;
several engines may append to one file, each record naming its writer's `engine_id`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import statistics
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""Where the trainer and the serving engine write their records, in a run or metrics directory."""
LAYOUT_KEYS = ("world_size", "strategy", "tensor_parallel_degree", "context_parallel_degree",
               "sequence_parallel", "pipeline_parallel_degree", "pipeline_parallel_schedule",
               "pipeline_parallel_stages_per_rank")
"""The `run` record's fields that fix the layout: an attempt resumed with others ran another one."""
STEP_TIME_KEYS = ("step_s", "step_time_s", "time_s", "iteration_time_s", "elapsed_s")
PHASE_KEYS = ("forward_backward_s", "optimizer_s")
TOKENS_PER_S_KEYS = ("tokens_per_s", "tps", "throughput_tokens_per_s", "tokens_per_second")
CONFIG_KEYS = {
    "preset": ("model.preset", "model.name", "model.flavor", "preset"),
    "model_path": ("model.path", "model.hf_assets_path", "model_path"),
    "seq_len": ("data.seq_len", "training.seq_len", "seq_len", "model.seq_len"),
    "global_batch_size": ("training.global_batch_size", "global_batch_size", "training.batch_size"),
    "micro_batch_size": ("training.micro_batch_size", "training.local_batch_size", "micro_batch_size"),
    "dtype": ("training.dtype", "training.mixed_precision_param", "dtype"),
    "activation_checkpointing": ("parallel.activation_checkpointing", "activation_checkpoint.mode"),
    "strategy": ("parallel.strategy", "strategy"),
    "tensor_parallel_degree": ("parallel.tensor_parallel_degree", "parallelism.tensor_parallel_degree",
                               "tensor_parallel_degree"),
    "context_parallel_degree": ("parallel.context_parallel_degree", "parallelism.context_parallel_degree",
                                "context_parallel_degree"),
    "sequence_parallel": ("parallel.sequence_parallel", "sequence_parallel"),
    "pipeline_parallel_degree": ("parallel.pipeline_parallel_degree", "parallelism.pipeline_parallel_degree",
                                 "pipeline_parallel_degree"),
    "pipeline_parallel_schedule": ("parallel.pipeline_parallel_schedule",
                                   "parallelism.pipeline_parallel_schedule", "pipeline_parallel_schedule"),
    "pipeline_parallel_stages_per_rank": ("parallel.pipeline_parallel_stages_per_rank",
                                          "pipeline_parallel_stages_per_rank"),
    "pipeline_parallel_microbatch_size": ("parallelism.pipeline_parallel_microbatch_size",),
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of `path` that is a JSON object; others are logged and skipped."""
    return [record for _, record in _numbered_jsonl(path)]


def _numbered_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every line of `path` that is a JSON object (see `read_jsonl`)."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            logger.warning("%s:%d: not JSON, skipped", path, number)
            continue
        if isinstance(value, dict):
            records.append((number, value))
        else:
            logger.warning("%s:%d: not a JSON object, skipped", path, number)
    return records


def _positive(value: Any) -> float | None:
    """`value` as a finite number > 0, else None (a string, a bool, null, 0, inf, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 < value < math.inf else None


def _first(record: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        value = _lookup(record, key)
        if value is not None:
            return value
    return None


def _lookup(record: Mapping[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """A training run as the model needs it: its config values and measured step times."""

    run_dir: Path
    config: dict[str, Any]
    """Normalised keys (see `CONFIG_KEYS`); missing ones are absent."""
    step_times_s: list[float]
    run_record: dict[str, Any]
    phase_times_s: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Per-step times of the phases the trainer logs (`forward_backward_s`, `optimizer_s`)."""
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The records read: those since the newest attempt's layout began (`read_train_run`), so that
    a report's statistics cover the steps the times above come from."""
    measured: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Of them, the train records past warm-up whose times are `step_times_s`."""

    @property
    def median_step_s(self) -> float:
        if not self.step_times_s:
            raise ValueError(f"{self.run_dir}: no training step times in metrics.jsonl")
        return statistics.median(self.step_times_s)

    def median_phase_s(self, name: str) -> float | None:
        times = self.phase_times_s.get(name)
        return statistics.median(times) if times and len(times) == len(self.step_times_s) else None


def read_train_run(run_dir: str | Path, warmup_steps: int = 2) -> TrainRun:
    """Read `metrics.jsonl` and the config of a run directory (see the module docstring). The
    first `warmup_steps` steps of every attempt (each `run` record starts one; a file without
    them: steps 1 .. warmup_steps) are warm-up, not measured: a resumed process is as cold as a
    new one (its allocator, oneDNN's kernels, compile)."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    records = read_jsonl(metrics)
    config = _normalise(read_config(run_dir))
    runs = [(i, r) for i, r in enumerate(records) if r.get("kind") == "run"]
    run = runs[-1][1] if runs else {}
    start = 0  # the steps since the newest attempt's layout began, which config.toml describes
    for i, earlier in reversed(runs):
        if _layout(earlier) != _layout(run):
            logger.info("%s: the run was resumed at another layout (%s, then %s); only the steps since "
                        "are read", metrics, _layout(earlier), _layout(run))
            break
        start = i
    tokens_per_step = run.get("tokens_per_step") or _tokens_per_step(config)
    times, measured, phases = [], [], {name: [] for name in PHASE_KEYS}
    skipped = 0
    first_step: int | None = 1  # the attempt's first step; None after a `run` record, until one
    for record in records[start:]:
        if record.get("kind") == "run":
            first_step = None
        if record.get("kind", "train") != "train":
            continue
        step_s, step = _step_time_s(record, tokens_per_step), record.get("step", warmup_steps + 1)
        if step_s is None or isinstance(step, bool) or not isinstance(step, int):
            skipped += 1
            continue
        first_step = step if first_step is None else first_step
        if step >= first_step + warmup_steps:
            times.append(step_s)
            measured.append(record)
            for name in PHASE_KEYS:
                if _positive(record.get(name)) is not None:
                    phases[name].append(float(record[name]))
    if skipped:
        logger.warning("%s: %d train records without an integer step and a finite step time > 0, "
                       "skipped", metrics, skipped)
    for key in ("world_size", "device", "dtype", "strategy", "tensor_parallel_degree",
                "context_parallel_degree", "sequence_parallel", "pipeline_parallel_degree",
                "pipeline_parallel_schedule", "pipeline_parallel_stages_per_rank"):
        if key in run and key not in config:
            config[key] = run[key]
    return TrainRun(run_dir, config, times, run, {k: v for k, v in phases.items() if v}, records[start:],
                    measured)


def threads_per_rank(run: Mapping[str, Any]) -> int | None:
    """The torch threads each rank of a run computed with, from its `run` record: its `num_threads`
    where it has one, else (records before it) the count the trainer's calibrated MFU peak names
    (its `peak_source`, "calibrated CPU, N threads, ..."), else 1 for several ranks (`slipstream
    train --nproc` starts them with torchrun, which sets OMP_NUM_THREADS=1 where it is unset),
    else None: one process ran torch's default for this machine."""
    threads = run.get("num_threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0:
        return threads
    found = _THREADS.search(str(run.get("peak_source", "")))
    if found:
        return int(found.group(1))
    world = run.get("world_size", 1)
    return 1 if isinstance(world, int) and not isinstance(world, bool) and world > 1 else None


_THREADS = re.compile(r"^calibrated .*, (\d+) threads, ")


def _layout(run: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a `run` record decides the parallel layout the model prices (records written
    before tensor, context or pipeline parallelism have no degree: 1, without sequence
    parallelism, one stage per rank of the trainer's default schedule, 1F1B)."""
    defaults = {"tensor_parallel_degree": 1, "context_parallel_degree": 1, "sequence_parallel": False,
                "pipeline_parallel_degree": 1, "pipeline_parallel_schedule": "1F1B",
                "pipeline_parallel_stages_per_rank": 1}
    return tuple(run.get(key, defaults.get(key)) for key in LAYOUT_KEYS)


def _step_time_s(record: Mapping[str, Any], tokens_per_step: float | None) -> float | None:
    """The record's step time, or its tokens/s turned into one; None where neither is a finite
    number > 0."""
    step_s = _first(record, STEP_TIME_KEYS)
    if step_s is not None:
        return _positive(step_s)
    tps = _positive(_first(record, TOKENS_PER_S_KEYS))
    return tokens_per_step / tps if tokens_per_step and tps else None


def _tokens_per_step(config: Mapping[str, Any]) -> float | None:
    batch, seq_len = _positive(config.get("global_batch_size")), _positive(config.get("seq_len"))
    return batch * seq_len if batch and seq_len else None


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config: config.toml, else config.json; {} when neither is there."""
    for name, parse in (("config.toml", tomllib.loads), ("config.json", json.loads)):
        path = run_dir / name
        if path.is_file():
            try:
                return parse(path.read_text())
            except (ValueError, tomllib.TOMLDecodeError) as e:
                logger.warning("%s: unreadable (%s), ignored", path, e)
    return {}


def _normalise(raw: Mapping[str, Any]) -> dict[str, Any]:
    config = {}
    for key, candidates in CONFIG_KEYS.items():
        value = _first(raw, candidates)
        if value is not None:
            config[key] = value
    return config


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """One measured engine step."""

    phase: str
    batch_size: int
    length: int
    """Prompt tokens per sequence (prefill) or cached context per sequence (decode)."""
    step_s: float


def read_engine_steps(records: Iterable[Mapping[str, Any]], max_batch_size: int | None = None,
                      max_positions: int | None = None) -> list[EngineStep]:
    """Engine step records (`kind: "engine_step"`); malformed ones (a phase other than prefill,
    decode or mixed, a batch size that is no integer >= 1, a prompt of no tokens, a step time that
    is no finite number > 0) and those beyond the bounds (as `read_engine_file`'s) are logged and
    skipped, and those of several shapes counted and skipped (see the module docstring)."""
    return _engine_steps(((f"record {i}", r) for i, r in enumerate(records, 1)), max_batch_size,
                         max_positions)


def read_engine_headers(path: Path) -> list[dict[str, Any]]:
    """The header records (`kind: "engine_config"`) of the JSON-lines file `path`, one per engine
    start that wrote to it, in order."""
    return [r for r in read_jsonl(path) if r.get("kind") == "engine_config"]


def engines_by(headers: Iterable[Mapping[str, Any]],
               value_of: Callable[[Mapping[str, Any]], Any]) -> dict[str, list[str]]:
    """The engines that wrote `headers`, grouped by `value_of(header)` (as a string; None, a header
    that does not say, is left out): {value: their `engine_id`s}, sorted by value. Several values
    mean the engines that appended to one file differ in it."""
    groups: dict[str, list[str]] = {}
    for header in headers:
        value = value_of(header)
        if value is not None:
            ids = groups.setdefault(str(value), [])
            if header.get("engine_id") is not None:
                ids.append(str(header["engine_id"]))
    return dict(sorted(groups.items()))


def read_engine_file(path: Path, max_batch_size: int | None = None,
                     max_positions: int | None = None) -> list[EngineStep]:
    """The engine steps of the JSON-lines file `path`, as `read_engine_steps` takes them, also
    skipping those of more than `max_batch_size` sequences or `max_positions` positions (a prompt,
    or a decode step's context and new token): each skipped record is logged with its file and
    line, where one such record would otherwise abort the whole fit or roofline."""
    return _engine_steps(((f"{path}:{number}", r) for number, r in _numbered_jsonl(path)),
                         max_batch_size, max_positions)


def _engine_steps(located: Iterable[tuple[str, Mapping[str, Any]]], max_batch_size: int | None = None,
                  max_positions: int | None = None) -> list[EngineStep]:
    """The engine steps among (where, record) pairs, each record skipped logged with its `where`
    but those of several shapes (`_is_unpriced`), which are only counted."""
    steps, num_unpriced = [], 0
    for where, r in located:
        if r.get("kind") != "engine_step":
            continue
        if _is_unpriced(r):
            num_unpriced += 1
            continue
        step = _engine_step(r)
        why = "malformed" if step is None else _out_of_range(step, max_batch_size, max_positions)
        if why:
            logger.warning("%s: engine_step record skipped (%s): %s", where, why, r)
            continue
        steps.append(step)
    if num_unpriced:
        logger.info("%d engine steps of several shapes skipped (phase mixed, or prefill chunks not all "
                    "from position 0 with one length): the model prices one shape per step", num_unpriced)
    return steps


def _is_unpriced(r: Mapping[str, Any]) -> bool:
    """Whether an engine step record says it was of no one shape: the engine writes such steps
    as phase "mixed", and prefill steps of several chunk shapes with `prompt_len` null."""
    return r.get("phase") == "mixed" or (r.get("phase") == "prefill" and "prompt_len" in r
                                         and r["prompt_len"] is None)


def _engine_step(r: Mapping[str, Any]) -> EngineStep | None:
    """The record as an EngineStep, or None when it is malformed (see `read_engine_steps`). A
    record of `num_forward_passes` decode steps run at once counts as one of them, taking its
    share of the time (its `context_len` is the mean over them)."""
    phase, batch_size, step_s = r.get("phase"), r.get("batch_size"), _positive(r.get("step_s"))
    length = r.get("prompt_len" if phase == "prefill" else "context_len")
    num_passes = r.get("num_forward_passes", 1)
    if (phase not in ("prefill", "decode") or not _is_int(batch_size, 1) or step_s is None
            or not _is_int(length, 1 if phase == "prefill" else 0) or not _is_int(num_passes, 1)
            or (phase == "prefill" and num_passes > 1)):
        return None
    return EngineStep(phase, batch_size, length, step_s / num_passes)


def _out_of_range(step: EngineStep, max_batch_size: int | None, max_positions: int | None) -> str | None:
    """Why `step` is beyond the bounds, or None."""
    if max_batch_size is not None and step.batch_size > max_batch_size:
        return f"batch_size {step.batch_size:,} above {max_batch_size:,}"
    positions = step.length + (step.phase == "decode")  # a decode step also holds its new token
    if max_positions is not None and positions > max_positions:
        return f"{positions:,} positions, more than the model's max_position_embeddings ({max_positions:,})"
    return None


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
