"""The device side of a profiler trace: kernel classes, TraceLens's split of the kernels' span,
and HTA's communication/compute overlap, idle-time breakdown and CUDA kernel launch statistics
(trace.py assigns the kernels to steps and reports them).

Sources: HTA `hta/analyzers/breakdown_analysis.py`, `hta/analyzers/cuda_kernel_analysis.py` and
`docs/source/features/`; TraceLens `TraceLens/TreePerf/gpu_event_analyser.py`.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from slipstream.perf.kineto import Event

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "xpu_runtime")
KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# HTA's classes (hta/common/types.py) by kernel name. HTA's communication class is NCCL's and HCCL's
# kernels (and every name starting "hip", a HIP memcpy included); here it is NCCL's, RCCL's and
# HCCL's, and collectives named as such (TensorRT-LLM's allReduceFusionKernel).
_COMMUNICATION = re.compile(r"nccl|rccl|hccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all",
                            re.IGNORECASE)
_MEMORY = re.compile(r"^(hip)?(memcpy|memset)|^dma", re.IGNORECASE)

Intervals = list[tuple[float, float]]


def union(spans: Iterable[tuple[float, float]]) -> Intervals:
    """The sorted, disjoint union of half-open spans [start, end)."""
    merged: Intervals = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The intersection of two unions (each sorted and disjoint), by a merge walk."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> float:
    """The length of `a` outside `b` (both unions)."""
    return length(a) - length(intersect(a, b))


def kernel_class(event: Event) -> str:
    """HTA's kernel classes: communication, memory or compute."""
    return _kernel_class(event.name, event.cat)


@functools.lru_cache(maxsize=65536)
def _kernel_class(name: str, cat: str) -> str:
    if _COMMUNICATION.search(name):
        return "communication"
    if cat in ("gpu_memcpy", "gpu_memset") or _MEMORY.search(name):
        return "memory"
    return "compute"


def gpu_breakdown(kernels: Sequence[Event], launch_us: dict[int, float]) -> dict[str, float]:
    """TraceLens's split of the kernels' span (first start to last end), HTA's overlap, and
    HTA's idle-time breakdown (`idle_waits`)."""
    if not kernels:
        return {}
    by_class: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for k in kernels:
        by_class[kernel_class(k)].append((k.start_us, k.end_us))
    compute = union(by_class["compute"])
    communication = union(by_class["communication"])
    memory = union(by_class["memory"])
    busy = union([*compute, *communication, *memory])
    span = max(k.end_us for k in kernels) - min(k.start_us for k in kernels)
    communication_us = length(communication)
    return {
        "span_us": span,
        "compute_us": length(compute),
        "exposed_communication_us": subtract(communication, compute),
        "exposed_memory_us": subtract(memory, union([*compute, *communication])),
        "idle_us": span - length(busy),
        "communication_us": communication_us,
        "memory_us": length(memory),
        "overlap": length(intersect(communication, compute)) / communication_us if communication_us else None,
        **idle_waits(kernels, launch_us),
    }


KERNEL_WAIT_US = 30.0
"""HTA's `consecutive_kernel_delay`: a shorter gap between kernels on a stream is the kernels'
own launch latency, not a wait on anything."""


def idle_waits(kernels: Sequence[Event], launch_us: dict[int, float]) -> dict[str, float]:
    """HTA's idle-time breakdown, summed over streams (so with several streams it can exceed the
    span's idle time). Each gap between consecutive kernels on a stream is a *host wait* when the
    next kernel's launch call started after the previous kernel ended (the GPU waited for the
    CPU), else a *kernel wait* when shorter than KERNEL_WAIT_US, else *other* (an event, a
    dependency on another stream)."""
    waits = {"host_wait_us": 0.0, "kernel_wait_us": 0.0, "other_wait_us": 0.0}
    by_stream: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for k in kernels:
        by_stream[(k.pid, k.tid)].append(k)
    for stream in by_stream.values():
        stream.sort(key=lambda k: k.start_us)
        for previous, k in itertools.pairwise(stream):
            gap = k.start_us - previous.end_us
            if gap <= 0:
                continue
            if launch_us.get(k.correlation, -math.inf) > previous.end_us:
                waits["host_wait_us"] += gap
            elif gap < KERNEL_WAIT_US:
                waits["kernel_wait_us"] += gap
            else:
                waits["other_wait_us"] += gap
    return waits


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync")
"""The runtime calls HTA's launch statistics follow to their kernels (copies and sets included)."""
RUNTIME_OUTLIER_US = 50.0
"""HTA's `runtime_cutoff`: a launch call longer than this is an outlier."""
LAUNCH_DELAY_OUTLIER_US = 100.0
"""HTA's `launch_delay_cutoff`: a kernel starting this long after its launch call ended is one."""


def launch_stats(kernels: Sequence[Event], calls: dict[int, Event]) -> dict[str, float]:
    """HTA's CUDA kernel launch statistics over `kernels`: each launched by one of LAUNCH_CALLS
    (`calls`, by correlation: `launch_calls`), its launch delay (the kernel's start less the
    call's end, at least 0), how many ran shorter than their launch call took (the GPU outpaced
    the CPU), and HTA's outliers. {} when no kernel has its launch call in the trace."""
    pairs = [(calls[k.correlation], k) for k in kernels
             if k.correlation in calls and calls[k.correlation].name in LAUNCH_CALLS]
    if not pairs:
        return {}
    delays = sorted(max(k.start_us - call.end_us, 0.0) for call, k in pairs)
    return {
        "launches": len(pairs),
        "shorter_than_launch": sum(k.dur_us < call.dur_us for call, k in pairs),
        "launch_call_us": sum(call.dur_us for call, _ in pairs),
        "launch_delay_us": sum(delays),
        "median_launch_delay_us": statistics.median(delays),
        "runtime_outliers": sum(call.dur_us > RUNTIME_OUTLIER_US for call, _ in pairs),
        "launch_delay_outliers": sum(d > LAUNCH_DELAY_OUTLIER_US for d in delays),
    }


def launch_calls(events: Sequence[Event]) -> dict[int, Event]:
    """Each runtime call (cudaLaunchKernel, cudaMemcpyAsync, ...) by its correlation id."""
    return {e.correlation: e for e in events if e.cat in LAUNCH_CATEGORIES and e.correlation is not None}
