"""The accelerator table: peaks, memory and links of the parts we plan for, each with its source.

Every number is per device. Conventions, stated once because they are where tools disagree:

- `peak_flops_per_s` is the dense peak (no 2:4 structured sparsity); `sparse_peak_flops_per_s`
  is the sparse one, listed separately. NVIDIA datasheets print the sparse figure with an
  asterisk: the dense one is half of it.
- Link bandwidths are per direction (what a ring collective moves each way at once). Vendors
  quote the sum of both directions; we halve it and say so in the source.
- `devices_per_node` is the scale-up domain: the devices joined by the intra-node link (an
  NVLink/NVSwitch box of 8, a TPU pod over ICI). Past it, traffic uses `inter_node`.
- Bytes are SI (1 GB = 1e9 B) unless a source gives GiB, which is then converted and noted.

An unknown name is a ValueError listing the known ones: never a silent fallback to another part's
numbers (torchtitan's fallback to the A100 peak reported 563 % MFU on an MI350X, AMD-AGI/Primus
PR #772).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import Any

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


MIN_SCALE, MAX_SCALE = 1e-6, 1e6
"""The range of `Accelerator.scaled`'s factors: a million times slower or faster is past any real
part, and a factor near 0 (1e-320) left the times infinite and their ratios NaN."""

_CORE_FIELDS = ("peak_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")
_OPTIONAL_FIELDS = (
    "sparse_peak_flops_per_s", "intra_node_bytes_per_s", "devices_per_node", "inter_node_bytes_per_s",
    "cache_read_bytes_per_s",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
    """Peak compute, memory and links of one device, with a source for every field."""

    name: str
    peak_flops_per_s: Mapping[str, float]
    """Dense peak per dtype key (see `DTYPE_KEYS`); a missing key means no such matmul path."""
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    sources: Mapping[str, str]
    """Field name -> public document (name and URL) the value comes from."""
    sparse_peak_flops_per_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Peak with 2:4 structured sparsity per dtype key; empty when the part has none."""
    intra_node_bytes_per_s: float | None = None
    """Scale-up link bandwidth per device, per direction (NVLink, Infinity Fabric, ICI)."""
    devices_per_node: int = 1
    """Devices in one scale-up domain (joined by the intra-node link)."""
    inter_node_bytes_per_s: float | None = None
    """Scale-out network bandwidth per device, per direction (InfiniBand, data-center network)."""
    cache_read_bytes_per_s: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """Read bandwidth of a buffer read over and over, by its size in bytes, where measured (the
    local machine's `calibrate()`): near the last-level cache's size part of it stays cached
    between passes, as a decode step's weights do between steps. Kept as the running minimum from
    small to large sizes, floored at the memory's bandwidth, so it never rises with the size nor
    falls below memory's rate. See `read_bandwidth`."""
    calibrated: bool = False
    """Whether the peaks were measured on this machine (`calibrate()`) rather than read from a
    datasheet: only a measured peak can be beaten (see `efficiency.max_fraction`)."""

    def __post_init__(self) -> None:
        for field in ("peak_flops_per_s", "sparse_peak_flops_per_s"):
            unknown = set(getattr(self, field)) - set(DTYPE_KEYS)
            if unknown:
                raise ValueError(f"{self.name}: unknown dtype keys {sorted(unknown)} in {field}")
        missing = [f for f in _CORE_FIELDS + _OPTIONAL_FIELDS
                   if self._is_set(f) and f not in self.sources]
        if missing:
            raise ValueError(f"{self.name}: no source for {sorted(missing)}")
        if any(not size > 0 or not rate > 0 for size, rate in self.cache_read_bytes_per_s.items()):
            raise ValueError(f"{self.name}: cache_read_bytes_per_s needs positive sizes and rates, "
                             f"got {dict(self.cache_read_bytes_per_s)}")
        for field in ("peak_flops_per_s", "sparse_peak_flops_per_s", "sources"):
            object.__setattr__(self, field, types.MappingProxyType(dict(getattr(self, field))))
        # Non-increasing from small to large, never below the memory's rate: a larger buffer reads
        # no faster than a smaller one (it keeps no more of itself cached), and none reads slower
        # than memory. Where noise says otherwise (each point is the best of a few passes on a
        # shared machine; a slow outlier would otherwise hold for every larger size) the running
        # minimum, floored at the memory's rate, holds; a curve from an older calibration file too.
        curve, ceiling = {}, math.inf
        memory = self.memory_bandwidth_bytes_per_s or 0.0
        for size, rate in sorted(self.cache_read_bytes_per_s.items()):
            curve[int(size)] = ceiling = max(min(ceiling, float(rate)), memory)
        object.__setattr__(self, "cache_read_bytes_per_s", types.MappingProxyType(curve))

    def _is_set(self, field: str) -> bool:
        value = getattr(self, field)
        if field == "devices_per_node":
            return value != 1
        return value is not None and value != {}

    @property
    def host_link(self) -> bool:
        """Whether its collectives run on the cores that compute: true of a calibrated machine with a
        link, which only `hardware.calibrate_link` gives it (gloo among processes of this host, whose
        copies, reductions and loopback transfers take a compute core each), false of every table
        entry (a GPU's collectives run as kernels of their own on a few of its SMs, beside the compute)."""
        return self.calibrated and self.intra_node_bytes_per_s is not None

    def peak_flops(self, dtype: Any) -> float:
        """Dense peak FLOP/s for `dtype`; ValueError if this accelerator has no such path."""
        key = dtype_key(dtype)
        if key not in self.peak_flops_per_s:
            raise ValueError(
                f"{self.name} lists no {key} peak; listed: {', '.join(self.peak_flops_per_s)}"
            )
        return self.peak_flops_per_s[key]

    def read_bandwidth(self, working_set_bytes: float) -> float:
        """Bandwidth of reading `working_set_bytes` once per pass, pass after pass (a decode step's
        weights and KV cache, step after step): `cache_read_bytes_per_s` interpolated linearly in
        log size, its smallest size's rate below it, and from its largest size on
        `memory_bandwidth_bytes_per_s` (the memory's everywhere, when nothing was measured): never
        rising with the size, never below the memory's rate."""
        curve = self.cache_read_bytes_per_s
        sizes = list(curve)
        if not sizes or working_set_bytes >= sizes[-1]:
            return self.memory_bandwidth_bytes_per_s
        if working_set_bytes <= sizes[0]:
            return curve[sizes[0]]
        above = bisect.bisect_right(sizes, working_set_bytes)  # sizes[above - 1] <= ws < sizes[above]
        size_a, size_b = sizes[above - 1], sizes[above]
        t = math.log(working_set_bytes / size_a) / math.log(size_b / size_a)
        return curve[size_a] + t * (curve[size_b] - curve[size_a])

    def ridge_flops_per_byte(self, dtype: Any = "bf16") -> float:
        """Arithmetic intensity above which a kernel is compute-bound: peak / bandwidth."""
        return self.peak_flops(dtype) / self.memory_bandwidth_bytes_per_s

    def link_bytes_per_s(self, num_devices: int) -> float:
        """Per-direction bandwidth of the slowest link a group of `num_devices` crosses."""
        if num_devices <= self.devices_per_node and self.intra_node_bytes_per_s:
            return self.intra_node_bytes_per_s
        if self.inter_node_bytes_per_s:
            return self.inter_node_bytes_per_s
        raise ValueError(f"{self.name} lists no link for a group of {num_devices} devices")

    def scaled(self, **factors: float) -> Accelerator:
        """A what-if copy: `flops`, `memory_bandwidth`, `memory_capacity`, `link` multiply the
        peaks, the memory bandwidth, the capacity and both link bandwidths."""
        unknown = set(factors) - {"flops", "memory_bandwidth", "memory_capacity", "link"}
        if unknown:
            raise ValueError(f"unknown scale factors {sorted(unknown)}; "
                             "known: flops, memory_bandwidth, memory_capacity, link")
        f = {k: factors.get(k, 1.0) for k in ("flops", "memory_bandwidth", "memory_capacity", "link")}
        for key, value in f.items():
            if not MIN_SCALE <= value <= MAX_SCALE:  # also NaN; a subnormal factor made times infinite
                raise ValueError(f"scale factor {key} must be a number from {MIN_SCALE:g} to "
                                 f"{MAX_SCALE:g}, got {value}")
        tag = ", ".join(f"{k} x{v:g}" for k, v in f.items() if v != 1.0)

        def link(bandwidth: float | None) -> float | None:
            return None if bandwidth is None else bandwidth * f["link"]

        return dataclasses.replace(
            self,
            name=f"{self.name} ({tag})" if tag else self.name,
            peak_flops_per_s={k: v * f["flops"] for k, v in self.peak_flops_per_s.items()},
            sparse_peak_flops_per_s={k: v * f["flops"] for k, v in self.sparse_peak_flops_per_s.items()},
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s * f["memory_bandwidth"],
            cache_read_bytes_per_s={size: rate * f["memory_bandwidth"]
                                    for size, rate in self.cache_read_bytes_per_s.items()},
            memory_bytes=int(self.memory_bytes * f["memory_capacity"]),
            intra_node_bytes_per_s=link(self.intra_node_bytes_per_s),
            inter_node_bytes_per_s=link(self.inter_node_bytes_per_s),
            sources=dict(self.sources) | ({"what_if": tag} if tag else {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v)
                for f in dataclasses.fields(self)}


_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet, SXM column (dense; starred figures are sparse), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_NVML_MEMORY = (
    "total memory as NVML (nvidia-smi) reports it, the capacity the runtime can allocate: "
    "A100 80GB 81,920 MiB (80 GiB), H100 80GB 81,559 MiB (79.65 GiB, 85.52 GB), H200 143,771 MiB "
    "(140.40 GiB, 150.75 GB); the datasheets' '80GB' and '141GB' are binary gigabytes. Modal, "
    "'Why does an NVIDIA H100 80GB card offer 85.52 GB?', "
    "https://thundergolfer.com/blog/nvidia-gpu-memory-capacity"
)
_B200_MEMORY = (
    "total memory as NVML reports it on an HGX B200: 183,359 MiB (179.06 GiB, 192.27 GB); Vultr's "
    "HGX B200 hardware overview, checked with nvidia-smi --query-gpu=memory.total, lists 179 GB "
    "(https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview) and the "
    "DGX B200 datasheet 1,440 GB over 8 GPUs, 180 each (https://resources.nvidia.com/en-us-dgx-"
    "systems/dgx-b200-datasheet), both binary gigabytes; the HGX page's 192 GB is not what the "
    "runtime can allocate"
)
_MI300X_MEMORY = (
    "total memory as HIP reports it: torch.cuda.get_device_properties on an MI300X prints "
    "total_memory=196592MB (MiB: 191.98 GiB, 206.14 GB) in ROCm/ROCm issue #4203, "
    "https://github.com/ROCm/ROCm/issues/4203; the data sheet's '192 GB' HBM3 is 192 GiB"
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
    "NVIDIA HGX platform specifications, HGX B200 column divided by its 8 GPUs (1,000 W; the "
    "page lists sparse figures, dense is half), https://www.nvidia.com/en-us/data-center/hgx/"
)
_DGX_B200 = (
    "NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s HBM3e over 8 GPUs, 8x ConnectX-7 400 Gb/s, "
    "https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet"
)
_MI300X_DATASHEET = (
    "AMD Instinct MI300X accelerator data sheet (dense and 'with structured sparsity' columns), "
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
    "amd-instinct-mi300x-data-sheet.pdf"
)
_NVLINK = (
    "NVIDIA NVLink and NVSwitch page: total per-GPU bandwidth 600 GB/s (NVLink 3, A100), "
    "900 GB/s (NVLink 4, H100/H200), 1.8 TB/s (NVLink 5, B200), both directions summed; "
    "halved here to per direction, https://www.nvidia.com/en-us/data-center/nvlink/"
)
_DGX_A100 = (
    "NVIDIA DGX A100 datasheet: 8 GPUs on NVSwitch, 8x single-port ConnectX-6 200 Gb/s HDR "
    "InfiniBand (one 25 GB/s NIC per GPU per direction); Selene, the system of Korthikanti et "
    "al. 2022 (arXiv 2205.05198, section 6), has the same eight 200 Gb/s HCAs per node, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf"
)
_DGX_H100 = (
    "NVIDIA DGX H100/H200 datasheet: 8 GPUs on NVSwitch, 8x single-port ConnectX-7 400 Gb/s "
    "(one 50 GB/s NIC per GPU per direction), "
    "https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx"
)
_MI300X_LINKS = (
    "AMD Instinct MI300X data sheet: 7 Infinity Fabric links at 128 GB/s peak each (both "
    "directions), fully connecting 8 GPUs: 7 x 64 GB/s per direction, "
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
    "amd-instinct-mi300x-data-sheet.pdf"
)
_ND_MI300X = (
    "Microsoft Azure ND MI300X v5 series: 8 MI300X per VM, InfiniBand 8x400 Gb/s NDR "
    "(one 50 GB/s NIC per GPU per direction), https://learn.microsoft.com/en-us/azure/"
    "virtual-machines/sizes/gpu-accelerated/nd-mi300x-v5-series"
)
_TPU_V5E = (
    "Google Cloud TPU v5e documentation (197 TFLOPs bf16, 16 GB HBM2 at 819 GBps, 400 GBps "
    "bidirectional ICI per chip = 200 per direction, 256-chip pod, 2x100 Gbps NIC per 8-chip "
    "host = 25 Gbps per chip), https://cloud.google.com/tpu/docs/v5e"
)
_TPU_V5P = (
    "Google Cloud TPU v5p training documentation (459 TFLOPs bf16 and fp8, 95 GiB HBM at "
    "2765 GBps (the v5p page says 95 GB), 1200 GBps bidirectional ICI per chip = 600 per "
    "direction, 8960-chip pod, 50 Gbps DCN per chip), https://cloud.google.com/tpu/docs/v5p-training"
)


def _sources(default: str, **overrides: str) -> dict[str, str]:
    fields = _CORE_FIELDS + ("sparse_peak_flops_per_s",)
    return dict.fromkeys(fields, default) | overrides


def _nvidia(name: str, *, dense: dict, sparse: dict, bandwidth: float, memory: int, nvlink: float,
            nic: float, sources: dict) -> Accelerator:
    return Accelerator(
        name=name, peak_flops_per_s=dense, sparse_peak_flops_per_s=sparse,
        memory_bandwidth_bytes_per_s=bandwidth, memory_bytes=memory,
        intra_node_bytes_per_s=nvlink / 2, devices_per_node=8, inter_node_bytes_per_s=nic,
        sources=sources,
    )


_HOPPER_DENSE_PEAKS = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
                       "fp8": 1978.9e12}
