"""The completed accelerator table (`slipstream.perf.accelerators`) and the local CPU entry."""

from __future__ import annotations

import json

import pytest

from slipstream.perf.accelerators import ACCELERATORS, Accelerator, get_accelerator
from slipstream.perf.hardware import Calibration, calibrate, local_accelerator

_ALL_FIELDS = ("peak_flops_per_s", "sparse_peak_flops_per_s", "memory_bandwidth_bytes_per_s",
               "memory_bytes", "intra_node_bytes_per_s", "devices_per_node", "inter_node_bytes_per_s")


def test_table_covers_the_issue_parts():
    """Guards the required parts: A100, H100 SXM, H200, B200, MI300X, TPU v5e and v5p."""
    for name in ("a100", "h100", "h200", "b200", "mi300x", "v5e", "v5p"):
        assert get_accelerator(name).name in ACCELERATORS


@pytest.mark.parametrize("name", ACCELERATORS)
def test_every_link_and_sparse_field_has_a_source(name):
    """Guards provenance of the new fields: links, node size and sparse peaks name a document."""
    acc = ACCELERATORS[name]
    for field in _ALL_FIELDS:
        if field == "sparse_peak_flops_per_s" and not acc.sparse_peak_flops_per_s:
            continue  # TPUs list no structured sparsity
        assert "http" in acc.sources[field], (name, field)
    assert acc.intra_node_bytes_per_s > acc.inter_node_bytes_per_s > 0
    assert acc.devices_per_node >= 8


def test_sparse_is_twice_dense_and_stated_separately():
    """Guards dense vs sparse: 2:4 sparsity doubles each tensor-core dtype and never fp32."""
    for acc in ACCELERATORS.values():
        for dtype, sparse in acc.sparse_peak_flops_per_s.items():
            assert sparse == pytest.approx(2 * acc.peak_flops_per_s[dtype], rel=0.03), (acc.name, dtype)
        assert "fp32" not in acc.sparse_peak_flops_per_s
    assert get_accelerator("h100").sparse_peak_flops_per_s["fp8"] == pytest.approx(3958e12, rel=1e-3)
    assert not get_accelerator("v5p").sparse_peak_flops_per_s


def test_links_are_per_direction():
    """Guards the per-direction convention: NVLink 600/900/1800 GB/s totals are halved."""
    expected = {"a100": 300e9, "h100": 450e9, "h200": 450e9, "b200": 900e9, "mi300x": 448e9,
                "v5e": 200e9, "v5p": 600e9}
    for name, bandwidth in expected.items():
        assert get_accelerator(name).intra_node_bytes_per_s == pytest.approx(bandwidth)
    assert get_accelerator("a100").inter_node_bytes_per_s == 25e9  # 200 Gb/s HDR per GPU
    assert get_accelerator("h100").inter_node_bytes_per_s == 50e9  # 400 Gb/s per GPU


def test_tpu_values_and_units():
    """Guards the TPU rows, including v5p's 95 GiB (not GB) and v5e's 819 GB/s."""
    v5e, v5p = get_accelerator("TPU v5e"), get_accelerator("tpu v5p")
    assert v5e.peak_flops("bf16") == 197e12 and v5e.memory_bandwidth_bytes_per_s == 819e9
    assert v5p.memory_bytes == 95 * 2**30 and v5p.peak_flops("fp8") == 459e12
    with pytest.raises(ValueError, match="lists no fp32"):
        v5e.peak_flops("fp32")


def test_unknown_device_error_lists_known_and_cpu():
    """Guards that an unknown name fails loudly and says how to get this machine."""
    with pytest.raises(ValueError, match="known: .*TPU v5p.*'cpu'"):
        get_accelerator("A800")


def test_scaled_what_if_copy():
    """Guards Accelerator.scaled: each factor multiplies its fields only, and is named."""
    base = get_accelerator("h100")
    fast = base.scaled(flops=2, memory_bandwidth=1.5, link=3)
    assert fast.peak_flops("bf16") == 2 * base.peak_flops("bf16")
    assert fast.memory_bandwidth_bytes_per_s == 1.5 * base.memory_bandwidth_bytes_per_s
    assert fast.intra_node_bytes_per_s == 3 * base.intra_node_bytes_per_s
    assert fast.memory_bytes == base.memory_bytes and "flops x2" in fast.name
    with pytest.raises(ValueError, match="unknown scale factors"):
        base.scaled(clock=2)


