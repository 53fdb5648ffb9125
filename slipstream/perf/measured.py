"""Predicted against measured for slipstream's own runs, and calibration from them.

`records.py` reads the files; this module maps each measured step onto the model (an engine step
onto `serving.step_time`, a training run onto `model.predict_training`), fits the efficiency to
a set of them (`fit.calibrate`) and tabulates predicted against measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from slipstream.perf.accelerators import Accelerator
from slipstream.perf.efficiency import Efficiency, max_fraction
from slipstream.perf.fit import Calibration, calibrate
from slipstream.perf.model import Layout, TrainSetup, predict_training
from slipstream.perf.records import EngineStep, TrainRun
from slipstream.perf.serving import ServeSetup, check_positions, step_time
from slipstream.perf.shapes import TransformerShape, resolve_model
from slipstream.perf.work import Work

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

ZERO_STAGES = {"fsdp": 3, "ddp": 0, "single": 0}
"""The ZeRO stage of each of the trainer's `parallel.strategy` values (its run record says "single"
for one data-parallel replica: one rank, or one tensor-parallel group): FSDP2's `fully_shard`
shards parameters, gradients and optimizer state (ZeRO-3); DDP (`replicate`) all-reduces the
gradients in buckets during the backward and every rank keeps the whole optimizer state (ZeRO-0).
A config without one ran the trainer's default, fsdp."""

MULTI_STAGE_SCHEDULES = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                         "dualpipev")
"""torch's pipeline schedules of several stages per rank (`PipelineScheduleMulti`), lower-cased as
torch's `get_schedule_class` matches them: a run of one without a stages-per-rank count ran
torchtitan's default of 2 (its `pipeline_parallel_layers_per_stage` unset)."""


def engine_step_work(step: EngineStep, setup: ServeSetup, accelerator: Accelerator,
                     efficiency: Efficiency) -> Work:
    """The model's time for one measured engine step."""
    if step.phase == "prefill":
        return step_time(setup, accelerator, prefill_lens=[step.length] * step.batch_size,
                         efficiency=efficiency)
    return step_time(setup, accelerator, decode_contexts=[step.length] * step.batch_size,
                     efficiency=efficiency)


OVERLAPS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
"""`roofline_overlap` values `fit_engine_steps` tries."""
ATTENTION_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
"""`attention_fraction` values `fit_engine_steps` tries when prefills of two lengths are measured."""


def fit_engine_steps(
    steps: Sequence[EngineStep], setup: ServeSetup, accelerator: Accelerator, efficiency: Efficiency,
    components: Sequence[str] = ("gemm_s", "memory_s"), overlaps: Sequence[float] = OVERLAPS,
    attention_fractions: Sequence[float] | None = None,
) -> Calibration:
    """Fit `efficiency` to measured engine steps of one model.

    GEMM and memory multipliers by default, not overhead: one model's weight streaming and its
    fixed per-step costs are both constant in batch size, so its steps cannot tell them apart
    (a three-way fit trades one against the other and lands on nonsense), and overhead keeps its
    prior. The prefill steps pin GEMM, decode at batch 1 pins memory. `roofline_overlap` is chosen
    from `overlaps` as the value whose fit leaves the smallest RMS relative error: decode at
    batch 8-32 shows how much of a small-M GEMM's compute hides under its weight streaming. Pass
    `overlaps=(efficiency.roofline_overlap,)` to keep the prior's.

    `attention_fraction` is searched the same way over `attention_fractions` (default
    `ATTENTION_FRACTIONS` when the steps hold prefills of at least two prompt lengths, whose
    attention shares differ: quadratic against the linears' linear; otherwise the prior's). A CPU's
    fused attention runs far below its GEMM rate, so the GEMM multiplier alone cannot carry both.
    The fraction is the prior before the GEMM multiplier, which scales attention too.
    """
    if not steps:
        raise ValueError("no engine steps to fit")
    if not overlaps or any(not 0 <= o <= 1 for o in overlaps):
        raise ValueError(f"overlaps must be a non-empty sequence of values in [0, 1], got {overlaps!r}")
    if attention_fractions is None:
        prefill_lengths = {s.length for s in steps if s.phase == "prefill"}
        attention_fractions = (ATTENTION_FRACTIONS if len(prefill_lengths) > 1
                               else (efficiency.attention_fraction,))
    elif not attention_fractions or any(not 0 < a <= 1 for a in attention_fractions):
        raise ValueError(f"attention_fractions must be a non-empty sequence of values in (0, 1], "
                         f"got {attention_fractions!r}")
    measured_s = [s.step_s for s in steps]

    def predict(e: Efficiency) -> list[Work]:
        return [engine_step_work(s, setup, accelerator, e) for s in steps]

    def fit(overlap: float, attention: float) -> Calibration:
        prior = efficiency.replace(roofline_overlap=overlap, attention_fraction=attention)
        notes = {}
        for name, values in (("roofline_overlap", overlaps), ("attention_fraction", attention_fractions)):
            if len(values) > 1:
                notes[name] = f"chosen by fit_engine_steps from {list(values)} (smallest RMS error)"
        prior = prior.replace(sources=dict(prior.sources) | notes)
        return calibrate(predict, measured_s, prior, components, ceiling=max_fraction(accelerator))

    return min((fit(o, a) for o in overlaps for a in attention_fractions),
               key=lambda c: sum(e * e for e in c.errors_after))


