"""Weight-only int8 quantization, applied to a finished model as a function (as gpt-fast's
`WeightOnlyInt8QuantHandler` and torchao's `int8_weight_only` do).

Each output channel (row) n of a weight W (out_features, in_features) is stored as int8 values
q[n, :] and one fp32 scale s[n] = max_k |W[n, k]| / 127, with q = round(W / s) in [-127, 127]
(symmetric, no zero point; a row of zeros gets s = 1). A layer computes

    y[m, n] = s[n] * sum_k x[m, k] * q[n, k]  (+ bias[n])

accumulated in fp32 and rounded once to the input's dtype: every q is exact in fp32 and in bf16,
so the fast kernels differ from this plain path only in the order of the sum. Decode reads a
quarter of an fp32 weight's bytes and half of a bf16 one's, which is what batch-1 decode, bound
by memory bandwidth, gains.

On the CPU, `ops.inference.optimize_for_cpu_inference` then packs each `Int8Linear` into a
`PackedInt8Linear`, whose product is the C kernel of cpu_ops.c (int8 widened to fp32 in
registers, one copy of the weight in panels, every row count); `Int8Linear` stays the path
wherever that kernel does not apply (CUDA, fp16, no compiler, neither AVX-512 nor AVX2).

What is quantized follows vLLM's and llm-compressor's default: the linear layers of the decoder
layers (attention and MLP projections, experts included); the embeddings, the LM head, and a
mixture-of-experts router (`gate`) and shared-expert gate stay in the model's dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from slipstream.ops import cpu_kernels
from slipstream.ops.allocator import huge_page_empty

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8",)
"""Values of EngineConfig.quantization besides None: "int8", weight-only int8, one scale per
output channel."""

_KEPT_IN_DTYPE = frozenset({"gate", "router", "shared_expert_gate"})
"""Names of linear layers inside decoder layers that stay unquantized: the router of a
mixture-of-experts block (`gate`, gpt-oss's `router`), whose scores pick experts, and the shared
expert's scalar gate."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): int8 values (out_features, in_features) and fp32 scales (out_features,) with
    W ~= s[:, None] * q, rounding to nearest (ties to even)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8 takes a 2-D weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"quantize_int8 takes a floating-point weight, got {weight.dtype}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("quantize_int8: the weight holds inf or NaN, which int8 cannot represent")
    amax = w.abs().amax(dim=1)  # (out_features,)
    # A row below 127 times the smallest normal fp32 (~1.5e-36) takes that normal as its scale,
    # not a subnormal or zero one that would lose or zero the row.
    smallest = torch.finfo(torch.float32).tiny
    scale = torch.where(amax > 0, (amax / 127.0).clamp(min=smallest), torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """Inference-only linear layer over int8 weights with one fp32 scale per output channel (see
    the module docstring for the math). This is the plain PyTorch path, which every fast path is
    tested against."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        qweight, scale = quantize_int8(linear.weight)
        self.register_buffer("qweight", qweight)  # (out_features, in_features) int8
        self.register_buffer("scale", scale)  # (out_features,) fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        """s[:, None] * q in fp32 (out_features, in_features): the weight this layer multiplies by."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        y = torch.nn.functional.linear(x.float(), self.qweight.float()) * self.scale  # (..., out) fp32
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights, per-channel scales")


class PackedInt8Linear(nn.Module):
    """`Int8Linear` through the C int8 kernel (`cpu_kernels.int8_panel_gemm`, see cpu_ops.c): the
    same int8 values, scales and bias, the weight held once in the kernel's panel layout, and the
    same math up to the order of the sums, for every number of rows (batch-1 decode included).
    `pack_int8_linears` makes it; the optimised CPU model holds it and the decode graph reads its
    panels and scales."""

    def __init__(self, layer: Int8Linear, panel_buffer: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = layer.in_features
        self.out_features = layer.out_features
        self.dtype = layer.dtype
        self.register_buffer("panels", cpu_kernels.pack_int8_panels(layer.qweight, out=panel_buffer))
        self.register_buffer("scale", layer.scale)  # (out_features,) fp32
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"PackedInt8Linear takes inputs of {self.in_features} features, got shape "
                             f"{tuple(x.shape)}")
        if not cpu_kernels.supports_int8(x):
            raise ValueError(f"PackedInt8Linear takes fp32 or bf16 CPU inputs, got {x.dtype} on {x.device}")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return cpu_kernels.int8_panel_gemm(x, self.panels, self.scale, bias, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 panels, per-channel scales")


@torch.no_grad()
def pack_int8_linears(model: nn.Module) -> int:
    """Replace every `Int8Linear` of `model` by a `PackedInt8Linear`, in place, where the C int8
    kernel takes its dtype here (fp32 or bf16 on a CPU with AVX-512 or AVX2); returns how many.
    The panels of all layers are slices of one huge-page buffer (`ops.allocator`): decode streams
    them whole at every step, and small weights would otherwise each occupy a 2 MiB page."""
    names = [name for name, m in model.named_modules()
             if isinstance(m, Int8Linear) and m.qweight.device.type == "cpu"
             and cpu_kernels.supports_int8(torch.empty(0, dtype=m.dtype))]
    if not names:
        return 0
    sizes = [cpu_kernels.int8_panel_numel(*model.get_submodule(name).qweight.shape) for name in names]
    buffers = huge_page_empty(sum(sizes), torch.int8).split(sizes)
    for name, buffer in zip(names, buffers, strict=True):
        parent_name, _, child_name = name.rpartition(".")
        packed = PackedInt8Linear(model.get_submodule(name), panel_buffer=buffer)
        setattr(model.get_submodule(parent_name), child_name, packed)
    logger.info("packed %d int8 linear layers for the C int8 kernel", len(names))
    return len(names)


def check_quantization(method: str | None) -> None:
    """ValueError unless `method` is None or one of QUANTIZATION_METHODS."""
    if method is not None and method not in QUANTIZATION_METHODS:
        choices = ", ".join(map(repr, QUANTIZATION_METHODS))
        raise ValueError(f"quantization must be None or one of {choices}, got {method!r}")


@torch.no_grad()
def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the linear layers inside the model's decoder layers by quantized ones, in place
    (`method` from QUANTIZATION_METHODS); returns how many were replaced."""
    check_quantization(method)
    if method is None:
        raise ValueError(f"quantize_linears needs a method, one of {QUANTIZATION_METHODS}, got None")
    layers = _decoder_layers(model)
    count = 0
    for layer in layers:
        for name, module in list(layer.named_modules()):
            child_name = name.rpartition(".")[2]
            if type(module) is nn.Linear and child_name not in _KEPT_IN_DTYPE:
                parent = layer.get_submodule(name.rpartition(".")[0])
                setattr(parent, child_name, Int8Linear(module))
                count += 1
    logger.info("quantized %d linear layers to int8 (weight-only, per-channel scales)", count)
    return count


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (`Transformer.model.layers`)."""
    decoder = getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"quantize_linears expects a slipstream Transformer, got {type(model).__name__}")
    return layers
