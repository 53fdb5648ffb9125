"""The critical path of one profiler step: the chain of host ops, kernel launches, kernels and
synchronizations that set the step's length, as Holistic Trace Analysis's critical path analysis
finds it (HTA `hta/analyzers/critical_path_analysis.py`, `docs/source/features/`), on a smaller
graph of our own (`trace_critical_graph`).

Nodes are the starts and ends of the step's events; an edge says that one point in time had to
wait for another, and weighs the time between them when that time is work or a delay of the
step, 0 when it is waiting on something else. Every path from the step's start to its end then
weighs at most the step's span; the longest is the critical path.

- **Host.** The step's thread's spans (ops, annotations, Python frames, runtime calls) inside the
  step, nested as torch.profiler nests them (`trace_tree.parents`), walked depth first: each edge
  between consecutive starts and ends is the self time of the span open between them (the step
  annotation's own is the time between ops). A span that starts before the walk's last point (a
  `record_function` range opened inside its own `__enter__` frame under `with_stack`) starts
  there. Another thread's outermost span that fits wholly between two of those points while the
  step's thread was in no op of its own, only in an annotation or a Python frame (as when it
  waits for a data loader, or on a GPU for the autograd engine's thread), joins the walk there
  with its children; other threads' spans that ran alongside the step's ops are not on it.
- **Launch.** A runtime call -> the kernel, copy or set of its `correlation`: the launch delay,
  from the call's end (from its start for a kernel that started before its call returned).
- **Stream order.** A kernel -> the next on its stream: the gap between them is idle.
- **Cross-stream waits.** Each `cudaStreamWaitEvent` (its "Stream Wait Event"): the last kernel
  launched on the event's stream before its `cudaEventRecord` -> the first launched on the
  waiting stream from the waiting call's thread after it (as HTA): a sync wait.

A kernel starts when the last of its launch, stream and cross-stream dependencies finished: that
edge weighs its gap, the others are not drawn, nor one that finished after the kernel started
(host and device clocks that disagree). A kernel with none left hangs from the step's start by an
edge weighing nothing.

- **Synchronization.** A call that returned only once device work ended waited for it: a copy
  it launched itself (`cudaMemcpy`; `cudaMemcpyAsync` only for a copy to pageable memory), or for
  the synchronize calls the last kernel to end during the call on the streams it synchronized
  (its "Stream Sync", "Event Sync" or "Context Sync" event says which; every stream without
  one). That kernel's end -> the call's end is a sync wait, and the call's own span weighs 0.

What HTA does and this does not: it can take several steps in one graph, mark the path in a
trace for the viewer, and simulate changes on the graph; it models the CUDA runtime's lock
between threads and classes the caller's data-loading events apart. Here: one step, the report's
table and `--json`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from slipstream.perf.kineto import Trace
from slipstream.perf.trace_critical_graph import Graph, longest_path, step_graph
from slipstream.perf.trace_tree import STEP_NAME, Step, profiler_steps

KINDS = ("host", "kernel", "launch_delay", "sync_wait", "idle")
"""How the path's time splits: host spans' self time, kernels (copies and sets included), launch
delays, waits on a synchronization after the awaited work ended, and gaps between a stream's
kernels."""
SLOWEST = "slowest"
"""`trace.analyze`'s `critical_path` for the slowest step (the one whose slowest rank took longest)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of the path: `duration_us` of `kind` in the event `name`, from `start_us`
    (consecutive stretches of one name and kind, a span and a child of the same name, are one)."""

    name: str
    kind: str
    start_us: float
    duration_us: float


@dataclasses.dataclass(frozen=True)
class CriticalPath:
    step: int
    step_start_us: float
    step_us: float
    length_us: float
    """The path's weight: the step's span less `unexplained_us`."""
    segments: tuple[Segment, ...]
    breakdown_us: dict[str, float]
    """The path's time by kind (KINDS); it sums to `length_us`."""

    @property
    def unexplained_us(self) -> float:
        """The step's span less the path's weight: the time from the step's start to a kernel on
        the path whose start the trace explains by no dependency at all (launched before the
        step or by a call the trace lacks, with no kernel before it on its stream and no event
        wait; or only dependencies that the clocks contradict). A dependency the trace does not
        link is not counted: the wait of a kernel held by an event the trace does not name shows
        as its launch delay or stream idle."""
        return self.step_us - self.length_us

    def top_ops(self, n: int | None = None) -> list[dict[str, Any]]:
        """The `n` events (all without `n`) with the most time on the path, by (kind, name)."""
        totals: dict[tuple[str, str], float] = defaultdict(float)
        for s in self.segments:
            totals[(s.kind, s.name)] += s.duration_us
        rows = [{"name": name, "kind": kind, "time_us": t,
                 "share": t / self.step_us if self.step_us else None} for (kind, name), t in totals.items()]
        return sorted(rows, key=lambda r: (-r["time_us"], r["name"]))[:n]

    def as_dict(self, top: int | None = None) -> dict[str, Any]:
        """The record `perf trace --json` gives: segments' starts from the step's start."""
        return {"step": self.step, "step_us": self.step_us, "length_us": self.length_us,
                "unexplained_us": self.unexplained_us, "breakdown_us": self.breakdown_us,
                "top": self.top_ops(top),
                "segments": [dataclasses.asdict(s) | {"start_us": s.start_us - self.step_start_us}
                             for s in self.segments]}


