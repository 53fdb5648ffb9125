"""Decode steps replayed from CUDA graphs: the GPU counterpart of `ops.decode_graph`.

A decode step of a small batch launches a few hundred short kernels; issued one by one from
Python, the launches take longer than the kernels. As vLLM does, the runner instead captures the
step once per shape in a CUDA graph (`torch.cuda.CUDAGraph`) and replays it: a replay launches
the whole step at once.

A graph bakes in every tensor address and shape, so a step runs on static input buffers sized for
the largest batch, and graphs are captured per bucket: the batch padded up to the next of
`batch_buckets(max_seqs)` and the block tables to the next power of two of their width (the
PyTorch decode attention gathers `width * block_size` keys per sequence, so one width for every
step would read the longest context each time). Graphs are captured when a bucket is first met
and share one memory pool. Padding rows decode token 0 at position 0 with one key, in the
runner's spare block (`pad_block`, never given to a request), so they write only there and
their attention stays finite.

A step is captured only where it can be (`can_capture`): a mixture-of-experts block reads how
many tokens each expert got back to the host to run the experts one after another, a
synchronisation that capture refuses, so models with such layers decode eagerly, as with
`enforce_eager`.

`capture=False` keeps the static buffers and the padding but runs each step eagerly: the tests
use it to check the bucketing on a CPU against the unpadded step (equal bit for bit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from slipstream.model.transformer import Transformer
from slipstream.ops.paged_attention import PagedBatch

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]
"""(token_ids (B,), positions (B,), a pure decode batch of those B sequences) -> hidden (B, E)."""


def can_capture(model: Transformer) -> bool:
    """Whether `model`'s decode step can be captured in a CUDA graph: not where it has
    mixture-of-experts layers, whose token counts per expert go to the host (`SparseMoeBlock`)."""
    num_moe_layers = len(model.config.moe_layers)
    if num_moe_layers:
        logger.info("no CUDA graphs for this model: its %d mixture-of-experts layers read their token "
                    "counts per expert on the host, which capture refuses; decode steps run eagerly",
                    num_moe_layers)
    return num_moe_layers == 0


def batch_buckets(max_seqs: int) -> list[int]:
    """Batch sizes graphs are captured at, up to `max_seqs`: 1, 2, 4, 8, then multiples of 16
    (vLLM's steps are 8)."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be at least 1, got {max_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_seqs] + list(range(16, max_seqs, 16))
    return [*sizes, max_seqs]


def width_bucket(width: int, max_width: int) -> int:
    """The block-table width a step of `width` runs at: the next power of two, at most
    `max_width`."""
    if not 0 < width <= max_width:
        raise ValueError(f"block-table width must be in [1, {max_width}], got {width}")
    return min(1 << (width - 1).bit_length(), max_width)


class CudaDecodeGraphs:
    """Runs pure decode steps of 1 to `max_seqs` sequences from captured graphs."""

    def __init__(
        self, forward: Forward, *, max_seqs: int, max_blocks: int, block_size: int, pad_block: int,
        device: torch.device, capture: bool = True,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_block = pad_block
        self.capture = capture
        self._forward = forward
        self._batch_sizes = batch_buckets(max_seqs)
        self._buckets: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        """(batch, width) -> runs the step on the static buffers, returns (batch, E) hidden states."""
        self._pool = None
        int64 = {"dtype": torch.int64, "device": device}
        self._token_ids = torch.zeros(max_seqs, **int64)
        self._positions = torch.zeros(max_seqs, **int64)
        self._slots = torch.zeros(max_seqs, **int64)
        self._seq_lens = torch.zeros(max_seqs, **int64)
        self._block_tables = torch.zeros(max_seqs, max_blocks, **int64)
        self._rows = torch.arange(max_seqs, **int64)
        self._empty = torch.zeros(0, **int64)
        self._reset_padding(0, max_seqs, max_blocks)

    @property
    def num_captured(self) -> int:
        return len(self._buckets)

    def __call__(
        self,
        token_ids: torch.Tensor,  # (B,) int64: each sequence's new token
        positions: torch.Tensor,  # (B,) int64
        batch: PagedBatch,  # a pure decode batch of those B sequences, in order
    ) -> torch.Tensor:  # (B, E): valid until the next call
        num_seqs, width = batch.decode_block_tables.shape
        if batch.prefills or not 0 < num_seqs <= self.max_seqs or token_ids.shape != (num_seqs,):
            raise ValueError(f"decode graphs take 1 to {self.max_seqs} decoding sequences and no prefill; "
                             f"got {tuple(token_ids.shape)} tokens for {num_seqs} decoding sequences and "
                             f"{len(batch.prefills)} prefill chunks")
        size = next(s for s in self._batch_sizes if s >= num_seqs)
        run = self._bucket(size, width_bucket(width, self.max_blocks))
        self._reset_padding(num_seqs, size, self.max_blocks)
        self._token_ids[:num_seqs].copy_(token_ids)
        self._positions[:num_seqs].copy_(positions)
        self._slots[:num_seqs].copy_(batch.slot_mapping)
        self._seq_lens[:num_seqs].copy_(batch.decode_seq_lens)
        self._block_tables[:num_seqs, :width].copy_(batch.decode_block_tables)
        self._block_tables[:num_seqs, width:].fill_(self.pad_block)
        return run()[:num_seqs]

    def _reset_padding(self, start: int, end: int, width: int) -> None:
        """Rows [start, end) become padding: token 0 at position 0, one key, in the spare block."""
        self._token_ids[start:end] = 0
        self._positions[start:end] = 0
        self._slots[start:end] = self.pad_block * self.block_size
        self._seq_lens[start:end] = 1
        self._block_tables[start:end, :width] = self.pad_block

    def _static_batch(self, size: int, width: int) -> PagedBatch:
        return PagedBatch(
            slot_mapping=self._slots[:size], block_size=self.block_size, prefills=[],
            prefill_rows=self._empty, prefill_query_lens=self._empty, prefill_seq_lens=self._empty,
            prefill_block_tables=self._empty.view(0, 0), decode_token_rows=self._rows[:size],
            decode_block_tables=self._block_tables[:size, :width], decode_seq_lens=self._seq_lens[:size],
            decode_max_len=width * self.block_size,
        )

    def _bucket(self, size: int, width: int) -> Callable[[], torch.Tensor]:
        run = self._buckets.get((size, width))
        if run is not None:
            return run
        batch = self._static_batch(size, width)

        def step() -> torch.Tensor:
            return self._forward(self._token_ids[:size], self._positions[:size], batch)

        run = self._capture(size, step) if self.capture else step
        self._buckets[(size, width)] = run
        return run

    def _capture(self, size: int, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """`step` captured in a CUDA graph, on padding rows only (their keys go to the spare block);
        returns its replay. Warm-up runs first, on a side stream as PyTorch's docs ask: lazy
        initialisation (cuBLAS workspaces, the allocator's first blocks) must not happen during
        capture."""
        self._reset_padding(0, size, self.max_blocks)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = step()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
