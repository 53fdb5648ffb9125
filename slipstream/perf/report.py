"""A run's report: where its time went and how it compares with the performance model.

`load_run` reads a training run directory or a serving metrics directory (or its metrics.jsonl)
and tells which it is from the records' kinds; `train_report` and `serve_report` reduce the
records to a JSON-ready summary, measured against `model.predict_training` or `serving.step_time`
on the given accelerator; `report_html.render` draws it as one self-contained HTML file and
`format_text` as a few lines for the terminal.

Percentiles are numpy's (linear between the two nearest ranks), so p50 is the median. Training
statistics cover the records `records.read_train_run` reads (those of the newest attempt's
layout, in a run resumed at another one) less the warm-up steps it drops (the first two of each
attempt: compilation, allocator growth), which the prediction is compared against too. A serving run's
header is read as `perf fit` reads it (`commands._with_engine_headers`)."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.perf import measured
from slipstream.perf.accelerators import Accelerator
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.model import predict_training
from slipstream.perf.records import METRICS_FILE, EngineStep, read_jsonl, read_train_run
from slipstream.perf.serving import ServeSetup
from slipstream.perf.shapes import resolve_model

REPORT_FILE = "report.html"
TRAIN_KINDS = ("run", "train")
SERVE_KINDS = ("engine_config", "engine_step", "request")
WARMUP_STEPS = 2
"""Training steps left out of the statistics: `read_train_run`'s default."""
LATENCIES = {"ttft": "time_to_first_token_seconds", "tpot": "request_time_per_output_token_seconds",
             "e2e": "e2e_request_latency_seconds", "queue": "request_queue_time_seconds"}
"""The request intervals summarised, by short name (vLLM's record names, docs/engine.md)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's records and which runtime wrote them."""

    kind: str
    """"train" or "serve"."""
    metrics_path: Path
    records: list[dict[str, Any]]

    @property
    def directory(self) -> Path:
        return self.metrics_path.parent

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]


def load_run(path: str | Path) -> Run:
    """The records of a training run directory, a serving metrics directory or a metrics file;
    ValueError for a path that holds no such records, or records of both runtimes."""
    path = Path(path)
    metrics = path / METRICS_FILE if path.is_dir() else path
    if not metrics.is_file():
        raise ValueError(f"RUN {path}: no {METRICS_FILE} there (expected a training run directory, a "
                         "serving --metrics-dir, or its metrics.jsonl)")
    records = read_jsonl(metrics)
    kinds = collections.Counter(r.get("kind") for r in records)
    train, serve = sum(kinds[k] for k in TRAIN_KINDS), sum(kinds[k] for k in SERVE_KINDS)
    if train and serve:
        raise ValueError(f"RUN {path}: {metrics.name} mixes {train} training records (kind run, train) "
                         f"with {serve} serving records (kind engine_config, engine_step, request); "
                         "a report covers one run")
    if not train and not serve:
        raise ValueError(f"RUN {path}: {metrics.name} holds no training records (kind run, train) nor "
                         f"serving records (kind engine_config, engine_step, request)")
    return Run("train" if train else "serve", metrics, records)


def run_hardware(run: Run) -> str:
    """The --hardware a training run ran on, from its newest `run` record: "cpu" (the calibrated
    CPU) for a CPU run; ValueError where it ran elsewhere, whose datasheet the records do not name.
    (A serving run's is its engine header's, read as `perf fit` reads it.)"""
    device = str((run.of_kind("run") or [{}])[-1].get("device", ""))
    if device.startswith("cpu"):
        return "cpu"
    raise ValueError(f"RUN {run.metrics_path}: the records do not name the hardware the run ran on "
                     f"(device {device or 'unknown'}); give --hardware (a100, h100, h200, b200, ..., cpu)")


def engine_header(run: Run) -> dict[str, Any]:
    """The serving engine's newest header record; ValueError where there is none."""
    headers = run.of_kind("engine_config")
    if not headers:
        raise ValueError(f"RUN {run.metrics_path}: no engine_config record (the engine writes one first), "
                         "so the served model and dtype are unknown")
    return headers[-1]


def spread(values: Sequence[float], qs: Sequence[int] = (10, 50, 90)) -> dict[str, float] | None:
    """{"p10": .., "p50": .., ...} of `values` (numpy's percentiles, linear between ranks, as
    `slipstream bench serve` takes them), with their count; None for no values."""
    if not values:
        return None
    points = np.percentile(values, qs)
    return {f"p{q}": float(p) for q, p in zip(qs, points, strict=True)} | {"count": len(values)}


