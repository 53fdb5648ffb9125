"""The CPU inference fast path, applied to a finished model as a function.

`optimize_for_cpu_inference(model)` keeps the model's math and swaps in faster pieces: the
q/k/v and gate/up projections fused into one linear each (fewer, larger matrix products; the
experts of a mixture-of-experts layer are MLPs too), oneDNN pre-packed linear layers
(`ops.linear`; those of experts pad their inputs to few shapes), weight-only int8 linears on
the C int8 kernel where quantization is asked for (`ops.quant.PackedInt8Linear`), the fused
RMSNorm (Llama's and Gemma's), rotary-embedding and silu- or gelu-and-multiply C kernels of
`ops.cpu_kernels` in place of their several-op PyTorch versions, a decoder whose residual sums
run inside those RMSNorm kernels (`KernelDecoder`, Gemma 2's sandwich layers included), and the
routed experts of each mixture-of-experts block in one C call (`KernelMoeExperts`).
The result is for inference only. Where a piece does not apply (no oneDNN, no C compiler, CUDA,
fp16) the model's own modules stay; tests check the optimised model against the plain one.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from slipstream.model.transformer import (
    MLP,
    Attention,
    AttentionMetadata,
    Decoder,
    DecoderLayer,
    GeluTanhAndMul,
    GemmaRMSNorm,
    RMSNorm,
    Rotary,
    SandwichDecoderLayer,
    SiluAndMul,
    SparseMoeBlock,
)
from slipstream.ops import cpu_kernels
from slipstream.ops.linear import (
    MAX_PANEL_ROWS,
    ONEDNN_ROW_MULTIPLE,
    PackedLinear,
    extra_copies_of,
    pack_linears,
)
from slipstream.ops.quant import check_quantization, pack_int8_linears, quantize_linears

logger = logging.getLogger(__name__)


class KernelRMSNorm(nn.Module):
    """RMSNorm through one fused C kernel (same weight, same rounding as `RMSNorm`)."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, self.weight, self.eps)


class KernelGemmaRMSNorm(nn.Module):
    """`GemmaRMSNorm` (times 1 + weight, in fp32, rounded once) through the same C kernel. Not a
    KernelRMSNorm: code that takes one for Llama's norm (the decode graph) must not take this."""

    def __init__(self, norm: GemmaRMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, self.weight, self.eps, one_plus_weight=True)


class KernelDecoder(nn.Module):
    """`Decoder` whose residual sums each run in the C kernel of the RMSNorm that reads them
    (`cpu_kernels.add_rms_norm_`), as vLLM's layers pass the residual to their next norm: the layer
    stack keeps one residual stream, updated in place, and never writes a sum only to read it back
    for its norm. The same modules and weights as the decoder it replaces, and the same results."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.embed_tokens = decoder.embed_tokens
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rope = decoder.rope
        self.local_rope = decoder.local_rope
        self.local_rope_layers = decoder.local_rope_layers
        self.embed_scale = decoder.embed_scale

    @staticmethod
    def applies_to(decoder: nn.Module) -> bool:
        """Whether every norm of `decoder` (a `Decoder` of `DecoderLayer`s or Gemma 2's
        `SandwichDecoderLayer`s) has the C kernel, and the decoder holds no module beyond those
        this one runs."""
        kernel_norms = (KernelRMSNorm, KernelGemmaRMSNorm)
        if type(decoder) is not Decoder or not isinstance(decoder.norm, kernel_norms) or not decoder.layers:
            return False
        runs = {"embed_tokens", "layers", "norm", "rope", "local_rope"}
        if {name for name, _ in decoder.named_children()} - runs:
            return False
        return all(type(layer) in (DecoderLayer, SandwichDecoderLayer)
                   and all(isinstance(m, kernel_norms) for n, m in layer.named_children() if "norm" in n)
                   for layer in decoder.layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, E)
        """`Decoder.embed`: the embeddings, scaled (by the scale rounded to the dtype) where Gemma's are."""
        x = self.embed_tokens(token_ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, T, E)
        # A new tensor either way (the stream that the sums update): never the caller's.
        residual = self.embed(token_ids) if inputs_embeds is None else inputs_embeds.clone()
        tables = self.rope(positions, residual.dtype)  # cos and sin
        local = tables if self.local_rope is None else self.local_rope(positions, residual.dtype)
        hidden = self.layers[0].input_layernorm(residual)
        for i, layer in enumerate(self.layers):
            attended = layer.self_attn(hidden, *(local if i in self.local_rope_layers else tables), attn)
            following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            if isinstance(layer, SandwichDecoderLayer):  # each block's output normed before its sum
                hidden = _add_and_norm(residual, layer.post_attention_layernorm(attended),
                                       layer.pre_feedforward_layernorm)
                mlp_out = layer.post_feedforward_layernorm(layer.mlp(hidden))
                hidden = _add_and_norm(residual, mlp_out, following)
            else:
                hidden = _add_and_norm(residual, attended, layer.post_attention_layernorm)
                hidden = _add_and_norm(residual, layer.mlp(hidden), following)
        return hidden


