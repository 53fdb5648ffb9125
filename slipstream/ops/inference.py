"""The CPU inference fast path, applied to a finished model as a function.

`optimize_for_cpu_inference(model)` keeps the model's math and swaps in faster pieces:
oneDNN pre-packed linear layers (`ops.linear`), and the fused RMSNorm and rotary-embedding C
kernels of `ops.cpu_kernels` in place of their several-op PyTorch versions. The result is for
inference only. Where a piece does not apply (no oneDNN, no C compiler, CUDA, fp16) the model's
own modules stay; tests check the optimised model against the plain one.
"""

from __future__ import annotations

import logging
import os

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


# Keep a second, row-major copy of the linear weights for batch-1 decode only while the model's
# weights are at most this fraction of available memory.
MAX_WEIGHT_FRACTION_FOR_GEMV_COPY = 0.25


@torch.no_grad()
def optimize_for_cpu_inference(model: nn.Module) -> nn.Module:
    """Pack linears for oneDNN and swap in the fused C kernels, in place; returns the model."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    keep_rows = weight_bytes <= MAX_WEIGHT_FRACTION_FOR_GEMV_COPY * _available_memory_bytes()
    if not keep_rows:
        logger.info("weights too large to keep a second copy: batch-1 decode uses oneDNN GEMV")
    pack_linears(model, keep_rows=keep_rows)
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


def _available_memory_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
