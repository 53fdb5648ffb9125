"""Calibration: fit the model's efficiency knobs to measured times, then predict again.

Every prediction is a `Work` split into GEMM, memory, communication and overhead seconds, so a
measured time `y` is modeled as `sum_c k_c * T_c` with one multiplier `k_c` per component. The
multipliers are fitted by least squares on relative error with a weak pull towards 1 (so a
component the measurements cannot see keeps its prior), then folded back into the `Efficiency`
(a GEMM multiplier of 1.2 divides `gemm_fraction` by 1.2, an overhead multiplier scales the
per-kernel costs) and the fit is repeated, because a changed efficiency can move a GEMM across
its roofline ridge. Readers for slipstream's own records live in `records.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from slipstream.perf.efficiency import MAX_FRACTION, Efficiency
from slipstream.perf.work import COMPONENTS, Work

PRIOR_WEIGHT = 1e-3
MIN_SCALE, MAX_SCALE = 0.2, 20.0
"""Bounds of a fitted multiplier: a stack 5x faster than its default fraction of the datasheet is
a misfit (a component the measurements do not constrain), not a discovery."""
"""Weight of the pull of each multiplier towards 1, against each point's squared relative error."""


def fit_scales(
    works: Sequence[Work], measured_s: Sequence[float], components: Sequence[str] = COMPONENTS,
    prior_weight: float = PRIOR_WEIGHT,
) -> dict[str, float]:
    """Multipliers per component minimising relative error of `sum_c k_c T_c` against `measured_s`.

    Multipliers are kept in [MIN_SCALE, MAX_SCALE]: a component that would need more is not what
    limits the measurements, and its multiplier is clamped rather than left to absorb noise.
    """
    if len(works) != len(measured_s) or not works:
        raise ValueError("need as many measured times as predictions, at least one")
    if any(not m > 0 for m in measured_s):
        raise ValueError("measured times must be > 0")
    used = [c for c in components if any(getattr(w, c) > 0 for w in works)]
    fixed = [c for c in COMPONENTS if c not in used]  # kept at multiplier 1
    y = np.asarray(measured_s, dtype=float)
    a = np.array([[getattr(w, c) for c in used] for w in works], dtype=float) / y[:, None]
    b = 1.0 - np.array([sum(getattr(w, c) for c in fixed) for w in works]) / y
    # Ridge towards 1: append sqrt(weight) * (k - 1) = 0 rows.
    a = np.vstack([a, np.sqrt(prior_weight) * np.eye(len(used))])
    b = np.concatenate([b, np.sqrt(prior_weight) * np.ones(len(used))])
    k, *_ = np.linalg.lstsq(a, b, rcond=None)
    return {c: float(np.clip(v, MIN_SCALE, MAX_SCALE)) for c, v in zip(used, k, strict=True)}


def apply_scales(efficiency: Efficiency, scales: dict[str, float],
                 ceiling: float = MAX_FRACTION) -> Efficiency:
    """Fold component multipliers into the efficiency knobs (time x k = rate / k), no fraction
    past `ceiling` (`efficiency.max_fraction` of the accelerator)."""
    g, m = scales.get("gemm_s", 1.0), scales.get("memory_s", 1.0)
    c, o = scales.get("comm_s", 1.0), scales.get("overhead_s", 1.0)
    note = ", ".join(f"{k.removesuffix('_s')} x{v:.3f}" for k, v in scales.items())
    sources = dict(efficiency.sources) | {"calibration": f"fitted to measurements: {note}"}
    return efficiency.replace(
        gemm_fraction=min(efficiency.gemm_fraction / g, ceiling),
        attention_fraction=min(efficiency.attention_fraction / g, ceiling),
        training_attention_fraction=min(efficiency.training_attention_fraction / g, ceiling),
        memory_fraction=min(efficiency.memory_fraction / m, ceiling),
        link_fraction=min(efficiency.link_fraction / c, ceiling),
        network_fraction=min(efficiency.network_fraction / c, ceiling),
        gemm_overhead_s=efficiency.gemm_overhead_s * o, kernel_overhead_s=efficiency.kernel_overhead_s * o,
        module_call_overhead_s=efficiency.module_call_overhead_s * o,
        step_overhead_s=efficiency.step_overhead_s * o,
        sequence_overhead_s=efficiency.sequence_overhead_s * o,
        link_latency_s=efficiency.link_latency_s * c, network_latency_s=efficiency.network_latency_s * c,
        sources=sources,
    )


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A fitted efficiency and how well it explains the measurements it was fitted to."""

    efficiency: Efficiency
    scales: dict[str, float]
    """Product of the multipliers over the fitting rounds, per component."""
    errors_before: list[float]
    errors_after: list[float]
    """Relative errors (predicted / measured - 1) per measurement."""

    def to_dict(self) -> dict:
        return {"efficiency": self.efficiency.to_dict(), "scales": self.scales,
                "errors_before": self.errors_before, "errors_after": self.errors_after}


def calibrate(
    predict: Callable[[Efficiency], Sequence[Work]], measured_s: Sequence[float],
    efficiency: Efficiency, components: Sequence[str] = COMPONENTS, rounds: int = 4,
    ceiling: float = MAX_FRACTION,
) -> Calibration:
    """Fit `efficiency` so that `predict(efficiency)` matches `measured_s`, no fraction past
    `ceiling` (`efficiency.max_fraction` of the accelerator); see the module doc."""
    original = efficiency
    before = [w.total_s / m - 1 for w, m in zip(predict(efficiency), measured_s, strict=True)]
    total = dict.fromkeys(components, 1.0)
    for _ in range(rounds):
        scales = fit_scales(predict(efficiency), measured_s, components)
        total = {c: min(max(total[c] * scales.get(c, 1.0), MIN_SCALE), MAX_SCALE) for c in total}
        efficiency = apply_scales(original, total, ceiling)
    after = [w.total_s / m - 1 for w, m in zip(predict(efficiency), measured_s, strict=True)]
    return Calibration(efficiency, total, before, after)


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    return [p / m - 1 for p, m in zip(predicted, measured, strict=True)]
