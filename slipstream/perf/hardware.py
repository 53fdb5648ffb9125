"""Accelerator peaks with their sources, and a calibration that measures this machine.

The table (dense and sparse peaks per dtype, memory, links, each field with the public document
it comes from) lives in `slipstream.perf.accelerators` and is re-exported here;
`get_accelerator("cpu")` is this machine as `calibrate()` measures it.

`calibrate()` measures the machine at hand: matmul FLOP/s per dtype through each GEMM path
PyTorch offers here, and memory read and copy bandwidth. MFU computed against a calibrated
peak uses the best path, so a model that runs on a slower path shows the gap.

`calibrate_link(n)` measures the link between n ranks of this host (gloo over loopback, as the
trainer's ranks talk under torchrun on a CPU), each collective the training model prices there
with its own fit: only where a multi-rank run is priced, apart from `calibrate()`, so that nobody
else waits for it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import platform
import re
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slipstream.cache import cache_dir  # noqa: F401  (re-exported: the calibration cache lives there)
from slipstream.perf.accelerators import (  # noqa: F401  (re-exported: the table lives there)
    ACCELERATORS,
    DTYPE_KEYS,
    Accelerator,
    dtype_key,
)
from slipstream.perf.accelerators import get_accelerator as _table_accelerator
from slipstream.perf.collectives import AlphaBetaFit, Link, MeasuredCost, fit_alpha_beta

logger = logging.getLogger(__name__)

_LOCAL_NAMES = ("cpu", "local")


def is_local(name: str) -> bool:
    """Whether `name` means the machine at hand ("cpu" or "local", any case)."""
    return name.strip().lower() in _LOCAL_NAMES


def get_accelerator(name: str) -> Accelerator:
    """The table entry for `name` (see `slipstream.perf.accelerators`), or this machine.

    "cpu" (or "local") is the machine at hand as `calibrate()` measures it (cached after the
    first call): measured matmul peaks and read bandwidth, its RAM as capacity, no links (see
    `local_accelerator` for one with the link `calibrate_link` measures).
    Any other unknown name is a ValueError listing the known ones.
    """
    if is_local(name):
        return local_accelerator(calibrate(device="cpu"))
    return _table_accelerator(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostAccelerator(Accelerator):
    """Ranks of this host joined by the gloo link `calibrate_link` measured among them, with each
    measured collective's cost per call (`collectives.MeasuredCost`, in units of the link: the
    all-reduce's bandwidth and per-step latency). A subclass rather than a field of the table's
    `Accelerator`: only a measured host link has costs of its own per collective."""

    collective_costs: Mapping[str, MeasuredCost] = dataclasses.field(default_factory=dict)
    """Collective -> its measured cost, over exactly `devices_per_node` ranks (the ones measured)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "collective_costs", types.MappingProxyType(dict(self.collective_costs)))

    def measured_cost(self, collective: str, num_ranks: int) -> MeasuredCost | None:
        """The measured cost of `collective` over `num_ranks` ranks; None where it was not measured
        (another collective, or a group of another size: priced from the link as a ring)."""
        return self.collective_costs.get(collective) if num_ranks == self.devices_per_node else None

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"collective_costs": {c: dataclasses.asdict(cost)
                                                         for c, cost in self.collective_costs.items()}}


def local_accelerator(calibration: Calibration, link: LinkCalibration | None = None) -> Accelerator:
    """An `Accelerator` for a calibrated device: best measured GEMM rate per dtype as the peak.

    With `link` (`calibrate_link`), a `HostAccelerator`: its ranks are one node joined by the
    measured link, the fitted all-reduce bus bandwidth as the intra-node bandwidth (its per-step
    latency is the efficiency's `link_latency_s`, see `efficiency.default_efficiency`), and each
    collective whose fit found a bandwidth at its own cost (`LinkCalibration.costs`).
    """
    measured = f"measured by slipstream.perf.hardware.calibrate() at {calibration.created_at}"
    peaks = {d: max(p.values()) for d, p in calibration.matmul_flops_per_s.items() if p}
    name = f"{calibration.device_name} ({calibration.num_threads} threads, calibrated)"
    links: dict[str, Any] = {}
    sources = {"peak_flops_per_s": measured, "memory_bandwidth_bytes_per_s": measured,
               "memory_bytes": "/proc/meminfo MemTotal (os.sysconf fallback)",
               "cache_read_bytes_per_s": measured}
    if link is not None:
        name += f" x {link.num_ranks} ranks over {link.backend}"
        links = {"intra_node_bytes_per_s": link.link.bandwidth_bytes_per_s,
                 "devices_per_node": link.num_ranks}
        sources |= {"intra_node_bytes_per_s": link.describe(),
                    "devices_per_node": f"the {link.num_ranks} ranks the link was measured among: one host"}
    fields = dict(
        name=name,
        peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=calibration.memory_bandwidth_bytes_per_s,
        memory_bytes=_physical_memory_bytes(),
        cache_read_bytes_per_s=calibration.cache_read_bytes_per_s,
        sources=sources,
        calibrated=True,
        **links,
    )
    if link is None:
        return Accelerator(**fields)
    return HostAccelerator(**fields, collective_costs=link.costs)