def _with_curve(curve: dict[int, float]) -> Accelerator:
    return Accelerator(name="x", peak_flops_per_s={"bf16": 1.0}, memory_bandwidth_bytes_per_s=50.0,
                       memory_bytes=1, cache_read_bytes_per_s=curve,
                       sources=dict.fromkeys(("peak_flops_per_s", "memory_bandwidth_bytes_per_s",
                                              "memory_bytes", "cache_read_bytes_per_s"), "x http://x"))


def test_read_bandwidth_interpolates_the_measured_curve():
    """Guards Accelerator.read_bandwidth: the measured rates at their sizes, linear in log size
    between them (the geometric mean of two sizes is halfway), the smallest size's rate below it,
    the memory bandwidth from the largest size on and for table parts (nothing measured)."""
    acc = _with_curve({64: 80.0, 16: 200.0, 256: 50.0})  # given out of order
    assert list(acc.cache_read_bytes_per_s) == [16, 64, 256]
    assert [acc.read_bandwidth(size) for size in (1, 16, 64)] == [200.0, 200.0, 80.0]
    assert acc.read_bandwidth(32) == pytest.approx(140.0)
    assert acc.read_bandwidth(128) == pytest.approx(65.0)
    assert acc.read_bandwidth(256) == acc.read_bandwidth(10**12) == 50.0
    h100 = get_accelerator("h100")
    assert h100.read_bandwidth(2**20) == h100.memory_bandwidth_bytes_per_s
    assert acc.scaled(memory_bandwidth=2).read_bandwidth(32) == pytest.approx(280.0)
    with pytest.raises(ValueError, match="positive sizes and rates"):
        _with_curve({0: 1.0})


def test_missing_source_for_a_link_is_an_error():
    """Guards that a link bandwidth without a source cannot enter the table."""
    with pytest.raises(ValueError, match="no source for .*intra_node"):
        Accelerator(name="x", peak_flops_per_s={"bf16": 1.0}, memory_bandwidth_bytes_per_s=1.0,
                    memory_bytes=1, intra_node_bytes_per_s=1.0,
                    sources=dict.fromkeys(("peak_flops_per_s", "memory_bandwidth_bytes_per_s",
                                           "memory_bytes"), "x http://x"))


