"""Fast inference linear layers, applied to a finished model as a function.

On x86 CPUs PyTorch's default fp32 GEMM path runs at less than half the speed oneDNN reaches on
the same shapes (on the AMD EPYC development machine: ~210 vs ~490 GFLOP/s for fp32, and a batch-1
GEMV streams its weights at 18 vs 36 GB/s). `pack_linears(model)` replaces every `nn.Linear` with a
`PackedLinear` that keeps its weight pre-packed in oneDNN's blocked layout and calls oneDNN's
linear directly, as vLLM's CPU backend does. Where memory allows it keeps faster copies for the
sizes oneDNN handles less well: row-major weights for the C matrix-vector kernel (batch-1 decode)
and panel-packed weights for the C panel kernel (decode batches, whose weights stream from
memory every step, and in fp32 every size; see cpu_ops.c and benchmarks/linear_kernels.py).
The math is unchanged (y = x W^T + b, up to summation order); `nn.Linear` stays the tested
fallback wherever oneDNN is not available. oneDNN multiplies bf16 only on CPUs with AVX-512 or
AVX-NE-CONVERT (`onednn_multiplies`); on others (AVX2 CPUs such as a Zen 3) a bf16 layer keeps its
panel-packed copy as its only one, or, without the C kernels, PyTorch's own product.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from slipstream.ops import cpu_kernels
from slipstream.ops.allocator import huge_page_empty

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


# Up to this many rows the panel kernel beats oneDNN here (fp32 and bf16: 1.1-1.4x from 8 to 128
# rows, about even at 256; benchmarks/linear_kernels.py). Beyond, bf16 goes to oneDNN where the CPU
# multiplies bf16 natively (0.96-0.99x from 512 to 2048 rows on the AMD EPYC); fp32 stays on the
# panel kernel, even with oneDNN from 256 to 1024 rows and ahead at prefill chunks of 2048 (rows in
# bands, cpu_ops.c), and so does bf16 where both multiply in fp32 (an Ice Lake Xeon, without
# AVX512-BF16: 3.6-3.7x oneDNN from 512 to 2048 rows). With AVX2, oneDNN takes fp32 beyond and the
# panel kernel every bf16 size, which oneDNN does not multiply there
# (`cpu_kernels.panel_gemm_takes_all_rows`). With AMX (Intel Xeons from Sapphire Rapids on) bf16
# runs on the tiles, 1.2-1.4x oneDNN from 1 to 128 rows, 0.8-1.0x at 256 and 512, 0.68x at 2,048.
MAX_PANEL_ROWS = 256

# oneDNN builds (JIT-compiles) a primitive for each input shape it has not met, ~10 ms for a bf16
# product of 1,200-1,300 rows on the Xeon of family 6, model 167, against ~7 ms for the product
# itself, and PyTorch caches 1,024 of them. A mixture-of-experts layer's experts each get a number
# of rows that changes from step to step, so the fast path pads their inputs of this many rows or
# more to a multiple of it (`PackedLinear.pad_rows_to`): few shapes, each built once, for at most
# 31 rows of extra work.
ONEDNN_ROW_MULTIPLE = 32


class PackedLinear(nn.Module):
    """Inference-only linear layer over a oneDNN pre-packed weight (where oneDNN multiplies the
    dtype; else over the panel-packed copy, or the weight as it is for PyTorch's product). Where
    the panel copy takes every input its row-major copy does not (fp32 with AVX-512), no oneDNN
    copy is made: it would never be read.

    With `extra_copies`, up to two more copies of the weight are kept for small inputs (see
    `extra_copies_of`): a row-major one, on huge pages (`ops.allocator`), for inputs of fewer than
    `cpu_kernels.min_panel_rows` rows (batch-1 decode: the C matrix-vector kernel streams the
    weight faster than oneDNN does at that size, and faster than the panel kernel), and a
    panel-packed one for the C panel kernel (AVX-512 or AVX2): every other input up to
    `MAX_PANEL_ROWS` rows, or all where `cpu_kernels.panel_gemm_takes_all_rows` or where oneDNN
    does not multiply the dtype. Without the panel copy
    the matrix-vector kernel takes up to `cpu_kernels.MAX_GEMV_ROWS` rows.
    Both copies go on huge pages, since decode streams them whole at every step: `row_buffer`
    (out_features * in_features elements of the weight's dtype) and `panel_buffer`
    (`cpu_kernels.panel_numel` elements) are where to put them; `pack_linears` hands every layer
    slices of model-wide buffers, so that small weights do not each occupy a 2 MiB page.
    """

    def __init__(
        self, linear: nn.Linear, *, extra_copies: bool = False, row_buffer: torch.Tensor | None = None,
        panel_buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        onednn = onednn_multiplies(weight.dtype)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.row_weight = self.panel_weight = None
        rows = extra_copies and extra_copies_of(weight)[0]
        panels = keeps_panels(weight, extra_copies)
        # The rows from which the panel kernel takes over, and whether it takes every size beyond.
        self._min_panel_rows = cpu_kernels.min_panel_rows(weight.dtype) if panels else 0
        self._panels_for_all_rows = panels and (
            not onednn or cpu_kernels.panel_gemm_takes_all_rows(weight.dtype))
        # oneDNN's copy only where some inputs reach it (not fp32 with AVX-512 and the panel copy).
        self.packed_weight = (torch.ops.mkldnn._reorder_linear_weight(weight, None)
                              if onednn and not self._panels_for_all_rows else None)
        if rows:
            if row_buffer is None:
                row_buffer = huge_page_empty(weight.numel(), weight.dtype)
            self.row_weight = row_buffer.view(weight.shape).copy_(weight)
        if panels:
            if panel_buffer is None:
                panel_buffer = huge_page_empty(_panel_numel(weight), weight.dtype)
            self.panel_weight = cpu_kernels.pack_panels(weight, out=panel_buffer)
        # PyTorch's product where neither oneDNN nor the panel kernel takes every size.
        self.plain_weight = weight if not onednn and not self._panels_for_all_rows else None
        self.pad_rows_to = 1
        """Inputs that reach oneDNN with at least this many rows are padded to a multiple of it
        (ONEDNN_ROW_MULTIPLE for experts, whose row counts vary step by step); 1: never."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.numel() // self.in_features
        few_rows = rows < self._min_panel_rows or (
            self.panel_weight is None and rows <= cpu_kernels.MAX_GEMV_ROWS
        )
        if self.row_weight is not None and few_rows:
            return cpu_kernels.gemv(x, self.row_weight, self.bias)
        if self.panel_weight is not None and (rows <= MAX_PANEL_ROWS or self._panels_for_all_rows):
            return cpu_kernels.panel_gemm(x, self.panel_weight, self.bias, self.out_features)
        if self.packed_weight is None:
            return torch.nn.functional.linear(x, self.plain_weight, self.bias)
        return self._onednn(x, rows)

    def _onednn(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """oneDNN's product; from `pad_rows_to` rows, over rows padded with zeros to a multiple of
        it, whose outputs are dropped. A row's result may differ from the unpadded product's in its
        last bit: oneDNN may split the sums differently for another number of rows."""
        padding = -rows % self.pad_rows_to
        if padding == 0 or rows < self.pad_rows_to:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        flat = torch.nn.functional.pad(x.reshape(rows, self.in_features), (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        copies = {"oneDNN packed": self.packed_weight, "plain": self.plain_weight, "rows": self.row_weight,
                  "panels": self.panel_weight}
        held = ", ".join(name for name, weight in copies.items() if weight is not None)
        return f"in_features={self.in_features}, out_features={self.out_features}, {held}"


@functools.cache
def onednn_multiplies(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear takes weights of `dtype` here: fp32 wherever PyTorch has oneDNN, bf16
    only where the CPU has AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, PyTorch's own test (on an AVX2
    CPU, such as a Zen 3, oneDNN's bf16 weight packing raises)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def extra_copies_of(weight: torch.Tensor) -> tuple[bool, bool]:
    """Which extra copies a `PackedLinear` keeps of `weight` with `extra_copies`: (row-major,
    panel-packed). The row-major copy only where some inputs take the matrix-vector kernel: not
    in bf16 on a CPU without bf16 arithmetic, whose panel kernel takes every size."""
    panels = cpu_kernels.supports_panel_gemm(weight)
    rows = cpu_kernels.supports(weight) and not (panels and cpu_kernels.min_panel_rows(weight.dtype) == 1)
    return rows, panels


def keeps_panels(weight: torch.Tensor, extra_copies: bool) -> bool:
    """Whether a `PackedLinear` of `weight` keeps a panel-packed copy: as an extra copy, or as its
    only one where oneDNN does not multiply the dtype."""
    supported = cpu_kernels.supports_panel_gemm(weight)
    return supported and (extra_copies or not onednn_multiplies(weight.dtype))


def _panel_numel(weight: torch.Tensor) -> int:
    return cpu_kernels.panel_numel(weight.shape[0], weight.shape[1], weight.dtype)


def can_pack(model: nn.Module) -> bool:
    """Whether oneDNN packing applies: CPU weights in fp32 or bf16 and oneDNN built in."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
    )


@torch.no_grad()
def pack_linears(model: nn.Module, *, extra_copies: bool = False) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) with a `PackedLinear`; returns the model.

    The model is for inference afterwards: packed weights take no gradients. A tied lm_head gets
    its own packed copy; the embedding table stays as it is for the lookup. `extra_copies`: see
    `PackedLinear`.
    """
    if not can_pack(model):
        logger.info("oneDNN linear packing does not apply here; keeping nn.Linear")
        return model
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    row_buffers = _huge_page_buffers(
        [(name, m) for name, m in targets if extra_copies and extra_copies_of(m.weight)[0]],
        lambda weight: weight.numel())
    panel_buffers = _huge_page_buffers(
        [(name, m) for name, m in targets if keeps_panels(m.weight, extra_copies)], _panel_numel)
    names = [name for name, _ in targets]
    del targets
    for name in names:  # looked up one at a time: each original is freed once the next replaces it
        parent_name, _, child_name = name.rpartition(".")
        linear = model.get_submodule(name)
        packed = PackedLinear(linear, extra_copies=extra_copies, row_buffer=row_buffers.get(name),
                              panel_buffer=panel_buffers.get(name))
        setattr(model.get_submodule(parent_name), child_name, packed)
    logger.info("packed %d linear layers for oneDNN", len(names))
    return model


def _huge_page_buffers(
    targets: list[tuple[str, nn.Linear]], numel: Callable[[torch.Tensor], int]
) -> dict[str, torch.Tensor]:
    """One huge-page buffer for a copy of each of `targets`' weights (`numel(weight)` elements),
    sliced per layer by name (empty where their dtypes differ: each layer then gets a buffer of
    its own)."""
    weights = {name: linear.weight for name, linear in targets}
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) != 1:
        return {}
    sizes = [numel(w) for w in weights.values()]
    arena = huge_page_empty(sum(sizes), dtypes.pop())
    return dict(zip(weights, arena.split(sizes), strict=True))
