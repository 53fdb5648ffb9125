"""Serving: prefill and decode step times, KV-cache capacity, latency and throughput under load.

A step runs every layer once over the step's tokens (`layers.py`): GEMMs with m = tokens in the
step (weights read once per step, so decode is memory-bound until the batch passes the ridge
point; of a mixture-of-experts layer's experts, those the step's tokens are expected to touch
under uniform routing, k at batch 1, all of them in a large batch), attention over the cache
(decode streams each sequence's K and V; prefill is causal FlashAttention math), two
tensor-parallel all-reduces per layer, the lm_head only where a token is sampled, plus a fixed
per-step cost (scheduling, sampling, launches). On this machine's CPU (a calibrated accelerator) a
MoE model runs as slipstream's CPU engine runs it: its blocks' routed experts in one C call where
the engine takes them (`layers.cpu_moe_block`). Every model's decode steps there replay the CPU
decode graph where that holds them; its prefills and the other decode steps run module by module,
each call from Python at `Efficiency.module_call_overhead_s`. Gemma, Gemma 2 and Gemma 3
(gemma3_text) decode outside the CPU decode graph (`cpu_decode_graph_declines`), as a dense model
does beyond the graph's batch or under enforce_eager.
KV capacity is what memory is left after the weights, every expert of a MoE model held (Scaling
Book, `inference.md`: 2 bytes x K x H x L per token).

Under load, requests arrive at `request_rate` with fixed prompt and output lengths and are
served by continuous batching: per second the engine spends `rate * prefill_time` on prefills
and the rest on decode steps of the `concurrency` running sequences, where concurrency follows
Little's law (`rate * end-to-end latency`), solved by fixed-point iteration. TTFT adds an M/D/1
queueing wait for the prefill server (Kleinrock, Queueing Systems vol. 1, Pollaczek-Khinchine).
The running sequences are capped (max_num_seqs, or what the KV cache holds); `max_request_rate`
is the highest rate at which these same equations have a steady state within the cap (not always
at the cap: on a CPU a decode step's cost per sequence can rise with the batch once its bytes
spill out of the cache), so a rate at or above it is a ValueError that names the sustainable rate
and the batch it is reached at. So are a model whose weights, or
weights and given KV budget, do not fit a device (`check_weights_fit`, `check_kv_budget_fits`)
and lengths beyond the model's positions (`check_positions`).

fp8 weights are vLLM's fp8 linears: 1-byte weights in the layers' GEMMs (at the fp8 peak) on
16-bit activations, while the embedding, the lm_head, norms, attention, the all-reduces and, by
default, the KV cache stay in 16 bits (vLLM's kv_cache_dtype "auto" is the model's dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from slipstream.ops.kv_cache_dtypes import KV_CACHE_DTYPE_NAMES
from slipstream.perf.accelerators import Accelerator, dtype_key
from slipstream.perf.efficiency import Efficiency, default_efficiency
from slipstream.perf.layers import (
    Device,
    FusedExperts,
    LayerSpec,
    attention_core_forward,
    attention_gemms,
    cpu_moe_block,
    layer_gemms,
    layer_kinds,
    pointwise_forward,
    tp_collectives,
)
from slipstream.perf.shapes import TransformerShape
from slipstream.perf.work import Work

STEP_KERNELS = 6
"""Kernels outside the layers per step: embedding gather, final norm, lm_head, sampling."""

_DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp8": 1}
"""Bytes per element of a dtype key; the others (bf16, fp16) are 2."""

KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_NAMES)
"""The kv_cache_dtype names ServeSetup takes: the engine's (`ops.kv_cache_dtypes`), "auto" the
model's dtype (16 bits under fp8 weights), the fp8 formats 1 byte each."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeSetup:
    """What is served, how: the shape, the tensor-parallel degree, weight and KV dtypes."""

    shape: TransformerShape
    tp: int = 1
    dtype: str = "bf16"
    """The weights' dtype; "fp8" is 1-byte linear weights on 16-bit (bf16) everything else."""
    kv_dtype: str | None = None
    """The KV cache's dtype, one of the engine's kv_cache_dtype names (`KV_CACHE_DTYPES`); None or
    "auto": the model's activation dtype, `dtype` or bf16 under fp8 weights, as vLLM's "auto"."""
    memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (vLLM's gpu_memory_utilization)."""
    kv_cache_bytes: float | None = None
    """The KV cache's bytes per device, given (vLLM's kv_cache_memory_bytes, slipstream's
    kv_cache_memory) instead of what memory_utilization leaves beside the weights."""
    block_size: int = 16
    """Tokens per KV block: a sequence holds whole blocks (vLLM's and slipstream's default 16)."""
    decode_graph_max_batch: int = 0
    """Decode-only steps of up to this many sequences replay a captured graph (vLLM's CUDA graphs,
    slipstream's CPU decode graph): their layers pay no per-kernel or per-GEMM launch overhead.
    Not for a mixture-of-experts shape, whose decode the engine runs eagerly."""

    def __post_init__(self) -> None:
        dtype_key(self.dtype)
        if self.kv_dtype is not None:
            kv_cache_dtype(self.kv_dtype)
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
        """Bytes per weight of the layers' linears."""
        return _DTYPE_BYTES.get(dtype_key(self.dtype), 2)

    @property
    def activation_dtype(self) -> str:
        """The dtype of everything but the layers' linear weights: `dtype`, bf16 under fp8."""
        key = dtype_key(self.dtype)
        return "bf16" if key == "fp8" else key

    @property
    def activation_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.activation_dtype, 2)

    @property
    def kv_element_bytes(self) -> int:
        key = None if self.kv_dtype is None else kv_cache_dtype(self.kv_dtype)
        return _DTYPE_BYTES.get(key or self.activation_dtype, 2)

    def weights_bytes_per_device(self) -> float:
        """One device's share of the weights: the layers' linears at `element_bytes`, the rest
        (embedding, lm_head, norms, biases) at `activation_bytes`."""
        shape = self.shape
        if self.element_bytes == self.activation_bytes:
            return shape.num_params() * self.element_bytes / self.tp
        linears = shape.layers_matmul_params()  # every expert's
        rest = shape.num_params() - linears
        return (linears * self.element_bytes + rest * self.activation_bytes) / self.tp


