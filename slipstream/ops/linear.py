"""Fast inference linear layers, applied to a finished model as a function.

On x86 CPUs PyTorch's default fp32 GEMM path runs at less than half the speed oneDNN reaches on
the same shapes (on the AMD EPYC development machine: ~210 vs ~490 GFLOP/s for fp32, and a batch-1
GEMV streams its weights at 18 vs 36 GB/s). `pack_linears(model)` replaces every `nn.Linear` with a
`PackedLinear` that keeps its weight pre-packed in oneDNN's blocked layout and calls oneDNN's
linear directly, as vLLM's CPU backend does. The math is unchanged (y = x W^T + b, up to
summation order); `nn.Linear` stays the tested fallback wherever oneDNN is not available.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from slipstream.ops import cpu_kernels
from slipstream.ops.allocator import huge_page_empty

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """Inference-only linear layer over a oneDNN pre-packed weight.

    With `keep_rows`, a row-major copy of the weight is kept as well, on huge pages
    (`ops.allocator`), and inputs of at most `cpu_kernels.MAX_GEMV_ROWS` rows (batch-1 decode) go
    through the C matrix-vector kernel, which streams the weight faster than oneDNN does at that
    size; this doubles the layer's weight memory. `row_buffer` (out_features * in_features
    elements of the weight's dtype) is where to put that copy: `pack_linears` hands every layer a
    slice of one model-wide buffer, so that small weights do not each occupy a 2 MiB page.
    """

    def __init__(
        self, linear: nn.Linear, *, keep_rows: bool = False, row_buffer: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.row_weight = None
        if keep_rows and cpu_kernels.supports(weight):
            if row_buffer is None:
                row_buffer = huge_page_empty(weight.numel(), weight.dtype)
            self.row_weight = row_buffer.view(weight.shape).copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.row_weight is not None and x.numel() <= cpu_kernels.MAX_GEMV_ROWS * self.in_features:
            return cpu_kernels.gemv(x, self.row_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def can_pack(model: nn.Module) -> bool:
    """Whether oneDNN packing applies: CPU weights in fp32 or bf16 and oneDNN built in."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
    )


@torch.no_grad()
def pack_linears(model: nn.Module, *, keep_rows: bool = False) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) with a `PackedLinear`; returns the model.

    The model is for inference afterwards: packed weights take no gradients. A tied lm_head gets
    its own packed copy; the embedding table stays as it is for the lookup. `keep_rows`: see
    `PackedLinear`.
    """
    if not can_pack(model):
        logger.info("oneDNN linear packing does not apply here; keeping nn.Linear")
        return model
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    row_buffers = _row_buffers(targets) if keep_rows else {}
    for name, linear in targets:
        parent_name, _, child_name = name.rpartition(".")
        packed = PackedLinear(linear, keep_rows=keep_rows, row_buffer=row_buffers.get(name))
        setattr(model.get_submodule(parent_name), child_name, packed)
    logger.info("packed %d linear layers for oneDNN", len(targets))
    return model


def _row_buffers(targets: list[tuple[str, nn.Linear]]) -> dict[str, torch.Tensor]:
    """One huge-page buffer for the row-major copies of all `targets`' weights, sliced per layer
    by name (empty where their dtypes differ: each layer then gets a buffer of its own)."""
    weights = {name: linear.weight for name, linear in targets}
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) != 1:
        return {}
    sizes = [w.numel() for w in weights.values()]
    arena = huge_page_empty(sum(sizes), dtypes.pop())
    return dict(zip(weights, arena.split(sizes), strict=True))
