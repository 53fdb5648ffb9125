"""`perf trace`'s per-op roofline: FLOPs against torch.utils.flop_counter and the profiler's own
count on a real profile, bytes against the closed form from the shapes, the roofline fraction and
the kernels' time on hand-built traces, and ops whose work the trace does not give."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from slipstream.cli import main
from slipstream.perf.hardware import get_accelerator
from slipstream.perf.trace import analyze
from slipstream.perf.trace_report import format_report

Q, KV = (1, 4, 8, 16), (1, 2, 8, 16)  # grouped-query attention: 4 query heads on 2 key/value heads
CAUSAL_Q, CAUSAL_KV = (2, 2, 6, 8), (2, 2, 10, 8)  # causal, 6 queries on 10 keys


def _work():
    """Products through every path a model takes them (a 2-D and a 3-D linear, mm, a batched matmul,
    baddbmm), attention (and causal attention), a broadcast add and a bf16 layer norm."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    linear(torch.randn(16, 64))
    linear(torch.randn(2, 8, 64))
    torch.mm(torch.randn(16, 64), torch.randn(64, 32))
    torch.matmul(torch.randn(3, 5, 7), torch.randn(3, 7, 4))
    torch.baddbmm(torch.randn(3, 5, 4), torch.randn(3, 5, 7), torch.randn(3, 7, 4))
    torch.nn.functional.scaled_dot_product_attention(torch.randn(Q), torch.randn(KV), torch.randn(KV),
                                                     enable_gqa=True)
    torch.nn.functional.scaled_dot_product_attention(torch.randn(CAUSAL_Q), torch.randn(CAUSAL_KV),
                                                     torch.randn(CAUSAL_KV), is_causal=True)
    torch.randn(64, 1) + torch.randn(1, 32)
    torch.nn.functional.layer_norm(torch.randn(4, 32, dtype=torch.bfloat16), (32,))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The roofline of a profile of `_work` on the H100's datasheet, FlopCounterMode's count of the
    same work ({op name: FLOPs}), and the profiler's own (with_flops: {op name: FLOPs})."""
    with FlopCounterMode(display=False) as counter:
        _work()
    counts = counter.get_flop_counts()["Global"]
    counted = {f"aten::{op.__name__.split('.')[0]}": flops for op, flops in counts.items()}
    path = tmp_path_factory.mktemp("roofline") / "ops.json"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        _work()
    prof.export_chrome_trace(str(path))
    profiler = defaultdict(int)
    for e in prof.key_averages():
        profiler[e.key] += e.flops
    roofline = analyze([str(path)], top=100, hardware="h100")["ranks"][0]["roofline"]
    return roofline, counted, profiler


def _by_name(roofline, key):
    out = defaultdict(float)
    for g in roofline["ops"]:
        out[g["name"]] += g[key]
    return out


