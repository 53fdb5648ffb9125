"""Roofline: attainable FLOP/s against arithmetic intensity, with operating points on it.

The roof is `min(peak, intensity * bandwidth)` (Williams, Waterman and Patterson, "Roofline: an
insightful visual performance model for multicore architectures", CACM 2009). A point is a step
of work: its intensity is the model's FLOPs over the bytes it must move, its height the FLOPs
over the time (measured for a record, predicted otherwise). Decode steps sit left of the ridge
(memory-bound), prefill and training steps right of it. The PNG needs matplotlib (an optional
dependency: `pip install matplotlib`); without it `plot_png` raises a RuntimeError saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slipstream.perf.accelerators import Accelerator
from slipstream.perf.work import Work


@dataclasses.dataclass(frozen=True)
class OperatingPoint:
    label: str
    flops: float
    memory_bytes: float
    time_s: float
    measured: bool

    @property
    def intensity_flops_per_byte(self) -> float:
        return self.flops / self.memory_bytes if self.memory_bytes else float("inf")

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.time_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"intensity_flops_per_byte": self.intensity_flops_per_byte,
                                           "achieved_flops_per_s": self.achieved_flops_per_s}


def point(label: str, work: Work, measured_s: float | None = None) -> OperatingPoint:
    """A point from a modeled step; `measured_s` places it at the measured time instead."""
    time_s = work.total_s if measured_s is None else measured_s
    return OperatingPoint(label, work.flops, work.memory_bytes, time_s, measured_s is not None)


def roof_flops_per_s(accelerator: Accelerator, dtype: str, intensity: float) -> float:
    return min(accelerator.peak_flops(dtype), intensity * accelerator.memory_bandwidth_bytes_per_s)


def above_roof(p: OperatingPoint, accelerator: Accelerator, dtype: str) -> bool:
    """Whether a point claims more FLOP/s than the roof allows at its intensity: for a measured
    step, a time too short for its work (a bad record), or bytes the caches served instead of the
    memory (`Accelerator.read_bandwidth`)."""
    return p.achieved_flops_per_s > roof_flops_per_s(accelerator, dtype, p.intensity_flops_per_byte)


def format_points(points: Sequence[OperatingPoint], accelerator: Accelerator, dtype: str) -> str:
    ridge = accelerator.ridge_flops_per_byte(dtype)
    lines = [f"{accelerator.name}: peak {accelerator.peak_flops(dtype) / 1e12:.3g} TFLOP/s ({dtype}), "
             f"bandwidth {accelerator.memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s, ridge {ridge:.1f} FLOP/B",
             f"{'point':<32} {'FLOP/B':>10} {'GFLOP/s':>12} {'% of roof':>10}  source"]
    for p in points:
        roof = roof_flops_per_s(accelerator, dtype, p.intensity_flops_per_byte)
        source = "measured" if p.measured else "model"
        if above_roof(p, accelerator, dtype):
            source += ", ABOVE THE ROOF"
        percent = 100 * p.achieved_flops_per_s / roof
        lines.append(f"{p.label:<32} {p.intensity_flops_per_byte:>10.2f} "
                     f"{p.achieved_flops_per_s / 1e9:>12.1f} {percent:>9.1f}%  {source}")
    above = sum(p.measured and above_roof(p, accelerator, dtype) for p in points)
    if above:
        lines.append(f"{above} measured point(s) above the roof: a step time too short for its work "
                     "(check the records), or bytes served from cache rather than memory")
    return "\n".join(lines)


def plot_png(
    points: Sequence[OperatingPoint], accelerator: Accelerator, dtype: str, path: str | Path
) -> Path:
    """Write the roofline with its points to `path` (PNG); RuntimeError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "the roofline PNG needs matplotlib, which is not installed: pip install matplotlib "
            "(the same points are printed as a table and with --json)"
        ) from e
    intensities = [p.intensity_flops_per_byte for p in points] or [1.0]
    lo = min(min(intensities) / 4, 0.1)
    hi = max(max(intensities) * 4, accelerator.ridge_flops_per_byte(dtype) * 8)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(xs, [roof_flops_per_s(accelerator, dtype, x) for x in xs], "k-", label="roof")
    for p in points:
        ax.loglog(p.intensity_flops_per_byte, p.achieved_flops_per_s, "o" if p.measured else "x",
                  label=f"{p.label} ({'measured' if p.measured else 'model'})")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"{accelerator.name}, {dtype}")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