def _physical_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---------------------------------------------------------------------------------------------
# Calibration: measure this machine.

# Bumped when what calibrate() measures changes (2: memory bandwidth read from huge pages; 3: reads
# of buffers around the last-level cache's size; 4: bf16 products widened to fp32; 5: repeated reads
# over a fixed grid of sizes, not multiples of the reported last-level cache). Fields added since
# with a default (the load average before measuring) keep the version: older files still load.
CACHE_VERSION = 5
BUSY_LOAD_AVERAGE = 0.5
"""A 1-minute load average from which `calibrate()` warns that other work may have lowered the
peaks it measures (the same bar `benchmarks/perf_local_validation.py` sets before it measures)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Measured matmul peaks and memory bandwidth of one device, as `calibrate()` returns them."""

    device: str
    """"cpu" or "cuda"."""
    device_name: str
    """CPU model or GPU name."""
    torch_version: str
    num_threads: int
    matmul_flops_per_s: Mapping[str, Mapping[str, float]]
    """dtype key -> GEMM path -> best FLOP/s measured (paths that failed are absent)."""
    matmul_errors: Mapping[str, str]
    """"dtype/path" -> why that combination could not be measured."""
    memory_read_bytes_per_s: float
    """Reduction over a buffer several times the last-level cache: what decode needs."""
    memory_copy_bytes_per_s: float
    """`dst.copy_(src)`, counting bytes read plus bytes written (STREAM convention)."""
    cache_read_bytes_per_s: Mapping[int, float]
    """Buffer bytes -> read bandwidth of a reduction over a buffer of that size, repeated: from
    8 MiB (`CACHE_READ_SIZES`) to the `memory_read_bytes_per_s` buffer, whose rate is the last
    (on a CPU; empty on CUDA). What decode gets when its weights nearly fit in the cache. As
    measured, noise and all: `Accelerator` takes its running minimum, floored at the memory's."""
    quick: bool
    elapsed_s: float
    created_at: str
    load_average_1m: float | None = None
    """The machine's 1-minute load average just before measuring (None where the OS has none):
    from `BUSY_LOAD_AVERAGE` on, other processes shared the cores and the peaks may be low."""

    @property
    def memory_bandwidth_bytes_per_s(self) -> float:
        """The read bandwidth: decode streams weights and KV cache, it rarely writes."""
        return self.memory_read_bytes_per_s

    @property
    def best_paths(self) -> dict[str, str]:
        """dtype key -> the fastest GEMM path measured for it."""
        flops = self.matmul_flops_per_s
        return {d: max(paths, key=paths.get) for d, paths in flops.items() if paths}

    def peak_flops(self, dtype: Any) -> float:
        """Best measured matmul FLOP/s for `dtype` over all paths (the MFU denominator)."""
        paths = self.matmul_flops_per_s.get(dtype_key(dtype))
        if not paths:
            raise ValueError(
                f"no {dtype_key(dtype)} matmul was measured on {self.device_name}; measured: "
                f"{', '.join(d for d, p in self.matmul_flops_per_s.items() if p)}"
            )
        return max(paths.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; derived values (`best_paths`, `memory_bandwidth_bytes_per_s`) too."""
        d = dataclasses.asdict(self) | {
            "matmul_flops_per_s": {k: dict(v) for k, v in self.matmul_flops_per_s.items()},
            "matmul_errors": dict(self.matmul_errors),
            "cache_read_bytes_per_s": {str(k): v for k, v in self.cache_read_bytes_per_s.items()},
        }
        return d | {
            "best_paths": self.best_paths,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        """Inverse of `to_dict` (derived keys are ignored); ValueError on missing/unknown keys."""
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        derived = {"best_paths", "memory_bandwidth_bytes_per_s"}
        unknown = set(d) - fields - derived
        missing = required - set(d)
        if unknown or missing:
            raise ValueError(
                f"bad calibration record: unknown keys {sorted(unknown)}, missing {sorted(missing)}"
            )
        values = {k: v for k, v in d.items() if k in fields}
        values["cache_read_bytes_per_s"] = {int(k): v for k, v in d["cache_read_bytes_per_s"].items()}
        return cls(**values)

    def format(self) -> str:
        """A readable table for the CLI."""
        paths = sorted({p for by_path in self.matmul_flops_per_s.values() for p in by_path})
        paths += sorted({k.split("/")[1] for k in self.matmul_errors} - set(paths))
        width = max([10, *(len(p) + 2 for p in paths)])  # "onednn-fp32" needs more than 10
        lines = [
            f"{self.device_name} ({self.device}, {self.num_threads} threads, "
            f"torch {self.torch_version}{', quick' if self.quick else ''})",
            f"{'matmul GFLOP/s':<16}" + "".join(f"{p:>{width}}" for p in paths) + f"{'best':>{width}}",
        ]
        measured = self.matmul_flops_per_s.keys() | {k.split("/")[0] for k in self.matmul_errors}
        for dtype in (d for d in DTYPE_KEYS if d in measured):
            by_path = self.matmul_flops_per_s.get(dtype, {})
            cells = "".join(
                f"{by_path[p] / 1e9:>{width}.1f}" if p in by_path else f"{'-':>{width}}" for p in paths
            )
            lines.append(f"  {dtype:<14}{cells}{self.best_paths.get(dtype, '-'):>{width}}")
        lines += [
            f"memory read      {self.memory_read_bytes_per_s / 1e9:8.1f} GB/s"
            "  (memory_bandwidth: what decode needs)",
            f"memory copy      {self.memory_copy_bytes_per_s / 1e9:8.1f} GB/s"
            "  (bytes read + bytes written)",
        ]
        if self.cache_read_bytes_per_s:
            reads = ", ".join(f"{size / 2**20:.0f} MiB {rate / 1e9:.0f}"
                              for size, rate in self.cache_read_bytes_per_s.items())
            lines.append(f"repeated reads   {reads} GB/s")
        lines += [f"  not measured: {k}: {v}" for k, v in sorted(self.matmul_errors.items())]
        lines.append(f"measured in {self.elapsed_s:.1f} s at {self.created_at}")
        if self.load_average_1m is not None:
            busy = self.load_average_1m >= BUSY_LOAD_AVERAGE
            lines[-1] += f", load average {self.load_average_1m:.2f} before" + (
                " (busy: peaks may be low; measure again when idle with --force)" if busy else "")
        return "\n".join(lines)

    __str__ = format


def calibrate(
    *, cache: bool = True, force: bool = False, quick: bool = False, device: str | None = None
) -> Calibration:
    """Measure (or load from cache) this machine's matmul peaks and memory bandwidth.

    `device` is "cpu" or "cuda" (default: "cuda" when available). The result is cached as JSON
    under `$XDG_CACHE_HOME/slipstream/` (default `~/.cache/slipstream/`), keyed by device name,
    torch version, thread count and `quick`; `force=True` measures again and overwrites it.
    `quick=True` uses small sizes and every other repeated-read buffer (6 to 8 s on a 2-core
    Xeon VM, 1 or 2 threads; for tests, not for MFU).
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    device_name = device_name_of(device)
    path = _cache_path(device, device_name, torch.__version__, torch.get_num_threads(), quick)
    if cache and not force:
        cached = _load_cached(path)
        if cached is not None:
            logger.info("calibration loaded from %s", path)
            return cached
    result = _measure(device, device_name, quick)
    if cache:
        _save(path, result.to_dict())
    return result


def cached_calibration(device: str) -> Calibration | None:
    """What `calibrate(device=device)` would load from its cache, or None where it would have to
    measure (minutes): for callers that report against the measured peak when there is one but
    must not stall for it, such as the serving engine's metrics records."""
    import torch

    return _load_cached(_cache_path(device, device_name_of(device), torch.__version__,
                                    torch.get_num_threads(), False))


def _measure(device: str, device_name: str, quick: bool) -> Calibration:
    import torch

    start_s = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    logger.info("calibrating %s (%s)%s", device_name, device, ", quick" if quick else "")
    if load is not None and load >= BUSY_LOAD_AVERAGE:
        logger.warning("the 1-minute load average is %.2f: other work shares the cores and may lower "
                       "the peaks measured now; measure again on an idle machine with "
                       "`slipstream perf calibrate --force`", load)
    flops, errors = _measure_matmuls(device, quick)
    read_bps, copy_bps = measure_memory_bandwidth(device, quick)
    cache_reads = _measure_cache_reads(quick) | {_memory_buffer_bytes(): read_bps} if device == "cpu" else {}
    return Calibration(
        device=device,
        device_name=device_name,
        torch_version=torch.__version__,
        num_threads=torch.get_num_threads(),
        matmul_flops_per_s=flops,
        matmul_errors=errors,
        memory_read_bytes_per_s=read_bps,
        memory_copy_bytes_per_s=copy_bps,
        cache_read_bytes_per_s=cache_reads,
        quick=quick,
        elapsed_s=time.perf_counter() - start_s,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        load_average_1m=load,
    )


# (m, k, n) GEMM shapes: square ones and an LLM-like (tokens x hidden) @ (hidden x hidden). The
# first is a cheap probe whose rate predicts the cost of the next, so a path that turns out very
# slow (fp16 on CPUs without native fp16) is not run at sizes that would take seconds.
_SHAPES = {
    ("cpu", False): ((256, 256, 256), (1024, 1024, 1024), (2048, 2048, 2048), (512, 4096, 4096)),
    ("cpu", True): ((256, 256, 256), (512, 512, 512)),
    ("cuda", False): ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192)),
    ("cuda", True): ((1024, 1024, 1024), (2048, 2048, 2048)),
}
_MAX_CALL_S = 0.5  # skip a shape whose single matmul would take longer than this
_TIME_BUDGET_S = 0.3  # per shape, after the warm-up; at least 2 timed calls


