"""The CPU inference fast path, applied to a finished model as a function.

`optimize_for_cpu_inference(model)` keeps the model's math and swaps in faster pieces:
oneDNN pre-packed linear layers (`ops.linear`), and the fused RMSNorm and rotary-embedding C
kernels of `ops.cpu_kernels` in place of their several-op PyTorch versions. The result is for
inference only. Where a piece does not apply (no oneDNN, no C compiler, CUDA, fp16) the model's
own modules stay; tests check the optimised model against the plain one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from slipstream.model.transformer import RMSNorm, Rotary
from slipstream.ops import cpu_kernels
from slipstream.ops.linear import pack_linears

logger = logging.getLogger(__name__)


class KernelRMSNorm(nn.Module):
    """RMSNorm through one fused C kernel (same weight, same rounding as `RMSNorm`)."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, self.weight, self.eps)


class KernelRotary(nn.Module):
    """The rotary embedding through one in-place C kernel per tensor."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = q.contiguous(), k.contiguous()
        return cpu_kernels.rotary_embedding_(q, cos, sin), cpu_kernels.rotary_embedding_(k, cos, sin)


@torch.no_grad()
def optimize_for_cpu_inference(model: nn.Module) -> nn.Module:
    """Pack linears for oneDNN and swap in the fused C kernels, in place; returns the model."""
    pack_linears(model)
    param = next(model.parameters(), None)
    if param is None or not cpu_kernels.supports(param):
        return model
    swaps = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, (RMSNorm, Rotary)):
            parent_name, _, child_name = name.rpartition(".")
            fast = KernelRMSNorm(module) if isinstance(module, RMSNorm) else KernelRotary()
            setattr(model.get_submodule(parent_name), child_name, fast)
            swaps += 1
    logger.info("swapped %d RMSNorm/rotary modules for fused C kernels", swaps)
    return model
