"""Faster CPU training pieces, applied to a built model as a function.

PyTorch's default fp32 GEMM on the development machine's AMD CPU runs at about 210 GFLOP/s, while
oneDNN reaches about 470 on the same shapes (`slipstream perf calibrate`). Inference packs its
weights once (`ops.linear`); training changes them every step, so `OneDNNLinear` calls oneDNN on
the plain weight for all three GEMMs of a linear layer: the forward `y = x W^T`, and in the
backward `dx = dy W` and `dW = dy^T x`, each written as a oneDNN "linear" over (possibly
transposed, strided) views, without copies: about 1.8x the plain layer's fp32 forward+backward
on the training shapes. Under bf16 autocast `F.linear` already takes oneDNN's bf16 path (and was
faster than this function there), so the layer defers to it.

`use_onednn_linears(model)` swaps every `nn.Linear` for a `OneDNNLinear` that holds the very
same parameters (names, sharing and tying unchanged); `nn.Linear` stays the tested fallback where
oneDNN is absent or the model is not on the CPU.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


@torch.library.custom_op("slipstream::onednn_mm_nt", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) through oneDNN; both may be strided views.

    A custom op so that torch.compile calls it as it is: Inductor's own lowering of this oneDNN
    op only accepts constant (frozen) weights."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class _OneDNNLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _onednn_linear(x.reshape(-1, x.shape[-1]), weight)  # (M, N)
        if bias is not None:
            out += bias
        # _unsafe_view (as matmul does): a plain view would make the model's output a view
        # tensor, which FSDP2 warns about.
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))  # (..., N)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])  # (M, K)
        g2d = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(g2d, weight.t()).view(x.shape)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn_linear(g2d.t(), x2d.t())  # (N, M) @ (M, K) -> (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g2d.sum(0)
        return grad_x, grad_weight, grad_bias


class OneDNNLinear(nn.Linear):
    """`nn.Linear`'s math with oneDNN GEMMs in forward and backward; shares the layer's params.

    A subclass, so code that initialises or inspects `nn.Linear` layers treats it as one."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: the parameters are linear's own
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        # Under autocast (bf16) F.linear already runs on oneDNN, and measured faster than three
        # strided oneDNN calls; the plain fp32 path is where PyTorch's default GEMM is slow.
        if torch.is_autocast_enabled("cpu") or x.dtype != torch.float32 or self.weight.dtype != x.dtype:
            return F.linear(x, self.weight, self.bias)
        return _OneDNNLinearFunction.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a CPU (or meta) model for a `OneDNNLinear`, in place; returns
    how many were swapped (0 where oneDNN is unavailable)."""
    if not onednn_available():
        logger.info("oneDNN is not available; keeping nn.Linear for training")
        return 0
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, OneDNNLinear(linear))
    logger.info("using oneDNN for %d linear layers in training", len(targets))
    return len(targets)