def test_product_flops_match_flop_counter_and_the_profiler(profiled):
    """Per op name, the products' FLOPs are FlopCounterMode's and the profiler's own (with_flops),
    each product counted once: the linear layers and the batched matmul only through the addmm and
    bmm inside them. Attention (whose CPU kernel FlopCounterMode has no formula for) is its
    sdpa_flop_count formula."""
    roofline, counted, profiler = profiled
    ours = _by_name(roofline, "flops")
    assert {"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm"} == set(counted)
    for name, flops in counted.items():
        assert ours[name] == flops == profiler[name], name
    assert "aten::linear" not in ours and "aten::matmul" not in ours
    attention = next(g for g in roofline["ops"] if g["name"].endswith("attention_for_cpu")
                     and not g["shapes"].endswith("causal"))
    assert attention["flops"] == sdpa_flop_count(Q, KV, KV)
    del ours["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert sum(ours.values()) == sum(counted.values())
    assert roofline["unpriced"] == [] and roofline["time_source"] == "host"


def test_causal_attention_counts_the_pairs_its_mask_keeps(profiled):
    """Causal attention of 6 queries on 10 keys is charged for the (query, key) pairs PyTorch's
    is_causal mask keeps (counted from the mask itself), not for all 60."""
    roofline, _, _ = profiled
    (causal,) = [g for g in roofline["ops"] if g["shapes"].endswith("causal")]
    b, heads, length, e = CAUSAL_Q
    keys = CAUSAL_KV[2]
    pairs = int(torch.ones(length, keys, dtype=torch.bool).tril().sum())
    assert pairs == 21
    assert causal["flops"] == 2 * b * heads * pairs * (e + e)
    full = sdpa_flop_count(CAUSAL_Q, CAUSAL_KV, CAUSAL_KV)
    assert causal["flops"] == full * pairs / (length * keys)


def test_bytes_are_the_inputs_and_outputs_once(profiled):
    """Bytes moved by the closed form from the shapes: mm (16x64)(64x32) reads both and writes
    16x32 in fp32; the broadcast add reads 64x1 and 1x32 and writes 64x32; the bf16 layer norm
    reads and writes 4x32 at 2 bytes; addmm reads its 48 bias values too (twice called)."""
    roofline, _, _ = profiled
    groups = {(g["name"], g["shapes"]): g for g in roofline["ops"]}
    assert groups[("aten::mm", "16x64, 64x32")]["bytes"] == (16 * 64 + 64 * 32 + 16 * 32) * 4
    assert groups[("aten::add", "64x1, 1x32")]["bytes"] == (64 + 32 + 64 * 32) * 4
    norm = groups[("aten::native_layer_norm", "4x32")]
    assert (norm["bytes"], norm["dtype"], norm["flops"]) == (2 * 4 * 32 * 2, "c10::BFloat16", 0)
    addmm = groups[("aten::addmm", "48, 16x64, 64x48")]
    assert (addmm["calls"], addmm["bytes"]) == (2, 2 * (48 + 16 * 64 + 64 * 48 + 16 * 48) * 4)


def _op(name, start, dur, dims=None, types=None, tid=100):
    event = {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": tid, "ts": start, "dur": dur}
    if dims is not None:
        event["args"] = {"Input Dims": dims, "Input type": types or ["float"] * len(dims)}
    return event


def _write(path, events, **metadata):
    path.write_text(json.dumps({"schemaVersion": 1, **metadata, "traceEvents": events}))
    return str(path)


def test_fraction_of_the_roofline_by_closed_form(tmp_path):
    """An mm of (4096x4096)(4096x4096) in bf16 in 200 us, in a linear that is not counted again: its
    roofline bound on the H100 is max(2 x 4096^3 / peak, 3 x 4096^2 x 2 / bandwidth), compute;
    a bf16 add of 2^20 elements in 10 us is memory-bound at 3 x 2 MiB / bandwidth."""
    h100 = get_accelerator("h100")
    n = 4096
    events = [_op("aten::linear", 0, 300, [[n, n], [n, n], []], ["c10::BFloat16"] * 2 + [""]),
              _op("aten::mm", 50, 200, [[n, n], [n, n]], ["c10::BFloat16"] * 2),
              _op("aten::add", 400, 10, [[2**20], [2**20], []], ["c10::BFloat16"] * 2 + ["Scalar"])]
    roofline = analyze([_write(tmp_path / "t.json", events)], hardware="h100")["ranks"][0]["roofline"]
    mm, add = roofline["ops"]
    flops, nbytes = 2 * n**3, 3 * n * n * 2
    assert (mm["name"], mm["flops"], mm["bytes"], mm["bound"]) == ("aten::mm", flops, nbytes, "compute")
    assert mm["roofline_fraction"] == pytest.approx(flops / h100.peak_flops("bf16") / 200e-6)
    assert mm["gflops_per_s"] == pytest.approx(flops / 200e-6 / 1e9)
    assert mm["flops_per_byte"] == pytest.approx(flops / nbytes)
    assert (add["bound"], add["bytes"]) == ("memory", 3 * 2**21)
    assert add["roofline_fraction"] == pytest.approx(3 * 2**21 / h100.memory_bandwidth_bytes_per_s / 10e-6)
    assert roofline["hardware"] == h100.name


def test_gpu_ops_are_timed_by_their_kernels(tmp_path):
    """On a GPU trace an op's time is its kernels' (linked by the launch calls inside it), and the
    GPU the trace names is the default hardware: an addmm that launched kernels of 30 + 20 us
    takes 50 us, not its 100 us on the host; a copy inside it is timed by its own kernel."""
    events = [_op("aten::addmm", 0, 100, [[64], [32, 64], [64, 64]]),
              _op("aten::copy_", 10, 20, [[32, 64], [64]]),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100, "ts": 15,
               "dur": 2, "args": {"correlation": 1}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100, "ts": 40,
               "dur": 2, "args": {"correlation": 2}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100, "ts": 60,
               "dur": 2, "args": {"correlation": 3}}]
    events += [{"ph": "X", "cat": "kernel", "name": f"k{c}", "pid": 0, "tid": 7, "ts": 100 + 40 * c, "dur": d,
                "args": {"correlation": c}} for c, d in ((1, 5), (2, 30), (3, 20))]
    path = _write(tmp_path / "gpu.json", events, deviceProperties=[{"name": "NVIDIA H100 80GB HBM3"}])
    roofline = analyze([path])["ranks"][0]["roofline"]
    times = {g["name"]: (g["time_us"], g["host_us"]) for g in roofline["ops"]}
    assert times == {"aten::addmm": (50, 100), "aten::copy_": (5, 20)}
    assert roofline["time_source"] == "kernels" and roofline["hardware"] == get_accelerator("h100").name


def test_ops_without_usable_shapes_are_unpriced_not_dropped(tmp_path, capsys):
    """An mm whose sizes the trace gives oddly, one of a complex type, one whose inner sizes
    differ and an sdpa of 3-D inputs are listed unpriced with the reason; a trace without shapes
    has no roofline section, and an unknown --hardware is an error naming it."""
    events = [_op("aten::mm", 0, 5, [[4, "x"], [4, 4]]), _op("aten::mm", 10, 5, [[4, 4], [4, 4]],
                                                             ["c10::complex<float>"] * 2),
              _op("aten::mm", 20, 5, [[4, 3], [4, 4]]),
              _op("aten::scaled_dot_product_attention", 30, 5, [[2, 8, 16]] * 3),
              _op("aten::mm", 40, 5, [[2, 3], [3, 4]])]
    path = _write(tmp_path / "odd.json", events)
    report = analyze([path], hardware="h100")
    roofline = report["ranks"][0]["roofline"]
    reasons = sorted(u["reason"] for u in roofline["unpriced"])
    assert reasons == sorted(["input 0 has 3 dimensions, 4 expected", "input 0 has no sizes",
                              "input 0 has element type 'c10::complex<float>'", "inner sizes 3 and 4 differ"])
    assert [g["flops"] for g in roofline["ops"]] == [2 * 2 * 3 * 4]
    assert "not priced: aten::mm, 1 calls" in format_report(report)
    plain = _write(tmp_path / "plain.json", [_op("aten::mm", 0, 5)])
    assert analyze([plain])["ranks"][0]["roofline"] is None
    views = _write(tmp_path / "views.json", [_op("aten::view", 0, 5, [[4, 4], []], ["float", "ScalarList"])])
    assert analyze([views])["ranks"][0]["roofline"] is None
    assert main(["perf", "trace", plain]) == 0
    assert "roofline" not in capsys.readouterr().out
    assert main(["perf", "trace", path, "--hardware", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["roofline"]["ops"][0]["bound"] == "memory"
    assert main(["perf", "trace", path, "--hardware", "z80"]) == 2
    assert "unknown accelerator 'z80'" in capsys.readouterr().err


def test_slipstreams_onednn_products_are_priced(tmp_path):
    """slipstream's CPU linears reach oneDNN (`mkldnn::_linear_pointwise`; the trainer's three
    products of a layer through its `slipstream::onednn_mm_nt` around it): a training layer's
    forward and backward and an engine layer's forward are priced, each product once, to the
    FLOPs FlopCounterMode counts for the same products of a plain nn.Linear."""
    from slipstream.ops.linear import PackedLinear
    from slipstream.train.cpu_kernels import OneDNNLinear

    torch.manual_seed(0)
    plain, x = torch.nn.Linear(64, 96), torch.randn(2, 150, 64)
    trained, served = OneDNNLinear(torch.nn.Linear(64, 96)), PackedLinear(torch.nn.Linear(64, 96))
    with FlopCounterMode(display=False) as counter:
        plain(x.requires_grad_()).sum().backward()
        plain(x)
    path = tmp_path / "onednn.json"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trained(x.detach().requires_grad_()).sum().backward()
        served(x.detach())
    prof.export_chrome_trace(str(path))
    roofline = analyze([str(path)], hardware="h100")["ranks"][0]["roofline"]
    names = {g["name"] for g in roofline["ops"] if g["flops"]}
    assert names == {"mkldnn::_linear_pointwise"} and not roofline["unpriced"]
    assert sum(_by_name(roofline, "flops").values()) == counter.get_total_flops() == 4 * 2 * 300 * 64 * 96


def test_out_variants_and_where_write_their_output_once_in_its_type(tmp_path):
    """`torch.add(a, b, out=c)` reads a and b and writes c (its last input); `sigmoid(out=)` and
    `div(rounding_mode=, out=)` likewise; a `div` with a rounding mode and no `out` writes a new
    tensor; `where(mask, a, b)` reads a 1-byte mask and writes a's fp32 type."""
    n = 1024
    a, b, c, mask = torch.randn(n), torch.randn(n), torch.empty(n), torch.rand(n) > 0.5
    path = tmp_path / "out.json"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.add(a, b, out=c)
        torch.sigmoid(a, out=c)
        torch.div(a, b, rounding_mode="floor", out=c)
        torch.div(a, b, rounding_mode="floor")
        torch.where(mask, a, b)
    prof.export_chrome_trace(str(path))
    groups = analyze([str(path)], hardware="h100")["ranks"][0]["roofline"]["ops"]
    bytes_of = {(g["name"], g["shapes"]): g["bytes"] / g["calls"] for g in groups}
    f32 = 4 * n
    assert bytes_of[("aten::add", "1024, 1024, -, 1024")] == 3 * f32
    assert bytes_of[("aten::sigmoid", "1024, 1024")] == 2 * f32
    assert bytes_of[("aten::div", "1024, 1024, -, 1024")] == 3 * f32
    assert bytes_of[("aten::div", "1024, 1024")] == 3 * f32
    where = next(g for g in groups if g["name"] == "aten::where")
    assert (where["bytes"], where["dtype"]) == (n + 3 * f32, "float")


def test_sizes_past_what_a_float_holds_are_unpriced(tmp_path):
    """Sizes the profiler cannot have written (past int64) are no sizes; sizes whose work passes
    a float's range are unpriced with the reason; a memory event of such a byte count is
    skipped and counted. No OverflowError reaches the user."""
    big = 2**62
    events = [_op("aten::mm", 0, 5, [[10**200, 4], [4, 4]]),
              _op("aten::add", 10, 5, [[big] * 17, [big] * 17, []], ["float", "float", "Scalar"]),
              {"ph": "i", "name": "[memory]", "pid": 100, "tid": 100, "ts": 20, "s": "t",
               "args": {"Device Type": 0, "Device Id": -1, "Bytes": 10**400, "Total Allocated": 0}}]
    path = _write(tmp_path / "huge.json", events)
    report = analyze([path], hardware="h100")
    rank = report["ranks"][0]
    reasons = sorted(u["reason"] for u in rank["roofline"]["unpriced"])
    assert reasons[0] == "input 0 has no sizes"
    assert reasons[1].endswith("give more work than a float holds")
    assert rank["memory"] == [] and rank["skipped_memory_events"] == 1
    format_report(report)
