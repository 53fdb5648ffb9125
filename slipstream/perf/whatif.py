"""What-if hardware: scale a device's FLOP/s, memory bandwidth, capacity or link speed and see
which resource bounds a workload, and what it would take to reach a target.

A workload is a function from an `Accelerator` to a metric (seconds per step, seconds per output
token). `sweep` reports the metric and the bounding component for each single-resource scaling;
`requirements` finds, by bisection on a log scale, the smallest factor of each resource alone
(and of all together) that meets a target, or says that resource alone cannot: the time left in
the other components is the floor it cannot go below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from slipstream.perf.accelerators import Accelerator
from slipstream.perf.work import Work

RESOURCES = ("flops", "memory_bandwidth", "link")
MAX_FACTOR = 1000.0


@dataclasses.dataclass(frozen=True)
class Requirement:
    resource: str
    """"flops", "memory_bandwidth", "link" or "all"."""
    factor: float | None
    """Smallest scaling that meets the target; None when this resource alone cannot."""
    floor_s: float
    """The metric with this resource made 1000x faster: what the other resources leave."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sweep(workload: Callable[[Accelerator], Work], accelerator: Accelerator,
          factors: tuple[float, ...] = (0.5, 2.0, 4.0)) -> list[dict[str, Any]]:
    """The metric and its bounding component for each resource scaled by each factor."""
    rows = [_row("baseline", 1.0, workload(accelerator))]
    for resource in RESOURCES:
        for factor in factors:
            rows.append(_row(resource, factor, workload(accelerator.scaled(**{resource: factor}))))
    return rows


def _row(resource: str, factor: float, work: Work) -> dict[str, Any]:
    return {"resource": resource, "factor": factor, "time_s": work.total_s, "bound": work.bound(),
            "work": work.to_dict()}


def requirements(workload: Callable[[Accelerator], Work], accelerator: Accelerator,
                 target_s: float) -> list[Requirement]:
    """What each resource alone (and all together) must scale by for `workload` <= `target_s`."""
    if not target_s > 0:
        raise ValueError(f"target must be > 0, got {target_s}")
    result = []
    for resource in RESOURCES + ("all",):
        def metric(f: float, resource: str = resource) -> float:
            scales = dict.fromkeys(RESOURCES, f) if resource == "all" else {resource: f}
            return workload(accelerator.scaled(**scales)).total_s

        floor = metric(MAX_FACTOR)
        factor = None if floor > target_s else _bisect(metric, target_s)
        result.append(Requirement(resource, factor, floor))
    return result


def _bisect(metric: Callable[[float], float], target_s: float) -> float:
    """Smallest factor in [1e-3, MAX_FACTOR] with metric(factor) <= target (metric decreasing)."""
    lo, hi = math.log(1e-3), math.log(MAX_FACTOR)
    if metric(math.exp(lo)) <= target_s:
        return math.exp(lo)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if metric(math.exp(mid)) <= target_s:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def capacity_factor(needed_bytes: float, accelerator: Accelerator) -> float:
    """How much more memory per device a workload needs (<= 1: it already fits)."""
    return needed_bytes / accelerator.memory_bytes
