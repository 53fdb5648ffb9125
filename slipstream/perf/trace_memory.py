"""The memory timeline of a trace recorded with `torch.profiler.profile(profile_memory=True)`.

Its `[memory]` events each say how many bytes one allocation took (a free: negative) on which
device, and the allocator's totals after it. Per device, the report gives the peak of the
allocated total (and the reserved one, where the allocator reports it: the CUDA caching
allocator does, the CPU's does not), when it happened and what ran then (the innermost op and
`record_function` range on the allocating thread, the profiler step); per profiler step the
total at its start, its peak and its growth (a leak grows every step); and the bytes each op
allocated itself, as `key_averages()` counts `self_cpu_memory_usage` / `self_device_memory_usage`:
an event belongs to the innermost host span around it (key_averages takes every span whose time
holds the event, on any thread; here only the allocating thread's spans are searched).

What happened before the trace is not in it, and is said rather than left out: a CUDA trace's
first total includes the blocks allocated before profiling (`allocated_at_start_bytes`, the first
event's total less its own bytes), and frees of blocks that the trace never saw allocated
(negative bytes at an address with no allocation in the trace) are counted apart. The CPU's
allocator reports no free of a block allocated before profiling at all (it warns once), and its
total counts only the blocks allocated while a profiler recorded memory. A trace whose events
carry no totals has them summed from its own events, from 0 (`totals`: "summed").

PyTorch's `torch.profiler._memory_profiler` (`profile.export_memory_timeline`) sorts each
allocation into a category (parameter, gradient, activation, optimizer state, ...) from the live
profile's tensor graph, which a trace file does not hold, and HTA plots that export over time;
this report is what the trace file alone gives, as tables.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from slipstream.perf.kineto import Event, MemoryEvent
from slipstream.perf.trace_tree import STEP_NAME, Step, innermost, parents, step_at

OUTSIDE_OPS = "(outside any op)"
BETWEEN_OPS = "(between ops, in profiler steps)"


def memory_timeline(memory_events: Sequence[MemoryEvent], host: dict[tuple[Any, Any], list[Event]],
                    steps: Sequence[Step]) -> list[dict[str, Any]]:
    """Per device (sorted by name), its memory report; [] for a trace without memory events.
    `host` is the host spans by thread (`trace_tree.by_thread`), `steps` the profiler steps."""
    contexts = _contexts(memory_events, host)
    by_device: dict[str, list[tuple[MemoryEvent, _Context]]] = defaultdict(list)
    for event, context in zip(memory_events, contexts, strict=True):
        by_device[event.device].append((event, context))
    return [_device_report(device, sorted(pairs, key=lambda p: p[0].time_us), steps)
            for device, pairs in sorted(by_device.items())]


class _Context:
    """What ran on the allocating thread at a memory event: the innermost host span (whose self
    allocation it is), and the innermost op and `record_function` range around it."""

    __slots__ = ("owner", "op", "annotation")

    def __init__(self, owner: str, op: str | None, annotation: str | None):
        self.owner, self.op, self.annotation = owner, op, annotation


def _contexts(memory_events: Sequence[MemoryEvent],
              host: dict[tuple[Any, Any], list[Event]]) -> list[_Context]:
    """Each memory event's context, in the order given (one sweep per thread)."""
    out: list[_Context | None] = [None] * len(memory_events)
    by_thread: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for i, m in enumerate(memory_events):
        by_thread[(m.pid, m.tid)].append(i)
    for thread, indices in by_thread.items():
        indices.sort(key=lambda i: memory_events[i].time_us)
        spans = host.get(thread, [])
        parent_of = parents(spans)
        found = innermost(spans, [memory_events[i].time_us for i in indices])
        for i, span in zip(indices, found, strict=True):
            out[i] = _context(spans, parent_of, span)
    return out


def _context(spans: Sequence[Event], parent_of: Sequence[int | None], span: int | None) -> _Context:
    if span is None:
        return _Context(OUTSIDE_OPS, None, None)
    owner = BETWEEN_OPS if STEP_NAME.match(spans[span].name) else spans[span].name
    op = annotation = None
    at: int | None = span
    while at is not None and (op is None or annotation is None):
        e = spans[at]
        if op is None and e.cat == "cpu_op":
            op = e.name
        elif annotation is None and e.cat == "user_annotation" and not STEP_NAME.match(e.name):
            annotation = e.name
        at = parent_of[at]
    return _Context(owner, op, annotation)


