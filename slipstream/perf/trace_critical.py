"""The critical path of one profiler step: the chain of host ops, kernel launches, kernels and
synchronizations that set the step's length, as Holistic Trace Analysis's critical path analysis
finds it (HTA `hta/analyzers/critical_path_analysis.py`, `docs/source/features/`), on a smaller
graph of our own.

Nodes are the starts and ends of the step's events; an edge says that one point in time had to
wait for another, and weighs the time between them when that time is work or a delay of the
step, 0 when it is waiting on something else. Every path from the step's start to its end then
weighs at most the step's span, and the longest weighs all of it when the graph holds every
dependency the step waited on: the waits are the edges the longest path avoids.

- **Host.** The step's thread's spans (ops, annotations, Python frames, runtime calls) inside the
  step, nested as torch.profiler nests them (`trace_tree.parents`), walked depth first: each edge
  between consecutive starts and ends is the self time of the span open between them (the step
  annotation's own is the time between ops). Another thread's outermost span that fits wholly
  between two of those points while the step's thread was in no op of its own, only in an
  annotation or a Python frame (as when it waits for a data loader, or on a GPU for the autograd
  engine's thread), joins the walk there with its children; other threads' spans that ran
  alongside the step's ops are not on it.
- **Launch.** A runtime call -> the kernel, copy or set of its `correlation`: the launch delay,
  from the call's end (from its start for a kernel that started before its call returned).
- **Stream order.** A kernel -> the next on its stream: the gap between them is idle.
- **Cross-stream waits.** `cudaStreamWaitEvent` (its "Stream Wait Event"): the last kernel
  launched on the event's stream before its `cudaEventRecord` -> the first launched on the
  waiting stream after the wait: a sync wait.

A kernel starts when the last of its launch, stream and cross-stream dependencies finished: that
edge weighs its gap, the others are not drawn, nor one that finished after the kernel started
(host and device clocks that disagree): every edge goes forward in time.

- **Synchronization.** A call that returned only once device work ended waited for it: a copy
  it launched itself (`cudaMemcpy`, a blocking `cudaMemcpyAsync`), or for the synchronize calls
  the last kernel to end during the call on the streams it synchronized (its "Stream Sync",
  "Event Sync" or "Context Sync" event says which; every stream of the device without one).
  That kernel's end -> the call's end is a sync wait, and the call's own span weighs 0.

What HTA does and this does not: it can take several steps in one graph, mark the path in a
trace for the viewer, and simulate changes on the graph; it models the CUDA runtime's lock
between threads and classes the caller's data-loading events apart. Here: one step, the report's
table and `--json`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from slipstream.perf.kineto import Event, Trace
from slipstream.perf.trace_gpu import KERNEL_CATEGORIES, LAUNCH_CATEGORIES
from slipstream.perf.trace_tree import (
    HOST_CATEGORIES,
    STEP_NAME,
    by_thread,
    innermost,
    parents,
    profiler_steps,
)

KINDS = ("host", "kernel", "launch_delay", "sync_wait", "idle")
"""How the path's time splits: host spans' self time, kernels (copies and sets included), launch
delays, waits on a synchronization after the awaited work ended, and gaps between a stream's
kernels."""
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize")


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of the path: `duration_us` of `kind` in the event `name`, from `start_us`."""

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
    """The path's weight: the step's span when the graph holds every wait of the step."""
    segments: tuple[Segment, ...]
    breakdown_us: dict[str, float]
    """The path's time by kind (KINDS); it sums to `length_us`."""

    @property
    def unexplained_us(self) -> float:
        """Waits on the path whose cause the trace does not show (the step's span less the path)."""
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