def kv_cache_dtype(name: Any) -> str | None:
    """The dtype key of a kv_cache_dtype name (`KV_CACHE_DTYPES`, exactly as the engine takes
    them), None for "auto"."""
    if name == "auto":
        return None
    if not isinstance(name, str) or name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"unknown KV cache dtype {name!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    return dtype_key(KV_CACHE_DTYPE_NAMES[name])


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_weights_fit(setup: ServeSetup, accelerator: Accelerator) -> None:
    """ValueError when one device's share of the weights exceeds the memory the engine may use
    (`memory_utilization` of the device, as vLLM's gpu_memory_utilization): no step can run."""
    weights = setup.weights_bytes_per_device()
    usable = accelerator.memory_bytes * setup.memory_utilization
    if weights > usable:
        raise ValueError(
            f"{setup.shape.name} at tp {setup.tp} does not fit: weights {weights / 1e9:.1f} GB per "
            f"device > {usable / 1e9:.1f} GB ({setup.memory_utilization:g} x {accelerator.name}'s "
            f"{accelerator.memory_bytes / 1e9:.1f} GB); raise tp or use a smaller dtype"
        )


def check_kv_budget_fits(setup: ServeSetup, accelerator: Accelerator) -> None:
    """ValueError when a given KV budget (`kv_cache_bytes`, which bypasses memory_utilization as
    vLLM's kv_cache_memory_bytes does) and one device's share of the weights exceed the device's
    memory: the engine would run out of memory allocating it (slipstream's engine refuses only a
    kv_cache_memory above the device's total memory, vLLM checks nothing), so there is nothing to
    predict."""
    weights, kv = setup.weights_bytes_per_device(), setup.kv_cache_bytes
    memory = accelerator.memory_bytes
    if kv is not None and weights + kv > memory:
        raise ValueError(
            f"a KV cache of {kv / 1e9:.4g} GB per device does not fit beside {setup.shape.name}'s "
            f"{weights / 1e9:.1f} GB of weights at tp {setup.tp} in {accelerator.name}'s "
            f"{memory / 1e9:.1f} GB (at most {(memory - weights) / 1e9:.4g} GB)"
        )


