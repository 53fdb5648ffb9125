"""Serving model: decode and prefill rooflines, KV capacity, static batches, load, TP layouts."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.perf.accelerators import Accelerator, get_accelerator
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.layers import Device
from slipstream.perf.serving import (
    ServeSetup,
    kv_capacity,
    max_request_rate,
    static_batch,
    step_time,
    under_load,
)
from slipstream.perf.shapes import resolve_model

pytest_plugins = ["serve_fixtures"]

H100 = get_accelerator("h100")
LLAMA8B = resolve_model("llama3-8b")
# Ideal hardware: no overheads, full peak and bandwidth, so rooflines show as closed forms.
IDEAL = Efficiency(gemm_fraction=1.0, attention_fraction=1.0, memory_fraction=1.0, gemm_overhead_s=0,
                   kernel_overhead_s=0, link_fraction=1.0, link_latency_s=0)


def test_decode_batch1_is_the_memory_roofline():
    """Guards decode at batch 1: weights (minus the gathered embedding) + KV over bandwidth."""
    setup = ServeSetup(shape=LLAMA8B)
    work = step_time(setup, H100, decode_contexts=[4095], efficiency=IDEAL)
    weights = (LLAMA8B.num_params() - LLAMA8B.embedding_params()) * 2
    kv = 4096 * LLAMA8B.kv_bytes_per_token(2)
    expected = (weights + kv) / H100.memory_bandwidth_bytes_per_s
    print(f"decode {1e3 * work.total_s:.3f} ms, roofline {1e3 * expected:.3f} ms")
    assert work.total_s == pytest.approx(expected, rel=0.01)
    assert work.bound() == "memory"


def test_decode_reads_at_the_bandwidth_of_its_working_set():
    """Guards the cache-aware roofline: a decode step's bytes are re-read every step, so they go at
    `read_bandwidth` of the bytes the step moves: twice the memory's for a model that fits the
    cache (closed form: bytes / 2 x bandwidth), the memory's for one far beyond it."""
    bandwidth = H100.memory_bandwidth_bytes_per_s
    setup = ServeSetup(shape=resolve_model("tiny"))
    plain = step_time(setup, H100, decode_contexts=[255], efficiency=IDEAL)
    cached = dataclasses.replace(H100, cache_read_bytes_per_s={2**20: 2 * bandwidth, 2**30: 2 * bandwidth,
                                                               2**31: bandwidth},
                                 sources=dict(H100.sources) | {"cache_read_bytes_per_s": "test"})
    assert plain.memory_bytes < 2**30
    work = step_time(setup, cached, decode_contexts=[255], efficiency=IDEAL)
    assert work.memory_bytes == plain.memory_bytes
    assert work.total_s == pytest.approx(plain.memory_bytes / (2 * bandwidth), rel=0.01)
    assert work.total_s == pytest.approx(plain.total_s / 2, rel=0.01)
    big = ServeSetup(shape=LLAMA8B)
    assert step_time(big, cached, decode_contexts=[4095], efficiency=IDEAL) == step_time(
        big, H100, decode_contexts=[4095], efficiency=IDEAL)


def test_large_prefill_is_compute_bound():
    """Guards prefill: 2 N FLOPs per token plus causal attention, over the peak, when large."""
    setup = ServeSetup(shape=LLAMA8B)
    n = 8192
    work = step_time(setup, H100, prefill_lens=[n], efficiency=IDEAL)
    flops = 2 * (LLAMA8B.matmul_params() - LLAMA8B.embedding_params()) * n + 2 * LLAMA8B.embedding_params()
    flops += LLAMA8B.attention_flops_per_token(1) * n * (n + 1) / 2
    assert work.flops == pytest.approx(flops, rel=1e-9)
    head = 2 * LLAMA8B.embedding_params()  # the lm_head at one sampled row is memory-bound
    assert work.gemm_s == pytest.approx((flops - head) / H100.peak_flops("bf16"), rel=1e-9)
    print(f"GEMM {work.gemm_s:.4f} s, streamed norms/activations/rotary {work.memory_s:.4f} s")
    assert work.bound() == "gemm" and work.memory_s < 0.2 * work.gemm_s