_HOPPER_SPARSE_PEAKS = {"tf32": 989.4e12, "bf16": 1978.9e12, "fp16": 1978.9e12, "fp8": 3957.8e12}

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        _nvidia(
            "A100 SXM 80GB",
            dense={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
            sparse={"tf32": 312e12, "bf16": 624e12, "fp16": 624e12},
            bandwidth=2.039e12, memory=81_920 * 2**20, nvlink=600e9, nic=25e9,  # 80 GiB (NVML)
            sources=_sources(_A100_DATASHEET, memory_bytes=_NVML_MEMORY,
                             intra_node_bytes_per_s=_NVLINK, devices_per_node=_DGX_A100,
                             inter_node_bytes_per_s=_DGX_A100),
        ),
        _nvidia(
            "H100 SXM", dense=_HOPPER_DENSE_PEAKS, sparse=_HOPPER_SPARSE_PEAKS,
            bandwidth=3.35e12, memory=81_559 * 2**20, nvlink=900e9, nic=50e9,  # NVML's total
            sources=_sources(_H100_DATASHEET, peak_flops_per_s=f"{_H100_DATASHEET}; {_HOPPER_DENSE}",
                             memory_bytes=_NVML_MEMORY, intra_node_bytes_per_s=_NVLINK,
                             devices_per_node=_DGX_H100, inter_node_bytes_per_s=_DGX_H100),
        ),
        _nvidia(
            "H200", dense=_HOPPER_DENSE_PEAKS, sparse=_HOPPER_SPARSE_PEAKS,
            bandwidth=4.8e12, memory=143_771 * 2**20, nvlink=900e9, nic=50e9,  # NVML's total
            sources=_sources(_H200_DATASHEET, peak_flops_per_s=f"{_H200_DATASHEET}; {_HOPPER_DENSE}",
                             memory_bytes=_NVML_MEMORY, intra_node_bytes_per_s=_NVLINK,
                             devices_per_node=_DGX_H100, inter_node_bytes_per_s=_DGX_H100),
        ),
        _nvidia(
            "B200",
            dense={"fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
            sparse={"tf32": 2.2e15, "bf16": 4.5e15, "fp16": 4.5e15, "fp8": 9e15},
            bandwidth=8e12, memory=183_359 * 2**20, nvlink=1.8e12, nic=50e9,  # NVML's total
            sources=_sources(_HGX_B200, memory_bandwidth_bytes_per_s=_DGX_B200, memory_bytes=_B200_MEMORY,
                             intra_node_bytes_per_s=_NVLINK, devices_per_node=_DGX_B200,
                             inter_node_bytes_per_s=_DGX_B200),
        ),
        Accelerator(
            name="MI300X",
            peak_flops_per_s={"fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12,
                              "fp16": 1307.4e12, "fp8": 2614.9e12},
            sparse_peak_flops_per_s={"tf32": 1307.4e12, "bf16": 2614.9e12, "fp16": 2614.9e12,
                                     "fp8": 5229.8e12},
            memory_bandwidth_bytes_per_s=5.3e12, memory_bytes=196_592 * 2**20,  # HIP's total
            intra_node_bytes_per_s=7 * 64e9, devices_per_node=8, inter_node_bytes_per_s=50e9,
            sources=_sources(_MI300X_DATASHEET, memory_bytes=_MI300X_MEMORY,
                             intra_node_bytes_per_s=_MI300X_LINKS,
                             devices_per_node=_MI300X_LINKS, inter_node_bytes_per_s=_ND_MI300X),
        ),
        Accelerator(
            name="TPU v5e",
            peak_flops_per_s={"bf16": 197e12},
            memory_bandwidth_bytes_per_s=819e9, memory_bytes=16 * 10**9,
            intra_node_bytes_per_s=200e9, devices_per_node=256, inter_node_bytes_per_s=25e9 / 8,
            sources=dict.fromkeys(_CORE_FIELDS + _OPTIONAL_FIELDS[1:], _TPU_V5E),
        ),
        Accelerator(
            name="TPU v5p",
            peak_flops_per_s={"bf16": 459e12, "fp8": 459e12},
            memory_bandwidth_bytes_per_s=2765e9, memory_bytes=95 * 2**30,
            intra_node_bytes_per_s=600e9, devices_per_node=8960, inter_node_bytes_per_s=50e9 / 8,
            sources=dict.fromkeys(_CORE_FIELDS + _OPTIONAL_FIELDS[1:], _TPU_V5P),
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
    "v5e": "TPU v5e", "tpu-v5-lite": "TPU v5e", "v5p": "TPU v5p", "tpuv5e": "TPU v5e",
    "tpuv5p": "TPU v5p",
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
        f"(aliases: {', '.join(sorted(_ALIASES))}; 'cpu' for this machine, calibrated)"
    )
