"""The dependency graph of one profiler step that `trace_critical` finds the longest path of.

Nodes are points in time (the starts and ends of the step's events); an edge says that its head
had to wait for its tail, and weighs the time between them when that time was work or a delay
of the step (0 when the head was waiting on something else). Edges go forward in time, so that a
path weighs at most the time between its ends and the graph has no cycle but among events of no
duration at one instant. `trace_critical`'s docstring says which edges are drawn.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

from slipstream.perf.kineto import Event
from slipstream.perf.trace_gpu import KERNEL_CATEGORIES, LAUNCH_CATEGORIES, launch_calls
from slipstream.perf.trace_tree import HOST_CATEGORIES, by_thread, innermost, parents

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize")


@dataclasses.dataclass
class Graph:
    """Nodes (their times) and edges (tail, head, weight, kind, name), in flat lists: a graph of
    a million spans would otherwise be millions of small objects for the collector to walk."""

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
        """An edge weighing the time from u to v (none when not `weighted`)."""
        assert self.times[v] >= self.times[u], "an edge goes forward in time"
        self.tails.append(u)
        self.heads.append(v)
        self.weights.append(self.times[v] - self.times[u] if weighted else 0.0)
        self.kinds.append(kind)
        self.names.append(name)


def longest_path(num_nodes: int, tails: Sequence[int], heads: Sequence[int], weights: Sequence[float],
                 source: int, sink: int) -> tuple[float, list[int]]:
    """The heaviest path from `source` to `sink` of a DAG of `num_nodes` nodes whose edge i runs
    from `tails[i]` to `heads[i]` and weighs `weights[i]`: its weight and its edges in order. One
    pass in topological order (Kahn's), relaxing each edge once. ValueError when the edges form a
    cycle or the sink cannot be reached."""
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


def step_graph(events: Sequence[Event], annotation: Event) -> tuple[Graph, int, int]:
    """The graph of the step `annotation` marks, its source (the step's start) and its sink (its end)."""
    graph = Graph()
    host = _host_walk(graph, _step_spans(events, annotation))
    root = host.spans[0]
    source = host.start[id(root)]
    _device_edges(graph, events, host, annotation, source)
    return graph, source, host.end[id(root)]


def _step_spans(events: Sequence[Event], annotation: Event) -> list[Event]:
    """The step's thread's host spans inside the step, with other threads' outermost spans (and
    their children) that `_waited_for`, sorted as `parents` takes them."""
    threads = by_thread((e for e in events if annotation.start_us <= e.start_us
                         and e.end_us <= annotation.end_us), HOST_CATEGORIES)
    main = threads.pop((annotation.pid, annotation.tid))
    joined = list(main)
    for spans in threads.values():
        root_of: list[int] = []  # parents come before their children
        for i, parent in enumerate(parents(spans)):
            root_of.append(i if parent is None else root_of[parent])
        roots = _waited_for(main, [e for i, e in enumerate(spans) if root_of[i] == i])
        joined += [e for e, root in zip(spans, root_of, strict=True) if id(spans[root]) in roots]
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
    """The host walk: each kept span's start and end node by its `id`, the kept spans (the step
    annotation first), their runtime calls by correlation, and the edge of a childless span's
    whole time by its `id` (a call that waited for the device has it weigh 0)."""

    start: dict[int, int] = dataclasses.field(default_factory=dict)
    end: dict[int, int] = dataclasses.field(default_factory=dict)
    spans: list[Event] = dataclasses.field(default_factory=list)
    calls: dict[int, Event] = dataclasses.field(default_factory=dict)
    own_edge: dict[int, int] = dataclasses.field(default_factory=dict)


def _host_walk(graph: Graph, spans: list[Event]) -> _Host:
    """The depth-first walk of the step's spans (the step annotation first, their root): one node
    per start and end, an edge between each consecutive two, which is the self time of the span
    open between them. A span that starts before the walk's last point (a `record_function` range
    opened inside its own Python `__enter__` frame under `with_stack`, a rounding) starts there
    instead, and one that also ends before it is left out with its children: the walk goes
    forward in time."""
    parent_of = parents(spans)
    stack: list[int] = []
    dropped: set[int] = set()
    host = _Host()
    previous: int | None = None
    for i, e in enumerate(spans):
        parent = parent_of[i]
        if parent in dropped or (parent is None and i > 0):
            dropped.add(i)
            continue
        while stack and stack[-1] != parent:
            previous = _close(graph, host, spans[stack.pop()], previous)
        begin = e.start_us if previous is None else max(e.start_us, graph.times[previous])
        if e.end_us < begin:
            dropped.add(i)
            continue
        node = graph.node(begin)
        if previous is not None:
            graph.edge(previous, node, "host", spans[stack[-1]].name)
        host.start[id(e)] = previous = node
        stack.append(i)
        host.spans.append(e)
    while stack:
        previous = _close(graph, host, spans[stack.pop()], previous)
    host.calls = launch_calls(host.spans)
    return host


def _close(graph: Graph, host: _Host, e: Event, previous: int | None) -> int:
    """End span `e`, the innermost open one: a node at its end, the edge to it its self time."""
    assert previous is not None, "a span's start node precedes its end"
    node = graph.node(e.end_us)
    if previous == host.start[id(e)]:
        host.own_edge[id(e)] = len(graph.weights)
    graph.edge(previous, node, "host", e.name)
    host.end[id(e)] = node
    return node


class _Dependency(NamedTuple):
    """What a kernel's start may have waited for: it finished at node `node` (at `time_us`), and
    the wait from then to the kernel's start is of `kind`."""

    time_us: float
    node: int
    kind: str


_Stream = tuple[Any, Any]
"""A device's stream: (pid, tid) of its kernels."""


def _device_edges(graph: Graph, events: Sequence[Event], host: _Host, annotation: Event, source: int) -> None:
    """The kernels that ran in the step, with their launch, stream-order, cross-stream and
    synchronization edges. A kernel waited for the dependency that finished last before it
    started (several, when they finished together: the longest path takes the one with the most
    behind it); one with none in the trace (launched before the step, or held by a wait the trace
    does not show) hangs from the step's start by an edge weighing nothing."""
    window = (annotation.start_us, annotation.end_us)
    calls = launch_calls(events)
    kernels = sorted((e for e in events if e.cat in KERNEL_CATEGORIES and e.end_us > window[0]
                      and e.start_us < window[1]), key=lambda k: (k.start_us, k.end_us))
    if not kernels:
        return
    syncs = [e for e in events if e.cat == "cuda_sync" and e.correlation is not None]
    streams: dict[_Stream, list[Event]] = defaultdict(list)
    for k in kernels:
        streams[(k.pid, k.tid)].append(k)
    launches = _Launches(streams, calls)
    waits = _stream_waits(syncs, launches, calls)
    start, end = {}, {}
    for k in kernels:
        start[id(k)] = graph.node(max(k.start_us, window[0]))
        end[id(k)] = graph.node(k.end_us)
        graph.edge(start[id(k)], end[id(k)], "kernel", k.name)
    for stream in streams.values():
        previous = None
        for k in stream:
            deps = [_Dependency(w.end_us, end[id(w)], "sync_wait") for w in waits.get(id(k), ())]
            if previous is not None:
                deps.append(_Dependency(previous.end_us, end[id(previous)], "idle"))
            call = host.calls.get(k.correlation)
            if call is not None:
                # From the call's end, or from its start for a kernel that began before it returned.
                node = host.end[id(call)] if k.start_us >= call.end_us else host.start[id(call)]
                deps.append(_Dependency(graph.times[node], node, "launch_delay"))
            # One that finished after the kernel started contradicts the clocks (host and device
            # disagree): it is left out, so that every edge goes forward in time.
            deps = [d for d in deps if d.time_us <= graph.times[start[id(k)]]]
            last = max((d.time_us for d in deps), default=None)
            for d in deps:
                if d.time_us == last:
                    graph.edge(d.node, start[id(k)], d.kind, k.name)
            if not deps:
                graph.edge(source, start[id(k)], "idle", k.name, weighted=False)
            previous = k
    _sync_edges(graph, host, streams, launches, syncs, calls, end)


class _Launches:
    """Each stream's kernels whose launch call the trace holds, in the calls' order, on the stream
    and on the stream from each host thread. Calls are ordered by (start, end), so that of two
    on one thread at one instant (times rounded to the microsecond) the one of no duration, which
    ended as the other began, comes first."""

    def __init__(self, streams: dict[_Stream, list[Event]], calls: dict[int, Event]):
        self._by: dict[tuple[Any, ...], tuple[list[tuple[float, float]], list[Event]]] = {}
        groups: dict[tuple[Any, ...], list[tuple[tuple[float, float], Event]]] = defaultdict(list)
        for key, stream in streams.items():
            for k in stream:
                call = calls.get(k.correlation)
                if call is not None:
                    groups[key].append(((call.start_us, call.end_us), k))
                    groups[(*key, call.pid, call.tid)].append(((call.start_us, call.end_us), k))
        for key, launched in groups.items():
            launched.sort(key=lambda pair: pair[0])
            self._by[key] = ([when for when, _ in launched], [k for _, k in launched])

    def before(self, stream: _Stream, call: Event | None) -> Event | None:
        """The kernel launched last on `stream` before `call` (from any thread)."""
        if call is None or stream not in self._by:
            return None
        when, kernels = self._by[stream]
        i = bisect.bisect_right(when, (call.start_us, call.end_us))
        return kernels[i - 1] if i > 0 else None

    def after(self, stream: _Stream, call: Event | None) -> Event | None:
        """The kernel launched first on `stream` after `call`, from `call`'s own thread."""
        key = None if call is None else (*stream, call.pid, call.tid)
        if key not in self._by:
            return None
        when, kernels = self._by[key]
        i = bisect.bisect_left(when, (call.start_us, call.end_us))
        return kernels[i] if i < len(kernels) else None


def _stream_waits(syncs: Sequence[Event], launches: _Launches,
                  calls: dict[int, Event]) -> dict[int, list[Event]]:
    """For each kernel that `cudaStreamWaitEvent`s held (by `id`), the kernels they waited for: the
    one launched last on the event's stream before its `cudaEventRecord`, for each wait."""
    out: dict[int, list[Event]] = defaultdict(list)
    for s in syncs:
        if s.name != "Stream Wait Event" or s.wait is None:
            continue
        awaited = launches.before((s.pid, s.wait.stream), calls.get(s.wait.record_correlation))
        waiting = launches.after((s.pid, s.tid), calls.get(s.correlation))
        if awaited is not None and waiting is not None:
            out[id(waiting)].append(awaited)
    return out


def _sync_edges(graph: Graph, host: _Host, streams: dict[_Stream, list[Event]], launches: _Launches,
                syncs: Sequence[Event], calls: dict[int, Event], end: dict[int, int]) -> None:
    """Each host call that returned only after device work ended: that work's end -> the call's
    end, and the call's own time weighs nothing (it was waiting)."""
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
        if call.name in SYNC_CALLS:
            candidates = _synchronized(call, by_correlation.get(call.correlation), by_end, launches, calls)
        else:
            candidates = [k for k in own_work.get(call.correlation, ()) if _waits_for_its_copy(call, k)]
        # Work that ended before the call began was not waited for; work that started only as it
        # returned was launched after it (a cycle otherwise, at one instant).
        begin = graph.times[host.start[id(call)]]
        candidates = [k for k in candidates if begin < k.end_us <= call.end_us and k.start_us < call.end_us]
        if candidates:
            awaited = max(candidates, key=lambda k: k.end_us)
            graph.edge(end[id(awaited)], host.end[id(call)], "sync_wait", call.name)
            graph.weights[host.own_edge[id(call)]] = 0.0


def _waits_for_its_copy(call: Event, copy: Event) -> bool:
    """A copy call that returns only once its copy has ended: the synchronous API (`cudaMemcpy`,
    no "Async"), or an asynchronous copy from the device to pageable host memory (Kineto's
    "Memcpy DtoH (Device -> Pageable)"), which CUDA's API synchronization behaviour makes wait
    for the copy. An asynchronous copy to or from pinned memory does not wait, though a short one
    may end before its call returns."""
    return "Memcpy" in call.name and ("Async" not in call.name or "-> Pageable" in copy.name)


def _synchronized(call: Event, sync: Event | None, by_end: dict[_Stream, tuple[list[float], list[Event]]],
                  launches: _Launches, calls: dict[int, Event]) -> list[Event]:
    """The kernels a synchronize call may have waited for: the last to end before it returned on
    the stream its "Stream Sync" names, or on each stream of its device (a "Context Sync"; every
    device's for a trace without these events); the one launched last before the
    `cudaEventRecord` its "Event Sync" names."""
    if sync is not None and sync.name == "Event Sync" and sync.wait is not None:
        k = launches.before((sync.pid, sync.wait.stream), calls.get(sync.wait.record_correlation))
        return [k] if k is not None else []
    if sync is not None and sync.name == "Stream Sync":
        scope = [(sync.pid, sync.tid)] if (sync.pid, sync.tid) in by_end else []
    else:
        scope = [key for key in by_end if sync is None or key[0] == sync.pid]
    out = []
    for key in scope:
        ends, kernels = by_end[key]
        i = bisect.bisect_right(ends, call.end_us)
        while i > 0 and kernels[i - 1].start_us >= call.end_us:  # no duration, launched after the call
            i -= 1
        if i > 0:
            out.append(kernels[i - 1])
    return out