@pytest.mark.parametrize("overlap", [1.0, 0.4, 0.0])
def test_roofline_overlap_closed_form(overlap):
    """Guards `roofline_overlap`: a kernel costs the longer of compute and memory plus the
    unhidden part of the shorter (1: the roofline's max, 0: the ECM-style sum), in both regimes."""
    eff = IDEAL.replace(roofline_overlap=overlap)
    peak, bandwidth = H100.peak_flops("bf16"), H100.memory_bandwidth_bytes_per_s
    device = Device(accelerator=H100, efficiency=eff)
    for m in (1, 4096):  # decode-like (memory-bound) and prefill-like (compute-bound)
        k = n = 4096
        compute_s, memory_s = 2 * m * k * n / peak, 2 * (m * k + k * n + m * n) / bandwidth
        expected = max(compute_s, memory_s) + (1 - overlap) * min(compute_s, memory_s)
        work = device.gemm(m, k, n)
        print(f"m={m} overlap={overlap}: {work.total_s * 1e6:.2f} us, closed form {expected * 1e6:.2f} us")
        assert work.total_s == pytest.approx(expected, rel=1e-12)
        assert eff.gemm_time_s(m, k, n, 2, H100, "bf16") == pytest.approx(expected, rel=1e-12)
        assert work.bound() == ("memory" if m == 1 else "gemm")
    with pytest.raises(ValueError, match="roofline_overlap"):
        IDEAL.replace(roofline_overlap=1.5)


def test_tensor_parallel_decode_is_faster_and_pays_all_reduces():
    """Guards TP layouts: per-device weights shrink by t, two all-reduces per layer appear."""
    b200 = get_accelerator("b200")  # 141 GB of bf16 weights fit one 180 GB device, not an 80 GiB one
    one = step_time(ServeSetup(shape=resolve_model("llama3-70b"), tp=1), b200, decode_contexts=[1024])
    eight = step_time(ServeSetup(shape=resolve_model("llama3-70b"), tp=8), b200, decode_contexts=[1024])
    assert one.comm_s == 0 and eight.comm_s > 0
    assert 3 < one.total_s / eight.total_s < 8


def test_kv_capacity_closed_form():
    """Guards KV capacity: (memory x utilization - weights - reserve) / (2 L kv_heads d bytes), in
    whole blocks of 16 tokens, a sequence taking ceil(context / 16) of them (a 17-token context
    takes two); or a given budget (vLLM's kv_cache_memory_bytes)."""
    setup = ServeSetup(shape=LLAMA8B, memory_utilization=0.9)
    cap = kv_capacity(setup, H100, context_len=8192, activation_reserve_bytes=0)
    per_token = 2 * 32 * 8 * 128 * 2  # 128 KiB (perf-tools: Llama-3-8B 128 KiB/token)
    budget = 0.9 * 81_559 * 2**20 - LLAMA8B.num_params() * 2  # NVML's H100 80GB total
    assert cap.kv_bytes_per_token_per_device == per_token
    blocks = int(budget // (16 * per_token))
    assert cap.max_tokens == 16 * blocks and cap.max_sequences == blocks // (8192 // 16)
    given = kv_capacity(ServeSetup(shape=LLAMA8B, kv_cache_bytes=100 * 16 * per_token), H100, context_len=17)
    assert (given.max_tokens, given.max_sequences) == (1600, 50)
    tp16 = kv_capacity(ServeSetup(shape=LLAMA8B, tp=16), H100, 8192)  # 8 KV heads: replicated
    assert tp16.kv_bytes_per_token_per_device == per_token / 8


def test_kv_capacity_of_a_given_budget_is_the_serving_engines(model_dir):
    """With the engine's KV budget, the model's capacity is the engine's own pool: its blocks of
    16 tokens, and the full-length sequences they hold."""
    from slipstream.perf.shapes import TransformerShape
    from slipstream.serve.engine import Engine, EngineConfig

    budget = 3 * 2**20
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=budget,
                                 max_model_len=200))
    shape = TransformerShape.from_model_config(engine.model_config)
    cap = kv_capacity(ServeSetup(shape=shape, dtype="fp32", kv_cache_bytes=budget), H100, context_len=200)
    assert cap.max_tokens == engine.limits.num_blocks * engine.limits.block_size
    assert cap.max_sequences == engine.limits.num_blocks // -(-200 // 16)


def test_static_batch_throughput_definition():
    """Guards throughput = batch x output tokens / (prefill + decode steps)."""
    setup = ServeSetup(shape=LLAMA8B)
    b = static_batch(setup, H100, batch_size=16, input_len=128, output_len=64)
    assert b.output_tokens_per_s == pytest.approx(16 * 64 / b.total_s)
    assert b.total_s == pytest.approx(b.prefill_s + 63 * b.decode_step_s)