def check_positions(shape: TransformerShape, name: str, positions: int) -> None:
    """ValueError naming `name` when `positions` tokens (a prompt and its output, or a decode
    step's cache and new token) are more than the model's `max_position_embeddings` (the serving
    engine's max_model_len cannot exceed it)."""
    limit = shape.max_position_embeddings
    if limit is not None and positions > limit:
        raise ValueError(f"{name} needs {positions:,} positions, more than {shape.name}'s "
                         f"max_position_embeddings ({limit:,})")


def _devices(
    setup: ServeSetup, accelerator: Accelerator, efficiency: Efficiency | None,
) -> tuple[Device, Device]:
    """(the layers' linear GEMMs, everything else): one device unless the weights are fp8, whose
    GEMMs run at the fp8 peak on 1-byte weights and 16-bit activations."""
    device = Device(accelerator=accelerator, efficiency=efficiency or default_efficiency(accelerator),
                    dtype=setup.activation_dtype, element_bytes=setup.activation_bytes)
    if setup.element_bytes == setup.activation_bytes:
        return device, device
    return dataclasses.replace(device, dtype=dtype_key(setup.dtype), weight_bytes=setup.element_bytes), device


def step_time(
    setup: ServeSetup, accelerator: Accelerator, *, prefill_lens: Sequence[int] = (),
    decode_contexts: Sequence[int] = (), efficiency: Efficiency | None = None, check_memory: bool = True,
) -> Work:
    """One engine step: prefill chunks of `prefill_lens` tokens (each from position 0) and one
    decode token for each sequence with `decode_contexts` cached positions, on one device.

    Steps follow one another over the same weights (and mostly the same KV cache), so the memory
    bandwidth is that of re-reading the bytes a step moves (`Accelerator.read_bandwidth`): above
    the memory's where they nearly fit in the last-level cache (a small model's decode on a CPU).
    A MoE step reads only the experts its tokens touch, but the next steps touch others: what
    cycles through the cache is every expert's weights (`_idle_expert_bytes`).
    ValueError for lengths below 1 or beyond the model's positions (a decode step needs its
    context and one more) and, unless not `check_memory`, for memory that does not fit
    (`check_weights_fit`, `check_kv_budget_fits`): a what-if device with more memory asks what
    the step would take where it does fit, and reports the fit itself.
    """
    for name, values in (("prefill_lens", prefill_lens), ("decode_contexts", decode_contexts)):
        for value in values:
            _check_positive(f"each of {name}", value)
    if prefill_lens:
        check_positions(setup.shape, f"prefill_lens {max(prefill_lens)}", max(prefill_lens))
    if decode_contexts:  # a decode step's sequence holds its context and the new token
        context = max(decode_contexts)
        check_positions(setup.shape, f"decode_contexts {context} (and the new token)", context + 1)
    if check_memory:
        check_weights_fit(setup, accelerator)
        check_kv_budget_fits(setup, accelerator)
    work = _step_work(setup, accelerator, prefill_lens, decode_contexts, efficiency)
    tokens = sum(prefill_lens) + len(decode_contexts)
    bandwidth = accelerator.read_bandwidth(work.memory_bytes + _idle_expert_bytes(setup, tokens))
    if bandwidth == accelerator.memory_bandwidth_bytes_per_s:
        return work
    cached = dataclasses.replace(accelerator, memory_bandwidth_bytes_per_s=bandwidth)
    return _step_work(setup, cached, prefill_lens, decode_contexts, efficiency)


