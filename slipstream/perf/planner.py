"""Parallel-layout planner: enumerate layouts that fit, rank them by throughput, explain the best.

For training, every combination of tensor (within a node, dividing the heads), pipeline (with
1F1B or an interleaved schedule), context and data parallelism that multiplies to N devices is
tried with a few micro-batch sizes, ZeRO-1 or FSDP, and the cheapest recomputation that fits in
memory (none, then selective, then full). For serving, each tensor-parallel degree is tried with
N / tp independent replicas. `what_if.py` asks what a different device would change.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from slipstream.perf.accelerators import Accelerator
from slipstream.perf.efficiency import Efficiency, default_efficiency
from slipstream.perf.model import Layout, TrainingPrediction, TrainSetup, layout_error, predict_training
from slipstream.perf.serving import ServeSetup, kv_capacity, static_batch, step_time

MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_STAGES = (1, 2, 4)
RECOMPUTE_ORDER = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidate_layouts(setup: TrainSetup, num_devices: int, accelerator: Accelerator) -> list[Layout]:
    """Layouts whose degrees multiply to `num_devices` and divide the shape's dimensions."""
    shape = setup.shape
    layouts = []
    tps = [t for t in _divisors(min(accelerator.devices_per_node, num_devices))
           if shape.tensor_parallel_error(t) is None]
    for tp, cp in itertools.product(tps, (1, 2, 4, 8)):
        if num_devices % (tp * cp) or setup.seq_len % (2 * cp) and cp > 1:
            continue
        for pp in _divisors(num_devices // (tp * cp)):
            dp = num_devices // (tp * cp * pp)
            if pp > shape.num_layers or setup.global_batch_size % dp:
                continue
            for v, zero in itertools.product(VIRTUAL_STAGES if pp > 1 else (1,), (1, 3)):
                if pp * v > shape.num_layers or (zero == 3 and dp * cp == 1):
                    continue
                layouts.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1,
                                      zero_stage=zero, virtual_stages=v))
    return layouts


@dataclasses.dataclass(frozen=True)
class Plan:
    """One feasible layout with the setup (micro-batch, recomputation) it was evaluated with."""

    setup: TrainSetup
    prediction: TrainingPrediction

    def to_dict(self) -> dict[str, Any]:
        return self.prediction.to_dict() | {"micro_batch_size": self.setup.micro_batch_size,
                                            "recompute": self.setup.recompute}


def plan_training(
    setup: TrainSetup, num_devices: int, accelerator: Accelerator, efficiency: Efficiency | None = None,
    top: int = 10,
) -> list[Plan]:
    """Feasible layouts ranked by predicted tokens/s (fastest first), at most `top`.

    ValueError, as `predict_training` words it, for what no layout can change: a dtype with no
    peak on the device, or more than one device on a device that lists no link; a layout is only
    skipped for its own shape (`layout_error`) or for not fitting in memory.
    """
    accelerator.peak_flops(setup.dtype)
    if num_devices > 1:
        (efficiency or default_efficiency(accelerator)).intra_link(accelerator)
    plans = []
    for layout in candidate_layouts(setup, num_devices, accelerator):
        best = _best_for_layout(setup, layout, accelerator, efficiency)
        if best is not None:
            plans.append(best)
    plans.sort(key=lambda p: p.prediction.step_time_s)
    return plans[:top]


def _best_for_layout(setup: TrainSetup, layout: Layout, accelerator: Accelerator,
                     efficiency: Efficiency | None) -> Plan | None:
    """The fastest (micro-batch, recomputation) that fits in memory for this layout."""
    best = None
    per_rank = setup.global_batch_size // layout.dp
    for micro in (m for m in MICRO_BATCH_SIZES if per_rank % m == 0):
        if layout_error(dataclasses.replace(setup, micro_batch_size=micro), layout):
            continue
        for recompute in RECOMPUTE_ORDER:
            candidate = dataclasses.replace(setup, micro_batch_size=micro, recompute=recompute)
            prediction = predict_training(candidate, layout, accelerator, efficiency)
            if prediction.fits:
                if best is None or prediction.step_time_s < best.prediction.step_time_s:
                    best = Plan(candidate, prediction)
                break  # a heavier recomputation only costs time
    return best


def explain(plans: list[Plan], accelerator: Accelerator) -> list[str]:
    """Why the top layouts win: what bounds each, its bubble, exposed communication, headroom."""
    lines = []
    for rank, plan in enumerate(plans[:3], start=1):
        p, b = plan.prediction, plan.prediction.breakdown_s
        headroom = 1 - p.memory_bytes_per_device / accelerator.memory_bytes
        lines.append(
            f"#{rank} {p.layout.describe()} mb{plan.setup.micro_batch_size} "
            f"recompute={plan.setup.recompute}: "
            f"{p.step_time_s:.2f} s/step, MFU {100 * p.mfu:.1f}%, bound by {p.work.bound()}; "
            f"pipeline bubble {100 * b['bubble_s'] / p.step_time_s:.1f}%, exposed communication "
            f"{100 * b['exposed_comm_s'] / p.step_time_s:.1f}%, memory "
            f"{p.memory_bytes_per_device / 2**30:.1f} GiB ({100 * headroom:.0f}% headroom)"
        )
    if len(plans) > 1:
        gap = plans[1].prediction.step_time_s / plans[0].prediction.step_time_s - 1
        lines.append(f"#1 is {100 * gap:.1f}% faster than #2")
    return lines


@dataclasses.dataclass(frozen=True)
class ServePlan:
    tp: int
    replicas: int
    decode_ms_per_token_batch1: float
    max_batch: int
    throughput_tokens_per_s: float
    """All replicas together, at `max_batch` sequences each (static batches of the given lengths)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_serving(
    setup: ServeSetup, num_devices: int, accelerator: Accelerator, input_len: int, output_len: int,
    max_num_seqs: int = 256, efficiency: Efficiency | None = None,
) -> list[ServePlan]:
    """Each TP degree that fits, with N / tp replicas, ranked by total throughput."""
    plans = []
    for tp in _divisors(min(num_devices, accelerator.devices_per_node)):
        if setup.shape.tensor_parallel_error(tp, serving=True) or num_devices % tp:
            continue
        candidate = dataclasses.replace(setup, tp=tp)
        capacity = kv_capacity(candidate, accelerator, input_len + output_len)
        batch = min(capacity.max_sequences, max_num_seqs)
        if batch < 1:
            continue
        latency = step_time(candidate, accelerator, decode_contexts=[input_len], efficiency=efficiency)
        full = static_batch(candidate, accelerator, batch, input_len, output_len, efficiency)
        replicas = num_devices // tp
        plans.append(ServePlan(tp, replicas, 1e3 * latency.total_s, batch,
                               replicas * full.output_tokens_per_s))
    return sorted(plans, key=lambda p: -p.throughput_tokens_per_s)
