"""The nesting of a trace's host spans on each thread, as torch.profiler's event tree nests them:
which span is a span's parent, and which span a point in time (a memory event, a launch call)
falls in."""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from slipstream.perf.kineto import Event
from slipstream.perf.trace_gpu import LAUNCH_CATEGORIES

STEP_NAME = re.compile(r"ProfilerStep#(\d+)$")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", *LAUNCH_CATEGORIES)
"""The host events torch.profiler's own tree holds (and key_averages lists): ops, annotations,
Python frames (with_stack) and the runtime calls that launch and wait for device work."""


def by_thread(events: Iterable[Event], categories: Sequence[str]) -> dict[tuple[Any, Any], list[Event]]:
    """The events of `categories` on each (pid, tid), sorted by start, longest first (the order
    `parents` and `innermost` take)."""
    threads: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for e in events:
        if e.cat in categories:
            threads[(e.pid, e.tid)].append(e)
    for spans in threads.values():
        spans.sort(key=lambda e: (e.start_us, -e.end_us))
    return dict(threads)


def parents(spans: Sequence[Event]) -> list[int | None]:
    """The index of each span's parent: the innermost open span that contains it whole (spans
    sorted by start, longest first). As torch.profiler builds its event tree: a span that
    starts inside another but ends after it (the profiler's rounding, a record_function opened
    inside a Python call) is not its child, and that span is closed for the spans after it."""
    out: list[int | None] = []
    stack: list[int] = []
    for i in range(len(spans)):
        _open(spans, stack, i)
        out.append(stack[-1] if stack else None)
        stack.append(i)
    return out


def innermost(spans: Sequence[Event], times: Sequence[float]) -> list[int | None]:
    """For each of `times` (sorted), the index of the innermost span (of `spans`, sorted as
    `parents` takes them) open at that time, its start and end included; None outside them all.
    One merge walk over both with the stack of open spans that `parents` keeps."""
    out: list[int | None] = []
    stack: list[int] = []
    i = 0
    for t in times:
        while i < len(spans) and spans[i].start_us <= t:
            _open(spans, stack, i)
            stack.append(i)
            i += 1
        # The stack nests, so a span under one that is still open is open too.
        while stack and spans[stack[-1]].end_us < t:
            stack.pop()
        out.append(stack[-1] if stack else None)
    return out


def _open(spans: Sequence[Event], stack: list[int], i: int) -> None:
    """Close the spans on `stack` that do not contain span `i` whole."""
    e = spans[i]
    while stack and (e.start_us >= spans[stack[-1]].end_us or e.end_us > spans[stack[-1]].end_us):
        stack.pop()


@dataclasses.dataclass(frozen=True)
class Step:
    number: int
    start_us: float
    end_us: float

    @property
    def name(self) -> str:
        return f"ProfilerStep#{self.number}"


def profiler_steps(events: Sequence[Event]) -> list[Step]:
    """The host-side `ProfilerStep#N` annotations, in order (one per step, on the host thread)."""
    steps = {}
    for e in events:
        match = STEP_NAME.match(e.name)
        if match and e.cat == "user_annotation":
            number = int(match.group(1))
            if number not in steps or e.dur_us > steps[number].end_us - steps[number].start_us:
                steps[number] = Step(number, e.start_us, e.end_us)
    return [steps[n] for n in sorted(steps)]


def step_at(steps: Sequence[Step], starts: list[float], time_us: float) -> Step | None:
    i = bisect.bisect_right(starts, time_us) - 1
    return steps[i] if i >= 0 and time_us < steps[i].end_us else None