def _measure_matmuls(
    device: str, quick: bool
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    flops: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    for dtype, path, make_fn in _gemm_paths(device):
        try:
            best = _best_gemm_flops_per_s(make_fn, _SHAPES[device, quick], device)
        except (RuntimeError, NotImplementedError) as e:
            errors[f"{dtype}/{path}"] = str(e).splitlines()[0][:200]
            logger.info("matmul %s/%s not usable: %s", dtype, path, errors[f"{dtype}/{path}"])
            continue
        flops.setdefault(dtype, {})[path] = best
        logger.info("matmul %s/%s: %.1f GFLOP/s", dtype, path, best / 1e9)
    return flops, errors


def _gemm_paths(device: str) -> list[tuple[str, str, Callable]]:
    """(dtype key, path name, make_fn) where make_fn(m, k, n) returns a zero-argument GEMM."""
    import torch

    def default(dtype: torch.dtype, precision: str = "highest") -> Callable:
        def make(m: int, k: int, n: int) -> Callable:
            x = torch.randn(m, k, device=device).to(dtype)  # (m, k)
            w = torch.randn(n, k, device=device).to(dtype)  # (n, k), as nn.Linear stores it

            def run() -> Any:
                previous = torch.get_float32_matmul_precision()
                torch.set_float32_matmul_precision(precision)  # "high" allows TF32 on CUDA
                try:
                    return torch.nn.functional.linear(x, w)  # (m, n)
                finally:
                    torch.set_float32_matmul_precision(previous)

            return run
        return make

    def onednn(dtype: torch.dtype) -> Callable:
        def make(m: int, k: int, n: int) -> Callable:
            # The weight is pre-packed once, outside the timing, as slipstream.ops.linear does.
            x = torch.randn(m, k).to(dtype)
            w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(dtype), None)
            return lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return make

    def widened(dtype: torch.dtype) -> Callable:
        # Inputs of `dtype` multiplied in fp32: the weight widened once (a packed copy, as above),
        # the activations in every call. Where the CPU has no bf16 arithmetic (Xeons before
        # Cooper Lake) this is the fast way to multiply bf16, and the peak a bf16 kernel can reach.
        def make(m: int, k: int, n: int) -> Callable:
            x = torch.randn(m, k).to(dtype)
            w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(dtype).float(), None)
            return lambda: torch.ops.mkldnn._linear_pointwise(x.float(), w, None, "none", [], "")
        return make

    if device == "cuda":
        return [
            ("fp32", "default", default(torch.float32)),
            ("tf32", "default", default(torch.float32, "high")),
            ("bf16", "default", default(torch.bfloat16)),
            ("fp16", "default", default(torch.float16)),
        ]
    paths = []
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        paths.append((key, "default", default(dtype)))
        if torch.backends.mkldnn.is_available():
            paths.append((key, "onednn", onednn(dtype)))
            if dtype == torch.bfloat16:
                paths.append((key, "onednn-fp32", widened(dtype)))
    return paths