def test_under_load_latency_grows_with_the_rate():
    """Guards the load model: latency and throughput grow with the rate below capacity."""
    setup = ServeSetup(shape=LLAMA8B)
    low = under_load(setup, H100, 0.5, 512, 128)
    high = under_load(setup, H100, 20.0, 512, 128)
    assert low.ttft_s < high.ttft_s and low.tpot_s <= high.tpot_s
    assert high.output_tokens_per_s > low.output_tokens_per_s


def _e2e_at_cap(prefill: float, decode: float, rate: float, output_len: int) -> float:
    """The module docstring's end-to-end latency with the running sequences at the cap (decode
    step `decode`): TTFT (M/D/1 wait, prefill, a decode step) and output_len - 1 decode steps
    slowed by the prefills' share of time."""
    rho = rate * prefill
    return prefill + decode + rho * prefill / (2 * (1 - rho)) + (output_len - 1) * decode / (1 - rho)


def test_over_capacity_rate_is_an_error_naming_the_sustainable_rate():
    """Guards saturation: at or above the rate at which Little's law needs more running sequences
    than the cap (rate x e2e(rate) = cap with the decode step of cap sequences, solved here by
    bisection) there is no steady state: a ValueError naming that rate, not TTFTs of 1e17 ms;
    just below it, numbers."""
    setup = ServeSetup(shape=LLAMA8B)
    cap, context = 64, 512 + 128 // 2
    prefill = step_time(setup, H100, prefill_lens=[512]).total_s
    decode = step_time(setup, H100, decode_contexts=[context] * cap).total_s
    low, high = 0.0, 1 / prefill
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if mid * _e2e_at_cap(prefill, decode, mid, 128) < cap else (low, mid)
    assert max_request_rate(setup, H100, 512, 128, max_num_seqs=cap) == pytest.approx(low, rel=1e-9)
    below = under_load(setup, H100, 0.95 * low, 512, 128, max_num_seqs=cap)
    print(f"max {low:.2f} req/s; at 95%: TTFT {1e3 * below.ttft_s:.1f} ms, "
          f"TPOT {1e3 * below.tpot_s:.2f} ms")
    assert below.max_request_rate == pytest.approx(low) and below.e2e_s < 3600
    assert below.limit == "max_num_seqs"
    for rate in (low * (1 + 1e-9), 1.01 * low, 1e5):
        with pytest.raises(ValueError, match=f"over capacity: at most {low:.3g} req/s"):
            under_load(setup, H100, rate, 512, 128, max_num_seqs=cap)


def test_just_below_the_max_rate_the_load_is_sustained():
    """The audit's case (llama3-8b on an H100, 8192 in / 64 out, 8 running sequences at most):
    the old max_request_rate (1 / (prefill + 63 decode(8) / 8)) sat above the rate at which the
    load model's own Little's law needs more than 8 running sequences, so rates between them
    printed bounded latencies while serving fewer tokens than offered. Now, up to the limit the
    reported latencies are those of the decode batch the fixed point runs (recomputed here from
    step_time and the module docstring's equations), within the cap, so by Little's law the
    completions (running / e2e) keep up with the arrivals; at the limit it is full."""
    setup = ServeSetup(shape=LLAMA8B)
    limit = max_request_rate(setup, H100, 8192, 64, max_num_seqs=8)
    prefill = step_time(setup, H100, prefill_lens=[8192]).total_s
    decode = step_time(setup, H100, decode_contexts=[8192 + 32] * 8).total_s
    assert limit * _e2e_at_cap(prefill, decode, limit, 64) == pytest.approx(8, rel=1e-9)
    for fraction in (0.5, 0.9, 0.97, 0.995, 0.99999):
        rate = fraction * limit
        load = under_load(setup, H100, rate, 8192, 64, max_num_seqs=8)
        print(f"{fraction} of {limit:.3f} req/s: {load.concurrency:.2f} running, e2e {load.e2e_s:.3f} s")
        running = step_time(setup, H100, decode_contexts=[8192 + 32] * round(load.concurrency)).total_s
        rho = rate * prefill
        assert load.tpot_s == pytest.approx(running / (1 - rho), rel=0.01)
        assert load.ttft_s == pytest.approx(prefill + running + rho * prefill / (2 * (1 - rho)), rel=0.01)
        assert load.e2e_s == pytest.approx(_e2e_at_cap(prefill, running, rate, 64), rel=0.01)
        assert load.concurrency <= 8 * (1 + 1e-6)
        assert load.concurrency / load.e2e_s == pytest.approx(rate, rel=0.01)  # completions keep up
    with pytest.raises(ValueError, match="over capacity.*reached at 8 running sequences .8 at most, "
                                         "the max_num_seqs limit"):
        under_load(setup, H100, limit, 8192, 64, max_num_seqs=8)


