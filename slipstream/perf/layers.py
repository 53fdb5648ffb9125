"""Per-layer work of one transformer layer on one device: GEMMs, streamed bytes, TP collectives.

Shared by the training model (forward, backward, recomputation of a micro-batch) and the serving
model (a prefill or decode step). Megatron's tensor parallelism (Shoeybi et al. 2019, arXiv
1909.08053): q/k/v and the MLP's first matrices are split by columns, o and the MLP's last matrix
by rows, so each device holds 1/t of every matrix and a layer needs two all-reduces forward and
two backward; sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2)
turns each all-reduce into an all-gather plus a reduce-scatter of the same volume and shards the
norms, dropouts and residual adds by 1/t.

Streamed bytes count what each memory-bound kernel reads and writes (16-bit activations, 1-byte
dropout masks), op by op as in Korthikanti et al. section 4.1. With fused pointwise kernels
(Megatron's, or a compiler's) each norm, activation, rotary embedding and residual add is one
kernel, and its backward is charged twice its forward bytes (it reads the saved input and the
incoming gradient and writes a gradient). Eager PyTorch runs them op by op as slipstream's
`slipstream/model/transformer.py` (and torchtitan's Llama) writes them (`_eager_pointwise`), Gemma's
norm and GeGLU through autograd's own ops. GEMM backward is two GEMMs (input and weight gradients).
Gemma 2's soft-capped scores and gpt-oss's scores meeting their sinks run unfused, their
elementwise passes counted (`_softcapped_scores`, `_sink_scores`).

A layer with experts (`LayerSpec.moe`) runs the router, then each expert its tokens have chosen as
GEMMs of their own, as slipstream's `SparseMoeBlock` runs them: under uniform routing the layer's
n tokens touch `experts_touched(n)` experts (`flops.expected_experts_touched`) of n k / touched
tokens each, so the expert weights read are those experts' and the FLOPs exactly n k experts'.
Tensor parallelism splits every expert as it does the dense MLP (vLLM's default for MoE without
expert parallelism); the router and the shared expert's gate are replicated. Slipstream's CPU
engine runs the block otherwise (`cpu_moe_block`): the routed experts in one C call where it takes
them (`FusedExperts`), the router, routing and shared expert as eager ops. gpt-oss's experts (biased,
with a clamped SwiGLU, on stacked weights) have their own eager ops (`_clamped_experts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from slipstream.perf.accelerators import Accelerator
from slipstream.perf.collectives import collective_time_s, hierarchical_time_s
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.hardware import HostAccelerator
from slipstream.perf.shapes import TransformerShape
from slipstream.perf.work import Work

ATTENTION_KERNELS = ("flash", "unfused")
POINTWISE_KERNELS = ("eager", "fused")
FLASH_BACKWARD_FACTOR = 2.5
"""FlashAttention's backward runs 5 matmuls to the forward's 2 (it recomputes the scores): Dao,
"FlashAttention-2", arXiv 2307.08691, section 3.1.2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """What a kernel-time estimate needs: the accelerator, its efficiency, the compute dtype."""

    accelerator: Accelerator
    efficiency: Efficiency
    dtype: str = "bf16"
    element_bytes: int = 2
    weight_bytes: int | None = None
    """Bytes per element of a GEMM's (k, n) operand, the weight; None: `element_bytes`. Serving fp8
    weights keeps 16-bit activations (vLLM's fp8 linears take and return the model's dtype)."""

    def gemm(self, m: float, k: float, n: float, count: float = 1) -> Work:
        """`count` GEMMs; a memory-bound one (left of the ridge) is charged as memory time."""
        flops = 2.0 * m * k * n
        traffic = self.element_bytes * (m * k + k * n + m * n)
        if self.weight_bytes is not None:
            traffic = self.element_bytes * (m * k + m * n) + self.weight_bytes * k * n
        return self.roofline(count * flops, count * traffic, self.efficiency.gemm_fraction,
                              count * self.efficiency.gemm_overhead_s)

    def roofline(self, flops: float, traffic: float, fraction: float, overhead_s: float) -> Work:
        """A kernel at `fraction` of the peak and at the streaming bandwidth: the slower of the
        two, plus what `roofline_overlap` leaves exposed of the faster (`Efficiency.overlapped_s`)."""
        compute_s = flops / (self.accelerator.peak_flops(self.dtype) * fraction)
        memory_s = self.efficiency.stream_time_s(traffic, self.accelerator, 0)
        compute_s, memory_s = self.efficiency.overlapped_s(compute_s, memory_s)
        return Work(gemm_s=compute_s, memory_s=memory_s, overhead_s=overhead_s, flops=flops,
                    memory_bytes=traffic)

    def stream(self, num_bytes: float, num_kernels: float) -> Work:
        time_s = self.efficiency.stream_time_s(num_bytes, self.accelerator, 0)
        return Work(memory_s=time_s, overhead_s=num_kernels * self.efficiency.kernel_overhead_s,
                    memory_bytes=num_bytes)

    def collective(self, op: str, size_bytes: float, num_ranks: int, ranks_per_node: int) -> Work:
        """One collective over `num_ranks` ranks, two-level when it spans nodes; on ranks of a host
        whose link was measured collective by collective (`hardware.HostAccelerator`), a collective
        measured among as many ranks at its own measured cost per call over that link."""
        if num_ranks <= 1:
            return Work()
        acc, eff = self.accelerator, self.efficiency
        measured = acc.measured_cost(op, num_ranks) if isinstance(acc, HostAccelerator) else None
        if measured is not None:
            time_s = collective_time_s(op, size_bytes, num_ranks, eff.intra_link(acc), measured=measured)
        else:
            time_s = hierarchical_time_s(op, size_bytes, num_ranks, min(ranks_per_node, num_ranks),
                                         eff.intra_link(acc), eff.inter_link(acc))
        return Work(comm_s=time_s, comm_bytes=size_bytes)

    def p2p(self, size_bytes: float, crosses_node: bool) -> Work:
        link = self.efficiency.inter_link(self.accelerator) if crosses_node else (
            self.efficiency.intra_link(self.accelerator))
        return Work(comm_s=collective_time_s("send_recv", size_bytes, 2, link), comm_bytes=size_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer's slice of work on one device."""

    shape: TransformerShape
    num_tokens: int
    """Tokens this device's layer processes (after context-parallel splitting)."""
    tp: int = 1
    sequence_parallel: bool = False
    attention: str = "flash"
    dropout: bool = False
    attention_pairs: float = 0.0
    """Query-key pairs each head computes, summed over sequences: s^2 per sequence for an unfused
    kernel (it masks after computing), about s^2 / 2 for causal FlashAttention (it skips masked
    blocks), the cached positions for decode."""
    kv_read_tokens: float = 0.0
    """KV-cache positions read (serving decode); 0 when K and V come from this step's tokens."""
    pointwise: str = "fused"
    """"fused": one kernel per norm, activation, rotary embedding and residual add; "eager": the
    PyTorch ops of slipstream's model code, one kernel each (see `_eager_pointwise`)."""
    residual_bytes: int | None = None
    """Bytes per element of the residual stream (the norm inputs and the residual adds, and the
    rotary tables made from it); None: the activation bytes. 4 under autocast (fp32 weights)."""
    autocast_weights: bool = False
    """fp32 weights under `torch.autocast`: the forward casts each matmul weight to 16 bits and
    the backward casts its gradient back (6 bytes per parameter each, one kernel per matrix)."""
    moe: bool = False
    """A layer with experts (the shape's `moe_layers`) rather than the dense MLP."""
    cpu_moe: bool = False
    """The experts as slipstream's CPU engine runs them: `cpu_moe_block` prices the whole block,
    its routing and activations included, which the layer's pointwise work then leaves out."""

    def __post_init__(self) -> None:
        if self.moe and not self.shape.is_moe:
            raise ValueError(f"moe=True for {self.shape.name}, which has no experts")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.pointwise not in POINTWISE_KERNELS:
            raise ValueError(f"pointwise must be one of {POINTWISE_KERNELS}, got {self.pointwise!r}")


def layer_kinds(shape: TransformerShape) -> list[tuple[bool, float]]:
    """(moe, share of the layers) of each kind of layer the shape has: a dense model's layers are
    all dense, a MoE model's are MoE or a mix (Qwen-MoE's `decoder_sparse_step`, `mlp_only_layers`).
    A whole-model time is the mean layer, `sum(share * time(moe))`, times the layers."""
    moe = len(shape.moe_layers) / shape.num_layers
    return [(kind, share) for kind, share in ((False, 1.0 - moe), (True, moe)) if share]


def layer_gemms(
    shape: TransformerShape, num_tokens: float, tp: int, *, moe: bool = False
) -> list[tuple[float, float, float, float]]:
    """(m, k, n, count) of one layer's linear GEMMs on one device of a tensor-parallel group."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    up = (shape.mlp_matrices - 1) * f  # gate and up fused, or GELU's single up matrix
    attention = attention_gemms(shape, num_tokens, tp)
    if moe:
        return attention + _moe_gemms(shape, num_tokens, tp)
    return attention + [
        (num_tokens, h, up / tp, 1),  # mlp up (and gate)
        (num_tokens, f / tp, h, 1),  # mlp down
    ]


def attention_gemms(
    shape: TransformerShape, num_tokens: float, tp: int
) -> list[tuple[float, float, float, float]]:
    """(m, k, n, count) of one layer's attention projections on one device: qkv and o."""
    h = shape.hidden_size
    return [
        (num_tokens, h, (shape.q_dim + 2 * shape.kv_dim) / tp, 1),  # qkv
        (num_tokens, shape.q_dim / tp, h, 1),  # o
    ]


def _moe_gemms(
    shape: TransformerShape, num_tokens: float, tp: int
) -> list[tuple[float, float, float, float]]:
    """The router, each touched expert's gate-up and down GEMMs over its share of the n k routed
    tokens (uniform routing), and the shared expert with its gate."""
    h, m, s = shape.hidden_size, shape.expert_ffn_hidden_size, shape.shared_expert_ffn_hidden_size
    gemms = [(num_tokens, h, shape.num_experts, 1)]  # router, replicated
    touched = shape.experts_touched(num_tokens)
    if touched:
        per_expert = num_tokens * shape.experts_per_token / touched
        gemms += [(per_expert, h, 2 * m / tp, touched), (per_expert, m / tp, h, touched)]
    if s:
        gemms += [(num_tokens, h, 2 * s / tp, 1), (num_tokens, s / tp, h, 1), (num_tokens, h, 1, 1)]
    return gemms


def attention_core_forward(spec: LayerSpec, device: Device) -> Work:
    """QK^T, softmax (and dropout), AV for this device's heads."""
    shape, heads = spec.shape, spec.shape.num_heads / spec.tp
    flops = 4.0 * heads * shape.head_dim * spec.attention_pairs
    e = device.element_bytes
    if spec.kv_read_tokens:  # decode: stream the cache, the scores are tiny
        kv_heads = max(shape.num_kv_heads / spec.tp, 1)
        num_bytes = 2 * kv_heads * shape.head_dim * e * spec.kv_read_tokens
        return device.stream(num_bytes, 2) + Work(flops=flops)
    qkv_bytes = e * spec.num_tokens * (shape.q_dim * 2 + 2 * shape.kv_dim) / spec.tp
    if spec.attention == "flash":
        return device.roofline(flops, qkv_bytes, device.efficiency.attention_fraction,
                                device.efficiency.kernel_overhead_s)
    scores = heads * spec.attention_pairs  # elements of the score matrix
    bmm = _unfused_matmuls(spec, device)
    if shape.attention_softcap or shape.attention_sinks:
        return bmm + device.stream(*_explicit_scores(shape, scores, e, backward=False))
    softmax_bytes = 2 * scores * e + (3 * scores * e + scores if spec.dropout else 0)
    return bmm + device.stream(softmax_bytes, 2 if spec.dropout else 1)


def _unfused_matmuls(spec: LayerSpec, device: Device) -> Work:
    """QK^T and AV as two matmuls: QK^T writes the e-byte scores, AV reads the probabilities."""
    shape, e = spec.shape, device.element_bytes
    scores = shape.num_heads / spec.tp * spec.attention_pairs
    qkv_bytes = e * spec.num_tokens * (shape.q_dim * 2 + 2 * shape.kv_dim) / spec.tp
    return device.roofline(4.0 * shape.head_dim * scores, qkv_bytes + 2 * scores * e,
                           device.efficiency.gemm_fraction, 2 * device.efficiency.gemm_overhead_s)


def attention_core_backward(spec: LayerSpec, device: Device) -> Work:
    """The attention core's backward: FlashAttention's at `FLASH_BACKWARD_FACTOR` times its
    forward; unfused, two matmuls per forward matmul and the score passes' gradients, autograd's
    ops for Gemma 2's soft-capped scores and gpt-oss's sinks (`_explicit_scores`), twice the
    softmax's otherwise."""
    forward = attention_core_forward(spec, device)
    if spec.attention == "flash":
        return forward * FLASH_BACKWARD_FACTOR
    if not (spec.shape.attention_softcap or spec.shape.attention_sinks):
        return forward * 2.0
    scores = spec.shape.num_heads / spec.tp * spec.attention_pairs
    return (_unfused_matmuls(spec, device) * 2.0
            + device.stream(*_explicit_scores(spec.shape, scores, device.element_bytes, backward=True)))


def _explicit_scores(shape: TransformerShape, scores: float, e: int, *, backward: bool) -> tuple[float, int]:
    """(bytes, kernels) between the two matmuls of the attention `ops.attention` computes
    explicitly: Gemma 2's soft-capped scores, else gpt-oss's scores meeting their sinks."""
    if shape.attention_softcap:
        return _softcapped_scores(scores, e, backward=backward)
    return _sink_scores(scores, e, backward=backward)


def _softcapped_scores(scores: float, e: int, *, backward: bool) -> tuple[float, int]:
    """(bytes, kernels) of Gemma 2's soft-capped scores between its two matmuls, op by op as
    `ops.attention` computes them and torch's dispatcher sees them, on e-byte scores.

    Forward: the scale, the division by the cap, tanh, the product by the cap and the mask's
    addition (each reading and writing the scores), the softmax in fp32 (its input cast to fp32
    first where e is 2) and its cast back to e bytes for the AV matmul. Backward: that cast's
    gradient to fp32, softmax's backward (reading the gradient and the output, writing 4 bytes
    each), its input's gradient cast to e bytes, then the product's, tanh's (reading the gradient
    and tanh's output), the division's and the scale's gradients; the mask's addition passes its
    gradient through. A cast reads and writes (e + 4) bytes and is free when e is 4."""
    cast, casts = (0, 0) if e == 4 else (e + 4, 1)
    if backward:
        return scores * (2 * cast + 12 + 2 * e + 3 * e + 2 * e + 2 * e), 5 + 2 * casts
    return scores * (5 * 2 * e + 2 * cast + 8), 6 + 2 * casts


def _sink_scores(scores: float, e: int, *, backward: bool) -> tuple[float, int]:
    """(bytes, kernels) of gpt-oss's scores meeting their sinks between its two matmuls, op by op
    as `ops.attention` computes them (`softmax_with_sinks`), on e-byte scores.

    Forward: the scale and the mask's addition (each reading and writing the scores), the cast
    to fp32 where e is 2, the concatenation of each row's sink (reading and writing 4 bytes), the
    fp32 softmax over it and the cast back to e bytes for the AV matmul. Backward: that cast's
    gradient to fp32, the slice's (the sink column dropped: writing the gradient into a row one
    longer), softmax's backward (reading the gradient and the output, writing 4 bytes each), the
    cast of its gradient to e bytes and the scale's gradient; the concatenation's gradient is a
    view. The sink's own column (1/L of the scores) is left out."""
    cast, casts = (0, 0) if e == 4 else (e + 4, 1)
    if backward:
        return scores * (2 * cast + 8 + 12 + 2 * e), 3 + 2 * casts
    return scores * (2 * 2 * e + 2 * cast + 8 + 8), 4 + 2 * casts


def pointwise_forward(spec: LayerSpec, device: Device) -> Work:
    """Norms, residual adds (with bias and dropout), the MLP activation, rotary embeddings."""
    return device.stream(*_pointwise(spec, device.element_bytes, backward=False))


def pointwise_backward(spec: LayerSpec, device: Device) -> Work:
    """Their gradients: twice the forward bytes when fused; eager autograd's own ops otherwise."""
    return device.stream(*_pointwise(spec, device.element_bytes, backward=True))


def _pointwise(spec: LayerSpec, e: int, backward: bool) -> tuple[float, float]:
    """(bytes, kernels) of one layer's pointwise work on one device, forward or backward."""
    shape, n, r = spec.shape, spec.num_tokens, spec.residual_bytes or e
    replicated = n * shape.hidden_size / (spec.tp if spec.sequence_parallel else 1)
    f_local = n * shape.mlp_width(moe=spec.moe) / spec.tp
    rotary_width = 0 if shape.learned_positions else n * (shape.q_dim + shape.kv_dim) / spec.tp
    scale = 2 if backward else 1
    mask = replicated if spec.dropout else 0
    norms = shape.norms_per_layer
    parts = {  # fused: one kernel per operation, forward; the backward twice the bytes
        "norm": (scale * norms * replicated * (r + e), scale * norms),  # read x, write y, per norm
        "residual": (scale * 2 * (replicated * (2 * r + e) + mask), scale * 2),  # x + f(x)
        "activation": (scale * (2 if shape.mlp == "gelu" else 3) * f_local * e, scale),
        "rotary": (scale * 2 * rotary_width * e, scale if rotary_width else 0),
    }
    if shape.qk_norm:  # one per head of q and of k
        parts["qk_norm"] = (scale * 2 * rotary_width * e, scale * 2 if rotary_width else 0)
    if spec.moe and spec.cpu_moe:  # `cpu_moe_block` prices them as the engine runs them
        del parts["activation"]
    elif spec.moe:
        parts["routing"] = _routing(spec, e, scale)
    if spec.pointwise == "eager":
        parts |= _eager_pointwise(spec, e, r, backward, replicated, f_local, rotary_width)
        if spec.moe and not spec.cpu_moe and shape.expert_bias_params:
            parts["activation"] = _clamped_experts(spec, e, r, backward)
    if spec.autocast_weights:
        parts["weight_casts"] = _weight_casts(spec)
    return sum(b for b, _ in parts.values()), sum(k for _, k in parts.values())


def _routing(spec: LayerSpec, e: int, scale: int) -> tuple[float, float]:
    """(bytes, kernels) of routing as `SparseMoeBlock` runs it: the router logits' fp32 softmax and
    top-k (read e, write 4, read 4 per logit; a value and an index written per choice), then per
    touched expert the gather of its tokens, the product by their routing weights and the
    index_add into the output (each reading and writing its rows, n k rows of hidden in all), and
    the output zeroed; the backward twice that. Rows are whole on every tensor-parallel rank: the
    layer's input is replicated and the experts' row-parallel outputs are partial sums."""
    shape, n, h = spec.shape, spec.num_tokens, spec.shape.hidden_size
    logits = n * shape.num_experts * (e + 8) + n * shape.experts_per_token * 12
    rows = n * shape.experts_per_token * h * e
    num_bytes = logits + 3 * 2 * rows + e * n * h
    return scale * num_bytes, scale * (3 + 3 * shape.experts_touched(n))


def _clamped_experts(spec: LayerSpec, e: int, r: int, backward: bool) -> tuple[float, float]:
    """(bytes, kernels) of gpt-oss's experts outside their matmuls, op by op as `GptOssExperts`
    runs each touched expert eagerly, on e-byte matmul outputs and r-byte biases (the sum takes
    the bias's dtype: fp32 under autocast).

    Forward, per intermediate element: the gate-up bias add (two columns, read e, write r), the
    two clamps of its strided views, the scale by alpha, sigmoid, the two products, up + 1, and
    the cast to e bytes for the down matmul; per hidden element of a routed row the down bias add.
    Backward: the products', sigmoid's and scale's gradients and the sum of the gate's two, each
    clamp's comparison masks and where, the two views' slice_backwards into the gate-up width and
    their sum, the bias gradients' row sums, autocast's casts of the gradients; and per stacked
    parameter the backward of the forward's one unbind: a stack reading the called experts'
    gradients and writing all X experts' (an uncalled expert's a zero, filled by a one-element
    kernel and read through an expanded view: no traffic priced)."""
    shape, n, tp = spec.shape, spec.num_tokens, spec.tp
    h, m = shape.hidden_size, shape.expert_ffn_hidden_size / tp
    touched, rows = shape.experts_touched(n), n * shape.experts_per_token
    cast, casts = (0, 0) if r == e else (r + e, 1)
    if not backward:
        return rows * (m * (2 * e + 18 * r + cast) + h * (e + r)), touched * (9 + casts)
    expert = r * (shape.expert_params() / tp + shape.expert_bias_params)
    stacked = (touched + shape.num_experts) * expert
    elementwise = rows * (m * (41 * r + 5 + 3 * cast) + h * (r + cast))
    return elementwise + stacked, touched * (19 + 3 * casts) + 4 * (1 + shape.num_experts - touched)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedExperts:
    """When slipstream's CPU engine runs a MoE block's routed experts in one C call
    (`ops.inference.KernelMoeExperts`, cpu_ops.c's moe_experts): it declines a call where an
    expert would get more than `max_rows_per_expert` rows (None: any number) or whose workspace,
    every routed row's intermediates at once, would pass `workspace_limit_bytes`; the block's own
    path, expert by expert, runs those."""

    max_rows_per_expert: int | None
    workspace_limit_bytes: float
    workspace_bytes: Callable[[float, int, int, int], float]
    """The call's workspace for (pairs, hidden size, expert width, element bytes):
    `cpu_kernels.moe_workspace_bytes`."""
    graph_replays_top_k: Callable[[int, int], bool] | None = None
    """Where the engine's CPU decode graph holds MoE layers here (`ops.decode_graph`: it replays
    PyTorch's AVX-512 routing kernels), which (top_k, num_experts) it replays
    (`decode_graph.replays_top_k`); None: no graph for MoE models."""

    def in_decode_graph(self, shape: TransformerShape, num_tokens: float, element_bytes: int) -> bool:
        """Whether a decode step of `num_tokens` sequences replays the CPU decode graph, MoE layers
        and all: a top-k the graph replays, and the fused call taking the step."""
        replays = self.graph_replays_top_k
        return (replays is not None and replays(shape.experts_per_token, shape.num_experts)
                and self.takes(shape, num_tokens, element_bytes))

    def takes(self, shape: TransformerShape, num_tokens: float, element_bytes: int) -> bool:
        """Whether the call takes a layer's `num_tokens` tokens: under uniform routing each touched
        expert gets n k / touched rows (the mean; the engine looks at the most any expert got)."""
        pairs = num_tokens * shape.experts_per_token
        workspace = self.workspace_bytes(pairs, shape.hidden_size, shape.expert_ffn_hidden_size,
                                         element_bytes)
        if workspace > self.workspace_limit_bytes:
            return False
        limit = self.max_rows_per_expert
        return limit is None or pairs / shape.experts_touched(num_tokens) <= limit


def cpu_moe_block(spec: LayerSpec, linears: Device, device: Device, fused: FusedExperts | None) -> Work:
    """A MoE block's forward as slipstream's CPU engine runs it (`SparseMoeBlock.forward`), each
    eager op or C call one kernel at the kernel overhead, each linear one GEMM: the router; the
    routing (a cast of 16-bit logits to fp32, softmax, top-k, the renormalising sum and division,
    counted for every model, and the zeroed output); the routed experts in one call where `fused`
    takes them (the touched experts' weights read once, their rows' intermediates written and read
    back, one call's overhead), else expert by expert (`_declined_experts`); the shared expert and
    its gate (two GEMMs, the activation kernel, sigmoid, product and sum)."""
    shape, n, tp, e = spec.shape, spec.num_tokens, spec.tp, device.element_bytes
    h, m, s = shape.hidden_size, shape.expert_ffn_hidden_size / tp, shape.shared_expert_ffn_hidden_size / tp
    logits, choices = n * shape.num_experts, n * shape.experts_per_token
    cast = 0 if e == 4 else 1
    probabilities = logits * (cast * (e + 4) + 12)  # the cast, softmax's read and write, top-k's read
    chosen = choices * 32  # top-k's values and indices, the sum's read, the division's read and write
    work = linears.gemm(n, h, shape.num_experts) + device.stream(probabilities + chosen + e * n * h, cast + 5)
    touched = shape.experts_touched(n)
    if fused is not None and fused.takes(shape, n, e):
        weight_bytes = linears.weight_bytes or linears.element_bytes
        # Per routed row: its input gathered, the gate-up output, the activation and the down
        # output each written and read back; the input read and the output updated once per token.
        traffic = touched * 3 * h * m * weight_bytes + choices * (3 * h + 6 * m) * e + 3 * n * h * e
        work = work + linears.roofline(6.0 * choices * h * m, traffic, linears.efficiency.gemm_fraction,
                                       linears.efficiency.gemm_overhead_s)
    elif touched:
        work = work + _declined_experts(spec, linears, device)
    if s:
        work = work + linears.gemm(n, h, 2 * s) + linears.gemm(n, s, h) + linears.gemm(n, h, 1)
        work = work + device.stream(3 * n * s * e + n * (4 * e + 6 * h * e), 4)
    return work


def _declined_experts(spec: LayerSpec, linears: Device, device: Device) -> Work:
    """`SparseMoeBlock._routed`: argsort and bincount of the choices, the tokens' indices, the
    gather of the routed rows, per touched expert its gate-up GEMM, activation and down GEMM, the
    concatenation, the routing weights gathered and multiplied in, a cast to the output's dtype
    where the product is fp32 and the output not (fp32 weights, 16-bit activations), and per
    touched expert an index_add into the output."""
    shape, n, tp, e = spec.shape, spec.num_tokens, spec.tp, device.element_bytes
    h, m = shape.hidden_size, shape.expert_ffn_hidden_size / tp
    touched, choices = shape.experts_touched(n), n * shape.experts_per_token
    per_expert = choices / touched
    rows = choices * h * e
    cast = 0 if e == 4 else 1
    indices = choices * 8 * 6  # argsort, bincount, the division and the weights' gather, int64
    # The gather and the concatenation read and write the rows, the product and the index_add
    # read two operands and write one, the cast reads 4 bytes and writes e; the activation.
    num_bytes = indices + (2 + 2 + 3 + 3 + 3 * cast) * rows + 3 * choices * m * e
    kernels = 7 + cast + 2 * touched
    return (linears.gemm(per_expert, h, 2 * m, touched) + linears.gemm(per_expert, m, h, touched)
            + device.stream(num_bytes, kernels))


def _weight_casts(spec: LayerSpec) -> tuple[float, float]:
    """(bytes, kernels) of autocast's casts of the layer's matmul weights (each expert's only
    where a token runs it): one kernel per matrix."""
    shape = spec.shape
    if not spec.moe:
        return 6.0 * shape.layer_matmul_params() / spec.tp, 4 + shape.mlp_matrices  # q, k, v, o, MLP
    touched = shape.experts_touched(spec.num_tokens)
    per_expert = 2 if shape.expert_bias_params else 3  # gpt-oss's stacked gate-up and down, or three
    matrices = 5 + per_expert * touched + (4 if shape.shared_expert_ffn_hidden_size else 0)  # + router
    return 6.0 * shape.layer_matmul_params(moe=True, num_experts=touched) / spec.tp, matrices


def _eager_pointwise(spec: LayerSpec, e: int, r: int, backward: bool, replicated: float,
                     f_local: float, rotary_width: float) -> dict[str, tuple[float, int]]:
    """The parts eager PyTorch runs as several ops, counted op by op (bytes read plus written per
    element, kernels) from slipstream/model/transformer.py, whose RMSNorm, SwiGLU and rotary
    embedding torchtitan's and Hugging Face's Llama also write in plain ops; LayerNorm, GELU and
    the residual adds are one op either way and keep the fused count. Norms read the r-byte
    residual stream; under autocast (r = 4 > e) its fp32 rotary tables make q and k fp32 until
    attention casts them back, and autograd casts each gradient to its input's dtype. Per-row
    norm statistics (a few bytes per token) are left out."""
    shape, n = spec.shape, spec.num_tokens
    down = r + e if r != e else 0  # autocast: an fp32 tensor cast to the matmul dtype (or back)
    downs = 1 if down else 0
    parts: dict[str, tuple[float, int]] = {}
    if shape.norm == "rmsnorm":  # two per layer, each output cast once for its matmuls
        num_bytes, kernels = _rms_norm(r, r, r, backward)
        parts["norm"] = (2 * replicated * (num_bytes + down), 2 * (kernels + downs))
    elif shape.norm == "gemma_rmsnorm":  # the norms of the blocks' inputs, each output cast once
        # for its matmuls; Gemma 2's norms of the blocks' e-byte outputs, before the residual add
        num_bytes, kernels = _gemma_rms_norm(r, r, backward)
        parts["norm"] = (2 * replicated * (num_bytes + down), 2 * (kernels + downs))
        if shape.norms_per_layer == 4:
            num_bytes, kernels = _gemma_rms_norm(e, r, backward)
            parts["post_norm"] = (2 * replicated * num_bytes, 2 * kernels)
    # The rotary embedding's input: q and k as the projections wrote them, or as their norms
    # did (the norm's weight has the residual stream's dtype, which the product takes).
    rotary_in = e
    if shape.qk_norm and rotary_width and shape.norm == "gemma_rmsnorm":  # its output in its input's dtype
        num_bytes, kernels = _gemma_rms_norm(e, r, backward)
        parts["qk_norm"] = (num_bytes * rotary_width, 2 * kernels)
    elif shape.qk_norm and rotary_width:
        rotary_in = r
        num_bytes, kernels = _rms_norm(e, rotary_in, r, backward)
        parts["qk_norm"] = (num_bytes * rotary_width, 2 * kernels)
    # One activation per MLP run: a MoE layer's each touched expert and its shared expert.
    calls = shape.experts_touched(n) + (1 if shape.shared_expert_ffn_hidden_size else 0) if spec.moe else 1
    if shape.mlp == "swiglu":  # silu(gate) * up; backward: silu(gate) again, two muls, silu_backward
        parts["activation"] = ((11 if backward else 5) * e * f_local, calls * (4 if backward else 2))
    elif shape.mlp == "geglu":  # gelu(gate) * up; backward: two muls (gelu(gate) kept), gelu_backward
        parts["activation"] = ((9 if backward else 5) * e * f_local, calls * (3 if backward else 2))
    if rotary_width:  # x * cos + cat(-x2, x1) * sin for queries and keys, each multiply reading
        # an r-byte cos or sin row per token; backward: grad * cos and * sin, two slice_backwards,
        # neg, two adds; under autocast the fp32 results are cast for attention, and back
        tables, i = 4 * n * shape.head_dim * r, rotary_in
        if backward:  # the gradients of the multiplies cast to the input's dtype when it differs
            to_input = r + i if r != i else 0
            per_element = 10 * i + 4 * r + 2 * to_input + down
            parts["rotary"] = (per_element * rotary_width + tables, 14 + 4 * (to_input > 0) + 2 * downs)
        else:
            parts["rotary"] = ((5 * i + 5 * r + down) * rotary_width + tables, 10 + 2 * downs)
    if backward:  # a residual add passes its gradient through (cast to the branch's dtype under
        # autocast); autograd adds gradients where branches meet (read two, write one): each
        # residual, and the input q, k and v share (two adds) and gate and up share (one per
        # MLP run: each touched expert on its rows, the shared expert on every token; gpt-oss's
        # experts read theirs with one stacked matmul); dropout's backward multiplies by its mask
        dropout = 2 * (2 * e + 1) * replicated if spec.dropout else 0
        parts["residual"] = (dropout + 2 * down * replicated, (2 if spec.dropout else 0) + 2 * downs)
        gate_up_rows, gate_up_adds = n, 1
        if spec.moe:
            shared = 1 if shape.shared_expert_ffn_hidden_size else 0
            routed = 0 if shape.expert_bias_params else 1
            gate_up_rows = n * (routed * shape.experts_per_token + shared)
            gate_up_adds = routed * shape.experts_touched(n) + shared
        parts["gradient_adds"] = (6 * r * replicated + 3 * e * shape.hidden_size * (2 * n + gate_up_rows),
                                  4 + gate_up_adds)
    return parts


def _rms_norm(x: int, out: int, weight: int, backward: bool) -> tuple[float, int]:
    """(bytes per element, kernels) of slipstream's RMSNorm on x-byte input with a weight-byte
    weight, writing out-byte results (the product's promoted dtype).

    Forward: x.float(), pow, mean, + eps, rsqrt, x * rstd (fp32), .to(x.dtype), * weight.
    Backward (`_RMSNormFunction`): x.float() * rstd, (grad * weight).float(), the fp32 input
    gradient (g * normed, mean, normed * mean, sub, rstd *) and .to(x.dtype), the weight
    gradient's normed.to(x.dtype).float(), grad.float(), multiply and sum, and .to(weight.dtype).
    A cast to or from fp32 reads and writes (b + 4) bytes and is free when b is 4."""
    def cast(b: int) -> int:
        return 0 if b == 4 else b + 4

    def casts(b: int) -> int:
        return 0 if b == 4 else 1

    if backward:
        num_bytes = 68 + 2 * out + 4 * cast(x) + 2 * cast(out)
        return num_bytes, 9 + 4 * casts(x) + 2 * casts(out) + casts(weight)
    return 20 + 2 * cast(x) + x + out, 6 + 2 * casts(x)


def _gemma_rms_norm(x: int, weight: int, backward: bool) -> tuple[float, int]:
    """(bytes per element, kernels) of Gemma's RMSNorm on x-byte input with a weight-byte weight,
    autograd's ops throughout.

    Forward: x.float(), pow, mean, + eps, rsqrt, x * rstd, 1 + weight, * (1 + weight) (fp32) and
    .to(x.dtype). Backward: the gradient to fp32, the two products' gradients (with the sums over
    rows of the weight's and rstd's), rsqrt's and mean's per-row work, pow's backward (three
    ops), the two input gradients added and cast to x's dtype. A cast reads and writes (x + 4)
    bytes and is free when x is 4; the weight's (to fp32, 1 + weight, its gradient cast back) are
    per feature: kernels without bytes."""
    cast, casts = (0, 0) if x == 4 else (x + 4, 1)
    weight_casts = 0 if weight == 4 else 1
    if backward:
        return 96 + 2 * cast, 14 + 2 * casts + weight_casts
    return 28 + 2 * cast, 7 + 2 * casts + weight_casts


def tp_collectives(spec: LayerSpec, device: Device, ranks_per_node: int) -> Work:
    """Forward tensor-parallel communication of one layer: 2 all-reduces (or AG + RS pairs)."""
    if spec.tp == 1:
        return Work()
    size = spec.num_tokens * spec.shape.hidden_size * device.element_bytes
    if spec.sequence_parallel:
        pair = (device.collective("all_gather", size, spec.tp, ranks_per_node)
                + device.collective("reduce_scatter", size, spec.tp, ranks_per_node))
        return pair * 2
    return device.collective("all_reduce", size, spec.tp, ranks_per_node) * 2


def layer_forward(spec: LayerSpec, device: Device) -> Work:
    """Compute and memory time of one layer's forward pass (communication separately)."""
    gemms = [device.gemm(m, k, n, count)
             for m, k, n, count in layer_gemms(spec.shape, spec.num_tokens, spec.tp, moe=spec.moe)]
    work = attention_core_forward(spec, device) + pointwise_forward(spec, device)
    for g in gemms:
        work = work + g
    return work


def layer_backward(spec: LayerSpec, device: Device) -> Work:
    """Backward of one layer: two GEMMs per forward GEMM, twice the streamed bytes."""
    work = Work()
    for m, k, n, count in layer_gemms(spec.shape, spec.num_tokens, spec.tp, moe=spec.moe):
        work = work + device.gemm(m, n, k, count) + device.gemm(k, m, n, count)  # input grad, weight grad
    return work + attention_core_backward(spec, device) + pointwise_backward(spec, device)


def attention_recompute(spec: LayerSpec, device: Device) -> Work:
    """Selective recomputation: the attention core's forward again (Korthikanti et al. section 5)."""
    if spec.attention == "flash":
        return Work()  # FlashAttention already recomputes inside its backward
    return attention_core_forward(spec, device)