def _number(value: Any) -> float | None:
    """`value` as a finite float, else None (null, a string, a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _error(predicted: float, measured_value: float) -> float:
    """The prediction's relative error, as `measured.Comparison` takes it."""
    return predicted / measured_value - 1


# ---- training ---------------------------------------------------------------------------------


def train_report(run: Run, accelerator: Accelerator, efficiency: Efficiency, efficiency_source: str,
                 model: str | None = None) -> dict[str, Any]:
    """The training run's config, step statistics, goodput and predicted against measured step
    time and MFU. `model` (a preset or config.json) replaces the run's where that is gone."""
    if run.metrics_path.name != METRICS_FILE:  # its config and ledger are found beside metrics.jsonl
        raise ValueError(f"RUN {run.metrics_path}: a training run is read from its directory (metrics.jsonl, "
                         "config.toml, goodput.jsonl); give the directory")
    train_run = read_train_run(run.directory, WARMUP_STEPS)
    # The newest attempt's layout's records only: those the prediction's layout and times describe.
    steps = _train_steps(train_run.records)
    if not train_run.step_times_s:
        raise ValueError(f"RUN {run.metrics_path}: no training step past the {WARMUP_STEPS} warm-up steps "
                         f"with a step time ({len(steps)} train records); the report needs at least one")
    later = train_run.measured
    losses = [(r["step"], v) for r in steps if (v := _number(r.get("loss"))) is not None]
    model_dir = train_run.config.get("model_path")
    if model is None and model_dir is not None and not (Path(str(model_dir)) / "config.json").is_file():
        raise ValueError(f"RUN {run.metrics_path}: the run's model directory {model_dir} has no config.json "
                         "(any more); give --model (a preset or a config.json)")
    shape = resolve_model(model) if model else None
    return {
        "kind": "train", "run": str(run.directory), "config": _train_config(train_run),
        "steps": {"num_records": len(steps), "num_measured": len(train_run.step_times_s),
                  "num_earlier_layout": len(_train_steps(run.records)) - len(steps),
                  "warmup_steps": WARMUP_STEPS, "step_s": spread(train_run.step_times_s),
                  "tokens_per_s": spread(_values(later, "tokens_per_s")),
                  "mfu_logged": spread(_values(later, "mfu")),
                  "loss_first": losses[0][1] if losses else None,
                  "loss_last": losses[-1][1] if losses else None},
        "goodput": _goodput(run.directory),
        "prediction": _train_prediction(train_run, accelerator, efficiency, efficiency_source, shape),
        "series": {"step": [r["step"] for r in steps], "loss": [_number(r.get("loss")) for r in steps],
                   "step_s": [_number(r.get("step_s")) for r in steps],
                   "tokens_per_s": [_number(r.get("tokens_per_s")) for r in steps]},
    }


def _train_steps(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("kind") == "train" and isinstance(r.get("step"), int)]


def _values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [v for r in records if (v := _number(r.get(key))) is not None]


def _train_config(train_run) -> dict[str, Any]:
    c, r = train_run.config, train_run.run_record
    return {"model": r.get("model") or c.get("model_path") or c.get("preset"),
            "num_params": r.get("num_params"),
            "device": r.get("device"), "world_size": r.get("world_size", c.get("world_size", 1)),
            "strategy": r.get("strategy", c.get("strategy")),
            "tensor_parallel_degree": r.get("tensor_parallel_degree", 1),
            "context_parallel_degree": r.get("context_parallel_degree", 1),
            "sequence_parallel": r.get("sequence_parallel", False), "dtype": r.get("dtype", c.get("dtype")),
            "global_batch_size": c.get("global_batch_size"), "micro_batch_size": c.get("micro_batch_size"),
            "seq_len": c.get("seq_len"), "activation_checkpointing": c.get("activation_checkpointing"),
            "peak_source": r.get("peak_source")}


def _goodput(run_dir: Path) -> dict[str, Any]:
    """The goodput ledger's summary (`perf.goodput.summarize`: one definition of the buckets), or
    why there is none."""
    from slipstream.perf.goodput import LEDGER_FILE, read_ledger, summarize

    if not (run_dir / LEDGER_FILE).is_file():
        return {"missing": f"no {LEDGER_FILE} in the run directory"}
    events, skipped = read_ledger(run_dir)
    try:
        return summarize(events, skipped_lines=skipped)
    except ValueError as e:  # launched, but no attempt started training
        return {"missing": f"{LEDGER_FILE}: {e}"}


