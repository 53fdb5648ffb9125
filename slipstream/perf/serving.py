"""Serving: prefill and decode step times, KV-cache capacity, latency and throughput under load.

A step runs every layer once over the step's tokens (`layers.py`): GEMMs with m = tokens in the
step (weights read once per step, so decode is memory-bound until the batch passes the ridge
point), attention over the cache (decode streams each sequence's K and V; prefill is causal
FlashAttention math), two tensor-parallel all-reduces per layer, the lm_head only where a token
is sampled, plus a fixed per-step cost (scheduling, sampling, launches). KV capacity is what
memory is left after the weights (Scaling Book, `inference.md`: 2 bytes x K x H x L per token).

Under load, requests arrive at `request_rate` with fixed prompt and output lengths and are
served by continuous batching: per second the engine spends `rate * prefill_time` on prefills
and the rest on decode steps of the `concurrency` running sequences, where concurrency follows
Little's law (`rate * end-to-end latency`), solved by fixed-point iteration. TTFT adds an M/D/1
queueing wait for the prefill server (Kleinrock, Queueing Systems vol. 1, Pollaczek-Khinchine).
A rate at or above `max_request_rate` has no steady state and is a ValueError that names the
sustainable rate; so is a model whose weights do not fit a device (`check_weights_fit`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from slipstream.perf.accelerators import Accelerator, dtype_key
from slipstream.perf.efficiency import Efficiency, default_efficiency
from slipstream.perf.layers import (
    Device,
    LayerSpec,
    attention_core_forward,
    layer_forward,
    layer_gemms,
    pointwise_forward,
    tp_collectives,
)
from slipstream.perf.shapes import TransformerShape
from slipstream.perf.work import Work

STEP_KERNELS = 6
"""Kernels outside the layers per step: embedding gather, final norm, lm_head, sampling."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeSetup:
    """What is served, how: the shape, the tensor-parallel degree, weight and KV dtypes."""

    shape: TransformerShape
    tp: int = 1
    dtype: str = "bf16"
    kv_dtype: str | None = None
    """Default: `dtype`."""
    memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (vLLM's gpu_memory_utilization)."""
    kv_cache_bytes: float | None = None
    """The KV cache's bytes per device, given (vLLM's kv_cache_memory_bytes, slipstream's
    kv_cache_memory) instead of what memory_utilization leaves beside the weights."""
    block_size: int = 16
    """Tokens per KV block: a sequence holds whole blocks (vLLM's and slipstream's default 16)."""
    decode_graph_max_batch: int = 0
    """Decode-only steps of up to this many sequences replay a captured graph (vLLM's CUDA graphs,
    slipstream's CPU decode graph): their layers pay no per-kernel or per-GEMM launch overhead."""

    def __post_init__(self) -> None:
        dtype_key(self.dtype)
        if self.kv_dtype is not None:
            dtype_key(self.kv_dtype)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive integer, got {self.tp!r}")
        if error := self.shape.tensor_parallel_error(self.tp, serving=True):
            raise ValueError(error)
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_bytes is not None and not 0 < self.kv_cache_bytes < math.inf:
            raise ValueError(f"kv_cache_bytes must be a positive number of bytes, got {self.kv_cache_bytes}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if (isinstance(self.decode_graph_max_batch, bool) or not isinstance(self.decode_graph_max_batch, int)
                or self.decode_graph_max_batch < 0):
            raise ValueError(f"decode_graph_max_batch must be a non-negative integer, "
                             f"got {self.decode_graph_max_batch!r}")

    @property
    def element_bytes(self) -> int:
        return {"fp32": 4, "tf32": 4, "fp8": 1}.get(dtype_key(self.dtype), 2)

    @property
    def kv_element_bytes(self) -> int:
        return {"fp32": 4, "tf32": 4, "fp8": 1}.get(dtype_key(self.kv_dtype or self.dtype), 2)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_weights_fit(setup: ServeSetup, accelerator: Accelerator) -> None:
    """ValueError when one device's share of the weights exceeds the memory the engine may use
    (`memory_utilization` of the device, as vLLM's gpu_memory_utilization): no step can run."""
    weights = setup.shape.num_params() * setup.element_bytes / setup.tp
    usable = accelerator.memory_bytes * setup.memory_utilization
    if weights > usable:
        raise ValueError(
            f"{setup.shape.name} at tp {setup.tp} does not fit: weights {weights / 1e9:.1f} GB per "
            f"device > {usable / 1e9:.1f} GB ({setup.memory_utilization:g} x {accelerator.name}'s "
            f"{accelerator.memory_bytes / 1e9:.1f} GB); raise tp or use a smaller dtype"
        )


def _device(setup: ServeSetup, accelerator: Accelerator, efficiency: Efficiency | None) -> Device:
    return Device(accelerator=accelerator, efficiency=efficiency or default_efficiency(accelerator),
                  dtype=dtype_key(setup.dtype), element_bytes=setup.element_bytes)


def step_time(
    setup: ServeSetup, accelerator: Accelerator, *, prefill_lens: Sequence[int] = (),
    decode_contexts: Sequence[int] = (), efficiency: Efficiency | None = None,
) -> Work:
    """One engine step: prefill chunks of `prefill_lens` tokens (each from position 0) and one
    decode token for each sequence with `decode_contexts` cached positions, on one device.

    Steps follow one another over the same weights (and mostly the same KV cache), so the memory
    bandwidth is that of re-reading the bytes a step moves (`Accelerator.read_bandwidth`): above
    the memory's where they nearly fit in the last-level cache (a small model's decode on a CPU).
    ValueError for lengths below 1 or weights that do not fit (`check_weights_fit`).
    """
    for name, values in (("prefill_lens", prefill_lens), ("decode_contexts", decode_contexts)):
        for value in values:
            _check_positive(f"each of {name}", value)
    check_weights_fit(setup, accelerator)
    work = _step_work(setup, accelerator, prefill_lens, decode_contexts, efficiency)
    bandwidth = accelerator.read_bandwidth(work.memory_bytes)
    if bandwidth == accelerator.memory_bandwidth_bytes_per_s:
        return work
    cached = dataclasses.replace(accelerator, memory_bandwidth_bytes_per_s=bandwidth)
    return _step_work(setup, cached, prefill_lens, decode_contexts, efficiency)


def _step_work(
    setup: ServeSetup, accelerator: Accelerator, prefill_lens: Sequence[int],
    decode_contexts: Sequence[int], efficiency: Efficiency | None,
) -> Work:
    device = _device(setup, accelerator, efficiency)
    shape = setup.shape
    window = shape.sliding_window
    tokens = sum(prefill_lens) + len(decode_contexts)
    if tokens == 0:
        return Work()
    causal_pairs = sum(shape.causal_pairs(n) for n in prefill_lens)
    kv_read = sum(min(c + 1, window or c + 1) for c in decode_contexts)
    layer = Work()
    if prefill_lens:
        spec = LayerSpec(shape=shape, num_tokens=sum(prefill_lens), tp=setup.tp, attention="flash",
                         attention_pairs=causal_pairs)
        layer = layer + layer_forward(spec, device)
    if decode_contexts:
        spec = LayerSpec(shape=shape, num_tokens=len(decode_contexts), tp=setup.tp,
                         attention="flash", attention_pairs=kv_read, kv_read_tokens=kv_read)
        layer_device = device
        if not prefill_lens and len(decode_contexts) <= setup.decode_graph_max_batch:
            replay = dataclasses.replace(device.efficiency, gemm_overhead_s=0.0, kernel_overhead_s=0.0)
            layer_device = dataclasses.replace(device, efficiency=replay)
        kv_device = dataclasses.replace(layer_device, element_bytes=setup.kv_element_bytes)
        layer = layer + _decode_layer(spec, layer_device, kv_device)
    comm = tp_collectives(LayerSpec(shape=shape, num_tokens=tokens, tp=setup.tp), device,
                          accelerator.devices_per_node)
    sampled = len(prefill_lens) + len(decode_contexts)
    head = device.gemm(sampled, shape.hidden_size, shape.vocab_size / setup.tp)
    extra = device.stream(2.0 * tokens * shape.hidden_size * setup.element_bytes, STEP_KERNELS)
    host = device.efficiency.step_overhead_s + sampled * device.efficiency.sequence_overhead_s
    return (layer + comm) * shape.num_layers + head + extra + Work(overhead_s=host)


def _decode_layer(spec: LayerSpec, device: Device, kv_device: Device) -> Work:
    """Decode tokens of one layer: the dense part at the weights' dtype, the cache at the KV's."""
    work = attention_core_forward(spec, kv_device) + pointwise_forward(spec, device)
    for m, k, n in layer_gemms(spec.shape, spec.num_tokens, spec.tp):
        work = work + device.gemm(m, k, n)
    return work


@dataclasses.dataclass(frozen=True)
class KVCapacity:
    """How many tokens and sequences the KV cache holds on each device."""

    weights_bytes_per_device: float
    kv_bytes_per_token_per_device: float
    kv_budget_bytes_per_device: float
    max_tokens: int
    max_sequences: int
    context_len: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kv_capacity(setup: ServeSetup, accelerator: Accelerator, context_len: int,
                activation_reserve_bytes: float = 1 * 2**30) -> KVCapacity:
    """Tokens (and sequences of `context_len`) that fit beside the weights on each device, in
    whole blocks: a sequence takes ceil(context_len / block_size) of them.

    KV heads split over tensor parallelism, at least one per device (replicated when the TP
    degree exceeds the KV heads, as in llm-analysis `get_memory_kv_cache_per_layer`).
    """
    _check_positive("context_len", context_len)
    shape = setup.shape
    weights = shape.num_params() * setup.element_bytes / setup.tp
    kv_heads = max(shape.num_kv_heads / setup.tp, 1)
    per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * setup.kv_element_bytes
    budget = setup.kv_cache_bytes
    if budget is None:
        budget = accelerator.memory_bytes * setup.memory_utilization - weights - activation_reserve_bytes
    blocks = max(int(budget // (per_token * setup.block_size)), 0)
    blocks_per_sequence = -(-context_len // setup.block_size)
    return KVCapacity(weights, per_token, budget, blocks * setup.block_size, blocks // blocks_per_sequence,
                      context_len)


@dataclasses.dataclass(frozen=True)
class BatchPrediction:
    """A static batch: all sequences prefill together, then decode `output_len - 1` steps."""

    prefill_s: float
    decode_step_s: float
    """Mean decode step (per output token after the first)."""
    total_s: float
    output_tokens_per_s: float
    prefill_work: Work
    decode_work: Work

    def to_dict(self) -> dict[str, Any]:
        return {"prefill_s": self.prefill_s, "ttft_s": self.prefill_s,
                "decode_step_s": self.decode_step_s, "tpot_s": self.decode_step_s,
                "total_s": self.total_s, "output_tokens_per_s": self.output_tokens_per_s,
                "prefill_bound": self.prefill_work.bound(), "decode_bound": self.decode_work.bound()}


def static_batch(
    setup: ServeSetup, accelerator: Accelerator, batch_size: int, input_len: int, output_len: int,
    efficiency: Efficiency | None = None, samples: int = 8,
) -> BatchPrediction:
    """Prefill `batch_size` prompts of `input_len`, then decode to `output_len` tokens each.

    The decode steps are integrated over the growing context with `samples` midpoints.
    """
    for name, value in (("batch_size", batch_size), ("input_len", input_len), ("output_len", output_len)):
        _check_positive(name, value)
    prefill = step_time(setup, accelerator, prefill_lens=[input_len] * batch_size, efficiency=efficiency)
    steps = output_len - 1
    decode = Work()
    if steps:
        n = min(samples, steps)
        for i in range(n):
            context = input_len + int((i + 0.5) * steps / n)
            decode = decode + step_time(setup, accelerator, decode_contexts=[context] * batch_size,
                                        efficiency=efficiency) * (steps / n)
    total = prefill.total_s + decode.total_s
    mean_step = decode.total_s / steps if steps else 0.0
    return BatchPrediction(prefill.total_s, mean_step, total, batch_size * output_len / total,
                           prefill, decode * (1 / steps if steps else 0.0))


@dataclasses.dataclass(frozen=True)
class LoadPrediction:
    """Steady state of continuous batching at a request rate."""

    request_rate: float
    concurrency: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    output_tokens_per_s: float
    utilization: float
    """Fraction of time the prefills take (below 1: over capacity is a ValueError)."""
    saturated: bool
    limit: str
    """What capped concurrency, if anything: "" , "max_num_seqs" or "kv_cache"."""
    max_request_rate: float
    """The most requests/s the engine sustains (`max_request_rate`); `request_rate` is below it."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def max_request_rate(
    setup: ServeSetup, accelerator: Accelerator, input_len: int, output_len: int,
    max_num_seqs: int = 256, efficiency: Efficiency | None = None,
) -> float:
    """Requests/s above which the queue grows without bound: each request costs its prefill plus
    its share of `output_len - 1` decode steps of the most sequences that can run at once,
    1 / (prefill_s + (output_len - 1) x decode_s(cap) / cap); 0 when no sequence fits the cache."""
    for name, value in (("input_len", input_len), ("output_len", output_len),
                        ("max_num_seqs", max_num_seqs)):
        _check_positive(name, value)
    prefill_s = step_time(setup, accelerator, prefill_lens=[input_len], efficiency=efficiency).total_s
    cap = min(max_num_seqs, kv_capacity(setup, accelerator, input_len + output_len).max_sequences)
    if cap < 1:
        return 0.0
    decode_s = step_time(setup, accelerator, decode_contexts=[input_len + output_len // 2] * cap,
                         efficiency=efficiency).total_s
    return 1.0 / (prefill_s + (output_len - 1) * decode_s / cap)


def under_load(
    setup: ServeSetup, accelerator: Accelerator, request_rate: float, input_len: int,
    output_len: int, max_num_seqs: int = 256, efficiency: Efficiency | None = None,
) -> LoadPrediction:
    """TTFT, TPOT and throughput with `request_rate` requests/s (see the module docstring).

    ValueError when the rate is at or over capacity (`max_request_rate`): there is no steady
    state to report, the latencies grow without bound.
    """
    if isinstance(request_rate, bool) or not (isinstance(request_rate, int | float)
                                              and 0 < request_rate < float("inf")):
        raise ValueError(f"request_rate must be a finite number > 0, got {request_rate!r}")
    limit_rate = max_request_rate(setup, accelerator, input_len, output_len, max_num_seqs, efficiency)
    if limit_rate == 0:
        raise ValueError(f"the KV cache holds no sequence of {input_len + output_len} tokens "
                         f"(input_len + output_len) beside the weights")
    if request_rate >= limit_rate:
        raise ValueError(f"request_rate {request_rate:g} req/s is over capacity: at most "
                         f"{limit_rate:.3g} req/s sustainable with {input_len} in / {output_len} out")
    prefill_s = step_time(setup, accelerator, prefill_lens=[input_len], efficiency=efficiency).total_s
    capacity = kv_capacity(setup, accelerator, input_len + output_len)
    cap, limit = min(max_num_seqs, capacity.max_sequences), ""
    rho = request_rate * prefill_s  # < 1 below capacity
    context = input_len + output_len // 2
    concurrency, tpot_s = 1.0, 0.0
    for _ in range(50):
        batch = max(int(round(concurrency)), 1)
        decode_s = step_time(setup, accelerator, decode_contexts=[context] * batch,
                             efficiency=efficiency).total_s
        tpot_s = decode_s / (1.0 - rho)
        wait_s = rho * prefill_s / (2 * (1.0 - rho))
        ttft_s = wait_s + prefill_s + decode_s
        e2e_s = ttft_s + (output_len - 1) * tpot_s
        new = request_rate * e2e_s
        if new > cap:
            new, limit = float(cap), ("max_num_seqs" if cap == max_num_seqs else "kv_cache")
        if abs(new - concurrency) < 0.01 * max(concurrency, 1):
            concurrency = new
            break
        concurrency = 0.5 * (concurrency + new)
    throughput = min(request_rate, concurrency / e2e_s) * output_len
    saturated = limit != "" and request_rate * e2e_s > cap
    return LoadPrediction(request_rate, concurrency, ttft_s, tpot_s, e2e_s, throughput, rho, saturated,
                          limit, limit_rate)
