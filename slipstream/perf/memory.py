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

With pipeline parallelism the first stage holds `min(m, p)` micro-batches of its L/p layers in
1F1B (about L layers' worth), times `1 + (p - 1) / (p v)` with v interleaved chunks (section 4.2.3).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slipstream.perf.model import Layout, TrainSetup

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded device (the first pipeline stage)."""

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
    setup: TrainSetup, tp: int, sequence_parallel: bool, micro_batch_tokens: float
) -> float:
    """Activation bytes one layer keeps for the backward pass, for one micro-batch on one device.

    `micro_batch_tokens` is s*b on this device (after context-parallel splitting). Generalises
    Korthikanti et al. section 4.1 op by op (2-byte activations, 1-byte dropout masks).
    """
    shape, n = setup.shape, micro_batch_tokens
    if setup.recompute == "full":
        return 2.0 * n * shape.hidden_size  # the checkpointed layer input
    h, f = shape.hidden_size, shape.ffn_hidden_size
    mask = 1.0 if setup.dropout else 0.0
    # Replicated without SP: both norm inputs (4), the q/k/v and MLP inputs (4), dropout masks (2).
    replicated = n * h * (4 + 4 + 2 * mask)
    # Split by TP: q, k, v and the projection input (8 sbh for MHA), the MLP intermediates (GELU
    # input and the down-projection input, 16 sbh for a 4h GELU MLP; SwiGLU keeps gate, up, product).
    attention = 2 * n * (2 * shape.q_dim + 2 * shape.kv_dim)
    mlp = 2 * n * f * (3 if shape.mlp == "swiglu" else 2)
    split = attention + mlp
    scores = 0.0
    if setup.attention == "unfused" and setup.recompute != "selective":
        pairs = n * setup.seq_len  # every query against the whole sequence
        scores = shape.num_heads * pairs * (2 + 3 * mask)  # softmax out (+ dropout mask and out)
    elif setup.attention == "flash":
        scores = 4.0 * n * shape.num_heads  # fp32 log-sum-exp per query and head
    if sequence_parallel:
        return (replicated + split + scores) / tp
    return replicated + (split + scores) / tp


def in_flight_microbatches(layout: Layout, num_microbatches: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (1F1B / interleaved)."""
    if layout.pp == 1:
        return 1.0
    held = min(num_microbatches, layout.pp)
    if layout.virtual_stages > 1:
        held *= 1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages)
    return held


def training_memory(setup: TrainSetup, layout: Layout) -> MemoryBreakdown:
    """Memory of the first pipeline stage (embedding, its layers, its in-flight activations)."""
    shape = setup.shape
    layers = shape.num_layers / layout.pp
    params = layers * shape.layer_params() / layout.tp
    params += (shape.embedding_params() + shape.learned_positions * shape.hidden_size) / layout.tp
    if layout.pp == 1 and not shape.tied_embeddings:
        params += shape.embedding_params() / layout.tp
    zero, dp_shards = layout.zero_stage, layout.dp * layout.cp  # FSDP shards over DP x CP
    weights = params * setup.weight_bytes / (dp_shards if zero >= 3 else 1)
    grads = params * setup.grad_bytes / (dp_shards if zero >= 2 else 1)
    optimizer = params * setup.optimizer_bytes / (dp_shards if zero >= 1 else 1)
    tokens = setup.micro_batch_size * setup.seq_len / layout.cp
    per_layer = activation_bytes_per_layer(setup, layout.tp, layout.sequence_parallel, tokens)
    held = in_flight_microbatches(layout, setup.num_microbatches(layout))
    activations = per_layer * layers * held
    if setup.recompute == "full":  # the layer being recomputed materialises its activations
        full = dataclasses.replace(setup, recompute="none")
        activations += activation_bytes_per_layer(full, layout.tp, layout.sequence_parallel, tokens)
    if layout.pp == 1:  # logits of the loss in fp32 (section 4.3), on the last stage
        activations += 4.0 * tokens * shape.vocab_size / layout.tp
    return MemoryBreakdown(weights, grads, optimizer, activations, setup.reserved_bytes)