def _idle_expert_bytes(setup: ServeSetup, num_tokens: int) -> float:
    """The weights of the experts a step of `num_tokens` tokens leaves untouched (uniform routing),
    on one device."""
    shape = setup.shape
    idle = shape.num_experts - shape.experts_touched(num_tokens)
    return len(shape.moe_layers) * idle * shape.expert_params() * setup.element_bytes / setup.tp


@functools.cache
def cpu_fused_experts(dtype: str) -> FusedExperts | None:
    """Whether and up to where slipstream's CPU engine on this machine runs a MoE block's routed
    experts of `dtype` (a dtype key) in one C call, as `ops.inference` decides it: where the C
    kernels and their panel-packed weights exist for the dtype (fp32, bf16); any number of rows per
    expert where no linear keeps a oneDNN copy (the panel kernel takes every size: fp32 with
    AVX-512), else up to `MAX_PANEL_ROWS`; the CPU decode graph holds MoE layers where its routing
    replays this PyTorch's (`decode_graph.routing_not_replayed`). None: the block's own path, expert
    by expert, and no graph."""
    import torch  # the engine's own tests, only where a MoE step is priced on this machine

    from slipstream.ops import cpu_kernels
    from slipstream.ops.decode_graph import replays_top_k, routing_not_replayed
    from slipstream.ops.linear import MAX_PANEL_ROWS, keeps_panels, onednn_multiplies

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if torch_dtype is None or not keeps_panels(torch.empty(0, dtype=torch_dtype), extra_copies=True):
        return None
    every_size = not onednn_multiplies(torch_dtype) or cpu_kernels.panel_gemm_takes_all_rows(torch_dtype)
    return FusedExperts(max_rows_per_expert=None if every_size else MAX_PANEL_ROWS,
                        workspace_limit_bytes=cpu_kernels.MOE_WORKSPACE_LIMIT_BYTES,
                        workspace_bytes=cpu_kernels.moe_workspace_bytes,
                        graph_replays_top_k=replays_top_k if routing_not_replayed() is None else None)


def _cpu_moe(setup: ServeSetup, accelerator: Accelerator) -> tuple[bool, FusedExperts | None]:
    """(whether slipstream's CPU engine runs the MoE blocks, its fused experts): on a calibrated
    accelerator, this machine's CPU (as `efficiency.default_efficiency` reads it)."""
    if not (setup.shape.is_moe and accelerator.calibrated):
        return False, None
    return True, cpu_fused_experts(setup.activation_dtype)


def cpu_decode_graph_declines(shape: TransformerShape) -> str | None:
    """Why slipstream's CPU decode graph does not hold this model's decode steps, or None where it
    may: its C layers compute the Llama layer only, so it refuses Gemma's norm (with its scaled
    embeddings), GeGLU, Gemma 2's sandwich layers, soft caps, attention sinks and layers of
    different windows, and the engine decodes those models outside it (`ops.decode_graph`, which
    decides this on the built model; this is the same rule read off the shape)."""
    reasons = [reason for reason, applies in (
        ("Gemma's RMSNorm", shape.norm == "gemma_rmsnorm"), ("a GeGLU MLP", shape.mlp == "geglu"),
        ("four norms per layer", shape.norms_per_layer != 2),
        ("soft-capped attention scores", shape.attention_softcap),
        ("soft-capped logits", shape.logit_softcap), ("attention sinks", shape.attention_sinks),
        ("layers of different windows", bool(shape.full_attention_layers))) if applies]
    return ", ".join(reasons) or None


