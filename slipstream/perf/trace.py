"""Where a profiled run's time went, from its PyTorch profiler traces (one file per rank).

Steps are the `ProfilerStep#N` annotations that `torch.profiler.profile(schedule=...)` writes at
each `prof.step()` (slipstream's trainer steps its profiler once per training step; its engine
marks each engine step with an annotation of that name). For each rank the report gives:

- **Host (CPU) time by op.** Each host event's *self* time (CPU ops, annotations, Python frames,
  runtime calls): its duration less that of the events nested in it on the same thread, as the
  profiler's `key_averages()` counts it. A step's own self time is the host time between them.
- **Annotations.** The `record_function` ranges (the engine's step phases; torch's own, such as
  the optimizer's step) with their inclusive time.
- **GPU time by kernel class**, when the trace has device events, with Holistic Trace
  Analysis's classes: communication (NCCL/RCCL kernels), memory (memcpy, memset) and compute
  (every other kernel). Per step, TraceLens's identity splits the span from the step's first
  kernel to its last so that the parts sum to it: compute (the union of compute kernels over
  all streams) + exposed communication (communication not under compute) + exposed memory
  (copies under neither) + idle (no kernel at all). HTA's communication/compute overlap is the
  share of communication time during which a compute kernel runs, and its idle-time breakdown
  splits each stream's gaps into host, kernel and other waits; its launch statistics give each
  kernel's launch delay and count the kernels that ran shorter than their launch call and the
  outliers. Kernels belong to the step
  whose host code launched them (the runtime call with the same `correlation`), so a step's
  kernels that run after its host part has ended still count to it.
- **Memory** (`profile_memory=True`) and **ops against the roofline** (`record_shapes=True`), when
  the trace has them: `trace_memory` and `trace_roofline` say how.
- **The critical path** of one step, when asked (HTA's critical path analysis): `trace_critical`
  says how.

Sources: HTA `hta/analyzers/breakdown_analysis.py` and `docs/source/features/` (temporal and
kernel breakdown, comm-comp overlap); TraceLens `TraceLens/TreePerf/gpu_event_analyser.py`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slipstream.perf import trace_critical
from slipstream.perf.hardware import get_accelerator, is_local
from slipstream.perf.kineto import Event, Trace, read_trace
from slipstream.perf.trace_critical import SLOWEST, missing_step
from slipstream.perf.trace_gpu import (
    KERNEL_CATEGORIES,
    gpu_breakdown,
    kernel_class,
    launch_calls,
    launch_stats,
)
from slipstream.perf.trace_memory import memory_timeline
from slipstream.perf.trace_roofline import against, op_roofline
from slipstream.perf.trace_tree import HOST_CATEGORIES, Step, by_thread, parents, profiler_steps, step_at
from slipstream.perf.trace_tree import STEP_NAME as _STEP

TRACE_SUFFIXES = (".json", ".json.gz")


@dataclasses.dataclass
class OpTime:
    calls: int = 0
    total_us: float = 0.0
    self_us: float = 0.0


def host_op_times(events: Sequence[Event]) -> dict[tuple[str, str], OpTime]:
    """Calls, inclusive and self time per (category, name) of host event (HOST_CATEGORIES: ops,
    annotations, Python frames, runtime calls), over every thread, counted as the profiler's
    `key_averages()` counts them.

    On each thread one pass over the spans sorted by start, longest first, with a stack of open
    spans finds each span's parent (`trace_tree.parents`); a child's time leaves its parent's self time.
    An op whose only child has its own name (a redispatch: `aten::sum` calling `aten::sum`) is
    one call, as the profiler's event tree merges them.
    """
    times: dict[tuple[str, str], OpTime] = defaultdict(OpTime)
    for thread_events in by_thread(events, HOST_CATEGORIES).values():
        parent_of = parents(thread_events)
        num_children = Counter(p for p in parent_of if p is not None)
        for i, e in enumerate(thread_events):
            op = times[(e.cat, e.name)]
            op.self_us += e.dur_us
            parent = parent_of[i]
            if parent is not None:
                p = thread_events[parent]
                times[(p.cat, p.name)].self_us -= e.dur_us
                if p.name == e.name and p.cat == e.cat and num_children[parent] == 1:
                    continue
            op.calls += 1
            op.total_us += e.dur_us
    return dict(times)


def kernels_by_step(events: Sequence[Event], steps: Sequence[Step],
                    launch_us: dict[int, float]) -> dict[int, list[Event]]:
    """Each device event, under the step whose host code launched it, as HTA assigns them: the
    launch is the runtime call with the kernel's `correlation`. A kernel without one in the trace
    goes by its own start time (HTA drops it); kernels of no step are left out.
    """
    out: dict[int, list[Event]] = defaultdict(list)
    starts = [s.start_us for s in steps]
    for k in events:
        if k.cat in KERNEL_CATEGORIES:
            step = step_at(steps, starts, launch_us.get(k.correlation, k.start_us))
            if step is not None:
                out[step.number].append(k)
    return out


def _launched_within(kernels: Sequence[Event], launch_us: dict[int, float], start_us: float,
                     end_us: float) -> list[Event]:
    """The kernels whose launch call (or, without one in the trace, whose start) is in [start, end)."""
    return [k for k in kernels if start_us <= launch_us.get(k.correlation, k.start_us) < end_us]


def analyze_rank(trace: Trace, critical_step: int | None = None) -> dict[str, Any]:
    """One rank's report: its steps (with the GPU split of each), host time by op, annotations,
    kernels (every row, largest first), the GPU split over all steps and, given `critical_step`,
    the critical path of that step (`_critical_path_record`)."""
    steps = profiler_steps(trace.events)
    ops = host_op_times(trace.events)
    device_events = [e for e in trace.events if e.cat in KERNEL_CATEGORIES]
    calls = launch_calls(trace.events)
    launch_us = {correlation: call.start_us for correlation, call in calls.items()}
    per_step = kernels_by_step(device_events, steps, launch_us) if steps else {}
    step_reports = [{
        "step": s.number,
        "duration_us": s.end_us - s.start_us,
        "host_outside_ops_us": ops[("user_annotation", s.name)].self_us,
        "gpu": gpu_breakdown(per_step.get(s.number, []), launch_us) or None,
    } for s in steps]
    # Over the steps' window, as HTA's whole-trace numbers: kernels launched between steps count,
    # and the gaps between steps are idle too.
    step_kernels = _launched_within(device_events, launch_us, steps[0].start_us, steps[-1].end_us) \
        if steps else device_events
    return {
        "file": str(trace.path),
        "rank": trace.rank,
        "devices": trace.device_names,
        "skipped_events": trace.skipped_events,
        "steps": step_reports,
        "step_time_us": statistics.median(r["duration_us"] for r in step_reports) if steps else None,
        "host": _host_table(ops),
        "annotations": _annotation_table(ops, sum(r["duration_us"] for r in step_reports)),
        "gpu": gpu_breakdown(step_kernels, launch_us) or None,
        "launches": launch_stats(step_kernels, calls) or None,
        "kernels": _kernel_table(step_kernels),
        "memory": memory_timeline(trace.memory_events, by_thread(trace.events, HOST_CATEGORIES), steps),
        "skipped_memory_events": trace.skipped_memory_events,
        "roofline": op_roofline(trace.events),
        "critical_path": None if critical_step is None else _critical_path_record(trace, critical_step),
    }


def _host_table(ops: dict[tuple[str, str], OpTime]) -> list[dict[str, Any]]:
    """Host self time by op, largest first; the steps' own self time is one row, "between ops"."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for (cat, name), t in ops.items():
        if cat == "user_annotation" and _STEP.match(name):
            cat, name = "step", "(between ops, in profiler steps)"
        row = rows.setdefault((cat, name), {"name": name, "kind": cat, "calls": 0, "total_us": 0.0,
                                            "self_us": 0.0})
        row["calls"] += t.calls
        row["total_us"] += t.total_us
        row["self_us"] += t.self_us
    all_self_us = sum(r["self_us"] for r in rows.values())
    for row in rows.values():
        row["share"] = row["self_us"] / all_self_us if all_self_us > 0 else None
    return sorted(rows.values(), key=lambda r: -r["self_us"])