def train_setup(run: TrainRun, shape: TransformerShape | None = None) -> tuple[TrainSetup, Layout]:
    """The model's description of a measured training run: world / (pipeline_parallel_degree x
    tensor_parallel_degree x context_parallel_degree) data-parallel replicas of each pipeline
    stage, each over tensor_parallel_degree x context_parallel_degree ranks, with sequence
    parallelism where the run had it (the trainer's default with TP), pipeline_parallel_degree
    stages of pipeline_parallel_stages_per_rank virtual stages each, in GPipe's schedule where its
    pipeline_parallel_schedule says so (`_pipeline`); FSDP or DDP as
    its strategy says (`ZERO_STAGES`), over the data-parallel and context-parallel ranks together
    as the trainer applies it (none where those are one rank); with pp > 1 DDP's all-reduce not
    overlapped (the trainer's `average_grads` runs after the schedule); ValueError naming the run
    directory and the config key for a value the model cannot take."""
    c = run.config
    missing = [k for k in ("seq_len", "global_batch_size") if k not in c]
    if missing or (shape is None and "preset" not in c and "model_path" not in c):
        raise ValueError(f"{run.run_dir}: the run's config lacks {missing or ['model preset or path']}")
    shape = shape or resolve_model(str(c.get("model_path") or c["preset"]))
    dtype = _DTYPES.get(str(c.get("dtype", "float32")), str(c.get("dtype", "fp32")))
    recompute = "full" if c.get("activation_checkpointing") in (True, "full") else "none"
    try:
        world, batch = _config_int(c, "world_size", 1), _config_int(c, "global_batch_size")
        tp = _config_int(c, "tensor_parallel_degree", 1)
        cp = _config_int(c, "context_parallel_degree", 1)
        pp, v, gpipe, pipeline_micro_batch = _pipeline(c)
        if world % (tp * cp):
            raise ValueError(f"the run's tensor_parallel_degree x context_parallel_degree ({tp} x {cp}) "
                             f"does not divide its world size ({world})")
        if world // (tp * cp) % pp:
            raise ValueError(f"the run's pipeline_parallel_degree ({pp}) does not divide its world size / "
                             f"(tensor_parallel_degree x context_parallel_degree) ({world} / {tp * cp})")
        dp = world // (pp * tp * cp)
        strategy = c.get("strategy", "fsdp")
        if strategy not in ZERO_STAGES:
            raise ValueError(f"the run's parallel strategy is {strategy!r}; known: {', '.join(ZERO_STAGES)}")
        micro_batch = pipeline_micro_batch or _config_int(c, "micro_batch_size", batch)
        setup = TrainSetup(shape=shape, global_batch_size=batch, seq_len=_config_int(c, "seq_len"),
                           micro_batch_size=micro_batch, dtype=dtype, recompute=recompute,
                           weight_bytes=4, grad_bytes=4, optimizer_bytes=8, reserved_bytes=0,
                           dp_overlap=pp == 1)
        check_positions(shape, "the run's seq_len", setup.seq_len)
        sequence_parallel = tp > 1 and c.get("sequence_parallel", True) is not False
        return setup, Layout(dp=dp, tp=tp, cp=cp, pp=pp, virtual_stages=v, gpipe=gpipe,
                             sequence_parallel=sequence_parallel,
                             zero_stage=ZERO_STAGES[strategy] if dp * cp > 1 else 0)
    except ValueError as e:
        raise ValueError(f"{run.run_dir}: {e}") from None