# A calibrated one-thread CPU (the Xeon VM's calibration file of 2026-12-05): its repeated-read
# curve falls from 15 GB/s at 240 MiB to the memory's 10.7 at 1 GiB, so a small model's decode step
# reads slower as its batch's KV cache grows and the tokens/s of a batch do not rise with it.
CPU = Accelerator(
    name="Intel(R) Xeon(R) Processor (1 threads, calibrated)",
    peak_flops_per_s={"fp32": 190.8e9, "bf16": 1482.3e9, "fp16": 168.2e9},
    memory_bandwidth_bytes_per_s=10.746e9, memory_bytes=16 * 2**30,
    cache_read_bytes_per_s={240 * 2**20: 15.136e9, 480 * 2**20: 13.874e9, 720 * 2**20: 15.257e9,
                            960 * 2**20: 14.439e9, 2**30: 10.746e9},
    sources={k: "test" for k in ("peak_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes",
                                 "cache_read_bytes_per_s")},
    calibrated=True)


def _sustainable_by_bisection(setup: ServeSetup, acc: Accelerator, input_len: int, output_len: int,
                              cap: int) -> float:
    """The supremum of the rates at which some number b <= cap of running sequences keeps up
    (rate x e2e(rate) <= b with the decode step of b sequences, every b tried), by bisection on
    the rate: what under_load's fixed-point iteration can settle at."""
    prefill = step_time(setup, acc, prefill_lens=[input_len]).total_s
    context = input_len + output_len // 2
    decodes = [step_time(setup, acc, decode_contexts=[context] * b).total_s for b in range(1, cap + 1)]
    low, high = 0.0, 1 / prefill
    for _ in range(60):
        mid = (low + high) / 2
        keeps_up = any(mid * _e2e_at_cap(prefill, d, mid, output_len) <= b for b, d in enumerate(decodes, 1))
        low, high = (mid, high) if keeps_up else (low, mid)
    return low


def test_max_rate_is_the_best_batch_not_the_cap_where_decode_tokens_per_s_fall():
    """The review's case: `small` in bf16 on the calibrated CPU, 512 in / 256 out, 256 running at
    most. A batch of 64 decodes more tokens/s than one of 256 (its bytes read faster), so the
    equations have a steady state with fewer running at rates above the root of rate x e2e = 256
    with the decode step of 256, which max_request_rate was, and under_load refused them. The limit
    is now the best batch's rate: within 0.5% below the bisection over every batch (it tries every
    batch up to 64, then 1.1x steps), above the cap's, and under_load accepts rates up to it."""
    setup = ServeSetup(shape=resolve_model("small"), dtype="bf16", kv_cache_bytes=4 * 2**30,
                       decode_graph_max_batch=256)
    limit = max_request_rate(setup, CPU, 512, 256)
    reference = _sustainable_by_bisection(setup, CPU, 512, 256, 256)
    prefill = step_time(setup, CPU, prefill_lens=[512]).total_s
    at_cap = step_time(setup, CPU, decode_contexts=[640] * 256).total_s
    low, high = 0.0, 1 / prefill
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if mid * _e2e_at_cap(prefill, at_cap, mid, 256) < 256 else (low, mid)
    print(f"max_request_rate {limit:.4f}, bisection over every batch {reference:.4f}, the cap's {low:.4f}")
    assert reference * 0.995 <= limit <= reference * (1 + 1e-9)
    assert limit > 1.05 * low
    load = under_load(setup, CPU, 0.999 * limit, 512, 256)
    assert load.concurrency < 256 and load.concurrency / load.e2e_s == pytest.approx(0.999 * limit, rel=0.01)
    with pytest.raises(ValueError, match=r"at most .* req/s sustainable .*, reached at \d+ running "
                                         r"sequences \(256 at most, the max_num_seqs limit\)") as error:
        under_load(setup, CPU, limit, 512, 256)
    assert "reached at 256 " not in str(error.value)


