"""Accelerator table and local calibration of `slipstream.perf.hardware`."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest
import torch

from slipstream.perf import hardware
from slipstream.perf.hardware import (
    ACCELERATORS,
    DTYPE_KEYS,
    Accelerator,
    Calibration,
    cache_dir,
    calibrate,
    cpu_multiplies_bf16,
    cpu_name,
    dtype_key,
    get_accelerator,
)

_FIELDS = ("peak_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")


@pytest.mark.parametrize("name", ACCELERATORS)
def test_every_field_has_a_source(name):
    """Guards provenance: every numeric field of every entry names a public document."""
    accelerator = ACCELERATORS[name]
    for field in _FIELDS:
        source = accelerator.sources[field]
        assert "http" in source and len(source) > 20, (name, field, source)
    assert set(accelerator.peak_flops_per_s) <= set(DTYPE_KEYS)
    assert all(v > 0 for v in accelerator.peak_flops_per_s.values())
    assert accelerator.memory_bandwidth_bytes_per_s > 0 and accelerator.memory_bytes > 0


def test_dense_bf16_peaks_are_dense():
    """Guards against sparse datasheet figures leaking in as dense peaks (a 2x MFU error)."""
    expected = {"A100 SXM 80GB": 312e12, "H100 SXM": 989e12, "H200": 989e12, "B200": 2.25e15,
                "MI300X": 1307e12}
    for name, peak in expected.items():
        assert get_accelerator(name).peak_flops("bf16") == pytest.approx(peak, rel=1e-3)
    for accelerator in ACCELERATORS.values():
        peaks = accelerator.peak_flops_per_s
        if "tf32" not in peaks:  # TPUs: bf16 (and fp8 on v5p) only, no GPU-style ladder
            continue
        assert peaks["fp16"] == peaks["bf16"]
        assert peaks["tf32"] == pytest.approx(peaks["bf16"] / 2, rel=0.03)
        assert peaks["fp32"] < peaks["tf32"]
        if "fp8" in peaks:
            assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=1e-3)
        assert 100 < accelerator.ridge_flops_per_byte("bf16") < 400  # FLOPs per byte


def test_memory_values():
    """Guards HBM bandwidth against the datasheets and capacity against what the runtime reports:
    the H200's 143,771 MiB from NVML (Modal's table, thundergolfer.com/blog/nvidia-gpu-memory-
    capacity), the B200's 183,359 MiB from NVML (179 GB in Vultr's nvidia-smi check, 180 GB per GPU
    in the DGX B200 datasheet) and the MI300X's 196,592 MiB from HIP (ROCm/ROCm issue #4203), not
    the datasheets' 141e9 and 192e9 bytes, which are binary gigabytes read as decimal ones."""
    assert get_accelerator("a100").memory_bandwidth_bytes_per_s == 2.039e12
    assert get_accelerator("h100").memory_bandwidth_bytes_per_s == 3.35e12
    capacities = {"h200": (143_771, "thundergolfer.com"), "b200": (183_359, "docs.vultr.com"),
                  "mi300x": (196_592, "ROCm/ROCm/issues/4203")}
    for name, (mib, source) in capacities.items():
        accelerator = get_accelerator(name)
        assert accelerator.memory_bytes == mib * 2**20
        assert source in accelerator.sources["memory_bytes"]
    assert get_accelerator("b200").memory_bytes / 2**30 == pytest.approx(179.06, abs=0.005)
    assert get_accelerator("mi300x").memory_bytes / 2**30 == pytest.approx(192, abs=0.02)


def test_get_accelerator_names_and_aliases():
    """Guards lookup: case-insensitive, aliases, and torch.cuda device names."""
    assert get_accelerator("h100 sxm") is ACCELERATORS["H100 SXM"]
    assert get_accelerator("H100_SXM") is ACCELERATORS["H100 SXM"]
    assert get_accelerator("NVIDIA H100 80GB HBM3") is ACCELERATORS["H100 SXM"]
    assert get_accelerator("NVIDIA A100-SXM4-80GB") is ACCELERATORS["A100 SXM 80GB"]
    assert get_accelerator("AMD Instinct MI300X") is ACCELERATORS["MI300X"]
    assert get_accelerator("b200") is ACCELERATORS["B200"]