def _step_work(
    setup: ServeSetup, accelerator: Accelerator, prefill_lens: Sequence[int],
    decode_contexts: Sequence[int], efficiency: Efficiency | None,
) -> Work:
    linears, device = _devices(setup, accelerator, efficiency)
    shape = setup.shape
    cpu_moe = _cpu_moe(setup, accelerator)
    tokens = sum(prefill_lens) + len(decode_contexts)
    if tokens == 0:
        return Work()
    causal_pairs = sum(shape.causal_pairs(n) for n in prefill_lens)
    kv_read = sum(shape.decode_kv_positions(c) for c in decode_contexts)
    layer = Work()
    fused = cpu_moe[1]
    # Outside its decode graph slipstream's CPU engine runs every model module by module, each call
    # through Python: prefills, and decode steps the graph declines or does not hold.
    eager_linears, eager_device = (
        (_module_by_module(linears), _module_by_module(device)) if accelerator.calibrated
        else (linears, device))
    if prefill_lens:
        spec = LayerSpec(shape=shape, num_tokens=sum(prefill_lens), tp=setup.tp, attention="flash",
                         attention_pairs=causal_pairs)
        layer = layer + _layer(spec, eager_linears, eager_device, eager_device, cpu_moe)
    if decode_contexts:
        spec = LayerSpec(shape=shape, num_tokens=len(decode_contexts), tp=setup.tp,
                         attention="flash", attention_pairs=kv_read, kv_read_tokens=kv_read)
        layer_linears, layer_device = eager_linears, eager_device
        # A MoE model's routing asks the host how many tokens each expert got, which no CUDA
        # graph holds; the CPU decode graph routes in C where `FusedExperts.in_decode_graph`, and
        # does not hold Gemma's layers at all.
        declined = accelerator.calibrated and cpu_decode_graph_declines(shape) is not None
        graph_holds = not declined and (not shape.is_moe or (fused is not None and fused.in_decode_graph(
            shape, len(decode_contexts), setup.activation_bytes)))
        if not prefill_lens and graph_holds and len(decode_contexts) <= setup.decode_graph_max_batch:
            replay = dataclasses.replace(device.efficiency, gemm_overhead_s=0.0, kernel_overhead_s=0.0)
            layer_linears = dataclasses.replace(linears, efficiency=replay)
            layer_device = dataclasses.replace(device, efficiency=replay)
        kv_device = dataclasses.replace(layer_device, element_bytes=setup.kv_element_bytes)
        layer = layer + _layer(spec, layer_linears, layer_device, kv_device, cpu_moe)
    comm = tp_collectives(LayerSpec(shape=shape, num_tokens=tokens, tp=setup.tp), device,
                          accelerator.devices_per_node)
    sampled = len(prefill_lens) + len(decode_contexts)
    head = device.gemm(sampled, shape.hidden_size, shape.vocab_size / setup.tp)
    extra = device.stream(2.0 * tokens * shape.hidden_size * setup.activation_bytes, STEP_KERNELS)
    host = device.efficiency.step_overhead_s + sampled * device.efficiency.sequence_overhead_s
    return (layer + comm) * shape.num_layers + head + extra + Work(overhead_s=host)


def _layer(spec: LayerSpec, linears: Device, device: Device, attention: Device,
           cpu_moe: tuple[bool, FusedExperts | None]) -> Work:
    """The mean layer's work on the step's tokens (dense and MoE layers weighted by their share):
    the linears on `linears`, norms and activations on `device`, the attention core on
    `attention` (decode: at the KV cache's bytes); where `cpu_moe` (`_cpu_moe`) says the CPU
    engine runs the model, its MoE blocks as the engine runs them."""
    work = Work()
    on_cpu, fused = cpu_moe
    for moe, share in layer_kinds(spec.shape):
        kind = dataclasses.replace(spec, moe=moe, cpu_moe=moe and on_cpu)
        layer = attention_core_forward(kind, attention) + pointwise_forward(kind, device)
        if kind.cpu_moe:
            gemms = attention_gemms(spec.shape, spec.num_tokens, spec.tp)
            layer = layer + cpu_moe_block(kind, linears, device, fused)
        else:
            gemms = layer_gemms(spec.shape, spec.num_tokens, spec.tp, moe=moe)
        for m, k, n, count in gemms:
            layer = layer + linears.gemm(m, k, n, count)
        work = work + layer * share
    return work