def _device_report(device: str, pairs: list[tuple[MemoryEvent, _Context]],
                   steps: Sequence[Step]) -> dict[str, Any]:
    events = [m for m, _ in pairs]
    given = all(m.total_allocated is not None for m in events)
    if given:
        totals = [m.total_allocated for m in events]
        start = totals[0] - events[0].bytes
    else:
        start, totals, level = 0, [], 0
        for m in events:
            level += m.bytes
            totals.append(level)
    peak = max(range(len(events)), key=lambda i: totals[i])
    peak_step = step_at(steps, [s.start_us for s in steps], events[peak].time_us)
    reserved = [m.total_reserved for m in events if m.total_reserved]
    return {
        "device": device,
        "events": len(events),
        "totals": "allocator" if given else "summed",
        "allocated_at_start_bytes": start,
        "peak_allocated_bytes": totals[peak],
        "peak_time_us": events[peak].time_us,
        "peak_step": peak_step.number if peak_step else None,
        "peak_us_into_step": events[peak].time_us - peak_step.start_us if peak_step else None,
        "peak_op": pairs[peak][1].op,
        "peak_annotation": pairs[peak][1].annotation,
        "peak_reserved_bytes": max(reserved) if reserved else None,
        "final_allocated_bytes": totals[-1],
        **_blocks(events),
        **_by_step(events, totals, start, steps),
        "ops": _self_allocations(pairs),
    }


def _blocks(events: Sequence[MemoryEvent]) -> dict[str, int]:
    """Frees of blocks the trace never saw allocated (made before it began: their bytes are in
    the starting total, or on the CPU in none), and blocks allocated in it and never freed."""
    live: dict[int, int] = {}
    earlier_frees = earlier_bytes = 0
    for m in events:
        if m.bytes >= 0:
            if m.addr is not None:
                live[m.addr] = m.bytes
        elif m.addr is not None and m.addr in live:
            del live[m.addr]
        else:
            earlier_frees += 1
            earlier_bytes -= m.bytes
    return {"frees_of_earlier_blocks": earlier_frees, "freed_earlier_bytes": earlier_bytes,
            "unfreed_blocks": len(live), "unfreed_bytes": sum(live.values())}


def _by_step(events: Sequence[MemoryEvent], totals: Sequence[int], start: int,
             steps: Sequence[Step]) -> dict[str, Any]:
    """Each step's total at its start, peak, total at its end and growth; the events before the
    first step (allocations of set-up, the frees of what came before), counted apart."""
    times = [m.time_us for m in events]
    rows = []
    for s in steps:
        first, end = bisect.bisect_left(times, s.start_us), bisect.bisect_left(times, s.end_us)
        before = totals[first - 1] if first > 0 else start
        after = totals[end - 1] if end > first else before
        rows.append({"step": s.number, "start_bytes": before, "peak_bytes": max([before, *totals[first:end]]),
                     "end_bytes": after, "growth_bytes": after - before, "events": end - first})
    num_before = bisect.bisect_left(times, steps[0].start_us) if steps else 0
    return {
        "steps": rows,
        "grows_every_step": len(rows) >= 2 and all(r["growth_bytes"] > 0 for r in rows),
        "before_first_step": {"events": num_before, "net_bytes": sum(m.bytes for m in events[:num_before])}
        if num_before else None,
    }


def _self_allocations(pairs: Sequence[tuple[MemoryEvent, _Context]]) -> list[dict[str, Any]]:
    """Bytes allocated and freed in each op's own time (not its children's), most allocated first;
    `self_net_bytes` is what key_averages reports as the op's self memory usage."""
    rows: dict[str, dict[str, Any]] = {}
    for m, context in pairs:
        row = rows.setdefault(context.owner, {"name": context.owner, "allocations": 0, "allocated_bytes": 0,
                                              "freed_bytes": 0, "self_net_bytes": 0})
        if m.bytes > 0:
            row["allocations"] += 1
            row["allocated_bytes"] += m.bytes
        else:
            row["freed_bytes"] -= m.bytes
        row["self_net_bytes"] += m.bytes
    return sorted(rows.values(), key=lambda r: (-r["allocated_bytes"], r["name"]))