def longest_path(num_nodes: int, tails: Sequence[int], heads: Sequence[int], weights: Sequence[float],
                 source: int, sink: int) -> tuple[float, list[int]]:
    """The heaviest path from `source` to `sink` of a DAG of `num_nodes` nodes whose edge i runs
    from `tails[i]` to `heads[i]` and weighs `weights[i]`: its weight and its edges in order. One
    pass in topological order (Kahn's), relaxing each edge once; the edges are kept in flat lists
    (a graph of a million spans would otherwise be millions of small objects for the collector
    to walk). ValueError when the edges form a cycle or the sink cannot be reached."""
    first = [0] * (num_nodes + 1)  # the edges out of node u: by_tail[first[u]:first[u + 1]]
    indegree = [0] * num_nodes
    for u, v in zip(tails, heads, strict=True):
        first[u + 1] += 1
        indegree[v] += 1
    for u in range(num_nodes):
        first[u + 1] += first[u]
    by_tail = [0] * len(tails)
    filled = first[:-1]
    for i, u in enumerate(tails):
        by_tail[filled[u]] = i
        filled[u] += 1
    best = [float("-inf")] * num_nodes
    via = [-1] * num_nodes
    best[source] = 0.0
    ready = [n for n in range(num_nodes) if indegree[n] == 0]
    visited = 0
    while ready:
        u = ready.pop()
        visited += 1
        for i in by_tail[first[u]:first[u + 1]]:
            v = heads[i]
            if best[u] + weights[i] > best[v]:
                best[v], via[v] = best[u] + weights[i], i
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    if visited < num_nodes:
        raise ValueError("the dependencies form a cycle")
    if best[sink] == float("-inf"):
        raise ValueError("the end cannot be reached from the start")
    path: list[int] = []
    node = sink
    while node != source:
        path.append(via[node])
        node = tails[via[node]]
    return best[sink], path[::-1]


@dataclasses.dataclass
class _Graph:
    """Nodes (their times) and edges (tail, head, weight, kind, name), in flat lists."""

    times: list[float] = dataclasses.field(default_factory=list)
    tails: list[int] = dataclasses.field(default_factory=list)
    heads: list[int] = dataclasses.field(default_factory=list)
    weights: list[float] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)
    names: list[str] = dataclasses.field(default_factory=list)

    def node(self, time_us: float) -> int:
        self.times.append(time_us)
        return len(self.times) - 1

    def edge(self, u: int, v: int, kind: str, name: str, weighted: bool = True) -> None:
        """An edge weighing the time from u to v (none when not `weighted`). Edges go forward in
        time, so that a path weighs at most the time between its ends and the graph has no cycle
        (but among events of no duration at one instant)."""
        assert self.times[v] >= self.times[u], "an edge goes forward in time"
        self.tails.append(u)
        self.heads.append(v)
        self.weights.append(self.times[v] - self.times[u] if weighted else 0.0)
        self.kinds.append(kind)
        self.names.append(name)


def critical_path(trace: Trace, step: int | None = None) -> CriticalPath:
    """The critical path of `ProfilerStep#step` of `trace` (the slowest step when None).
    ValueError for a trace without profiler steps or without that step."""
    steps = profiler_steps(trace.events)
    if not steps:
        raise ValueError(f"{trace.path}: no ProfilerStep#N annotations, so no step to find the "
                         "critical path of")
    if step is None:
        chosen = max(steps, key=lambda s: s.end_us - s.start_us)
    else:
        found = [s for s in steps if s.number == step]
        if not found:
            raise ValueError(f"critical path step {step}: {trace.path} has no ProfilerStep#{step} "
                             f"(its steps: {', '.join(str(s.number) for s in steps)})")
        chosen = found[0]
    annotation = max((e for e in trace.events if e.cat == "user_annotation" and e.name == chosen.name),
                     key=lambda e: e.dur_us)
    graph = _Graph()
    spans = _step_spans(trace.events, annotation)
    source, sink, host = _host_walk(graph, spans)
    _device_edges(graph, trace.events, host, annotation, source)
    try:
        length, path = longest_path(len(graph.times), graph.tails, graph.heads, graph.weights, source,
                                    sink)
    except ValueError as e:
        raise ValueError(f"{trace.path}, step {chosen.number}: {e} (host and device clocks "
                         "that disagree?)") from None
    return _result(graph, path, length, chosen.number, annotation)