def _add_and_norm(
    residual: torch.Tensor, x: torch.Tensor, norm: KernelRMSNorm | KernelGemmaRMSNorm
) -> torch.Tensor:
    return cpu_kernels.add_rms_norm_(residual, x, norm.weight, norm.eps,
                                     one_plus_weight=isinstance(norm, KernelGemmaRMSNorm))


class KernelRotary(nn.Module):
    """The rotary embedding through one in-place C kernel per tensor."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.rotary_embedding_(q, cos, sin), cpu_kernels.rotary_embedding_(k, cos, sin)


class KernelSiluAndMul(nn.Module):
    """SiluAndMul through one C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(x)


class KernelGeluTanhAndMul(nn.Module):
    """GeluTanhAndMul (Gemma's GeGLU) through one C kernel: GELU's tanh approximation computed as
    g / (1 + exp(-2y)), within a few fp32 ulps of PyTorch's (more accurate where its
    0.5 g (1 + tanh(y)) cancels, for g below about -5)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gelu_tanh_and_mul(x)


class KernelMoeExperts(nn.Module):
    """A mixture-of-experts block's routed experts (`SparseMoeBlock._routed`) in one C call
    (`cpu_kernels.moe_experts_`): the same kernels per expert as their PackedLinears pick, the
    same sums, in place of ~45 eager ops per layer and step. It takes a call where the panel kernel
    takes every expert's rows (fp32 with AVX-512: all; else up to MAX_PANEL_ROWS per expert) and
    declines the others, which the block's own path runs. `num_calls` counts the calls taken."""

    def __init__(self, block: SparseMoeBlock) -> None:
        super().__init__()
        linears = [(expert.gate_up_proj, expert.down_proj) for expert in block.experts]
        self.dtype = linears[0][0].panel_weight.dtype
        self.experts = cpu_kernels.ExpertWeights(
            [(up.row_weight, up.panel_weight, up.bias) for up, _ in linears],
            [(down.row_weight, down.panel_weight, down.bias) for _, down in linears],
            hidden_size=linears[0][1].out_features, intermediate_size=linears[0][1].in_features,
            dtype=self.dtype)
        # A PackedLinear with panels and no oneDNN copy gives the panel kernel every size.
        all_rows = all(linear.packed_weight is None for pair in linears for linear in pair)
        self.max_panel_rows = None if all_rows else MAX_PANEL_ROWS
        self.num_calls = 0

    @staticmethod
    def applies_to(block: nn.Module) -> bool:
        """Whether every expert of `block` (a SparseMoeBlock) is an MLP with a fused gate/up
        PackedLinear and a down PackedLinear, all holding panel copies of one dtype, and the
        row-major copies wherever an expert's few rows take the matrix-vector kernel."""
        if not isinstance(block, SparseMoeBlock):
            return False
        linears = [linear for expert in block.experts
                   for linear in (getattr(expert, "gate_up_proj", None), getattr(expert, "down_proj", None))]
        if not all(isinstance(m, PackedLinear) and m.panel_weight is not None for m in linears):
            return False
        dtype = linears[0].panel_weight.dtype
        needs_rows = cpu_kernels.min_panel_rows(dtype) > 1
        return all(linear.panel_weight.dtype == dtype and (linear.row_weight is not None or not needs_rows)
                   for linear in linears)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, out: torch.Tensor
    ) -> bool:
        """out += the routed experts' weighted outputs; False (out untouched) where not taken."""
        if x.dtype != self.dtype or out.dtype != self.dtype:
            return False
        taken = cpu_kernels.moe_experts_(out, x, experts, weights, self.experts, self.max_panel_rows)
        self.num_calls += taken
        return taken


