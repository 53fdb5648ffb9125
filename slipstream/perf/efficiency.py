"""How close a software stack gets to a device's datasheet: the model's calibration knobs.

Kernel times are rooflines with size-dependent efficiency, not one constant:

    compute     = 2 m k n / (peak * gemm_fraction),  memory = bytes / (bandwidth * memory_fraction)
    gemm_time   = max(compute, memory) + (1 - roofline_overlap) * min(compute, memory)
                  + gemm_overhead_s
    stream_time = bytes / (bandwidth * memory_fraction) + kernel_overhead_s
    link        = per-direction bandwidth * link_fraction, latency per algorithm step (on a
                  host link measured collective by collective, each collective's measured
                  steps and share of that bandwidth: `collectives.MeasuredCost`)

The fixed per-call overhead makes the achieved fraction of peak rise with the GEMM's size and
saturate at `gemm_fraction` (`gemm_efficiency` reports it), the curve Calculon tabulates per
size (calculon-ai/calculon, systems/*.json `gflops_efficiency`). `roofline_overlap` is 1 (the
roofline) on GPUs; on CPUs a small-M GEMM (decode at batch 8-32) costs about its weight streaming
plus its compute, which is the ECM model's no-overlap sum (0). `fit.py` fits these knobs to
measured steps; `default_efficiency` gives, per accelerator, values from public measurements
(named in `sources`) where they exist and labelled assumptions where they do not.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Mapping
from typing import Any

from slipstream.perf.accelerators import Accelerator
from slipstream.perf.collectives import Link

_MAMF = (
    "Maximum Achievable Matmul FLOPS table, stas00/ml-engineering compute/accelerator/README.md "
    "(bf16 matmul, best shape): A100 SXM 267.9 of 312 TFLOPS, H100 SXM 792.1 of 989, MI300X "
    "781.9 of 1300 (ROCm 6.2), https://github.com/stas00/ml-engineering/blob/master/compute/"
    "accelerator/README.md#maximum-achievable-matmul-flops-comparison-table"
)
_H200_MSMF, _H200_MAMF = 698.6e12, 823.9e12
_B200_MSMF, _B200_MAMF = 1426.4e12, 1751.2e12
_MSMF = (
    "Maximum Sustainable Matmul FLOPS, stas00/ml-engineering compute/accelerator/benchmarks/"
    "README.md ('What we measured: alone vs all-8 concurrent', bf16, mean of 8 GPUs x 5 rounds "
    "with every GPU of the node computing): H200 698.6 TFLOPS sustained against a 823.9 boost-"
    "burst MAMF, B200 1426.4 against 1751.2; MSMF, the clock settled at the power limit, is "
    "'the power-saturated, sustained rate that matches real training throughput', MAMF the short "
    "burst's, https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/benchmarks/"
    "README.md#maximum-achievable-matmul-flops-finder"
)
_SUSTAINED_FROM_MAMF = (
    f"assumption built on measurements: no sustained (MSMF) figure is published for this part, so "
    f"its burst MAMF ({_MAMF}) times the H200's sustained-to-burst ratio "
    f"{_H200_MSMF / _H200_MAMF:.3f} (B200: {_B200_MSMF / _B200_MAMF:.3f}) ({_MSMF})"
)
_GPT_FAST_BW = (
    "pytorch-labs/gpt-fast README: on an A100 80GB 'peak bandwidth is about 1700 GB/s' "
    "empirically, 1700 / 2039 = 0.834, https://github.com/pytorch-labs/gpt-fast#speculative-sampling"
)
_ASTRA_H100 = (
    "ASTRA-sim HGX-H100 network config validated against NCCL: 400 GB/s of NVLink4's 450 per "
    "direction and 936.25 ns per step, https://github.com/astra-sim/astra-sim/blob/master/"
    "examples/network/analytical/HGX-H100-validated.yml"
)
_A100_NCCL = (
    "nccl-tests issue #149: 8x A100-SXM4-80GB over NVSwitch, all_reduce busbw about 200 GB/s "
    "of 300 per direction (https://github.com/NVIDIA/nccl-tests/issues/149); Calculon's A100 "
    "system file uses 0.65 (calculon-ai/calculon systems/a100_80g.json)"
)
_IB_NCCL = (
    "nccl-tests issue #119: 3 nodes of 8x A100 with 4x HDR per node, all_reduce busbw about "
    "85 GB/s of 100 (https://github.com/NVIDIA/nccl-tests/issues/119)"
)
_FA2 = (
    "Dao, 'FlashAttention-2', arXiv 2307.08691, abstract: 50-73% of the A100's peak (0.6, the "
    "middle of that range), https://arxiv.org/abs/2307.08691"
)
_FA3 = (
    "Shah et al., 'FlashAttention-3', arXiv 2407.08608, abstract: FlashAttention-2 reaches only "
    "35% of the H100's peak (FlashAttention-3 up to 75%), https://arxiv.org/abs/2407.08608"
)
_ASSUMED = "assumption (no public measurement found); fit it to your runs with `slipstream perf fit`"
_EAGER_OP_S = 5e-6
_EAGER_OP = (
    "PyTorch's operator micro-benchmarks time an eager CPU op doing almost no work at 2.3-3.4 us "
    "(pytorch/pytorch PR #32194, split_M8_N8_cpu); an engine kernel is a module call around one "
    "or two such ops: 5 us (assumption built on that measurement)"
)
_ENGINE_HOST = (
    "measured: slipstream's engine outside the model (scheduling, sampling, outputs) on a 2-core "
    "AMD EPYC, tiny and small presets, decode batches 1-32: 0.15-0.25 ms per step plus 13-21 us "
    "per sequence (engine.step less runner.execute)"
)
_MODULE_CALL_S = 12e-6
_MODULE_CALL = (
    "measured (benchmarks/moe_decode_prediction.py --module-by-module --shapes skeleton-2,skeleton-12): "
    "a Mixtral-shaped model with every width tiny (hidden 64, 8 experts of 64), so its decode step "
    "is all fixed cost, on a 2-core AMD EPYC, batch 1, two runs on a shared machine: the fastest "
    "step rises by 184-191 us per layer from 2 to 12 layers in fp32 and 198-209 in bf16, 11.5-12.3 "
    "us for each of the 16 (bf16: 17) kernel and GEMM calls the serving model counts in such a "
    "layer; an isolated C kernel call from Python (add_rms_norm_, rotary_embedding_, gemv on one "
    "row) takes 7-8 us there, the module code around it the rest"
)
_CPU_SDPA_TRAINING = (
    "measured (docs/training.md, Performance): in a bf16 training step of the tiny preset on a "
    "2-core AMD EPYC, PyTorch's CPU flash-attention kernel (SDPA, forward and backward, head_dim "
    "64) ran at about 70 GFLOP/s, 7% of the calibrated 971 GFLOP/s bf16 peak; the same fraction "
    "is assumed in fp32 (SDPA's forward alone: 10-30% of the fp32 peak, docs/perf.md)"
)
_CPU_OVERLAP = (
    "assumption: half way between the roofline (1, full overlap) and the ECM model's sum of "
    "in-core and transfer time (0, https://hpc.fau.de/research/ecm/); `fit_engine_steps` picks "
    "the value that fits measured engine steps"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of the datasheet a stack achieves, and fixed per-call costs, with sources."""

    gemm_fraction: float = 0.8
    """Plateau fraction of the dense peak for large GEMMs, at the clock a long run sustains."""
    gemm_overhead_s: float = 3e-6
    """Fixed time per GEMM call (launch, ramp, tail wave): small GEMMs achieve less."""
    attention_fraction: float = 0.5
    """Fraction of the dense peak a fused (flash) attention kernel achieves, forward and backward."""
    training_attention_fraction: float | None = None
    """The same for the kernel training runs; None is `attention_fraction` (on GPUs both are
    FlashAttention). On a CPU training runs PyTorch's SDPA, the engine's prefill its own kernel."""
    memory_fraction: float = 0.83
    """Fraction of the memory bandwidth a streaming kernel achieves."""
    roofline_overlap: float = 1.0
    """Fraction of the shorter of a kernel's compute and memory times hidden under the longer:
    1 is the roofline's `max` (a pipelined GPU kernel), 0 adds the two (see `overlapped_s`)."""
    kernel_overhead_s: float = 3e-6
    """Fixed time per non-GEMM kernel."""
    module_call_overhead_s: float | None = None
    """Fixed time per kernel or GEMM call where slipstream's CPU engine runs a model's layers module
    by module (prefills, decode steps no decode graph holds): the call from Python through its
    module, its checks and ctypes. None is `kernel_overhead_s`."""
    step_overhead_s: float = 0.0
    """Fixed host time per serving step (scheduling, launching the step)."""
    sequence_overhead_s: float = 0.0
    """Host time per sequence per serving step (its sampling row, detokenization, output)."""
    link_fraction: float = 0.8
    """Achieved busbw over the per-direction link bandwidth, scale-up link."""
    network_fraction: float = 0.85
    """The same for the scale-out network."""
    link_latency_s: float = 1e-6
    network_latency_s: float = 5e-6
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.training_attention_fraction is None:
            object.__setattr__(self, "training_attention_fraction", self.attention_fraction)
        if self.module_call_overhead_s is None:
            object.__setattr__(self, "module_call_overhead_s", self.kernel_overhead_s)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "sources" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                        or not math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        if not isinstance(self.sources, Mapping):
            raise ValueError(f"sources must be a mapping of field to source, got {self.sources!r}")
        for name in FRACTIONS:
            value = getattr(self, name)
            if not 0 < value <= MAX_FRACTION:  # > 1 only against a measured peak (max_fraction)
                raise ValueError(f"{name} must be in (0, {MAX_FRACTION:g}], got {value}")
        if not 0 <= self.roofline_overlap <= 1:
            raise ValueError(f"roofline_overlap must be in [0, 1], got {self.roofline_overlap}")
        for name in ("gemm_overhead_s", "kernel_overhead_s", "module_call_overhead_s", "step_overhead_s",
                     "sequence_overhead_s", "link_latency_s", "network_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "sources", types.MappingProxyType(dict(self.sources)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Efficiency:
        """Inverse of `to_dict`; unknown keys are a ValueError naming them."""
        if not isinstance(d, Mapping):
            raise ValueError(f"efficiency must be a JSON object of fractions and costs, "
                             f"got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown efficiency keys {sorted(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes: Any) -> Efficiency:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v)
                for f in dataclasses.fields(self)}

    # ---- kernel times -----------------------------------------------------------------------

    def gemm_time_s(self, m: float, k: float, n: float, element_bytes: float,
                    acc: Accelerator, dtype: str, count: float = 1) -> float:
        """Time of `count` (m x k) @ (k x n) GEMMs: the roofline plus a fixed cost per call."""
        flops = 2.0 * m * k * n
        traffic = element_bytes * (m * k + k * n + m * n)
        compute_s = flops / (acc.peak_flops(dtype) * self.gemm_fraction)
        memory_s = traffic / (acc.memory_bandwidth_bytes_per_s * self.memory_fraction)
        return count * (sum(self.overlapped_s(compute_s, memory_s)) + self.gemm_overhead_s)

    def overlapped_s(self, compute_s: float, memory_s: float) -> tuple[float, float]:
        """(compute, memory) seconds a kernel is charged: the longer in full, the shorter less
        the fraction `roofline_overlap` hidden under it.

        At 1 this is the roofline (Williams et al. 2009); at 0 the sum, as the ECM model adds a
        CPU core's non-overlapping execution to its data-transfer time (Hager, Treibig, Wellein;
        https://hpc.fau.de/research/ecm/): a small-M GEMM on a CPU streams a weight panel, then
        computes on it.
        """
        exposed = 1.0 - self.roofline_overlap
        if compute_s >= memory_s:
            return compute_s, exposed * memory_s
        return exposed * compute_s, memory_s

    def gemm_efficiency(self, m: float, k: float, n: float, element_bytes: float,
                        acc: Accelerator, dtype: str) -> float:
        """Achieved fraction of the dense peak for one GEMM of this size (the size curve)."""
        time_s = self.gemm_time_s(m, k, n, element_bytes, acc, dtype)
        return 2.0 * m * k * n / time_s / acc.peak_flops(dtype)

    def stream_time_s(self, num_bytes: float, acc: Accelerator, num_kernels: float = 1) -> float:
        """Time of memory-bound kernels moving `num_bytes` in total."""
        bandwidth = acc.memory_bandwidth_bytes_per_s * self.memory_fraction
        return num_bytes / bandwidth + num_kernels * self.kernel_overhead_s

    def intra_link(self, acc: Accelerator) -> Link:
        """The scale-up link at its achieved bandwidth."""
        bandwidth = acc.intra_node_bytes_per_s or acc.inter_node_bytes_per_s
        if not bandwidth:
            raise ValueError(f"{acc.name} lists no link bandwidth; collectives need one")
        return Link(latency_s=self.link_latency_s, bandwidth_bytes_per_s=bandwidth * self.link_fraction)

    def inter_link(self, acc: Accelerator) -> Link:
        """The scale-out network at its achieved bandwidth."""
        bandwidth = acc.inter_node_bytes_per_s or acc.intra_node_bytes_per_s
        if not bandwidth:
            raise ValueError(f"{acc.name} lists no network bandwidth; collectives need one")
        return Link(latency_s=self.network_latency_s,
                    bandwidth_bytes_per_s=bandwidth * self.network_fraction)


# GEMMs run at the sustained (power-limited) rate, not the burst MAMF: a training step keeps
# every SM busy for seconds, so the clock settles at the power limit.
_HOPPER_SUSTAINED = _H200_MSMF / 989.4e12
_DEFAULTS: dict[str, dict[str, Any]] = {
    "A100 SXM 80GB": dict(gemm_fraction=267.9 / 312 * _H200_MSMF / _H200_MAMF, link_fraction=0.67,
                          attention_fraction=0.6,
                          sources={"gemm_fraction": _SUSTAINED_FROM_MAMF,
                                   "link_fraction": _A100_NCCL, "attention_fraction": _FA2}),
    "H100 SXM": dict(gemm_fraction=_HOPPER_SUSTAINED, link_fraction=400 / 450,
                     link_latency_s=0.936e-6, attention_fraction=0.35,
                     sources={"gemm_fraction": f"{_MSMF} (H100: the H200's GH100 die at the same "
                                               "700 W; the MAMF table lists the H200 as the same)",
                              "link_fraction": _ASTRA_H100, "link_latency_s": _ASTRA_H100,
                              "attention_fraction": _FA3}),
    "H200": dict(gemm_fraction=_HOPPER_SUSTAINED, link_fraction=400 / 450, link_latency_s=0.936e-6,
                 attention_fraction=0.35,
                 sources={"gemm_fraction": _MSMF, "link_fraction": _ASTRA_H100,
                          "link_latency_s": _ASTRA_H100, "attention_fraction": _FA3}),
    "B200": dict(gemm_fraction=_B200_MSMF / 2250e12, sources={"gemm_fraction": _MSMF}),
    "MI300X": dict(gemm_fraction=781.9 / 1307.4, link_fraction=0.67,
                   sources={"gemm_fraction": f"{_MAMF}; the MI300X reaches its 750 W limit within "
                                             f"one bf16 kernel, so its MAMF is already the "
                                             f"sustained rate ({_MSMF})",
                            "link_fraction": f"{_ASSUMED} (A100 value)"}),
}


MAX_FRACTION = 1.5
"""The most of a peak an efficiency may claim: a measured peak (`Accelerator.calibrated`) is the
best of a few GEMM shapes, which a longer or better-shaped product can beat."""

FRACTIONS = ("gemm_fraction", "attention_fraction", "training_attention_fraction", "memory_fraction",
             "link_fraction", "network_fraction")


def max_fraction(acc: Accelerator) -> float:
    """The most of `acc`'s peaks an efficiency may claim: `MAX_FRACTION` of a measured peak, all
    of a datasheet's (no run beats it, so more would predict an MFU above 100%)."""
    return MAX_FRACTION if acc.calibrated else 1.0


def check_fractions(efficiency: Efficiency, acc: Accelerator) -> None:
    """ValueError naming a fraction of `efficiency` beyond `max_fraction(acc)`."""
    ceiling = max_fraction(acc)
    for name in FRACTIONS:
        if getattr(efficiency, name) > ceiling:
            raise ValueError(f"{name} {getattr(efficiency, name):g} is more than {acc.name} can give: its "
                             f"peaks are its datasheet's, which no run beats (at most {ceiling:g})")


def default_efficiency(acc: Accelerator, link_latency_s: float | None = None) -> Efficiency:
    """Public-measurement defaults for `acc` (see `sources`); a calibrated CPU gets 1.0 of its
    measured peaks and link bandwidth, which already are achieved rates, and `link_latency_s`, the
    per-step latency of its measured link (`hardware.calibrate_link`), where it has one."""
    if "calibrated" in acc.name:
        measured = "calibrate() measured the achieved rates: fraction 1.0 of them"
        link, link_sources = {}, {}
        if link_latency_s is not None:
            link = {"link_fraction": 1.0, "link_latency_s": link_latency_s}
            link_sources = dict.fromkeys(link, f"measured: {acc.sources.get('intra_node_bytes_per_s')}")
        return Efficiency(gemm_fraction=1.0, memory_fraction=1.0, attention_fraction=0.5,
                          training_attention_fraction=70 / 971, roofline_overlap=0.5,
                          gemm_overhead_s=_EAGER_OP_S, kernel_overhead_s=_EAGER_OP_S,
                          module_call_overhead_s=_MODULE_CALL_S,
                          step_overhead_s=0.2e-3, sequence_overhead_s=20e-6, **link,
                          sources={"gemm_fraction": measured, "memory_fraction": measured,
                                   "attention_fraction": _ASSUMED,
                                   "training_attention_fraction": _CPU_SDPA_TRAINING,
                                   "roofline_overlap": _CPU_OVERLAP,
                                   "gemm_overhead_s": _EAGER_OP, "kernel_overhead_s": _EAGER_OP,
                                   "module_call_overhead_s": _MODULE_CALL,
                                   "step_overhead_s": _ENGINE_HOST, "sequence_overhead_s": _ENGINE_HOST}
                          | link_sources)
    if link_latency_s is not None:
        raise ValueError(f"link_latency_s is a calibrated CPU's measured link latency; {acc.name} has "
                         "its link from the table")
    base = {"gemm_fraction": f"{_ASSUMED} (H100's sustained value)", "memory_fraction": _GPT_FAST_BW,
            "attention_fraction": _ASSUMED, "training_attention_fraction": _ASSUMED,
            "gemm_overhead_s": _ASSUMED, "kernel_overhead_s": _ASSUMED,
            "module_call_overhead_s": "the kernel overhead (no CPU engine runs there)",
            "step_overhead_s": _ASSUMED,
            "sequence_overhead_s": _ASSUMED,
            "link_fraction": _ASSUMED, "link_latency_s": _ASSUMED,
            "network_fraction": _IB_NCCL, "network_latency_s": _ASSUMED}
    known = next((v for k, v in _DEFAULTS.items() if acc.name.startswith(k)), None)
    if known is None:
        return Efficiency(gemm_fraction=_HOPPER_SUSTAINED, memory_fraction=1700 / 2039, sources=base)
    values = dict(known)
    sources = base | values.pop("sources")
    sources["training_attention_fraction"] = sources["attention_fraction"]  # the same kernel
    return Efficiency(memory_fraction=1700 / 2039, **values, sources=sources)