def _module_by_module(device: Device) -> Device:
    """`device` with every kernel and GEMM call at `Efficiency.module_call_overhead_s`."""
    efficiency = device.efficiency
    call = efficiency.module_call_overhead_s
    return dataclasses.replace(device, efficiency=dataclasses.replace(
        efficiency, gemm_overhead_s=call, kernel_overhead_s=call))


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
    check_positions(setup.shape, "context_len", context_len)
    check_kv_budget_fits(setup, accelerator)
    shape = setup.shape
    weights = setup.weights_bytes_per_device()
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
    check_positions(setup.shape, "input_len + output_len", input_len + output_len)
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
    """Steady state of continuous batching at a request rate below `max_request_rate`."""

    request_rate: float
    concurrency: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    output_tokens_per_s: float
    """The offered output tokens: in a steady state every request is served."""
    utilization: float
    """Fraction of time the prefills take."""
    limit: str
    """What caps the running sequences: "max_num_seqs" or "kv_cache" (`max_request_rate` is reached
    at that cap or, where a larger batch decodes fewer tokens/s, below it)."""
    max_request_rate: float
    """The most requests/s the engine sustains (`max_request_rate`); `request_rate` is below it."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Load:
    """What `under_load` and `max_request_rate` share."""

    prefill_s: float
    cap: int
    """The most sequences that may run: max_num_seqs, or what the KV cache holds."""
    limit: str
    context: int
    """The mean context of a decode step: the prompt and half the output."""
    max_rate: float
    batch: int
    """The running sequences at which `max_rate` is reached (at most `cap`; 0 when it is 0)."""


_EVERY_BATCH_UP_TO = 64
_BATCH_STEP = 1.1


def _batch_grid(cap: int) -> list[int]:
    """The running-sequence counts `max_request_rate` tries: every one up to 64, then about 1.1x
    apart, and `cap` (a few dozen decode steps to price, not `cap` of them)."""
    grid = list(range(1, min(cap, _EVERY_BATCH_UP_TO) + 1))
    batch = _EVERY_BATCH_UP_TO
    while (batch := max(batch + 1, int(batch * _BATCH_STEP))) < cap:
        grid.append(batch)
    return grid + [cap] if cap > _EVERY_BATCH_UP_TO else grid


def _rate_at(prefill_s: float, decode_s: float, batch: int, output_len: int) -> float:
    """The rate r at which r e2e(r) = `batch` with decode step `decode_s` (`max_request_rate`):
    the smaller root x = r P of (P / 2 + d) x^2 - (P (1 + batch) + n d) x + P batch, in (0, 1)."""
    qa, qb, qc = prefill_s / 2 + decode_s, prefill_s * (1 + batch) + output_len * decode_s, prefill_s * batch
    x = 2 * qc / (qb + math.sqrt(qb * qb - 4 * qa * qc))  # without cancellation
    return x / prefill_s


def _load(setup: ServeSetup, accelerator: Accelerator, input_len: int, output_len: int,
          max_num_seqs: int, efficiency: Efficiency | None) -> _Load:
    """The prefill, the cap and `max_request_rate` (its docstring derives the limit)."""
    for name, value in (("input_len", input_len), ("output_len", output_len),
                        ("max_num_seqs", max_num_seqs)):
        _check_positive(name, value)
    check_positions(setup.shape, "input_len + output_len", input_len + output_len)
    p = step_time(setup, accelerator, prefill_lens=[input_len], efficiency=efficiency).total_s
    room = kv_capacity(setup, accelerator, input_len + output_len).max_sequences
    cap, context = min(max_num_seqs, room), input_len + output_len // 2
    limit = "max_num_seqs" if max_num_seqs <= room else "kv_cache"
    if cap < 1:
        return _Load(p, cap, limit, context, 0.0, 0)
    rate, batch = max(
        (_rate_at(p, step_time(setup, accelerator, decode_contexts=[context] * b,
                               efficiency=efficiency).total_s, b, output_len), b)
        for b in _batch_grid(cap))
    return _Load(p, cap, limit, context, rate, batch)


def max_request_rate(
    setup: ServeSetup, accelerator: Accelerator, input_len: int, output_len: int,
    max_num_seqs: int = 256, efficiency: Efficiency | None = None,
) -> float:
    """Requests/s from which `under_load`'s equations have no steady state within `cap`
    (max_num_seqs, or what the KV cache holds) running sequences; 0 when no sequence fits the cache.

    With prefill time P, the decode step of b sequences d(b) and n = `output_len`, a request's
    end-to-end latency at rate r is e2e(r, b) = P + d(b) + r P^2 / (2 (1 - r P)) + (n - 1) d(b) /
    (1 - r P) (TTFT with its M/D/1 wait, then n - 1 decode steps slowed by the prefills' share of
    time), and a steady state with b running needs Little's law, r e2e(r, b) = b. r e2e(r, b) grows
    from 0 to infinity on (0, 1 / P), so for each b there is one rate r(b) that sustains b: with
    x = r P, the smaller root of (P / 2 + d(b)) x^2 - (P (1 + b) + n d(b)) x + P b = 0, in (0, 1).
    The limit is the most of r(b) over b <= cap, which is r(cap) when the decode cost per sequence
    d(b) / b falls with b (a GPU's), but can be a smaller batch's when it rises (a CPU's, once a
    step's weights and KV cache spill out of the last-level cache). b is tried every one up to 64,
    then about 1.1x apart, and at cap; below the limit the fixed point stays under it.
    """
    return _load(setup, accelerator, input_len, output_len, max_num_seqs, efficiency).max_rate


def under_load(
    setup: ServeSetup, accelerator: Accelerator, request_rate: float, input_len: int,
    output_len: int, max_num_seqs: int = 256, efficiency: Efficiency | None = None,
) -> LoadPrediction:
    """TTFT, TPOT and throughput with `request_rate` requests/s (see the module docstring).

    ValueError when the rate is at or over capacity (`max_request_rate`): no number of running
    sequences up to the cap keeps up, requests queue without bound and there is no steady state to
    report.
    """
    if isinstance(request_rate, bool) or not (isinstance(request_rate, int | float)
                                              and 0 < request_rate < float("inf")):
        raise ValueError(f"request_rate must be a finite number > 0, got {request_rate!r}")
    load = _load(setup, accelerator, input_len, output_len, max_num_seqs, efficiency)
    limit_rate = load.max_rate
    if limit_rate == 0:
        raise ValueError(f"the KV cache holds no sequence of {input_len + output_len} tokens "
                         f"(input_len + output_len) beside the weights")
    if request_rate >= limit_rate:
        raise ValueError(f"request_rate {request_rate:g} req/s is over capacity: at most "
                         f"{limit_rate:.3g} req/s sustainable with {input_len} in / {output_len} out, "
                         f"reached at {load.batch} running sequences ({load.cap} at most, the "
                         f"{load.limit} limit)")
    prefill_s = load.prefill_s
    rho = request_rate * prefill_s  # < 1 below capacity
    concurrency = 1.0
    for _ in range(50):
        # No clipping: below max_request_rate, request_rate x e2e falls below the batch at or
        # before the one that rate is reached at, which the iteration meets rising from 1.
        batch = max(int(round(concurrency)), 1)
        decode_s = step_time(setup, accelerator, decode_contexts=[load.context] * batch,
                             efficiency=efficiency).total_s
        tpot_s = decode_s / (1.0 - rho)
        wait_s = rho * prefill_s / (2 * (1.0 - rho))
        ttft_s = wait_s + prefill_s + decode_s
        e2e_s = ttft_s + (output_len - 1) * tpot_s
        new = request_rate * e2e_s
        converged = abs(new - concurrency) < 0.01 * max(concurrency, 1)
        concurrency = new if converged else 0.5 * (concurrency + new)
        if converged:
            break
    return LoadPrediction(request_rate, concurrency, ttft_s, tpot_s, e2e_s, request_rate * output_len, rho,
                          load.limit, limit_rate)