def _result(graph: _Graph, path: list[int], length: float, step: int, annotation: Event) -> CriticalPath:
    """The path as segments, consecutive edges of one event and kind merged (edges that weigh
    nothing, waits, are left out and split segments)."""
    segments: list[list[Any]] = []  # [name, kind, start, duration]
    breakdown = dict.fromkeys(KINDS, 0.0)
    joins = False
    for i in path:
        weight = graph.weights[i]
        if weight <= 0:
            joins = False
            continue
        kind, name = graph.kinds[i], graph.names[i]
        breakdown[kind] += weight
        if joins and segments[-1][1] == kind and segments[-1][0] == name:
            segments[-1][3] += weight
        else:
            segments.append([name, kind, graph.times[graph.tails[i]], weight])
        joins = True
    return CriticalPath(step, annotation.start_us, annotation.dur_us, length,
                        tuple(Segment(*s) for s in segments), breakdown)


def _step_spans(events: Sequence[Event], annotation: Event) -> list[Event]:
    """The step's thread's host spans inside the step, with other threads' outermost spans (and
    their children) that `_waited_for`, sorted as `parents` takes them."""
    threads = by_thread((e for e in events if annotation.start_us <= e.start_us
                         and e.end_us <= annotation.end_us), HOST_CATEGORIES)
    main = threads.pop((annotation.pid, annotation.tid))
    joined = list(main)
    for spans in threads.values():
        parent_of = parents(spans)
        roots = _waited_for(main, [e for e, parent in zip(spans, parent_of, strict=True) if parent is None])
        for e, parent in zip(spans, parent_of, strict=True):
            while parent is not None and parent_of[parent] is not None:
                parent = parent_of[parent]
            if id(e if parent is None else spans[parent]) in roots:
                joined.append(e)
    joined.sort(key=lambda e: (e.start_us, -e.end_us, e is not annotation))
    return joined


def _waited_for(main: list[Event], roots: list[Event]) -> set[int]:
    """The `id`s of the outermost spans of another thread that the step's thread waited for: each
    fits wholly between two consecutive starts or ends of the step's thread's spans, where that
    thread was in no op of its own, only in an annotation or a Python frame (as it waits for a
    data loader, or on a GPU for the autograd engine's thread)."""
    points = sorted({t for e in main for t in (e.start_us, e.end_us)})
    fits = []
    for e in roots:
        after = bisect.bisect_right(points, e.start_us)
        if after == len(points) or points[after] >= e.end_us:
            fits.append(e)
    fits.sort(key=lambda e: e.start_us + e.end_us)
    around = innermost(main, [(e.start_us + e.end_us) / 2 for e in fits])
    return {id(e) for e, i in zip(fits, around, strict=True)
            if i is not None and main[i].cat in _WAITING_CATEGORIES}


_WAITING_CATEGORIES = ("user_annotation", "python_function")
"""The spans whose own time may be a wait on another thread (an op's own time is its work)."""


@dataclasses.dataclass
class _Host:
    """The host walk: each kept span's start and end node by its `id`, the kept spans, and their
    runtime calls by correlation."""

    start: dict[int, int]
    end: dict[int, int]
    calls: dict[int, Event]
    spans: list[Event]
    own_edge: dict[int, int]
    """The edge of a childless span's whole time, by the span's `id` (a call that waited for the
    device has it weigh 0)."""


def _host_walk(graph: _Graph, spans: list[Event]) -> tuple[int, int, _Host]:
    """The depth-first walk of the step's spans (the step annotation first, their root): one node
    per start and end, an edge between each consecutive two, which is the self time of the span
    open between them. A span that starts before its previous sibling ends (Python frames that
    cross an op's bounds) is left out with its children: the walk must go forward in time."""
    parent_of = parents(spans)
    kept: list[int] = []
    stack: list[int] = []
    last_child_end: dict[int | None, float] = {}
    dropped: set[int] = set()
    host = _Host({}, {}, {}, [], {})
    previous: int | None = None
    for i, e in enumerate(spans):
        parent = parent_of[i]
        if parent in dropped or e.start_us < last_child_end.get(parent, float("-inf")) or (
                parent is None and i > 0):
            dropped.add(i)
            continue
        last_child_end[parent] = e.end_us
        while stack and stack[-1] != parent:
            previous = _close(graph, host, spans, stack, parent_of, previous)
        node = graph.node(e.start_us)
        if previous is not None:
            owner = spans[stack[-1]]
            graph.edge(previous, node, "host", owner.name)
        host.start[id(e)] = previous = node
        stack.append(i)
        kept.append(i)
    while stack:
        previous = _close(graph, host, spans, stack, parent_of, previous)
    host.spans = [spans[i] for i in kept]
    host.calls = _calls(host.spans)
    root = spans[0]
    return host.start[id(root)], host.end[id(root)], host