def critical_path(trace: Trace, step: int | None = None) -> CriticalPath:
    """The critical path of `ProfilerStep#step` of `trace` (its slowest step when None).
    ValueError for a trace without profiler steps or without that step."""
    chosen = _step(trace, step)
    annotation = max((e for e in trace.events if e.cat == "user_annotation" and e.name == chosen.name),
                     key=lambda e: e.dur_us)
    graph, source, sink = step_graph(trace.events, annotation)
    try:
        length, path = longest_path(len(graph.times), graph.tails, graph.heads, graph.weights, source, sink)
    except ValueError as e:
        # Edges go forward in time, so a cycle is among events of no duration at one instant.
        raise ValueError(f"{trace.path}, step {chosen.number}: {e} among events of no duration at one "
                         "instant that wait on each other (a malformed trace)") from None
    return _result(graph, path, length, chosen.number, annotation.start_us, annotation.dur_us)


def missing_step(trace: Trace, step: int) -> str | None:
    """Why `trace` has no critical path of `ProfilerStep#step`, or None when it has that step."""
    return _missing(trace, profiler_steps(trace.events), step)


def _missing(trace: Trace, steps: Sequence[Step], step: int | None) -> str | None:
    if not steps:
        return f"{trace.path}: no ProfilerStep#N annotations, so no step to find the critical path of"
    if step is None or any(s.number == step for s in steps):
        return None
    return (f"critical path step {step}: {trace.path} has no ProfilerStep#{step} "
            f"(its steps: {', '.join(str(s.number) for s in steps)})")


def _step(trace: Trace, step: int | None) -> Step:
    steps = profiler_steps(trace.events)
    missing = _missing(trace, steps, step)
    if missing is not None:
        raise ValueError(missing)
    if step is None:
        return max(steps, key=lambda s: s.end_us - s.start_us)
    return next(s for s in steps if s.number == step)


def _result(graph: Graph, path: list[int], length: float, step: int, start_us: float,
            step_us: float) -> CriticalPath:
    """The path as segments, consecutive edges of one name and kind merged (an edge that weighs
    nothing, a wait, is left out and splits them)."""
    segments: list[Segment] = []
    breakdown = dict.fromkeys(KINDS, 0.0)
    joins = False
    for i in path:
        weight = graph.weights[i]
        if weight <= 0:
            joins = False
            continue
        kind, name = graph.kinds[i], graph.names[i]
        breakdown[kind] += weight
        if joins and segments[-1].kind == kind and segments[-1].name == name:
            segments[-1] = dataclasses.replace(segments[-1], duration_us=segments[-1].duration_us + weight)
        else:
            segments.append(Segment(name, kind, graph.times[graph.tails[i]], weight))
        joins = True
    return CriticalPath(step, start_us, step_us, length, tuple(segments), breakdown)


def step_label(name: str) -> str:
    """A step annotation's self time is the time between its ops."""
    return "(between ops)" if STEP_NAME.match(name) else name