def test_local_cpu_from_calibration(tmp_path, monkeypatch):
    """Guards the local entry: measured peaks and bandwidth from calibrate(), RAM as capacity."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calibration = calibrate(quick=True, device="cpu")
    acc = local_accelerator(calibration)
    assert acc.peak_flops("fp32") == calibration.peak_flops("fp32")
    assert acc.memory_bandwidth_bytes_per_s == calibration.memory_bandwidth_bytes_per_s
    assert acc.memory_bytes > 2**30 and "calibrated" in acc.name
    sizes = list(acc.cache_read_bytes_per_s)
    assert len(sizes) > 2 and sizes == sorted(sizes) == list(calibration.cache_read_bytes_per_s)
    measured = list(calibration.cache_read_bytes_per_s.values())
    assert measured[-1] == acc.memory_bandwidth_bytes_per_s
    assert list(acc.cache_read_bytes_per_s.values()) == [
        max(min(measured[:i + 1]), acc.memory_bandwidth_bytes_per_s) for i in range(len(sizes))]


@pytest.mark.parametrize("l3_mib, quick", [(480, True), (480, False), (32, True)])
def test_repeated_reads_probe_small_buffers_whatever_the_reported_cache(monkeypatch, l3_mib, quick):
    """The repeated-read curve starts at 8 MiB and is dense (at most 2x apart) up to the memory
    buffer, whatever sysfs says the last-level cache is: an Intel Xeon VM reports 480 MiB of L3,
    and a curve of its multiples began at 240 MiB, so the `tiny` preset's 52 MB decode steps read
    at the 240 MiB rate (about 15 GB/s) where a 52 MiB buffer reads at 29 GB/s. The timing is
    replaced by a record of the buffers read: exactly the grid's below the memory buffer (every
    other one when quick), each at its own rate."""
    from slipstream.perf import hardware

    monkeypatch.setattr(hardware, "_l3_cache_bytes", lambda: l3_mib * 2**20)
    read = []

    def timed(nbytes: int) -> float:
        read.append(nbytes)
        return nbytes / 1e3
    monkeypatch.setattr(hardware, "_repeated_read_bytes_per_s", timed)
    curve = hardware._measure_cache_reads(quick=quick)
    memory_buffer = hardware._memory_buffer_bytes()
    grid = [mib * 2**20 for mib in (hardware.CACHE_READ_SIZES[::2] if quick else hardware.CACHE_READ_SIZES)]
    assert read == list(curve) == [size for size in grid if size < memory_buffer]
    assert all(rate == size / 1e3 for size, rate in curve.items())
    assert memory_buffer == (2**30 if l3_mib == 480 else 256 * 2**20)
    assert read[0] == 8 * 2**20 and read[-1] >= memory_buffer / 2
    ends = [*read, memory_buffer]
    assert max(b / a for a, b in zip(ends, ends[1:], strict=False)) <= (2 if quick else 1.5)
    assert any(32 * 2**20 <= size <= 64 * 2**20 for size in read)  # around tiny's 52 MB


def test_the_repeated_read_curve_never_rises_with_the_size():
    """The curve a calibration measured on a loaded machine (19:40 UTC, one thread), where noise
    has larger buffers read faster than smaller ones (724 MiB at 14.7 GB/s after 256 MiB at 8.8),
    and the 1 GiB memory read (12.8) ending it: the accelerator keeps its running minimum from
    small to large sizes floored at the memory's rate (a slow outlier must not price every larger
    read below what memory gives), also when loaded from a calibration file, and read_bandwidth
    never rises with the size, past the curve's end included."""
    grid = {8: 28.8, 11: 29.0, 16: 29.3, 23: 29.4, 32: 29.5, 45: 29.0, 64: 20.1, 91: 16.3, 128: 10.9,
            181: 15.7, 256: 8.8, 362: 10.3, 512: 10.1, 724: 14.7, 1024: 12.8}
    curve = {mib * 2**20: rate * 1e9 for mib, rate in grid.items()}
    calibration = Calibration(
        device="cpu", device_name="test CPU", torch_version="2.13.0", num_threads=1,
        matmul_flops_per_s={"fp32": {"default": 1e11}}, matmul_errors={}, memory_read_bytes_per_s=12.8e9,
        memory_copy_bytes_per_s=10e9, cache_read_bytes_per_s=curve, quick=False, elapsed_s=1.0,
        created_at="2026-12-05T19:40:00+00:00")
    loaded = Calibration.from_dict(json.loads(json.dumps(calibration.to_dict())))
    assert dict(loaded.cache_read_bytes_per_s) == curve  # the file keeps what was measured
    for acc in (local_accelerator(calibration), local_accelerator(loaded)):
        rates = list(acc.cache_read_bytes_per_s.values())
        assert rates == [max(min(list(grid.values())[:i + 1]), 12.8) * 1e9 for i in range(len(grid))]
        assert acc.cache_read_bytes_per_s[128 * 2**20] == acc.cache_read_bytes_per_s[181 * 2**20] == 12.8e9
        assert acc.cache_read_bytes_per_s[91 * 2**20] == 16.3e9 and acc.read_bandwidth(4 * 2**30) == 12.8e9
        sizes = [2**20 * 1.05**i for i in range(180)]
        bandwidths = [acc.read_bandwidth(size) for size in sizes]
        assert all(b <= a for a, b in zip(bandwidths, bandwidths[1:], strict=False))
        assert min(bandwidths) == 12.8e9


def test_80gb_parts_have_what_nvml_reports():
    """Guards the GB/GiB confusion: the datasheets' "80GB" A100 and H100 expose 81,920 MiB and
    81,559 MiB (nvidia-smi / NVML totals tabulated by Modal,
    https://thundergolfer.com/blog/nvidia-gpu-memory-capacity), not 80e9 bytes."""
    a100, h100 = get_accelerator("a100"), get_accelerator("h100")
    assert a100.memory_bytes == 80 * 2**30 == 81_920 * 2**20
    assert h100.memory_bytes == 81_559 * 2**20
    assert h100.memory_bytes / 1e9 == pytest.approx(85.52, abs=0.005)
    for acc in (a100, h100):
        assert "thundergolfer.com" in acc.sources["memory_bytes"]


@pytest.mark.parametrize("factor", [1e-320, 1e-7, 2e6, float("nan"), 0.0, -1.0])
def test_scale_factors_are_bounded(factor):
    """A factor near 0 (1e-320, a subnormal) made every time infinite and `perf whatif` print NaN:
    factors outside 1e-6..1e6 are refused, naming the factor."""
    with pytest.raises(ValueError, match="scale factor flops must be a number from 1e-06 to 1e"):
        get_accelerator("h100").scaled(flops=factor)
    edge = get_accelerator("h100").scaled(flops=1e-6, link=1e6)
    assert edge.peak_flops("bf16") == pytest.approx(1e-6 * get_accelerator("h100").peak_flops("bf16"))