def test_unknown_accelerator_raises_listing_known():
    """Guards against a silent fallback peak (torchtitan's 563 % MFU on an unknown part)."""
    with pytest.raises(ValueError, match="known: .*H100 SXM"):
        get_accelerator("NVIDIA H100 PCIe")


def test_missing_dtype_and_missing_source_raise():
    """Guards that a peak the part lacks (A100 fp8) and an unsourced entry are errors."""
    with pytest.raises(ValueError, match="no fp8"):
        get_accelerator("a100").peak_flops(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no source"):
        Accelerator(name="x", peak_flops_per_s={"bf16": 1.0}, memory_bandwidth_bytes_per_s=1.0,
                    memory_bytes=1, sources={})
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_key("float7")
    assert dtype_key(torch.bfloat16) == dtype_key("bfloat16") == "bf16"


@pytest.fixture(scope="module")
def quick_calibration(tmp_path_factory):
    """One quick CPU calibration into a temporary cache, shared by the tests below."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        start_s = time.perf_counter()
        result = calibrate(quick=True, device="cpu")
        first_s = time.perf_counter() - start_s
        start_s = time.perf_counter()
        again = calibrate(quick=True, device="cpu")
        second_s = time.perf_counter() - start_s
        files = list(cache_dir().glob("*.json"))
    return result, again, first_s, second_s, files


def test_calibrate_measures_this_cpu(quick_calibration):
    """Guards that calibration measures positive fp32/bf16 peaks and memory bandwidth."""
    result, _, first_s, _, _ = quick_calibration
    print(result.format())
    assert result.device == "cpu" and result.num_threads == torch.get_num_threads()
    assert result.peak_flops("float32") > 1e9
    assert result.peak_flops("float32") == max(result.matmul_flops_per_s["fp32"].values())
    assert result.memory_bandwidth_bytes_per_s == result.memory_read_bytes_per_s > 1e9
    assert result.memory_copy_bytes_per_s > 1e9
    for dtype, path in result.best_paths.items():
        assert result.peak_flops(dtype) == result.matmul_flops_per_s[dtype][path]
    assert first_s < 20


def test_calibration_cache_round_trips(quick_calibration):
    """Guards the cache: a second call loads the same record from XDG_CACHE_HOME, fast."""
    result, again, first_s, second_s, files = quick_calibration
    print(f"first call {first_s:.2f} s, cached call {second_s:.3f} s")
    assert again == result
    assert len(files) == 1 and "quick" in files[0].name
    assert second_s < 0.5


def test_calibration_dict_round_trip_and_format(quick_calibration):
    """Guards to_dict/from_dict (through JSON), the derived keys, and the CLI table."""
    result = quick_calibration[0]
    d = json.loads(json.dumps(result.to_dict()))
    assert d["best_paths"] == result.best_paths
    assert Calibration.from_dict(d) == result
    with pytest.raises(ValueError, match="unknown keys"):
        Calibration.from_dict(d | {"bogus": 1})
    text = result.format()
    assert "fp32" in text and "GB/s" in text and str(result) == text
    with pytest.raises(ValueError, match="no fp8 matmul"):
        result.peak_flops("fp8")


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    """Guards that an unreadable cache file is replaced by a fresh measurement, not an error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = calibrate(quick=True, device="cpu")
    (path,) = cache_dir().glob("*.json")
    path.write_text("{not json")
    second = calibrate(quick=True, device="cpu")
    assert dataclasses.asdict(second).keys() == dataclasses.asdict(first).keys()
    assert Calibration.from_dict(json.loads(path.read_text())) == second
    assert calibrate(quick=True, device="cpu", force=True) != second  # measured again


def test_cpu_name_tells_generations_with_one_model_name_apart():
    """Virtual machines report a bare "AMD EPYC" for Zen 4 and Zen 5 alike; the family and model
    keep their calibrations (and cache files) apart. Only the first processor's block counts."""
    block = "processor\t: {p}\nvendor_id\t: AuthenticAMD\ncpu family\t: {f}\nmodel\t\t: {m}\n" \
            "model name\t: AMD EPYC\nstepping\t: 1\n"
    zen4 = block.format(p=0, f=25, m=17) + "\n" + block.format(p=1, f=26, m=2)
    zen5 = block.format(p=0, f=26, m=2)
    assert cpu_name(zen4) == "AMD EPYC (family 25, model 17, stepping 1)"
    assert cpu_name(zen5) == "AMD EPYC (family 26, model 2, stepping 1)"
    assert cpu_name("processor\t: 0\nmodel name\t: Some CPU\n") == "Some CPU"


def test_cpu_bf16_arithmetic_from_the_cpuinfo_flags():
    """bf16 arithmetic is the kernel's avx512_bf16 or amx_bf16 flag on x86 (an Ice Lake Xeon has
    AVX-512 but neither; Zen 4 and Sapphire Rapids have them) and the bf16 hwcap in an Arm CPU's
    Features; avx512bw and the like are not it, and a CPU without flags has none."""
    ice_lake = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bitalg\n"
    zen4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire_rapids = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
    graviton3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"
    graviton2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
    assert not cpu_multiplies_bf16(ice_lake) and not cpu_multiplies_bf16(graviton2)
    assert all(map(cpu_multiplies_bf16, (zen4, sapphire_rapids, graviton3)))
    assert not cpu_multiplies_bf16("") and not cpu_multiplies_bf16("processor\t: 0\nmodel name\t: X\n")


@pytest.mark.parametrize(("load", "warned"), [(0.1, False), (1.7, True)])
def test_a_calibration_on_a_busy_machine_says_so(tmp_path, monkeypatch, caplog, load, warned):
    """Peaks measured while other processes share the cores come out low (and MFU against them
    above 100%): calibrate() records the 1-minute load average it started at, warns from
    BUSY_LOAD_AVERAGE on, and the table says so; the cache keeps the load."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(hardware, "_measure_matmuls", lambda device, quick: ({"fp32": {"default": 1e11}}, {}))
    monkeypatch.setattr(hardware, "measure_memory_bandwidth", lambda device, quick: (3e10, 2e10))
    monkeypatch.setattr(hardware, "_measure_cache_reads", lambda quick: {})
    with caplog.at_level(logging.WARNING, logger=hardware.__name__):
        calibration = calibrate(quick=True, device="cpu")
    assert calibration.load_average_1m == load
    assert ("load average is 1.70" in caplog.text) == warned
    assert ("busy: peaks may be low" in calibration.format()) == warned
    (path,) = cache_dir().glob("*.json")
    assert Calibration.from_dict(json.loads(path.read_text())).load_average_1m == load


def test_a_calibration_record_without_a_load_average_still_loads():
    """Calibrations written before the load average was recorded (or where the OS has none) read
    back with None, which the table leaves out."""
    calibration = Calibration(
        device="cpu", device_name="test CPU", torch_version="2.13.0", num_threads=1,
        matmul_flops_per_s={"fp32": {"default": 1e11}}, matmul_errors={}, memory_read_bytes_per_s=12.8e9,
        memory_copy_bytes_per_s=10e9, cache_read_bytes_per_s={}, quick=False, elapsed_s=1.0,
        created_at="2026-12-05T19:40:00+00:00", load_average_1m=3.0)
    record = {k: v for k, v in calibration.to_dict().items() if k != "load_average_1m"}
    calibration = Calibration.from_dict(record)
    assert calibration.load_average_1m is None and "load average" not in calibration.format()
