"""Accelerator peaks with their sources, and a calibration that measures this machine.

The table holds dense (no 2:4 sparsity) peak FLOP/s per dtype, memory bandwidth and capacity,
each field with the public document it comes from. NVIDIA datasheets print sparse tensor-core
figures; the dense peak is half of those, which is what the table stores.

`calibrate()` measures the machine at hand: matmul FLOP/s per dtype through each GEMM path
PyTorch offers here, and memory read and copy bandwidth. MFU computed against a calibrated
peak uses the best path, so a model that runs on a slower path shows the gap.
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

logger = logging.getLogger(__name__)

DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def dtype_key(dtype: Any) -> str:
    """The table's key for `dtype`: "fp32", "tf32", "bf16", "fp16" or "fp8".

    Accepts those keys, torch names ("bfloat16") and `torch.dtype` objects.
    """
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_KEYS:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_KEYS)}")
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
    """Dense peak compute and memory of one accelerator, with a source for every field."""

    name: str
    peak_flops_per_s: Mapping[str, float]
    """Dense peak per dtype key (see `DTYPE_KEYS`); a missing key means no such tensor-core path."""
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    sources: Mapping[str, str]
    """Field name -> public document (name and URL) the value comes from."""

    def __post_init__(self) -> None:
        unknown = set(self.peak_flops_per_s) - set(DTYPE_KEYS)
        if unknown:
            raise ValueError(f"{self.name}: unknown dtype keys {sorted(unknown)}")
        missing = set(_SOURCED_FIELDS) - set(self.sources)
        if missing:
            raise ValueError(f"{self.name}: no source for {sorted(missing)}")
        for name in ("peak_flops_per_s", "sources"):  # read-only views: the entry is frozen
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))

    def peak_flops(self, dtype: Any) -> float:
        """Dense peak FLOP/s for `dtype`; ValueError if this accelerator has no such path."""
        key = dtype_key(dtype)
        if key not in self.peak_flops_per_s:
            raise ValueError(
                f"{self.name} lists no {key} peak; listed: {', '.join(self.peak_flops_per_s)}"
            )
        return self.peak_flops_per_s[key]

    def ridge_flops_per_byte(self, dtype: Any = "bf16") -> float:
        """Arithmetic intensity above which a kernel is compute-bound: peak / bandwidth."""
        return self.peak_flops(dtype) / self.memory_bandwidth_bytes_per_s


_SOURCED_FIELDS = ("peak_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")

_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet, SXM column (dense; starred figures are sparse), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column, "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_HOPPER_DENSE = (
    "sparse datasheet figures halved; dense values as in the NVIDIA H100 Tensor Core GPU "
    "Architecture whitepaper (132 SMs at 1.83 GHz), "
    "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper"
)
_H200_DATASHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column, "
    "https://www.nvidia.com/en-us/data-center/h200/"
)
_HGX_B200 = (
    "NVIDIA HGX platform specifications, HGX B200 per-GPU column (1,000 W; sparse figures "
    "halved), https://www.nvidia.com/en-us/data-center/hgx/"
)
_DGX_B200 = (
    "NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s HBM3e over 8 GPUs (192 GB physical per "
    "GPU, 180 GB usable), https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet"
)
_MI300X_DATASHEET = (
    "AMD Instinct MI300X accelerator data sheet (dense columns), "
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
    "amd-instinct-mi300x-data-sheet.pdf"
)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            name="A100 SXM 80GB",
            peak_flops_per_s={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
            memory_bandwidth_bytes_per_s=2.039e12,
            memory_bytes=80 * 10**9,
            sources=dict.fromkeys(_SOURCED_FIELDS, _A100_DATASHEET),
        ),
        Accelerator(
            name="H100 SXM",
            peak_flops_per_s={
                "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
                "fp8": 1978.9e12,
            },
            memory_bandwidth_bytes_per_s=3.35e12,
            memory_bytes=80 * 10**9,
            sources=dict.fromkeys(_SOURCED_FIELDS, _H100_DATASHEET)
            | {"peak_flops_per_s": f"{_H100_DATASHEET}; {_HOPPER_DENSE}"},
        ),
        Accelerator(
            name="H200",
            peak_flops_per_s={
                "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
                "fp8": 1978.9e12,
            },
            memory_bandwidth_bytes_per_s=4.8e12,
            memory_bytes=141 * 10**9,
            sources=dict.fromkeys(_SOURCED_FIELDS, _H200_DATASHEET)
            | {"peak_flops_per_s": f"{_H200_DATASHEET}; {_HOPPER_DENSE}"},
        ),
        Accelerator(
            name="B200",
            peak_flops_per_s={
                "fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15,
            },
            memory_bandwidth_bytes_per_s=8e12,
            memory_bytes=180 * 10**9,
            sources={
                "peak_flops_per_s": _HGX_B200,
                "memory_bandwidth_bytes_per_s": _DGX_B200,
                "memory_bytes": _DGX_B200,
            },
        ),
        Accelerator(
            name="MI300X",
            peak_flops_per_s={
                "fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12,
                "fp8": 2614.9e12,
            },
            memory_bandwidth_bytes_per_s=5.3e12,
            memory_bytes=192 * 10**9,
            sources=dict.fromkeys(_SOURCED_FIELDS, _MI300X_DATASHEET),
        ),
    )
}

# Other spellings, including what `torch.cuda.get_device_name()` reports for these parts.
_ALIASES = {
    "a100": "A100 SXM 80GB", "a100-80gb": "A100 SXM 80GB", "a100-sxm": "A100 SXM 80GB",
    "a100-sxm4-80gb": "A100 SXM 80GB", "nvidia-a100-sxm4-80gb": "A100 SXM 80GB",
    "h100": "H100 SXM", "h100-sxm5": "H100 SXM", "h100-80gb-hbm3": "H100 SXM",
    "nvidia-h100-80gb-hbm3": "H100 SXM",
    "h200-sxm": "H200", "nvidia-h200": "H200",
    "hgx-b200": "B200", "nvidia-b200": "B200",
    "mi300": "MI300X", "amd-instinct-mi300x": "MI300X",
}


def _normalize_name(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def get_accelerator(name: str) -> Accelerator:
    """The table entry for `name` (case-insensitive, a few aliases); ValueError if unknown."""
    key = _normalize_name(name)
    by_key = {_normalize_name(n): a for n, a in ACCELERATORS.items()}
    if key in by_key:
        return by_key[key]
    if key in _ALIASES:
        return ACCELERATORS[_ALIASES[key]]
    raise ValueError(
        f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)} "
        f"(aliases: {', '.join(sorted(_ALIASES))})"
    )


# ---------------------------------------------------------------------------------------------
# Calibration: measure this machine.

CACHE_VERSION = 1


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
    quick: bool
    elapsed_s: float
    created_at: str

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
        }
        return d | {
            "best_paths": self.best_paths,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        """Inverse of `to_dict` (derived keys are ignored); ValueError on missing/unknown keys."""
        fields = {f.name for f in dataclasses.fields(cls)}
        derived = {"best_paths", "memory_bandwidth_bytes_per_s"}
        unknown = set(d) - fields - derived
        missing = fields - set(d)
        if unknown or missing:
            raise ValueError(
                f"bad calibration record: unknown keys {sorted(unknown)}, missing {sorted(missing)}"
            )
        return cls(**{k: v for k, v in d.items() if k in fields})

    def format(self) -> str:
        """A readable table for the CLI."""
        paths = sorted({p for by_path in self.matmul_flops_per_s.values() for p in by_path})
        paths += sorted({k.split("/")[1] for k in self.matmul_errors} - set(paths))
        lines = [
            f"{self.device_name} ({self.device}, {self.num_threads} threads, "
            f"torch {self.torch_version}{', quick' if self.quick else ''})",
            f"{'matmul GFLOP/s':<16}" + "".join(f"{p:>10}" for p in paths) + f"{'best':>10}",
        ]
        measured = self.matmul_flops_per_s.keys() | {k.split("/")[0] for k in self.matmul_errors}
        for dtype in (d for d in DTYPE_KEYS if d in measured):
            by_path = self.matmul_flops_per_s.get(dtype, {})
            cells = "".join(
                f"{by_path[p] / 1e9:>10.1f}" if p in by_path else f"{'-':>10}" for p in paths
            )
            lines.append(f"  {dtype:<14}{cells}{self.best_paths.get(dtype, '-'):>10}")
        lines += [
            f"memory read      {self.memory_read_bytes_per_s / 1e9:8.1f} GB/s"
            "  (memory_bandwidth: what decode needs)",
            f"memory copy      {self.memory_copy_bytes_per_s / 1e9:8.1f} GB/s"
            "  (bytes read + bytes written)",
        ]
        lines += [f"  not measured: {k}: {v}" for k, v in sorted(self.matmul_errors.items())]
        lines.append(f"measured in {self.elapsed_s:.1f} s at {self.created_at}")
        return "\n".join(lines)

    __str__ = format


def calibrate(
    *, cache: bool = True, force: bool = False, quick: bool = False, device: str | None = None
) -> Calibration:
    """Measure (or load from cache) this machine's matmul peaks and memory bandwidth.

    `device` is "cpu" or "cuda" (default: "cuda" when available). The result is cached as JSON
    under `$XDG_CACHE_HOME/slipstream/` (default `~/.cache/slipstream/`), keyed by device name,
    torch version, thread count and `quick`; `force=True` measures again and overwrites it.
    `quick=True` uses small sizes (about a second; for tests, not for MFU).
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    device_name = _device_name(device)
    path = _cache_path(device, device_name, torch.__version__, torch.get_num_threads(), quick)
    if cache and not force:
        cached = _load_cached(path)
        if cached is not None:
            logger.info("calibration loaded from %s", path)
            return cached
    result = _measure(device, device_name, quick)
    if cache:
        _save(path, result)
    return result