def _close(graph: _Graph, host: _Host, spans: list[Event], stack: list[int], parent_of: list[int | None],
           previous: int | None) -> int:
    """End the innermost open span: a node at its end, the edge to it its self time."""
    i = stack.pop()
    e = spans[i]
    node = graph.node(e.end_us)
    assert previous is not None, "a span's start node precedes its end"
    if previous == host.start[id(e)]:
        host.own_edge[id(e)] = len(graph.weights)
    graph.edge(previous, node, "host", e.name)
    host.end[id(e)] = node
    return node


def _calls(events: Sequence[Event]) -> dict[int, Event]:
    return {e.correlation: e for e in events if e.cat in LAUNCH_CATEGORIES and e.correlation is not None}


def _device_edges(graph: _Graph, events: Sequence[Event], host: _Host, annotation: Event,
                  source: int) -> None:
    """The kernels that ran in the step, with their launch, stream-order, cross-stream and
    synchronization edges."""
    window = (annotation.start_us, annotation.end_us)
    all_calls = _calls(events)
    kernels = sorted((e for e in events if e.cat in KERNEL_CATEGORIES and e.end_us > window[0]
                      and e.start_us < window[1]), key=lambda k: (k.start_us, k.end_us))
    if not kernels:
        return
    syncs = [e for e in events if e.cat == "cuda_sync" and e.correlation is not None]
    streams: dict[_Stream, list[Event]] = defaultdict(list)
    for k in kernels:
        streams[(k.pid, k.tid)].append(k)
    launched = _by_launch(streams, all_calls)
    waits = _stream_waits(syncs, launched, all_calls)
    start, end = {}, {}
    for k in kernels:
        start[id(k)] = graph.node(max(k.start_us, window[0]))
        end[id(k)] = graph.node(k.end_us)
        graph.edge(start[id(k)], end[id(k)], "kernel", k.name)
    for stream in streams.values():
        previous = None
        for k in stream:
            deps = []
            if k.start_us <= window[0]:
                deps.append((window[0], 3, source, "kernel"))
            if previous is not None:
                deps.append((previous.end_us, 1, end[id(previous)], "idle"))
            if id(k) in waits:
                deps.append((waits[id(k)].end_us, 2, end[id(waits[id(k)])], "sync_wait"))
            call = host.calls.get(k.correlation)
            if call is not None:
                returned = k.start_us >= call.end_us
                node = host.end[id(call)] if returned else host.start[id(call)]
                deps.append((call.end_us if returned else call.start_us, 0, node, "launch_delay"))
            # A dependency that finished after the kernel started contradicts the clocks (host and
            # device disagree): it is left out, so that every edge goes forward in time.
            deps = [d for d in deps if d[0] <= graph.times[start[id(k)]]]
            if deps:
                _, _, node, kind = max(deps, key=lambda d: (d[0], d[1]))
                graph.edge(node, start[id(k)], kind, k.name)
            else:
                graph.edge(source, start[id(k)], "idle", k.name, weighted=False)
            previous = k
    _sync_edges(graph, host, streams, launched, syncs, all_calls, end)


def _stream_waits(syncs: Sequence[Event], launched: dict[_Stream, _Launched],
                  calls: dict[int, Event]) -> dict[int, Event]:
    """For each kernel that a `cudaStreamWaitEvent` held (by `id`), the kernel it waited for."""
    out: dict[int, Event] = {}
    for s in syncs:
        if s.name != "Stream Wait Event" or s.wait is None:
            continue
        record, wait_call = calls.get(s.wait.record_correlation), calls.get(s.correlation)
        awaited = _launched_before(launched.get((s.pid, s.wait.stream)), record)
        waiting = _launched_after(launched.get((s.pid, s.tid)), wait_call)
        if awaited is not None and waiting is not None:
            out[id(waiting)] = awaited
    return out