def _best_gemm_flops_per_s(make_fn: Callable, shapes: tuple, device: str) -> float:
    """Best FLOP/s over `shapes`, skipping shapes predicted to take over `_MAX_CALL_S` a call."""
    best = 0.0
    for m, k, n in shapes:
        flop = 2 * m * k * n
        if best and flop / best > _MAX_CALL_S:
            logger.debug("skipping %dx%dx%d: about %.1f s a call", m, k, n, flop / best)
            continue
        best = max(best, flop / _best_time_s(make_fn(m, k, n), device))
    return best


def _best_time_s(fn: Callable, device: str, max_reps: int = 10) -> float:
    """Fastest of several timed calls after one warm-up; stops after `_TIME_BUDGET_S`."""
    sync = _synchronizer(device)
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 2 or (
        len(times) < max_reps and time.perf_counter() - start < _TIME_BUDGET_S
    ):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _synchronizer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_memory_bandwidth(device: str = "cpu", quick: bool = False) -> tuple[float, float]:
    """(read, copy) bytes/s over a buffer well beyond the last-level cache, measured now.

    Benchmarks that report bandwidth use call this in the same run, because the bandwidth a
    shared machine gives can change from minute to minute. On a CPU the buffers are on huge
    pages where the system gives them, as the engine's streamed weights are (`ops.allocator`):
    the best case for a stream, so a roofline against it does not flatter (4 KiB pages read ~7%
    slower on the development VM).
    """
    import torch

    from slipstream.ops.allocator import huge_page_empty

    if device == "cuda":
        nbytes = 256 * 2**20 if quick else 2 * 2**30
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    else:  # cheap enough that `quick` keeps the full size, which must not fit in cache
        nbytes = _memory_buffer_bytes()
        src = huge_page_empty(nbytes // 4, torch.float32)
    # Distinct values on every page, so no zero-page or page-merging trick can flatter the read.
    torch.arange(nbytes // 4, dtype=torch.float32, device=device, out=src)
    dst = huge_page_empty(src.numel(), src.dtype) if device == "cpu" else torch.empty_like(src)
    read_bps = nbytes / _best_time_s(src.sum, device)
    copy_bps = 2 * nbytes / _best_time_s(lambda: dst.copy_(src), device)
    logger.info("memory: read %.1f GB/s, copy %.1f GB/s (%d MiB)",
                read_bps / 1e9, copy_bps / 1e9, nbytes >> 20)
    return read_bps, copy_bps


def _memory_buffer_bytes() -> int:
    """The CPU buffer `measure_memory_bandwidth` reads: well beyond the last-level cache."""
    return min(max(8 * _l3_cache_bytes(), 256 * 2**20), 2**30)


CACHE_READ_SIZES = (8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724)
"""Buffers `calibrate()` reads repeatedly on a CPU, in MiB: a fixed grid, sqrt(2) apart, from well
inside any last-level cache to the 1 GiB memory buffer. Not multiples of the sysfs cache size: an
Intel Xeon VM reports 480 MiB of L3 (the host's), of which a process keeps about 64 MiB between
passes, so a curve starting at half the reported size never saw the buffers a small model's decode
reads (52 MiB read at 29 GB/s there, the curve's first point, 240 MiB, at 16)."""


def _measure_cache_reads(quick: bool = False) -> dict[int, float]:
    """Read bandwidth over buffers of CACHE_READ_SIZES MiB (every other one when `quick`), each
    read in a loop (on huge pages, as `measure_memory_bandwidth`): the share of a buffer that
    stays cached from one pass to the next depends on the cache's replacement policy and on what
    the machine grants this process, so it is measured, not assumed (LRU would keep nothing of a
    buffer past the cache's size; the AMD development machine's 32 MiB L3 kept about 40% of a 64
    MiB one, which read at 1.4x the memory's rate). Only sizes below the memory buffer's: its rate
    ends the curve."""
    rates = {}
    for mib in CACHE_READ_SIZES[::2] if quick else CACHE_READ_SIZES:
        nbytes = mib * 2**20
        if nbytes >= _memory_buffer_bytes():
            break
        rates[nbytes] = _repeated_read_bytes_per_s(nbytes)
    return rates


def _repeated_read_bytes_per_s(nbytes: int) -> float:
    """Read bandwidth of a reduction over one `nbytes` buffer of huge pages, the best of repeats."""
    import torch

    from slipstream.ops.allocator import huge_page_empty

    src = huge_page_empty(nbytes // 4, torch.float32)
    torch.arange(nbytes // 4, dtype=torch.float32, out=src)
    return nbytes / _best_time_s(src.sum, "cpu")


def _l3_cache_bytes() -> int:
    """Last-level cache size from sysfs; 32 MiB when it cannot be read."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            break
    return 32 * 2**20


def device_name_of(device: str) -> str:
    """What calibrations and benchmark records call `device` ("cpu" or "cuda") on this machine."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""  # cpu_name falls back to what the platform module says
    return cpu_name(cpuinfo)


def multiplies_bf16(device: str) -> bool:
    """Whether `device` ("cpu" or "cuda") has bf16 arithmetic, so that bf16 products run faster
    than fp32 ones: CUDA GPUs from Ampere on, and CPUs per `cpu_multiplies_bf16`."""
    import torch

    if device == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    try:
        return cpu_multiplies_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def cpu_multiplies_bf16(cpuinfo: str) -> bool:
    """Whether the first processor of /proc/cpuinfo text has bf16 arithmetic: x86's AVX512-BF16 or
    AMX-BF16 (Cooper Lake and Sapphire Rapids Xeons on, AMD Zen 4 on) or Arm's BF16 extension.
    Elsewhere oneDNN widens bf16 to multiply it: on an Ice Lake Xeon (AVX-512 without AVX512-BF16)
    the demo's bf16 training ran at about a third of its fp32 speed (600 against 1,600-1,900
    tokens/s, tiny preset)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()))
    return False


def cpu_name(cpuinfo: str) -> str:
    """The first processor's model name in /proc/cpuinfo text, with its family, model and stepping
    where given: virtual machines often report a bare "AMD EPYC" for different generations (Zen 4
    and Zen 5 here, with peaks a factor of two apart), which must not share a calibration."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block ends here
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown cpu"
    ids = [f"{key.removeprefix('cpu ')} {fields[key]}" for key in ("cpu family", "model", "stepping")
           if fields.get(key)]
    return f"{name} ({', '.join(ids)})" if ids else name


def _cache_path(
    device: str, device_name: str, torch_version: str, threads: int, quick: bool
) -> Path:
    key = f"{device}-{device_name}-torch{torch_version}-{threads}threads{'-quick' if quick else ''}"
    return cache_dir() / f"calibration-v{CACHE_VERSION}-{re.sub(r'[^A-Za-z0-9.]+', '-', key)}.json"


def _load_cached(path: Path, kind: type = Calibration) -> Any:
    """The `kind` (Calibration or LinkCalibration) cached in `path`; None where there is none or it
    cannot be read (a warning)."""
    if not path.is_file():
        return None
    try:
        return kind.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("ignoring unreadable %s cache %s: %s", kind.__name__, path, e)
        return None


def _save(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    logger.info("cached at %s", path)


# ---------------------------------------------------------------------------------------------
# The link between ranks of this host.

LINK_CACHE_VERSION = 2
"""Of the link cache files (`calibrate_link`), apart from `CACHE_VERSION`: bumped when what is
measured changes (2: all-gathers and reduce-scatters timed too, `times_s` by collective), so that a
file of an older version, under another name, is measured again rather than read."""
LINK_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
"""What `calibrate_link` times, each fitted on its own: what the training model prices on a host
link (DDP's gradients, FSDP's gradients as gloo runs them, tensor parallelism without sequence
parallelism and the trainer's scalars are all-reduces; FSDP's weights all-gathers; sequence and
context parallelism all-gather and reduce-scatter). Broadcasts and all-to-alls are priced nowhere
on a CPU; pipeline sends keep the ring's one step of the link."""
LINK_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)
"""Sizes `calibrate_link` times, 4 KiB to 16 MiB: the small ones pin the latency, the large ones
the bandwidth (a small model's gradients, 0.5 MB for the tests' 0.1M parameters, lie between; a
real model's buckets at the top)."""
LINK_ITERATIONS, LINK_WARMUP = 20, 3
"""Timed and untimed calls per collective and size: on a 2-core VM a loopback all-reduce takes
0.14-8 ms from one call to the next (waking the other process), so the median of 20 is what holds
still (over six measurements there the all-reduce fit's alpha ranged 0.31-0.44 ms and its
bandwidth 1.1-2.0 GB/s)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkCalibration:
    """Collective times among `num_ranks` processes of this host, as `calibrate_link()` measures
    them, and what they fit (`fits`, `fit`, `link`, `costs`: derived, never stored)."""

    device_name: str
    torch_version: str
    backend: str
    num_ranks: int
    sizes_bytes: tuple[int, ...]
    """The messages timed: nccl-tests' size, the whole buffer each rank all-reduces, the gathered
    output of an all-gather, the input of a reduce-scatter."""
    times_s: Mapping[str, tuple[float, ...]]
    """Collective -> per size, the median over iterations of the slowest rank's time
    (`collectives_bench`); the all-reduce's always."""
    elapsed_s: float
    created_at: str

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or self.num_ranks < 2:
            raise ValueError(f"num_ranks must be an integer >= 2, got {self.num_ranks!r}")
        if not isinstance(self.times_s, Mapping) or "all_reduce" not in self.times_s or (
                set(self.times_s) - set(LINK_COLLECTIVES)):
            raise ValueError(f"times_s must map collectives ({', '.join(LINK_COLLECTIVES)}, all_reduce at "
                             f"least) to their times, got {self.times_s!r}")
        for collective, times in self.times_s.items():
            if (len(self.sizes_bytes) != len(times) or len(set(self.sizes_bytes)) < 2
                    or not all(t > 0 for t in times)):
                raise ValueError(f"need a time > 0 for each of at least two distinct sizes, got sizes "
                                 f"{list(self.sizes_bytes)} and {collective} times {list(times)}")
        object.__setattr__(self, "times_s", {c: tuple(times) for c, times in self.times_s.items()})

    @property
    def fits(self) -> dict[str, AlphaBetaFit]:
        """Collective -> alpha and beta fitted to its timings (`collectives.fit_alpha_beta`)."""
        return {c: fit_alpha_beta(c, self.num_ranks, self.sizes_bytes, times)
                for c, times in self.times_s.items()}

    @property
    def fit(self) -> AlphaBetaFit:
        """The all-reduce's fit, which sets the link."""
        return self.fits["all_reduce"]

    @property
    def link(self) -> Link:
        """The fitted link: per-step latency of a ring all-reduce and its bus bandwidth, so that
        `collectives.collective_time_s("all_reduce", ...)` gives back the fitted times."""
        return self.fit.link("ring")

    @property
    def costs(self) -> dict[str, MeasuredCost]:
        """Collective -> its fit in units of `link` (`AlphaBetaFit.cost`), for each fit that found a
        bandwidth: `collective_time_s(c, ..., link, measured=costs[c])` gives back c's fitted line.
        A collective whose fit found none is left out (priced as a ring over the link)."""
        link = self.link
        return {c: fit.cost(link) for c, fit in self.fits.items() if fit.busbw_bytes_per_s is not None}

    def describe(self) -> str:
        """Where the link's numbers come from, each collective's fit, for an `Accelerator`'s sources
        and `slipstream perf calibrate --link`."""
        fits = []
        for collective, fit in self.fits.items():
            bandwidth = f"{fit.busbw_bytes_per_s / 1e9:.2f} GB/s" if fit.busbw_bytes_per_s else "no bandwidth"
            fits.append(f"{collective} alpha {1e6 * fit.alpha_s:.0f} us per call, busbw {bandwidth} "
                        f"(max error {100 * fit.max_relative_error:.0f}%)")
        return (f"{self.backend} collectives among {self.num_ranks} ranks of this host, sizes "
                f"{self.sizes_bytes[0]:,}-{self.sizes_bytes[-1]:,} bytes, alpha-beta fits (Thakur et al. "
                f"2005, collectives.py): {'; '.join(fits)}; measured by "
                f"slipstream.perf.hardware.calibrate_link() at {self.created_at}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; for people, the fitted link (`latency_s`, `bandwidth_bytes_per_s`: None
        where the all-reduce fit found no bandwidth) and each collective's fit (`fits`)."""
        fitted = self.fit.busbw_bytes_per_s is not None
        return dataclasses.asdict(self) | {
            "sizes_bytes": list(self.sizes_bytes),
            "times_s": {c: list(times) for c, times in self.times_s.items()},
            "latency_s": self.link.latency_s if fitted else None,
            "bandwidth_bytes_per_s": self.link.bandwidth_bytes_per_s if fitted else None,
            "fits": {c: {"alpha_s": f.alpha_s, "busbw_bytes_per_s": f.busbw_bytes_per_s,
                         "max_relative_error": f.max_relative_error} for c, f in self.fits.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkCalibration:
        """Inverse of `to_dict` (the derived keys are ignored); ValueError on missing or unknown
        keys, or on times not given by collective (a version 1 file's list: `__post_init__`)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(d) - fields - {"latency_s", "bandwidth_bytes_per_s", "fits"}, fields - set(d)
        if unknown or missing:
            raise ValueError(f"bad link calibration record: unknown keys {sorted(unknown)}, "
                             f"missing {sorted(missing)}")
        values = {k: v for k, v in d.items() if k in fields}
        return cls(**values | {"sizes_bytes": tuple(d["sizes_bytes"])})


def calibrate_link(num_ranks: int, *, cache: bool = True, force: bool = False) -> LinkCalibration:
    """Measure (or load from cache) the link between `num_ranks` processes of this host.

    Spawns `num_ranks` processes that join a gloo group on 127.0.0.1, as the trainer's ranks do
    under torchrun on a CPU, and times each of `LINK_COLLECTIVES` at `LINK_SIZES` in one run
    (`collectives_bench.measure`); about 5 s for 2 ranks on a 2-core VM. Cached as JSON beside
    `calibrate()`'s, keyed by CPU, torch version (gloo comes with it) and `num_ranks` (ranks that
    share the cores wait on each other), not by torch threads (gloo reduces in its own loop). A
    measurement with a fit that finds no bandwidth is not cached. Like `collectives_bench.measure`,
    the calling script needs the `if __name__ == "__main__":` guard of a spawning program.
    """
    import torch

    from slipstream.perf import collectives_bench

    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2:
        raise ValueError(f"num_ranks must be an integer >= 2, got {num_ranks!r}")
    device_name = device_name_of("cpu")
    key = f"gloo-{device_name}-torch{torch.__version__}-{num_ranks}ranks"
    path = cache_dir() / f"link-v{LINK_CACHE_VERSION}-{re.sub(r'[^A-Za-z0-9.]+', '-', key)}.json"
    if cache and not force:
        cached = _load_cached(path, LinkCalibration)
        if cached is not None:
            logger.info("link calibration loaded from %s", path)
            return cached
    logger.info("measuring the gloo link among %d ranks of this host (a few seconds)", num_ranks)
    start_s = time.perf_counter()
    timings, errors = collectives_bench.measure(num_ranks, "gloo", LINK_SIZES, LINK_COLLECTIVES,
                                                LINK_ITERATIONS, LINK_WARMUP)
    if errors:
        raise RuntimeError(f"gloo could not run collectives among {num_ranks} ranks: {errors}")
    times: dict[str, list[float]] = {}
    for t in timings:
        times.setdefault(t.collective, []).append(t.time_s)
    result = LinkCalibration(
        device_name=device_name, torch_version=torch.__version__, backend="gloo", num_ranks=num_ranks,
        sizes_bytes=tuple(dict.fromkeys(t.size_bytes for t in timings)),
        times_s={c: tuple(ts) for c, ts in times.items()},
        elapsed_s=time.perf_counter() - start_s,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    logger.info("link: %s", result.describe())
    if cache and all(f.busbw_bytes_per_s for f in result.fits.values()):
        _save(path, result.to_dict())
    return result