def _measure(device: str, device_name: str, quick: bool) -> Calibration:
    import torch

    start_s = time.perf_counter()
    logger.info("calibrating %s (%s)%s", device_name, device, ", quick" if quick else "")
    flops, errors = _measure_matmuls(device, quick)
    read_bps, copy_bps = measure_memory_bandwidth(device, quick)
    return Calibration(
        device=device,
        device_name=device_name,
        torch_version=torch.__version__,
        num_threads=torch.get_num_threads(),
        matmul_flops_per_s=flops,
        matmul_errors=errors,
        memory_read_bytes_per_s=read_bps,
        memory_copy_bytes_per_s=copy_bps,
        quick=quick,
        elapsed_s=time.perf_counter() - start_s,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
    shared machine gives can change from minute to minute.
    """
    import torch

    if device == "cuda":
        nbytes = 256 * 2**20 if quick else 2 * 2**30
    else:  # cheap enough that `quick` keeps the full size, which must not fit in cache
        nbytes = min(max(8 * _l3_cache_bytes(), 256 * 2**20), 2**30)
    # Distinct values on every page, so no zero-page or page-merging trick can flatter the read.
    src = torch.arange(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read_bps = nbytes / _best_time_s(src.sum, device)
    copy_bps = 2 * nbytes / _best_time_s(lambda: dst.copy_(src), device)
    logger.info("memory: read %.1f GB/s, copy %.1f GB/s (%d MiB)",
                read_bps / 1e9, copy_bps / 1e9, nbytes >> 20)
    return read_bps, copy_bps


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


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/slipstream`, or `~/.cache/slipstream`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slipstream"


def _cache_path(
    device: str, device_name: str, torch_version: str, threads: int, quick: bool
) -> Path:
    key = f"{device}-{device_name}-torch{torch_version}-{threads}threads{'-quick' if quick else ''}"
    return cache_dir() / f"calibration-v{CACHE_VERSION}-{re.sub(r'[^A-Za-z0-9.]+', '-', key)}.json"


def _load_cached(path: Path) -> Calibration | None:
    if not path.is_file():
        return None
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("ignoring unreadable calibration cache %s: %s", path, e)
        return None


def _save(path: Path, result: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    logger.info("calibration cached at %s", path)