def _annotation_table(ops: dict[tuple[str, str], OpTime], step_us: float) -> list[dict[str, Any]]:
    """`record_function` ranges (not the steps) by inclusive time, as a share of step time."""
    rows = [{"name": name, "calls": t.calls, "total_us": t.total_us,
             "share_of_steps": t.total_us / step_us if step_us > 0 else None}
            for (cat, name), t in ops.items() if cat == "user_annotation" and not _STEP.match(name)]
    return sorted(rows, key=lambda r: -r["total_us"])


def _kernel_table(kernels: Sequence[Event]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for k in kernels:
        row = rows.setdefault(k.name, {"name": k.name, "class": kernel_class(k), "calls": 0, "total_us": 0.0})
        row["calls"] += 1
        row["total_us"] += k.dur_us
    all_us = sum(r["total_us"] for r in rows.values())
    for row in rows.values():
        row["share"] = row["total_us"] / all_us if all_us > 0 else None
    return sorted(rows.values(), key=lambda r: -r["total_us"])


def trace_files(paths: Sequence[str]) -> list[Path]:
    """The trace files named, a folder standing for the traces in it (one per rank, as HTA takes
    them)."""
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise ValueError(f"{path}: no trace files ({', '.join(TRACE_SUFFIXES)}) in this folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such trace file or folder")
    return files


def analyze(paths: Sequence[str], top: int = 10, baseline: Sequence[str] = (),
            hardware: str | None = None, critical_path: int | str | None = None) -> dict[str, Any]:
    """The report of every rank's trace, ordered by rank, how far the ranks' steps spread and,
    given `baseline` traces, what changed per step against them; `top` rows in each table. The
    ops' roofline is on `hardware` (`_roofline_hardware` says which without it). Given
    `critical_path`, a step number or SLOWEST, each rank's critical path of that step
    (`trace_critical`): SLOWEST is the step whose slowest rank took longest, so that every rank's
    path is of the same step (in a synchronous run, the one every rank waited for)."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if critical_path is not None and critical_path != SLOWEST and (
            isinstance(critical_path, bool) or not isinstance(critical_path, int) or critical_path < 0):
        raise ValueError(f"critical_path must be a step number (>= 0) or {SLOWEST!r}, got {critical_path!r}")
    if hardware is not None and not is_local(hardware):
        get_accelerator(hardware)  # an unknown name is an error before any trace is read
    ranks = _analyze_files(trace_files(paths), critical_path)
    accelerators: dict[str, Any] = {}
    for rank in ranks:
        if rank["roofline"]:
            against(rank["roofline"], _roofline_hardware(hardware, rank, accelerators))
    report = {"ranks": ranks, "spread": _spread(ranks), "comparison": None}
    if baseline:
        baseline_files = trace_files(baseline)
        report["comparison"] = compare(ranks, _analyze_files(baseline_files), top)
        report["comparison"]["baseline"] = [str(p) for p in baseline_files]
    for rank in ranks:
        for table in ("host", "annotations", "kernels"):
            del rank[table][top:]
        if rank["critical_path"] and "top" in rank["critical_path"]:
            del rank["critical_path"]["top"][top:]
        for device in rank["memory"]:
            del device["ops"][top:]
        if rank["roofline"]:
            del rank["roofline"]["ops"][top:]
            del rank["roofline"]["unpriced"][top:]
    return report


def _roofline_hardware(hardware: str | None, rank: dict[str, Any], cache: dict[str, Any]) -> Any:
    """The accelerator a rank's ops are priced on: `hardware`; without it, for a trace of a GPU
    the table's entry for its name (None, said in the report, where the table lacks it), for a
    CPU trace this CPU as `slipstream perf calibrate` measures it (as the other perf commands)."""
    name = hardware or (rank["devices"][0] if rank["devices"] else "cpu")
    if name not in cache:
        try:
            cache[name] = get_accelerator(name)
        except ValueError:
            if hardware is not None:
                raise
            cache[name] = None
    if cache[name] is None:
        rank["roofline"]["hardware_note"] = f"{name} is not in the accelerator table: give --hardware"
    return cache[name]


def _analyze_files(files: Sequence[Path], critical_path: int | str | None = None) -> list[dict[str, Any]]:
    """Each trace's report, ordered by rank (unranked traces last, by file name), with the
    critical path of step `critical_path` (`analyze`'s). SLOWEST is known only once every trace's
    steps are: each trace of several is read again for its path (to hold one trace at a time)."""
    ranks, kept = [], None
    for path in files:
        trace = read_trace(path)
        ranks.append(analyze_rank(trace, None if critical_path == SLOWEST else critical_path))
        kept = trace if len(files) == 1 else None
    if critical_path == SLOWEST:
        timed = [(s["duration_us"], s["step"]) for r in ranks for s in r["steps"]]
        if not timed:
            raise ValueError(f"{', '.join(str(f) for f in files)}: no ProfilerStep#N annotations, so no "
                             "step to find the critical path of")
        step = max(timed, key=lambda t: t[0])[1]
        for rank in ranks:
            trace = kept if kept is not None else read_trace(rank["file"])
            rank["critical_path"] = _critical_path_record(trace, step)
    records = [r["critical_path"] for r in ranks]
    if critical_path is not None and all("lacking" in cp for cp in records):
        raise ValueError("; ".join(cp["lacking"] for cp in records))
    ranks.sort(key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else 0, r["file"]))
    return ranks


def _critical_path_record(trace: Trace, step: int) -> dict[str, Any]:
    """The critical path of `ProfilerStep#step` as `--json` gives it, or, for a trace without that
    step, the step and why (`lacking`)."""
    missing = missing_step(trace, step)
    if missing is not None:
        return {"step": step, "lacking": missing}
    return trace_critical.critical_path(trace, step).as_dict()


def compare(ranks: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], top: int) -> dict[str, Any]:
    """What changed from `baseline` to `ranks` (as HTA's trace diff: ops and kernels added, gone,
    slower, faster): per step when every trace has profiler steps (each side's mean over its
    ranks of the per-step mean), per trace when none has; `top` rows of the largest changes."""
    stepped = {bool(r["steps"]) for r in (*ranks, *baseline)}
    if len(stepped) > 1:
        lacking = [r["file"] for r in (*ranks, *baseline) if not r["steps"]]
        raise ValueError(f"cannot compare per step: {', '.join(lacking)} "
                         f"{'has' if len(lacking) == 1 else 'have'} no ProfilerStep#N annotations")
    step_us = [_mean([_mean([s["duration_us"] for s in r["steps"]]) for r in side if r["steps"]])
               for side in (baseline, ranks)]
    return {
        "per": "step" if stepped == {True} else "trace",
        "step_time_us": {"baseline": step_us[0], "new": step_us[1],
                         "ratio": step_us[1] / step_us[0] if step_us[0] and step_us[1] else None},
        "host": _changes(_per_step(baseline, "host", "self_us"), _per_step(ranks, "host", "self_us"), top),
        "kernels": _changes(_per_step(baseline, "kernels", "total_us"),
                            _per_step(ranks, "kernels", "total_us"), top),
    }


def _mean(values: Sequence[float | None]) -> float | None:
    return sum(values) / len(values) if values else None


def _per_step(ranks: Sequence[dict[str, Any]], table: str, key: str) -> dict[str, tuple[float, float]]:
    """(time, calls) per step and rank of each row of `table` (a trace without steps is one)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for rank in ranks:
        share = 1 / (max(len(rank["steps"]), 1) * len(ranks))
        for row in rank[table]:
            out[row["name"]][0] += row[key] * share
            out[row["name"]][1] += row["calls"] * share
    return {name: (time_us, calls) for name, (time_us, calls) in out.items()}


def _changes(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
             top: int) -> list[dict[str, Any]]:
    rows = []
    for name in before.keys() | after.keys():
        (old_us, old_calls), (new_us, new_calls) = before.get(name, (0.0, 0.0)), after.get(name, (0.0, 0.0))
        change = "added" if name not in before else "gone" if name not in after else (
            "slower" if new_us > old_us else "faster" if new_us < old_us else "same")
        rows.append({"name": name, "change": change, "baseline_us": old_us, "new_us": new_us,
                     "delta_us": new_us - old_us, "baseline_calls": old_calls, "new_calls": new_calls})
    return sorted(rows, key=lambda r: (-abs(r["delta_us"]), r["name"]))[:top]


def _spread(ranks: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """With several ranks of one job (traces that name their rank: several sessions of one
    engine are no ranks): the slowest and fastest by median step time (a straggler shows here)."""
    timed = [r for r in ranks if r["step_time_us"] and r["rank"] is not None]
    if len(timed) < 2:
        return None
    slowest = max(timed, key=lambda r: r["step_time_us"])
    fastest = min(timed, key=lambda r: r["step_time_us"])
    return {"slowest": _rank_label(slowest), "fastest": _rank_label(fastest),
            "slowest_step_us": slowest["step_time_us"], "fastest_step_us": fastest["step_time_us"],
            "ratio": slowest["step_time_us"] / fastest["step_time_us"]}


def _rank_label(report: dict[str, Any]) -> str:
    return f"rank {report['rank']}" if report["rank"] is not None else Path(report["file"]).name
