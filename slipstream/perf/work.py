"""`Work`: modeled time split by what bounds it, the unit every prediction adds up.

Splitting every predicted time into GEMM, memory-streaming, communication and fixed-overhead
seconds is what lets `fit.py` calibrate each kind separately from measured steps, and what lets a
report say which resource bounds a workload.
"""

from __future__ import annotations

import dataclasses

COMPONENTS = ("gemm_s", "memory_s", "comm_s", "overhead_s")


@dataclasses.dataclass(frozen=True)
class Work:
    """Seconds by kind on one device, and the FLOPs and bytes behind them."""

    gemm_s: float = 0.0
    """Matmul kernels (their roofline: compute- or memory-bound, whichever is slower)."""
    memory_s: float = 0.0
    """Memory-bound kernels: norms, activations, softmax, KV-cache reads, optimizer."""
    comm_s: float = 0.0
    """Communication on the critical path (what overlap did not hide)."""
    overhead_s: float = 0.0
    """Fixed per-kernel and per-step costs."""
    flops: float = 0.0
    memory_bytes: float = 0.0
    comm_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.memory_s + self.comm_s + self.overhead_s

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                            strict=True)))

    def __mul__(self, factor: float) -> Work:
        return Work(*(a * factor for a in dataclasses.astuple(self)))

    __rmul__ = __mul__

    def bound(self) -> str:
        """The component with the most time: "gemm", "memory", "comm" or "overhead"."""
        return max(COMPONENTS, key=lambda c: getattr(self, c)).removesuffix("_s")

    def scaled(self, scales: dict[str, float]) -> Work:
        """Each time component times its factor (calibration multipliers; missing keys are 1)."""
        return dataclasses.replace(self, **{c: getattr(self, c) * scales.get(c, 1.0) for c in COMPONENTS})

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"total_s": self.total_s}


def total(works: list[Work]) -> Work:
    result = Work()
    for w in works:
        result = result + w
    return result