def _pipeline(config: dict[str, Any]) -> tuple[int, int, bool, int | None]:
    """(stages, virtual stages per rank, whether GPipe's schedule ran, micro-batch size or None)
    of the run's pipeline. The virtual stages: `pipeline_parallel_stages_per_rank`, else 2 for a
    schedule of several stages per rank (`MULTI_STAGE_SCHEDULES`), else 1; 1 without pipeline
    parallelism, whatever the keys say. The micro-batch: torchtitan's
    `parallelism.pipeline_parallel_microbatch_size`, which splits each rank's local batch into
    the schedule's micro-batches; None where not given."""
    pp = _config_int(config, "pipeline_parallel_degree", 1)
    if pp == 1:
        return 1, 1, False, None
    schedule = str(config.get("pipeline_parallel_schedule", "1F1B")).lower()
    multi = schedule in MULTI_STAGE_SCHEDULES
    v = _config_int(config, "pipeline_parallel_stages_per_rank", 2 if multi else 1)
    micro_batch = config.get("pipeline_parallel_microbatch_size")
    return (pp, v, schedule == "gpipe",
            None if micro_batch is None else _config_int(config, "pipeline_parallel_microbatch_size"))


def _config_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """The run's config value `key` as an integer >= 1 (`default` when absent)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the run's {key} must be an integer >= 1, got {value!r}")
    return value


def train_run_work(run: TrainRun, accelerator: Accelerator, efficiency: Efficiency,
                   shape: TransformerShape | None = None) -> Work:
    """The model's time for one optimizer step of the run."""
    setup, layout = train_setup(run, shape)
    return predict_training(setup, layout, accelerator, efficiency).work


def _measurements(run: TrainRun) -> list[tuple[str, float]]:
    """What one run measured: its forward+backward and optimizer phases when the trainer logged
    them (two numbers, so one run can fit two multipliers), else the whole step."""
    forward_backward, optimizer = run.median_phase_s("forward_backward_s"), run.median_phase_s("optimizer_s")
    if forward_backward and optimizer:
        return [("forward_backward", forward_backward), ("optimizer", optimizer)]
    return [("step", run.median_step_s)]


def _phase_work(run: TrainRun, phase: str, accelerator: Accelerator, efficiency: Efficiency) -> Work:
    """The predicted work of one measured phase: the trainer's `optimizer_s` (with the gradient
    norm), its `forward_backward_s` (with the gradient reductions after a pipeline schedule), or
    the whole step (every part, the logged loss's all-reduce too)."""
    setup, layout = train_setup(run)
    prediction = predict_training(setup, layout, accelerator, efficiency)
    parts = prediction.parts
    if phase == "optimizer":
        return parts["optimizer"]
    if phase == "forward_backward":
        return parts["pipeline"] + parts["bubble"] + parts["data_parallel"] + parts["embedding_sync"]
    return prediction.work


def fit_train_runs(
    runs: Sequence[TrainRun], accelerator: Accelerator, efficiency: Efficiency,
    components: Sequence[str] | None = None,
) -> Calibration:
    """Fit to the measured phases of each run (see `_measurements`): as many multipliers as
    measurements allow, GEMM first, then memory, then overhead."""
    if not runs:
        raise ValueError("no training runs to fit")
    points = [(run, phase, t) for run in runs for phase, t in _measurements(run)]
    chosen = components or ("gemm_s", "memory_s", "overhead_s")[:min(len(points), 3)]

    def predict(e: Efficiency) -> list[Work]:
        return [_phase_work(run, phase, accelerator, e) for run, phase, _ in points]

    return calibrate(predict, [t for _, _, t in points], efficiency, chosen,
                     ceiling=max_fraction(accelerator))


@dataclasses.dataclass(frozen=True)
class Comparison:
    label: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"error": self.error}


def format_comparisons(rows: Sequence[Comparison]) -> str:
    lines = [f"{'step':<36} {'measured ms':>12} {'predicted ms':>13} {'error':>9}"]
    for r in rows:
        lines.append(f"{r.label:<36} {1e3 * r.measured_s:>12.3f} {1e3 * r.predicted_s:>13.3f} "
                     f"{100 * r.error:>+8.1f}%")
    if rows:
        errors = [abs(r.error) for r in rows]
        lines.append(f"mean |error| {100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}%")
    return "\n".join(lines)