def _train_prediction(train_run, accelerator: Accelerator, efficiency: Efficiency, source: str,
                      shape) -> dict[str, Any]:
    """The model's step time and MFU for the run's setup, against the measured median. Measured
    MFU takes the model's FLOPs and peak, so the two differ only by the step time."""
    setup, layout = measured.train_setup(train_run, shape)
    prediction = predict_training(setup, layout, accelerator, efficiency)
    measured_s = train_run.median_step_s
    peak = accelerator.peak_flops(setup.dtype) * layout.num_devices
    measured_mfu = prediction.model_flops_per_step / measured_s / peak
    return {"hardware": accelerator.name, "efficiency": source, "model": setup.shape.name,
            "layout": layout.describe(), "dtype": setup.dtype, "bound": prediction.work.bound(),
            "step_s": {"measured": measured_s, "predicted": prediction.step_time_s,
                       "error": _error(prediction.step_time_s, measured_s)},
            "mfu": {"measured": measured_mfu, "predicted": prediction.mfu,
                    "error": _error(prediction.mfu, measured_mfu)},
            "breakdown_s": prediction.breakdown_s}


# ---- serving ----------------------------------------------------------------------------------


def serve_report(run: Run, setup: ServeSetup, steps: Sequence[EngineStep], accelerator: Accelerator,
                 efficiency: Efficiency, efficiency_source: str) -> dict[str, Any]:
    """The engine's config, its priced `steps` (read once, as `perf fit` reads them) by phase and
    batch size against the model, the requests' latencies and outcomes, and the series the charts
    draw."""
    header = engine_header(run)
    step_records = run.of_kind("engine_step")
    requests = run.of_kind("request")
    if not step_records and not requests:
        raise ValueError(f"RUN {run.metrics_path}: an engine_config record but no engine_step or request "
                         "records: the engine ran no step")
    groups = step_groups(steps, setup, accelerator, efficiency)
    queries = sum(_values(step_records, "prefix_cache_queries"))
    kv_usage = [(t, u) for r in step_records if (t := _number(r.get("time"))) is not None
                and (u := _number(r.get("kv_cache_usage_perc"))) is not None]
    start = min((t for t, _ in kv_usage), default=0.0)
    hits = sum(_values(step_records, "prefix_cache_hits"))
    reasons = collections.Counter(str(r.get("finished_reason")) for r in requests)
    return {
        "kind": "serve", "run": str(run.directory),
        "config": {k: v for k, v in header.items() if k != "kind"},
        "prediction": {"hardware": accelerator.name, "efficiency": efficiency_source,
                       "model": setup.shape.name, "dtype": setup.dtype,
                       "decode_graph_max_batch": setup.decode_graph_max_batch},
        "steps": {"num_records": len(step_records),
                  "num_unpriced": len(step_records) - sum(g["count"] for g in groups),
                  "groups": groups, "utilization": _utilization(step_records)},
        "requests": {"count": len(requests),
                     "finished_reason": dict(reasons),
                     "latency_s": {name: spread(_values(requests, key), (50, 90, 99))
                                   for name, key in LATENCIES.items()},
                     "prompt_tokens": sum(_values(requests, "request_prompt_tokens")),
                     "generation_tokens": sum(_values(requests, "request_generation_tokens"))},
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "num_preemptions": int(sum(_values(step_records, "num_preemptions"))),
        "series": {"ttft_s": _values(requests, LATENCIES["ttft"]),
                   "tpot_s": _values(requests, LATENCIES["tpot"]),
                   "kv_time_s": [t - start for t, _ in kv_usage], "kv_usage": [u for _, u in kv_usage],
                   "steps": [[s.phase, s.batch_size, s.step_s] for s in steps]},
    }


def step_groups(steps: Sequence[EngineStep], setup: ServeSetup, accelerator: Accelerator,
                efficiency: Efficiency) -> list[dict[str, Any]]:
    """The priced steps by (phase, batch size): their median time per forward pass, against the
    model's time for that batch at the group's median length (prompt or cached context)."""
    by_shape: dict[tuple[str, int], list[EngineStep]] = collections.defaultdict(list)
    for step in steps:
        by_shape[step.phase, step.batch_size].append(step)
    groups = []
    for (phase, batch_size), members in sorted(by_shape.items()):
        length = round(statistics.median(s.length for s in members))
        measured_s = statistics.median(s.step_s for s in members)
        work = measured.engine_step_work(EngineStep(phase, batch_size, length, measured_s), setup,
                                         accelerator, efficiency)
        groups.append({"phase": phase, "batch_size": batch_size, "count": len(members), "length": length,
                       "measured_s": measured_s, "predicted_s": work.total_s,
                       "error": _error(work.total_s, measured_s), "bound": work.bound()})
    return groups


