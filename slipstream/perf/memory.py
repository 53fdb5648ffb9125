"""Training memory per device: weights, gradients, optimizer states, activations.

Weights, gradients and optimizer states follow ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054):
stage 1 shards the optimizer states over the data-parallel group, stage 2 also the gradients,
stage 3 (= FSDP) also the weights. Tensor and pipeline parallelism split every layer's weights
by t and the layers by p (the embedding sits on the first stage, a separate lm_head on the last).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198), written per op so that GQA, SwiGLU, dropout-free training
and FlashAttention are covered; for a GPT layer with dropout and unfused attention it reduces to
their Table 2 (bytes per layer; s sequence, b micro-batch, h hidden, a heads, t TP size):

    no parallelism                    s b h (34 + 5 a s / h)
    tensor parallel                   s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel        s b h (34 / t + 5 a s / (h t))
    + selective recomputation         the 5 a s / h terms vanish
    full recomputation                2 s b h (the layer input)

With pipeline parallelism stage r holds `min(m, p - r)` micro-batches of its layers in 1F1B (the
first stage about L layers' worth), times `1 + (p - 1) / (p v)` on the first stage with v
interleaved chunks (section 4.2.3; all m v chunk micro-batches when m = p), and all m under
GPipe's schedule (every forward before the first backward; the last stage then holds all m
micro-batches' logits too, 1F1B one's). Layers are whole, split as the time model splits them
(`stage_layers`), and the stage with the most memory is the one reported: it is what must fit.

Bytes follow the training dtype as slipstream's trainer runs it: fp32 parameters, gradients and
AdamW moments, plus autocast's 16-bit weight copies in bf16/fp16; activations are 2 bytes under
autocast and 4 in fp32, and the residual stream (the norm inputs) stays fp32 under autocast
(`TrainSetup.state_bytes_per_param`, `activation_bytes`, `residual_bytes`). 16-bit parameters
(`mixed_precision="parameters"`, Megatron) keep it in 16 bits, as Korthikanti et al. count it.
Under FSDP (ZeRO-3) autocast's 16-bit copies are of the gathered weights, so every rank holds
them whole (4 / N + 2 bytes a parameter), and 16-bit parameters are FSDP2's mixed precision
(torchtitan): the sharded fp32 master is the parameter, 16 / N bytes in all. FSDP with pp > 1
(torch's `PipelineStage`, the trainer's stages wrapped with `reshard_after_forward=False`) gathers
each unit once before the first micro-batch and reduce-scatters after the last, so through the
step every rank holds its stage's parameters whole (in the dtype they are gathered in) beside
their shards, and their gradients whole (the reduce-scatter's shards replace them after the last
backward, unit by unit).

Gemma's norms keep their input and output in fp32, OLMo 2's and gpt-oss's fp32-weight norms their
input and their fp32 normalised input, and GeGLU keeps gelu(gate) too; Gemma 2's
soft-capped attention runs as explicit matmuls (`TrainSetup.attention_kernel`), which keep the
T x T scores of every head (tanh's output, the fp32 softmax and its cast) and K and V repeated
to every query head.

A mixture-of-experts model holds every expert (weights, gradients and optimizer states of all of
them: each is trained, whichever tokens reach it); its activations are the k experts' a token
runs plus what routing keeps (`_routing_activation_bytes`); gpt-oss's biased experts keep their
clamped SwiGLU's intermediates in fp32 under autocast (`_clamped_expert_bytes`). Pipeline stages
need every layer alike (`pipeline_error`): a stage's weights follow from its count of whole layers
only then.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slipstream.perf.layers import layer_kinds

if TYPE_CHECKING:
    from slipstream.perf.accelerators import Accelerator
    from slipstream.perf.model import Layout, TrainSetup
    from slipstream.perf.shapes import TransformerShape

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded device (the pipeline stage with the most memory)."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    reserved_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.reserved_bytes)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"total_bytes": self.total_bytes}


def activation_bytes_per_layer(
    setup: TrainSetup, tp: int, sequence_parallel: bool, micro_batch_tokens: float, *, on_cuda: bool = False
) -> float:
    """Activation bytes the mean layer keeps for the backward pass, for one micro-batch on one
    device (dense and MoE layers weighted by their share of the layers; see `_layer_activation_bytes`);
    `on_cuda`: trained on a GPU, where SDPA takes grouped K/V heads in fewer cases than on a CPU."""
    return sum(share * _layer_activation_bytes(setup, tp, sequence_parallel, micro_batch_tokens, moe, on_cuda)
               for moe, share in layer_kinds(setup.shape))


def _expanded_kv_share(setup: TrainSetup, on_cuda: bool) -> float:
    """The share of the layers whose SDPA keeps K and V repeated to every query head, as
    `ops.attention._sdpa_takes_gqa` decides: none on a CPU (its flash kernel takes grouped heads,
    masked or not); on CUDA every layer in fp32 or past head_dim 256, else those handed a mask,
    the windowed layers once the sequence passes the window (only flash attention takes grouped
    heads there, and it takes no mask)."""
    shape = setup.shape
    if not on_cuda or shape.num_kv_heads == shape.num_heads:
        return 0.0
    if setup.activation_bytes == 4 or shape.head_dim > 256:
        return 1.0
    return shape.windowed_layer_share if _masked(setup) else 0.0


def _masked(setup: TrainSetup) -> bool:
    """Whether the windowed layers hand SDPA an additive mask: the window shorter than the sequence."""
    window = setup.shape.sliding_window
    return window is not None and setup.seq_len > window and setup.shape.windowed_layer_share > 0


def _layer_activation_bytes(
    setup: TrainSetup, tp: int, sequence_parallel: bool, micro_batch_tokens: float, moe: bool,
    on_cuda: bool = False,
) -> float:
    """Activation bytes one layer (`moe`: one with experts) keeps for the backward pass.

    `micro_batch_tokens` is s*b on this device (after context-parallel splitting). Generalises
    Korthikanti et al. section 4.1 op by op: e-byte activations (`setup.activation_bytes`, 2 in
    bf16/fp16, 4 in fp32) off an r-byte residual stream (`setup.residual_bytes`), 1-byte dropout
    masks, fp32 softmax statistics.
    """
    shape, n, e, r = setup.shape, micro_batch_tokens, setup.activation_bytes, setup.residual_bytes
    if setup.recompute == "full":
        return r * n * shape.hidden_size  # the checkpointed layer input
    h, f = shape.hidden_size, shape.mlp_width(moe=moe)
    mask = 1.0 if setup.dropout else 0.0
    # Replicated without SP: the norms' inputs (r: the residual stream, fp32 under autocast; a
    # Gemma norm keeps its input and its normalised output in fp32), the q/k/v and MLP inputs
    # (2e), dropout masks.
    replicated = n * h * (shape.norms_per_layer * _norm_bytes(shape, r) + 2 * e + 2 * mask)
    # A MoE layer's routing runs on the whole rows of the MLP input on every TP rank (gathered
    # under SP), so SP does not split it.
    routing = _routing_activation_bytes(shape, n, e, r) if moe else 0.0
    # Split by TP: q, k, v and the projection input (4e sbh for MHA), the MLP intermediates (GELU
    # input and the down-projection input, 8e sbh for a 4h GELU MLP; SwiGLU keeps gate, up, product).
    # Soft-capped attention's and attention with sinks' explicit matmuls keep K and V repeated to
    # every query head, as SDPA does where it does not take grouped heads (`_expanded_kv_share`).
    explicit = shape.attention_softcap or shape.attention_sinks
    kv_dim = shape.kv_dim + (shape.q_dim - shape.kv_dim) * (
        1.0 if explicit else _expanded_kv_share(setup, on_cuda))
    attention = e * n * (2 * shape.q_dim + 2 * kv_dim)
    if shape.qk_norm:  # the q and k norms keep their inputs too (Gemma's, fp32 copies)
        attention += _norm_bytes(shape, e) * n * (shape.q_dim + shape.kv_dim)
    # SwiGLU keeps gate, up and the product (its backward recomputes silu); GeGLU also gelu(gate).
    mlp = e * n * f * {"swiglu": 3, "geglu": 4, "gelu": 2}[shape.mlp]
    if moe and _clamped_experts(shape):
        mlp = _clamped_expert_bytes(n * f, e, r)
    split = attention + mlp
    scores = 0.0
    if setup.attention_kernel == "unfused" and setup.recompute != "selective":
        pairs = n * setup.seq_len  # every query against the whole sequence
        per_score = e + (1 + e) * mask  # softmax out (+ dropout mask, out)
        if shape.attention_softcap:  # tanh's output, the fp32 softmax and its cast for the matmul
            per_score = e + 4 + (e if e != 4 else 0)
        elif shape.attention_sinks:  # the fp32 softmax and its cast for the matmul, no tanh output
            per_score = 4 + (e if e != 4 else 0)
        scores = shape.num_heads * pairs * per_score
        if shape.attention_sinks:  # the softmax's column for each query's sink (`softmax_with_sinks`)
            scores += 4 * shape.num_heads * n
    elif setup.attention_kernel == "flash":
        scores = 4.0 * n * shape.num_heads  # fp32 log-sum-exp per query and head
    if sequence_parallel:
        return (replicated + split + scores) / tp + routing
    return replicated + routing + (split + scores) / tp


def attention_masks(setup: TrainSetup) -> int:
    """Additive T x T masks (in the compute dtype) the trainer's attention holds, each shared by
    every layer of its window (`ops.attention._additive_causal_mask` caches the last two made):
    soft-capped attention and attention with sinks (explicit matmuls) add one to every layer's
    scores, one per window the layers have (Gemma 2's and gpt-oss's windowed and full layers');
    SDPA gets one only on windowed layers shorter than the
    sequence (the others run `is_causal`), and keeps it for the backward."""
    shape = setup.shape
    if shape.attention_softcap or shape.attention_sinks:
        return 2 if 0.0 < shape.windowed_layer_share < 1.0 else 1
    return 1 if _masked(setup) else 0


def _rotary_tables(shape: TransformerShape) -> int:
    """Sets of rotary cos and sin rows the layers multiply by: two where the windowed layers take
    their own (Gemma 3's `rope_local_theta`) and the full layers the global ones, else one."""
    return 2 if shape.local_rotary and 0.0 < shape.windowed_layer_share < 1.0 else 1


def _norm_bytes(shape: TransformerShape, r: int) -> int:
    """Bytes per element one norm keeps for the backward: its r-byte input (slipstream's RMSNorm,
    a LayerNorm), that and the fp32 normalised input the weight multiplies (`fp32_weight_norms`:
    r + 4), or Gemma's fp32 input and fp32 normalised output (4 + 4, whatever the input's dtype: it
    computes in fp32 and multiplies by 1 + weight there)."""
    if shape.norm == "gemma_rmsnorm":
        return 8
    return r + 4 if shape.fp32_weight_norms else r


def _clamped_experts(shape: TransformerShape) -> bool:
    """Whether the experts are gpt-oss's (`GptOssMoeBlock`): biased, with a clamped SwiGLU. No
    other family's experts have biases."""
    return shape.expert_bias_params > 0


def _clamped_expert_bytes(width: float, e: int, r: int) -> float:
    """What gpt-oss's experts keep over `width` = n k F intermediate columns: the whole gate-up
    output (two columns per one, kept by the clamps of its strided gate and up views), the clamped
    gate, its sigmoid, their product and up + 1 (the two products' operands), all in the r-byte
    bias's dtype (the e-byte matmul's output plus the fp32 bias is fp32 under autocast), and the
    down projection's input cast to e bytes."""
    return width * (6 * r + e)


def _routing_activation_bytes(shape: TransformerShape, n: float, e: int, r: int) -> float:
    """What slipstream's `SparseMoeBlock` keeps beyond the experts' SwiGLU for n tokens: the
    router's fp32 softmax (4 bytes per expert); per choice of an expert, three int64 indices (the
    top k's, the sort order's, the token's), its fp32 routing weight and three rows of hidden
    (the gathered input and the expert's output, for the routing weight's gradient, in e bytes;
    the weighted output that index_add_ keeps, in the block's input dtype, r bytes: the residual
    stream's, as transformers sums the experts' rows); with a shared expert, its output and its
    gate's sigmoid. gpt-oss's block (`_clamped_experts`) keeps no router softmax: its top k of the
    raw logits keeps only the indices and its softmax over the k its e-byte output, once as
    returned and once gathered into expert order; the expert's output, biased, is r bytes."""
    k, h = shape.experts_per_token, shape.hidden_size
    if _clamped_experts(shape):
        return n * k * (24 + 2 * e) + (e + 2 * r) * n * k * h
    shared = e * n * (h + 1) if shape.shared_expert_ffn_hidden_size else 0
    return n * (4 * shape.num_experts + 28 * k) + (2 * e + r) * n * k * h + shared


def pipeline_error(shape: TransformerShape, pp: int) -> str | None:
    """Why `pp` pipeline stages cannot be priced for this shape, None when they can: with both
    dense and MoE layers a stage's weights and time depend on which layers it holds, which the
    stage split (`stage_layers`, counts of whole layers) does not say."""
    if pp > 1 and not shape.uniform_layers:
        return (f"pp={pp}: {shape.name} mixes {shape.num_dense_layers} dense and {len(shape.moe_layers)} "
                f"mixture-of-experts layers, which pipeline stages are not modeled for; use pp=1")
    return None


def stage_layers(num_layers: int, layout: Layout) -> tuple[int, int, int]:
    """Layers on the first, a middle and the last pipeline stage.

    Stages get ceil(L / (p v)) layers per chunk; when that overshoots L, the spare slots go to
    the first and last stages, which also carry the embedding and the output layer (as Llama 3
    does: one layer fewer on each, Dubey et al. 2024, arXiv 2407.21783, section 3.3.2).
    """
    chunk = -(-num_layers // (layout.pp * layout.virtual_stages))
    full = chunk * layout.virtual_stages
    spare = layout.pp * full - num_layers
    if layout.pp == 1:
        return num_layers, num_layers, num_layers
    return full - spare // 2, full, full - (spare - spare // 2)


def stage_params(shape: TransformerShape, layout: Layout) -> tuple[float, float, float]:
    """Parameters per device on the first, a middle and the last stage (whole layers, /tp).

    The first stage adds the embedding (and learned positions), the last the final norm and the
    lm_head: its own matrix when untied, with pp > 1 a copy of the tied embedding (Megatron keeps
    one there and all-reduces its gradient with the first stage's). With pp = 1 it is every
    parameter (`num_params`, every expert of a MoE model)."""
    if layout.pp == 1:
        return (shape.num_params() / layout.tp,) * 3
    if error := pipeline_error(shape, layout.pp):
        raise ValueError(error)
    first, middle, last = stage_layers(shape.num_layers, layout)
    layer = shape.layer_params(moe=shape.is_moe)  # every layer alike
    embedding = shape.embedding_params() + shape.learned_positions * shape.hidden_size
    final_norm = shape.hidden_size * (2 if shape.norm == "layernorm" else 1)
    head = final_norm + shape.embedding_params()
    return ((first * layer + embedding) / layout.tp, middle * layer / layout.tp,
            (last * layer + head) / layout.tp)


def in_flight_microbatches(layout: Layout, num_microbatches: int, stage: int = 0) -> float:
    """Micro-batches of its layers whose activations pipeline stage `stage` holds at its peak.

    1F1B: stage r holds min(m, p - r). Interleaved with v chunks: Megatron's warm-up of
    2 (p - r - 1) + (v - 1) p chunk micro-batches plus the one in flight, at most all m v of
    them, in units of the stage's v chunks; on the first stage that is p (1 + (p - 1) / (p v))
    (section 4.2.3) once m > p. GPipe: every stage holds all m (its backward passes begin after
    the last forward).
    """
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.gpipe:
        return float(num_microbatches)
    if v == 1:
        return float(min(num_microbatches, p - stage))
    chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, num_microbatches * v)
    return chunks / v


def training_memory(setup: TrainSetup, layout: Layout, accelerator: Accelerator | None = None
                    ) -> MemoryBreakdown:
    """Memory of the most loaded pipeline stage: the first (embedding, most micro-batches in
    flight), the second (whole middle layers) or the last (lm_head, fp32 logits). `accelerator`:
    what trains; a GPU (any but a calibrated CPU) changes which layers' SDPA keeps grouped K/V
    heads expanded (`_expanded_kv_share`); None is a CPU."""
    on_cuda = accelerator is not None and not accelerator.calibrated
    first, middle, last = stage_layers(setup.shape.num_layers, layout)
    params = stage_params(setup.shape, layout)
    stages = [_stage_memory(setup, layout, 0, first, params[0], on_cuda)]
    if layout.pp > 1:
        stages += [_stage_memory(setup, layout, 1, middle, params[1], on_cuda) if layout.pp > 2 else None,
                   _stage_memory(setup, layout, layout.pp - 1, last, params[2], on_cuda)]
    return max((s for s in stages if s is not None), key=lambda s: s.total_bytes)


def _stage_memory(setup: TrainSetup, layout: Layout, stage: int, layers: int, params: float,
                  on_cuda: bool) -> MemoryBreakdown:
    weight_bytes, grad_bytes, optimizer_bytes = setup.state_bytes_per_param()
    zero, dp_shards = layout.zero_stage, layout.dp * layout.cp  # FSDP shards over DP x CP
    whole = 0.0  # bytes per parameter every rank holds whole, sharded or not
    if zero >= 3 and setup.weight_bytes is None and setup.autocast:  # autocast casts the gathered
        whole = 2.0  # weights; autograd keeps the 16-bit copies, whole, from the forward to the backward
    gathered = weight_bytes - whole  # a whole parameter as FSDP gathers it
    if zero >= 3 and setup.weight_bytes is None and setup.activation_bytes == 2 and not setup.autocast:
        weight_bytes = 0.0  # 16-bit parameters under FSDP2 (torchtitan): the sharded fp32 master,
        # counted with the optimizer, is the parameter
    weights = params * ((weight_bytes - whole) / (dp_shards if zero >= 3 else 1) + whole)
    grads = params * grad_bytes / (dp_shards if zero >= 2 else 1)
    if zero >= 3 and layout.pp > 1:  # whole through the step (see the module docstring)
        weights += params * gathered
        grads = params * grad_bytes
    optimizer = params * optimizer_bytes / (dp_shards if zero >= 1 else 1)
    tokens = setup.micro_batch_size * setup.seq_len / layout.cp
    per_layer = activation_bytes_per_layer(setup, layout.tp, layout.sequence_parallel, tokens,
                                           on_cuda=on_cuda)
    held = in_flight_microbatches(layout, setup.num_microbatches(layout), stage)
    activations = per_layer * layers * held
    if setup.recompute == "full":  # the layer being recomputed materialises its activations
        full = dataclasses.replace(setup, recompute="none")  # the largest kind of layer, with experts
        activations += max(_layer_activation_bytes(full, layout.tp, layout.sequence_parallel, tokens, moe,
                                                   on_cuda) for moe, _ in layer_kinds(setup.shape))
    mask = setup.activation_bytes * setup.seq_len / layout.cp * setup.seq_len
    activations += attention_masks(setup) * mask
    if not setup.shape.learned_positions:  # the rotary cos and sin rows of every token, which
        # every layer's q and k multiply by (the trainer builds them once per micro-batch, and a
        # pipeline stage once per micro-batch and chunk: each one in flight holds its own)
        rows = 2.0 * setup.residual_bytes * tokens * setup.shape.head_dim
        activations += rows * _rotary_tables(setup.shape) * held * layout.virtual_stages
    if stage == layout.pp - 1:  # on the last stage: the final norm's and lm_head's inputs and
        # the fp32 logits of the loss (section 4.3), of one micro-batch (1F1B runs each one's
        # backward right after its forward there) or of all m (GPipe)
        split = layout.tp if layout.sequence_parallel else 1
        h, e, r = setup.shape.hidden_size, setup.activation_bytes, setup.residual_bytes
        logits = 4.0 + (e if setup.shape.logit_softcap else 0)  # (+ the soft cap's tanh output)
        held_heads = held if layout.gpipe else 1.0
        activations += held_heads * ((_norm_bytes(setup.shape, r) + e) * tokens * h / split
                                     + logits * tokens * setup.shape.vocab_size / layout.tp)
    return MemoryBreakdown(weights, grads, optimizer, activations, setup.reserved_bytes)