@pytest.mark.parametrize("input_len, output_len, cap", [(512, 128, 64), (1024, 256, 256), (8192, 64, 8)])
def test_max_rate_on_a_gpu_is_the_caps_and_matches_the_bisection(input_len, output_len, cap):
    """On an H100 a larger batch decodes more tokens/s, so the best batch is the cap and the
    limit equals the bisection over every batch."""
    setup = ServeSetup(shape=LLAMA8B, decode_graph_max_batch=256)
    limit = max_request_rate(setup, H100, input_len, output_len, max_num_seqs=cap)
    reference = _sustainable_by_bisection(setup, H100, input_len, output_len, cap)
    assert limit == pytest.approx(reference, rel=1e-6)
    with pytest.raises(ValueError, match=f"reached at {cap} running sequences"):
        under_load(setup, H100, limit, input_len, output_len, max_num_seqs=cap)


def test_a_noisy_read_curve_never_makes_a_larger_decode_batch_faster():
    """A curve measured on a loaded machine (one thread, 19:40 UTC) read 724 MiB at 14.7 GB/s after
    512 MiB at 10.1 and 256 MiB at 8.8; interpolated as measured, `small`'s bf16 decode step at 640
    positions took less time for 41 to 48 sequences than for one fewer. Its running minimum keeps
    the decode step from shrinking as the batch grows, 1 to 256 sequences."""
    grid = {8: 28.8, 11: 29.0, 16: 29.3, 23: 29.4, 32: 29.5, 45: 29.0, 64: 20.1, 91: 16.3, 128: 10.9,
            181: 15.7, 256: 8.8, 362: 10.3, 512: 10.1, 724: 14.7, 1024: 12.8}
    curve = {mib * 2**20: rate * 1e9 for mib, rate in grid.items()}
    noisy = dataclasses.replace(CPU, memory_bandwidth_bytes_per_s=12.8e9, cache_read_bytes_per_s=curve)
    setup = ServeSetup(shape=resolve_model("small"), dtype="bf16", kv_cache_bytes=4 * 2**30,
                       decode_graph_max_batch=256)
    steps = [step_time(setup, noisy, decode_contexts=[640] * b).total_s for b in range(1, 257)]
    assert all(b >= a for a, b in zip(steps, steps[1:], strict=False))


def test_weights_that_do_not_fit_are_an_error():
    """Guards Llama 3 405B at tp 8 on 80 GiB H100s: 405.9e9 bf16 parameters are 101.5 GB per
    device, over 0.9 x 85.5 GB, so there is no decode time to report; at tp 8 on B200s it fits."""
    setup = ServeSetup(shape=resolve_model("llama3-405b"), tp=8)
    with pytest.raises(ValueError, match=r"does not fit: weights 101.5 GB per device > 77.0 GB"):
        step_time(setup, H100, decode_contexts=[2048])
    with pytest.raises(ValueError, match="does not fit"):
        under_load(setup, H100, 1.0, 1024, 256)
    assert step_time(setup, get_accelerator("b200"), decode_contexts=[2048]).total_s > 0


def test_serve_setup_errors():
    """Guards user errors: TP not dividing heads, bad utilization, bad rate."""
    with pytest.raises(ValueError, match="tp=3"):
        ServeSetup(shape=LLAMA8B, tp=3)
    with pytest.raises(ValueError, match="memory_utilization"):
        ServeSetup(shape=LLAMA8B, memory_utilization=1.5)
    with pytest.raises(ValueError, match="request_rate"):
        under_load(ServeSetup(shape=LLAMA8B), H100, 0, 10, 10)


@pytest.mark.parametrize("name, call", [
    ("input_len", lambda s: under_load(s, H100, 1.0, 0, 16)),
    ("output_len", lambda s: under_load(s, H100, 1.0, 128, -1)),
    ("max_num_seqs", lambda s: under_load(s, H100, 1.0, 128, 16, max_num_seqs=0)),
    ("request_rate", lambda s: under_load(s, H100, -2.0, 128, 16)),
    ("request_rate", lambda s: under_load(s, H100, float("inf"), 128, 16)),
    ("input_len", lambda s: static_batch(s, H100, 1, 0, 16)),
    ("batch_size", lambda s: static_batch(s, H100, -1, 16, 16)),
    ("context_len", lambda s: kv_capacity(s, H100, 0)),
    ("prefill_lens", lambda s: step_time(s, H100, prefill_lens=[0])),
    ("decode_contexts", lambda s: step_time(s, H100, decode_contexts=[-5])),
])
def test_non_positive_lengths_and_rates_name_the_parameter(name, call):
    """Guards user errors: zero or negative lengths, batch, max_num_seqs or rate are ValueErrors
    naming the parameter, not negative throughputs."""
    with pytest.raises(ValueError, match=name):
        call(ServeSetup(shape=LLAMA8B))