_Stream = tuple[Any, Any]
"""A device's stream: (pid, tid) of its kernels."""
_Launched = tuple[list[float], list[Event]]
"""A stream's kernels whose launch call the trace holds, in launch order, and the calls' starts."""


def _by_launch(streams: dict[_Stream, list[Event]], calls: dict[int, Event]) -> dict[_Stream, _Launched]:
    """Each stream's kernels whose launch call the trace holds, in launch order, with the calls'
    start times."""
    out = {}
    for key, stream in streams.items():
        timed = sorted((calls[k.correlation].start_us, i)
                       for i, k in enumerate(stream) if k.correlation in calls)
        out[key] = ([t for t, _ in timed], [stream[i] for _, i in timed])
    return out


def _launched_before(launched: _Launched | None, call: Event | None) -> Event | None:
    if launched is None or call is None:
        return None
    i = bisect.bisect_right(launched[0], call.start_us)
    return launched[1][i - 1] if i > 0 else None


def _launched_after(launched: _Launched | None, call: Event | None) -> Event | None:
    if launched is None or call is None:
        return None
    i = bisect.bisect_left(launched[0], call.start_us)
    return launched[1][i] if i < len(launched[1]) else None


def _sync_edges(graph: _Graph, host: _Host, streams: dict[_Stream, list[Event]],
                launched: dict[_Stream, _Launched], syncs: Sequence[Event], calls: dict[int, Event],
                end: dict[int, int]) -> None:
    """Each host call that returned only after device work ended: that work's end -> the call's
    end, and the call's own time weighs nothing (it was waiting). A launch call whose short kernel
    ended before the call returned did not wait for it: only copies are waited for by their own
    call."""
    own_work: dict[int, list[Event]] = defaultdict(list)
    for stream in streams.values():
        for k in stream:
            if k.correlation is not None:
                own_work[k.correlation].append(k)
    by_end = {key: (sorted(k.end_us for k in stream), sorted(stream, key=lambda k: k.end_us))
              for key, stream in streams.items()}
    by_correlation = {s.correlation: s for s in syncs}
    for call in host.spans:
        if call.cat not in LAUNCH_CATEGORIES or id(call) not in host.own_edge:
            continue
        candidates = own_work.get(call.correlation, []) if "Memcpy" in call.name else []
        if not candidates and call.name in SYNC_CALLS:
            candidates = _synchronized(call, by_correlation.get(call.correlation), by_end, launched, calls)
        # Work that started only as the call returned was launched after it, not waited for.
        candidates = [k for k in candidates
                      if call.start_us < k.end_us <= call.end_us and k.start_us < call.end_us]
        if candidates:
            awaited = max(candidates, key=lambda k: k.end_us)
            graph.edge(end[id(awaited)], host.end[id(call)], "sync_wait", call.name)
            graph.weights[host.own_edge[id(call)]] = 0.0


def _synchronized(call: Event, sync: Event | None, by_end: dict[_Stream, tuple[list[float], list[Event]]],
                  launched: dict[_Stream, _Launched], calls: dict[int, Event]) -> list[Event]:
    """The kernels a synchronize call may have waited for: the last to end before it returned on
    the stream its "Stream Sync" names, or on each stream (a "Context Sync", or a trace without
    these events); the one launched last before the `cudaEventRecord` its "Event Sync" names."""
    if sync is not None and sync.name == "Event Sync" and sync.wait is not None:
        record = calls.get(sync.wait.record_correlation)
        k = _launched_before(launched.get((sync.pid, sync.wait.stream)), record)
        return [k] if k is not None else []
    if sync is not None and sync.name == "Stream Sync":
        scope = [(sync.pid, sync.tid)] if (sync.pid, sync.tid) in by_end else []
    else:
        scope = [key for key in by_end if sync is None or key[0] == sync.pid]
    out = []
    for key in scope:
        ends, kernels = by_end[key]
        i = bisect.bisect_right(ends, call.end_us)
        if i > 0:
            out.append(kernels[i - 1])
    return out


def step_label(name: str) -> str:
    """A step annotation's self time is the time between its ops."""
    return "(between ops)" if STEP_NAME.match(name) else name