def _utilization(step_records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median MFU and bandwidth use per phase, as the engine's records give them (against its
    header's peaks; null there without a calibration)."""
    phases = sorted({str(r.get("phase")) for r in step_records})
    return {phase: {key: statistics.median(values) if (values := _values(
                [r for r in step_records if str(r.get("phase")) == phase], key)) else None
                    for key in ("mfu", "mbu")} for phase in phases}


# ---- text -------------------------------------------------------------------------------------


def format_text(summary: Mapping[str, Any]) -> str:
    """A few lines for the terminal: what ran and how it compares with the model."""
    if summary["kind"] == "train":
        return _train_text(summary)
    return _serve_text(summary)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3g} ms"


def _train_text(s: Mapping[str, Any]) -> str:
    c, steps, p = s["config"], s["steps"], s["prediction"]
    step_s, tps = steps["step_s"], steps["tokens_per_s"]
    lines = [f"training run {s['run']}: {c['model']}, {c['world_size']} x {c['device']}, {c['dtype']}, "
             f"batch {c['global_batch_size']} x {c['seq_len']} tokens",
             f"{steps['num_records']} steps ({steps['num_measured']} past warm-up): "
             f"step {_ms(step_s['p50'])} median (p10 {_ms(step_s['p10'])}, p90 {_ms(step_s['p90'])})"
             + (f", {tps['p50']:,.0f} tokens/s" if tps else "")
             + (f"; {steps['num_earlier_layout']} records of earlier attempts at another layout left out"
                if steps["num_earlier_layout"] else "")]
    if steps["loss_first"] is not None:
        lines.append(f"loss {steps['loss_first']:.4g} -> {steps['loss_last']:.4g}")
    g = s["goodput"]
    if "missing" in g:
        lines.append(f"goodput: {g['missing']}")
    else:
        losses = sorted(((k, v) for k, v in g["seconds"].items() if k != "productive" and v > 0),
                        key=lambda kv: -kv[1])[:3]
        lines.append(f"goodput {100 * g['goodput']:.1f}% of {g['total_s']:.2f} s; largest losses: "
                     + (", ".join(f"{k} {100 * v / g['total_s']:.1f}%" for k, v in losses) or "none"))
    lines.append(f"predicted on {p['hardware']} ({p['layout']}): step {_ms(p['step_s']['predicted'])} "
                 f"({100 * p['step_s']['error']:+.1f}% against measured), "
                 f"MFU {100 * p['mfu']['predicted']:.1f}% "
                 f"(measured {100 * p['mfu']['measured']:.1f}%), bound by {p['bound']}")
    return "\n".join(lines)


def _serve_text(s: Mapping[str, Any]) -> str:
    c, steps, req = s["config"], s["steps"], s["requests"]
    lines = [f"serving run {s['run']}: {c.get('model')}, {c.get('dtype')} on {c.get('device')}, "
             f"{steps['num_records']} engine steps, {req['count']} requests "
             f"({', '.join(f'{k} {v}' for k, v in sorted(req['finished_reason'].items())) or 'none'})"]
    for name in ("ttft", "tpot", "e2e"):
        latency = req["latency_s"][name]
        if latency:
            lines.append(f"{name:<5} p50 {_ms(latency['p50'])}, p90 {_ms(latency['p90'])}, "
                         f"p99 {_ms(latency['p99'])}")
    hit = s["prefix_cache_hit_rate"]
    lines.append(f"prefix cache hit rate {'-' if hit is None else f'{100 * hit:.1f}%'}, "
                 f"{s['num_preemptions']} preemptions")
    lines.append(f"{'phase':<8}{'batch':>6}{'steps':>7}{'measured ms':>13}{'predicted ms':>14}{'error':>9}")
    for g in steps["groups"]:
        lines.append(f"{g['phase']:<8}{g['batch_size']:>6}{g['count']:>7}{1e3 * g['measured_s']:>13.3f}"
                     f"{1e3 * g['predicted_s']:>14.3f}{100 * g['error']:>+8.1f}%")
    if steps["num_unpriced"]:
        lines.append(f"{steps['num_unpriced']} step(s) of several shapes (mixed), malformed or out of range, "
                     "not priced")
    lines.append(f"predicted on {s['prediction']['hardware']}; efficiency {s['prediction']['efficiency']}")
    return "\n".join(lines)