def test_decode_graph_removes_launch_overhead_only_for_graphed_steps():
    """Decode-only steps up to decode_graph_max_batch pay no per-kernel or per-GEMM overhead in
    their layers (the lm_head, embedding and host costs stay); larger batches and steps with a
    prefill chunk are priced as before, and the data movement and FLOPs do not change."""
    eager = ServeSetup(shape=LLAMA8B)
    graphed = ServeSetup(shape=LLAMA8B, decode_graph_max_batch=8)
    eff = Efficiency(gemm_overhead_s=5e-6, kernel_overhead_s=5e-6, step_overhead_s=0, sequence_overhead_s=0)
    layer_launches = LLAMA8B.num_layers * 5e-6
    for batch in (1, 8):
        before = step_time(eager, H100, decode_contexts=[1000] * batch, efficiency=eff)
        after = step_time(graphed, H100, decode_contexts=[1000] * batch, efficiency=eff)
        assert after.flops == before.flops and after.memory_s == pytest.approx(before.memory_s)
        assert before.overhead_s - after.overhead_s >= 4 * layer_launches  # several launches a layer
        assert after.overhead_s > 0  # lm_head and the step's kernels outside the layers
    for kwargs in ({"decode_contexts": [1000] * 9}, {"prefill_lens": [64], "decode_contexts": [1000]}):
        assert (step_time(graphed, H100, efficiency=eff, **kwargs).overhead_s
                == step_time(eager, H100, efficiency=eff, **kwargs).overhead_s)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="decode_graph_max_batch"):
            ServeSetup(shape=LLAMA8B, decode_graph_max_batch=bad)


def test_a_kv_budget_beyond_the_device_is_an_error():
    """A given KV budget (vLLM's kv_cache_memory_bytes bypasses gpu_memory_utilization) must fit
    beside one device's weights in its memory: 80 GB of KV and Llama-3 8B's 16.06 GB of bf16
    weights (HF's 8,030,261,248 parameters) are more than an H100's 85.52 GB; 69 GB fits."""
    weights = 8_030_261_248 * 2
    room = H100.memory_bytes - weights
    for budget in (80e9, 1e30, room + 1):
        setup = ServeSetup(shape=LLAMA8B, kv_cache_bytes=budget)
        for call in (lambda s: step_time(s, H100, decode_contexts=[1024]),
                     lambda s: kv_capacity(s, H100, 1024), lambda s: under_load(s, H100, 1.0, 1024, 256)):
            with pytest.raises(ValueError, match=r"KV cache of .* does not fit beside llama3-8b's 16.1 GB"):
                call(setup)
    setup = ServeSetup(shape=LLAMA8B, kv_cache_bytes=room)
    assert kv_capacity(setup, H100, 1024).kv_budget_bytes_per_device == room
    assert step_time(setup, H100, decode_contexts=[1024]).total_s > 0


