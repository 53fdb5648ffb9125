"""Context parallelism: the ranks of a context-parallel (CP) group each hold a slice of every
sequence's tokens, so activations per rank shrink with the degree.

The design is Llama 3's (Dubey et al. 2024, section 3.3.2), not a ring: every rank of the group
reads the same batch, keeps its tokens of each sequence, and runs the whole model on them. Norms,
MLPs, projections and the loss are per token and need nothing from the other ranks; attention
does: each layer all-gathers K and V over the group (an autograd-aware gather whose backward
reduce-scatters, summing, the K/V gradients back to the ranks that hold those tokens) and attends
its own queries to the keys before them, the causal mask comparing global positions. RoPE takes
each token's global position. With grouped-query attention K and V are a fraction of the activations,
so the gather is cheap, and on gloo, with no overlap to win, one collective per layer is simpler
than a ring's C - 1 exchanges and their online-softmax merge.

The sequence is cut into 2 x C chunks and rank r keeps chunks r and 2C - 1 - r (the load balance
of PyTorch's `context_parallel` and of Llama 3): under a causal mask the late chunks attend to
more keys, so each rank gets one early and one late chunk and the same attention work.

The model needs no change: the trainer passes `ContextParallel.shard`'s attention as the model's
`attn` argument (the same hook the serving engine uses for paged attention). Phi-3's longrope
picks its frequencies by a forward's largest position, which differs between the ranks' slices;
`fix_rope_choice` fixes every rank's choice to the whole sequence's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from slipstream.model.transformer import RopeTables
from slipstream.ops.attention import masked_attention, sdpa_dtype


def chunk_bounds(seq_len: int, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """The two chunks [start, stop) of a sequence of `seq_len` positions that rank `cp_rank` of
    `cp_size` holds: chunks cp_rank and 2C - 1 - cp_rank of 2C equal chunks, in that order."""
    assert seq_len % (2 * cp_size) == 0 and 0 <= cp_rank < cp_size, "checked by the config"
    chunk = seq_len // (2 * cp_size)
    return [(i * chunk, (i + 1) * chunk) for i in (cp_rank, 2 * cp_size - 1 - cp_rank)]


def chunk_positions(seq_len: int, cp_rank: int, cp_size: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """The global positions (T / C,) rank `cp_rank` of `cp_size` holds (`chunk_bounds`)."""
    return torch.cat([torch.arange(start, stop, device=device)
                      for start, stop in chunk_bounds(seq_len, cp_rank, cp_size)])


def gather_positions(seq_len: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (T,) of the keys `gather_sequence` returns: every rank's
    `chunk_positions`, in rank order."""
    return torch.cat([chunk_positions(seq_len, r, cp_size, device) for r in range(cp_size)])


def fix_rope_choice(model: torch.nn.Module, seq_len: int) -> None:
    """Fix each RoPE table's choice of frequencies (longrope's short or long factors; nothing for
    other RoPE) to the one a forward over positions 0 .. seq_len - 1 makes, the whole sequence's,
    rather than each rank's by the largest position of its own chunks."""
    for module in model.modules():
        if isinstance(module, RopeTables):
            module.fix_context(seq_len)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 1) in the forward; in the backward each rank receives
    the sum over the group of the gradients of its own slice (a reduce-scatter): every rank's
    loss depends on every rank's keys."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # (B, t, ..) -> (B, C t, ..)
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # (B, C*t, ...) -> (B, t, ...)
        parts = [part.contiguous() for part in grad.chunk(dist.get_world_size(ctx.group), dim=1)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `x` (B, t, ...) concatenated along dim 1 in rank order, differentiably."""
    return _GatherSequence.apply(x, group)


def causal_mask_between(query_positions: torch.Tensor, key_positions: torch.Tensor, *,
                        sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (Tq, Tk), 0 where a query may attend a key, -inf elsewhere: keys at or
    before the query's position, and with a sliding window only the `sliding_window` most recent
    of those (itself included), as `ops.attention.causal_mask` has it for a whole sequence."""
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)


class GatheredKVAttention:
    """The model's `attn` under context parallelism: each layer gathers K and V over the group
    and attends this rank's queries to them (`attend`)."""

    def __init__(self, group: dist.ProcessGroup | None, seq_len: int, cp_rank: int, cp_size: int,
                 device: torch.device | None = None):
        self.group = group
        self.query_chunks = chunk_bounds(seq_len, cp_rank, cp_size)
        """This rank's two chunks of global positions [start, stop), in the order its tokens hold them."""
        self.key_order = torch.argsort(gather_positions(seq_len, cp_size, device))
        """The gathered keys' indices in position order."""
        self._masks: dict[tuple[int, int | None, torch.dtype], torch.Tensor] = {}

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
        softcap: float | None, sliding_window: int | None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, t, H, D)
        k, v = gather_sequence(k, self.group), gather_sequence(v, self.group)  # (B, T, K, D) each
        return self.attend(q, k, v, scale=scale, softcap=softcap, sliding_window=sliding_window, sinks=sinks)

    def attend(
        self,
        q: torch.Tensor,  # (B, t, H, D): this rank's queries
        k: torch.Tensor,  # (B, T, K, D): every rank's keys, in rank order (as gathered)
        v: torch.Tensor,  # (B, T, K, D)
        *,
        scale: float | None,
        softcap: float | None,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, t, H, D)
        """Each of this rank's query chunks attends only to the keys it can see: the keys put in
        position order, a chunk at [start, stop) takes those before stop (and, with a sliding
        window, from start - window + 1), so masked work is the chunk's diagonal block, not every
        key: 5 x S^2 pairs per rank at C = 2 instead of 8 (S the chunk length). Each mask is made
        once and shared by every layer and forward, so the backward keeps one copy, not one per
        layer."""
        k, v = k[:, self.key_order], v[:, self.key_order]  # (B, T, K, D) in position order
        outs = []
        for i, (start, stop) in enumerate(self.query_chunks):
            first = 0 if sliding_window is None else max(0, start - sliding_window + 1)
            mask = self._mask(i, first, sliding_window, sdpa_dtype(q))  # (S, stop - first)
            chunk_q = q[:, i * (stop - start):(i + 1) * (stop - start)]  # (B, S, H, D)
            outs.append(masked_attention(chunk_q, k[:, first:stop], v[:, first:stop], mask, scale=scale,
                                         softcap=softcap, sinks=sinks))
        return torch.cat(outs, dim=1)

    def _mask(self, i: int, first: int, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        key = (i, sliding_window, dtype)
        if key not in self._masks:
            start, stop = self.query_chunks[i]
            device = self.key_order.device
            self._masks[key] = causal_mask_between(torch.arange(start, stop, device=device),
                                                   torch.arange(first, stop, device=device),
                                                   sliding_window=sliding_window, dtype=dtype)
        return self._masks[key]


class ContextParallel:
    """One rank's place in its context-parallel group: which tokens of each sequence it keeps,
    and the attention its forwards run with (one for the run: its masks are made once)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp_size: int, seq_len: int,
                 device: torch.device):
        self.positions = chunk_positions(seq_len, cp_rank, cp_size, device)  # (T / C,)
        self.attention = GatheredKVAttention(group, seq_len, cp_rank, cp_size, device)

    def shard(
        self, inputs: torch.Tensor, targets: torch.Tensor  # (B, T) each
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, GatheredKVAttention]:
        """This rank's inputs, targets and positions (B, T / C) of a whole batch, and the attention
        the model runs with."""
        positions = self.positions.expand(inputs.shape[0], -1)  # (B, T / C)
        return inputs[:, self.positions], targets[:, self.positions], positions, self.attention