@torch.no_grad()
def fuse_projections(model: nn.Module) -> nn.Module:
    """Give every attention one q/k/v linear and every MLP one gate/up linear, in place.

    The fused weight is the row-wise concatenation of the separate ones (as vLLM's
    QKVParallelLinear and MergedColumnParallelLinear hold them): the same dot products, split
    afterwards. The separate linears are removed.
    """
    # Only the parents are listed, so that each original linear is freed as soon as it is fused
    # and the next concatenation can reuse its memory instead of faulting in fresh pages.
    for module in [m for m in model.modules() if isinstance(m, (Attention, MLP))]:
        if isinstance(module, Attention) and module.qkv_proj is None:
            module.qkv_proj = _concatenated(module.q_proj, module.k_proj, module.v_proj)
            del module.q_proj, module.k_proj, module.v_proj
        elif isinstance(module, MLP) and module.gate_up_proj is None:
            module.gate_up_proj = _concatenated(module.gate_proj, module.up_proj)
            del module.gate_proj, module.up_proj
    return model


def _concatenated(*linears: nn.Linear) -> nn.Linear:
    """One linear whose rows are those of `linears`, in order (built on the meta device, so no
    random initialisation is spent on weights that are replaced at once)."""
    first = linears[0]
    fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return fused


# Keep the extra copies of the linear weights (row-major for batch-1 decode, panel-packed for
# decode batches) only while they take at most this fraction of available memory.
MAX_EXTRA_COPIES_MEMORY_FRACTION = 0.25


@torch.no_grad()
def optimize_for_cpu_inference(model: nn.Module, *, quantization: str | None = None) -> nn.Module:
    """Fuse projections, quantize the decoder layers' linears (`quantization`, one of
    `ops.quant.QUANTIZATION_METHODS`, or None to keep the weights) and pack them for the C int8
    kernel, pack the other linears for oneDNN and swap in the C kernels, in place; returns the
    model."""
    check_quantization(quantization)  # before the model changes
    fuse_projections(model)
    if quantization is not None:
        quantize_linears(model, quantization)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    param = next(model.parameters(), None)
    copies = sum(extra_copies_of(param)) if param is not None else 0
    extra_copies = copies * weight_bytes <= MAX_EXTRA_COPIES_MEMORY_FRACTION * _available_memory_bytes()
    if not extra_copies:
        logger.info("weights too large to keep extra copies: every linear goes through oneDNN")
    pack_linears(model, extra_copies=extra_copies)
    pack_int8_linears(model)
    _pad_expert_rows(model)
    param = next(model.parameters(), None)
    if param is None or not cpu_kernels.supports(param):
        return model
    swaps = 0
    for name, module in list(model.named_modules()):
        fast = _kernel_module(module)
        if fast is not None:
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, fast)
            swaps += 1
    logger.info("swapped %d norm/rotary/activation modules for fused C kernels", swaps)
    _fuse_experts(model)
    decoder = getattr(model, "model", None)
    if KernelDecoder.applies_to(decoder):
        model.model = KernelDecoder(decoder)
    return model


def _kernel_module(module: nn.Module) -> nn.Module | None:
    """The C kernel module that replaces `module`, or None where it has none."""
    if isinstance(module, RMSNorm):
        return KernelRMSNorm(module)
    if isinstance(module, GemmaRMSNorm):
        return KernelGemmaRMSNorm(module)
    if isinstance(module, Rotary):
        return KernelRotary()
    if isinstance(module, SiluAndMul):
        return KernelSiluAndMul()
    if isinstance(module, GeluTanhAndMul):
        return KernelGeluTanhAndMul()
    return None


def _pad_expert_rows(model: nn.Module) -> None:
    """Let the packed linears of every mixture-of-experts block's experts pad their oneDNN inputs
    to a multiple of ONEDNN_ROW_MULTIPLE rows (`PackedLinear.pad_rows_to`): an expert's row count
    changes from step to step, and oneDNN builds code for each new one."""
    experts = [m for block in model.modules() if isinstance(block, SparseMoeBlock)
               for m in block.experts.modules() if isinstance(m, PackedLinear)]
    for linear in experts:
        linear.pad_rows_to = ONEDNN_ROW_MULTIPLE
    if experts:
        logger.info("%d expert linears pad their oneDNN inputs to multiples of %d rows", len(experts),
                    ONEDNN_ROW_MULTIPLE)


def _fuse_experts(model: nn.Module) -> None:
    """Give every mixture-of-experts block whose experts allow it a `KernelMoeExperts`."""
    blocks = [m for m in model.modules() if KernelMoeExperts.applies_to(m)]
    for block in blocks:
        block.fused_experts = KernelMoeExperts(block)
    if blocks:
        logger.info("%d mixture-of-experts blocks run their routed experts in one C call", len(blocks))


def _available_memory_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