def test_fp8_weights_keep_16_bit_kv_cache_embedding_lm_head_and_all_reduces():
    """vLLM's fp8 quantizes the layers' linear weights only: kv_cache_dtype "auto" is the model's
    16-bit dtype, the embedding and lm_head stay 16-bit, activations and TP all-reduces are 16-bit.
    Llama-3 8B (HF's counts): 32 x 218,103,808 linear weights at 1 byte plus the other
    1,050,939,392 parameters at 2 bytes = 9.08 GB; 128 KiB of KV per token; decode at batch 1 is
    those weights less the gathered embedding rows, plus the KV, over the bandwidth."""
    linears, rest = 32 * 218_103_808, 8_030_261_248 - 32 * 218_103_808
    fp8 = ServeSetup(shape=LLAMA8B, dtype="fp8")
    cap = kv_capacity(fp8, H100, 4096)
    assert cap.weights_bytes_per_device == linears + 2 * rest == 9_081_200_640
    assert cap.kv_bytes_per_token_per_device == 2 * 32 * 8 * 128 * 2
    work = step_time(fp8, H100, decode_contexts=[4095], efficiency=IDEAL)
    streamed = linears + 2 * (rest - LLAMA8B.embedding_params()) + 4096 * 2 * 32 * 8 * 128 * 2
    assert work.total_s == pytest.approx(streamed / H100.memory_bandwidth_bytes_per_s, rel=0.01)
    for dtype, kv_dtype, per_token in (("fp8", "auto", 131072), ("fp8", "fp8_e4m3", 65536),
                                       ("fp8", "fp8_e5m2", 65536), ("fp8", "bfloat16", 131072),
                                       ("bf16", "fp8", 65536)):
        setup = ServeSetup(shape=LLAMA8B, dtype=dtype, kv_dtype=kv_dtype)
        assert kv_capacity(setup, H100, 4096).kv_bytes_per_token_per_device == per_token
    b200 = get_accelerator("b200")
    tp2 = {d: step_time(ServeSetup(shape=LLAMA8B, dtype=d, tp=2), b200, decode_contexts=[1024] * 8)
           for d in ("bf16", "fp8")}
    assert tp2["fp8"].comm_bytes == tp2["bf16"].comm_bytes > 0  # 16-bit all-reduce payloads
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'; known: auto, fp8, fp8_e4m3"):
        ServeSetup(shape=LLAMA8B, kv_dtype="int3")


@pytest.mark.parametrize("name", ["FP8", "Auto", "float16", "tf32", "bf16", "float32", "fp8_inc", 8])
def test_perf_refuses_the_kv_cache_dtypes_the_engine_refuses(name):
    """One table of kv_cache_dtype names: what the engine refuses (case, torch names, dtype keys)
    the performance model refuses too, and every name the engine takes prices the KV at the
    element size of the torch dtype the engine's cache holds."""
    torch = pytest.importorskip("torch")
    from slipstream.ops.paged_attention import KV_CACHE_DTYPES
    from slipstream.serve.engine import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_dtype=name)
    with pytest.raises(ValueError, match=f"unknown KV cache dtype {name!r}"):
        ServeSetup(shape=LLAMA8B, kv_dtype=name)
    per_element = 2 * 32 * 8 * 128  # Llama-3 8B: K and V, 32 layers, 8 kv heads of 128
    for engine_name, cache_dtype in KV_CACHE_DTYPES.items():
        EngineConfig(model="m", kv_cache_dtype=engine_name)
        setup = ServeSetup(shape=LLAMA8B, dtype="fp32", kv_dtype=engine_name)
        per_token = kv_capacity(setup, H100, 4096).kv_bytes_per_token_per_device
        assert per_token == per_element * cache_dtype.itemsize
    auto = ServeSetup(shape=LLAMA8B, dtype="fp32", kv_dtype="auto")
    assert kv_capacity(auto, H100, 4096).kv_bytes_per_token_per_device == per_element * torch.float32.itemsize


def test_lengths_beyond_the_models_positions_are_errors():
    """The engine's max_model_len is at most the config's max_position_embeddings (131,072 for
    Llama-3.1 8B, whose config the llama3-8b preset follows; 2,048 learned positions for GPT-3):
    a prompt and its output, a prefill or a decode step's context and new token beyond it are
    ValueErrors naming the parameter; exactly at it they run."""
    setup = ServeSetup(shape=LLAMA8B)
    assert LLAMA8B.max_position_embeddings == 131072
    assert resolve_model("gpt3-175b").max_position_embeddings == 2048
    step_time(setup, H100, decode_contexts=[131071])
    step_time(setup, H100, prefill_lens=[131072])
    for name, call in (
        ("decode_contexts", lambda: step_time(setup, H100, decode_contexts=[131072])),
        ("prefill_lens", lambda: step_time(setup, H100, prefill_lens=[131073])),
        ("context_len", lambda: kv_capacity(setup, H100, 200_000)),
        ("input_len \\+ output_len", lambda: under_load(setup, H100, 0.01, 131_000, 100)),
        ("input_len \\+ output_len", lambda: max_request_rate(setup, H100, 200_000, 1000)),
        ("input_len \\+ output_len", lambda: static_batch(setup, H100, 1, 131_072, 1)),
    ):
        with pytest.raises(ValueError, match=f"{name}.* needs .* positions, more than llama3-8b's "
                                             "max_position_embeddings \\(131,072\\)"):
            call()
