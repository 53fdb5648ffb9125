"""Paged attention: keys and values live in fixed-size blocks addressed through block tables.

A batch is a flat run of tokens from several sequences. Sequence i contributes `query_lens[i]`
new tokens at the end of its `seq_lens[i]` tokens; its keys and values (new and earlier ones)
are in the blocks of its block table, token t at slot
`block_table[t // block_size] * block_size + t % block_size` of the cache.

`write_kv` stores the new tokens' keys and values. `paged_attention` attends every new token to
its sequence's keys up to its own position (causal, optionally within a sliding window), its
scores times a scale (head_dim**-0.5 unless told, Gemma 2's is its own) and optionally soft-capped
(Gemma 2: cap * tanh(score / cap) before the softmax), and optionally with attention sinks
(gpt-oss: a logit per query head in each softmax's denominator, `attention.softmax_with_sinks`,
which the C kernels add when they normalise). A prefill chunk may name spans of positions whose
tokens attend to each other both ways (`PrefillChunk.bidirectional`: Gemma 3's images); such a
chunk goes through the PyTorch path, whose masks `causal_mask` builds, as the C prefill kernel's
are causal only (the step's other chunks keep the kernel). The window, scale, cap and
sinks are the calling layer's own (Gemma 2 windows only some layers), so they are arguments of
each call, not part of the step's `PagedBatch`, which every layer shares. One batched
computation for all single-token (decode) sequences, and for the multi-token (prefill) chunks
either one call of the C kernel (`cpu_kernels.paged_prefill_attention_`, reading the cache in place)
or one SDPA call per chunk over its gathered keys (two matmuls and an fp32 softmax where SDPA
cannot, over pieces of the chunk's queries so that their scores stay under `_SCORE_PIECE_BYTES`).
The tests check both against dense attention over unpaged keys.

The cache may hold keys and values in a narrower dtype than the model's (`kv_cache_dtype`, vLLM's
values): "fp8" (= "fp8_e4m3"), "fp8_e5m2" or "bfloat16". `write_kv` then saturates each value to the
format's finite range and casts (per-tensor scale 1.0, vLLM's default without calibrated scales), and
the C kernels (`write_kv`, the decode and prefill attention; `cpu_kernels.FP8_CACHE_CODES`) store
and read fp8 as the PyTorch paths do (the same rounding, each value widened exactly), and the
PyTorch paths widen what they gather back to the queries' dtype; a bf16 cache under fp32 queries
runs the PyTorch paths.

Layout legend: N new tokens in the batch, H query heads, K kv heads, D head dim, P blocks,
S block size, B decoding sequences, L keys.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from slipstream.ops import cpu_kernels
from slipstream.ops.attention import causal_mask, softmax_with_sinks_
from slipstream.ops.kv_cache_dtypes import KV_CACHE_DTYPE_NAMES
from slipstream.ops.linear import onednn_multiplies

KV_CACHE_DTYPES = {name: getattr(torch, dtype) for name, dtype in KV_CACHE_DTYPE_NAMES.items()}
"""vLLM's kv_cache_dtype values besides "auto" (the model's dtype), and the cache dtype of each."""


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype `name` (vLLM's kv_cache_dtype) means for a model served in `model_dtype`."""
    if name == "auto":
        return model_dtype
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported: 'auto' or one of "
                         f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
    return KV_CACHE_DTYPES[name]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache's `dtype`: an 8-bit float saturates at its largest finite value first, as
    vLLM's conversion does (e4m3fn has no infinity and e5m2 would round to one)."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int  # new tokens
    seq_len: int  # all tokens of the sequence, the new ones included
    bidirectional: tuple[tuple[int, int], ...] = ()
    """Spans of positions [start, stop) whose tokens attend to each other both ways (Gemma 3's
    images), each within the chunk's keys (stop <= seq_len): `causal_mask`'s."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedBatch:
    """Per-step layout of a flat batch over the paged cache, built once and used by every layer."""

    slot_mapping: torch.Tensor  # (N,) int64: cache slot of each new token
    block_size: int
    prefills: list[PrefillChunk]
    prefill_rows: torch.Tensor  # (C,) int64: first flat-batch row of each prefill chunk
    prefill_query_lens: torch.Tensor  # (C,) int64
    prefill_seq_lens: torch.Tensor  # (C,) int64
    prefill_block_tables: torch.Tensor  # (C, max_blocks) int64, padded with block 0
    decode_token_rows: torch.Tensor  # (B,) int64: flat-batch row of each decode token
    decode_block_tables: torch.Tensor  # (B, max_blocks) int64, padded with block 0
    decode_seq_lens: torch.Tensor  # (B,) int64
    decode_max_len: int

    @classmethod
    def build(
        cls,
        *,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        bidirectional: Sequence[tuple[tuple[int, int], ...]] | None = None,
        device: torch.device | str = "cpu",
    ) -> PagedBatch:
        """Layout for sequences given in batch order (their new tokens are consecutive)."""
        return cls.build_groups(seq_lens=seq_lens, query_lens=query_lens, group_tables=[block_tables],
                                block_size=block_size, bidirectional=bidirectional, device=device)[0]

    @classmethod
    def build_groups(
        cls,
        *,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        group_tables: Sequence[Sequence[Sequence[int]]],
        block_size: int,
        bidirectional: Sequence[tuple[tuple[int, int], ...]] | None = None,
        device: torch.device | str = "cpu",
    ) -> tuple[PagedBatch, ...]:
        """One layout per KV cache group, `group_tables[g][i]` being sequence i's block table in
        group g; `bidirectional[i]`, where given, sequence i's spans of positions that attend both
        ways (`PrefillChunk.bidirectional`; a single-token chunk, laid out as a decode, attends
        causally, which is the same for the last token of a span, the only one of a span that
        such a chunk can hold when spans are computed whole).

        Only the slot mapping and the block tables differ from group to group: the rest is built
        once and its tensors shared (a model of six groups paid six times a layout's cost every
        step, and ran slower than without the hybrid manager where the KV budget did not bind); a
        group's slots are runs of a block's consecutive slots, not a Python step per token, and
        every tensor comes from a flat list through an array (`_int64_tensor`)."""
        num_blocks = [-(-seq_len // block_size) for seq_len in seq_lens]
        prefills, decode_rows, decode_lens = [], [], []
        token_start = decode_width = prefill_width = 0  # the widest decode and prefill tables
        spans = bidirectional or [()] * len(seq_lens)
        for seq_len, query_len, n, both_ways in zip(seq_lens, query_lens, num_blocks, spans, strict=True):
            if query_len == 1:
                decode_rows.append(token_start)
                decode_lens.append(seq_len)
                decode_width = max(decode_width, n)
            else:
                prefills.append(PrefillChunk(token_start=token_start, num_tokens=query_len, seq_len=seq_len,
                                             bidirectional=both_ways))
                prefill_width = max(prefill_width, n)
            token_start += query_len

        def int64(values: list) -> torch.Tensor:
            return _int64_tensor(values).to(device)

        shared = dict(
            block_size=block_size,
            prefills=prefills,
            prefill_rows=int64([c.token_start for c in prefills]),
            prefill_query_lens=int64([c.num_tokens for c in prefills]),
            prefill_seq_lens=int64([c.seq_len for c in prefills]),
            decode_token_rows=int64(decode_rows),
            decode_seq_lens=int64(decode_lens),
            decode_max_len=max(decode_lens, default=0),
        )
        zeros = [0] * max(decode_width, prefill_width)
        batches = []
        for tables in group_tables:
            # Each token's slot, and the decode and prefill tables padded with block 0, row after row.
            slots: list[int] = []
            decode_flat: list[int] = []
            prefill_flat: list[int] = []
            for table, seq_len, query_len, n in zip(tables, seq_lens, query_lens, num_blocks, strict=True):
                row = table[:n]
                if len(row) < n:
                    raise ValueError(f"a block table of {len(table)} blocks for a sequence of {n} blocks")
                if query_len == 1:
                    slots.append(row[-1] * block_size + (seq_len - 1) % block_size)
                    decode_flat += row
                    decode_flat += zeros[n:decode_width]
                    continue
                position = seq_len - query_len
                while position < seq_len:  # a run of consecutive slots per block
                    block, offset = divmod(position, block_size)
                    first = row[block] * block_size + offset
                    run = min(seq_len - position, block_size - offset)
                    slots += range(first, first + run)
                    position += run
                prefill_flat += row
                prefill_flat += zeros[n:prefill_width]
            batches.append(cls(
                slot_mapping=int64(slots),
                prefill_block_tables=int64(prefill_flat).view(len(prefills), prefill_width),
                decode_block_tables=int64(decode_flat).view(len(decode_lens), decode_width),
                **shared,
            ))
        return tuple(batches)


def _int64_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values`: through an array, a third of `torch.tensor`'s time on the
    thousands of block ids a step's tables hold."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def write_kv(
    k_cache: torch.Tensor,  # (P, S, K, D)
    v_cache: torch.Tensor,  # (P, S, K, D)
    k: torch.Tensor,  # (N, K, D)
    v: torch.Tensor,  # (N, K, D)
    slot_mapping: torch.Tensor,  # (N,)
    *,
    use_kernel: bool = True,
) -> None:
    """Store the new tokens' keys and values at their slots, in the cache's dtype."""
    writable = k_cache.dtype == k.dtype or k_cache.dtype in cpu_kernels.FP8_CACHE_CODES
    if use_kernel and writable and cpu_kernels.supports(k):
        cpu_kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    for cache, new in ((k_cache, k), (v_cache, v)):
        new = to_cache_dtype(new, cache.dtype)
        if cache.dtype.itemsize == 1:  # index_copy_ has no 8-bit float kernels: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, new)


def paged_attention(
    q: torch.Tensor,  # (N, H, D)
    k_cache: torch.Tensor,  # (P, S, K, D)
    v_cache: torch.Tensor,  # (P, S, K, D)
    batch: PagedBatch,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
    use_kernel: bool = True,
) -> torch.Tensor:  # (N, H, D)
    """Attention of each new token over its sequence's cached keys (see the module docstring):
    scores times `scale` (None: head_dim**-0.5), then `softcap * tanh(score / softcap)` where
    `softcap` is given, each token seeing at most its `sliding_window` most recent keys, each
    head's `sinks` logit joining its softmax where given.

    Decodes and prefills go through the C kernels of `cpu_kernels` where they apply (a cache of the
    queries' dtype or fp8) and `use_kernel` is set, else through the PyTorch versions below.
    """
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 or None, got {sliding_window}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q.shape[1]},), got "
                         f"{tuple(sinks.shape)}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not batch.prefills:  # a pure decode step: every row is a decode, in order
        return _decode(q, k_cache, v_cache, batch, scale, softcap, sliding_window, use_kernel, sinks)
    out = torch.empty_like(q)
    readable = k_cache.dtype == q.dtype or k_cache.dtype in cpu_kernels.FP8_CACHE_CODES
    kernel = use_kernel and readable and cpu_kernels.supports_prefill_attention(q)
    # The C kernel's masks are causal: it takes the causal chunks, PyTorch the rest.
    by_pytorch = [i for i, chunk in enumerate(batch.prefills) if chunk.bidirectional or not kernel]
    if kernel and len(by_pytorch) < len(batch.prefills):
        causal = slice(None) if not by_pytorch else torch.tensor(
            [i for i, chunk in enumerate(batch.prefills) if not chunk.bidirectional], device=q.device)
        cpu_kernels.paged_prefill_attention_(
            out, q, k_cache, v_cache, batch.prefill_rows[causal], batch.prefill_query_lens[causal],
            batch.prefill_seq_lens[causal], batch.prefill_block_tables[causal], sliding_window, scale=scale,
            softcap=softcap, sinks=sinks,
        )
    for i in by_pytorch:
        chunk = batch.prefills[i]
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        table = batch.prefill_block_tables[i, : -(-chunk.seq_len // batch.block_size)]
        keys = _gather(k_cache, table, chunk.seq_len, q.dtype)  # (L, K, D)
        values = _gather(v_cache, table, chunk.seq_len, q.dtype)
        out[rows] = _attend(q[rows], keys, values, sliding_window, scale=scale, softcap=softcap,
                            sinks=sinks, bidirectional=chunk.bidirectional)
    if len(batch.decode_token_rows):
        rows = batch.decode_token_rows
        out[rows] = _decode(q[rows], k_cache, v_cache, batch, scale, softcap, sliding_window, use_kernel,
                            sinks)
    return out


def _decode(
    q: torch.Tensor,  # (B, H, D): the decode rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    use_kernel: bool,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # (B, H, D)
    readable = k_cache.dtype == q.dtype or k_cache.dtype in cpu_kernels.FP8_CACHE_CODES
    if use_kernel and readable and cpu_kernels.supports(q):
        return cpu_kernels.paged_decode_attention(
            q, k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, sliding_window,
            scale=scale, softcap=softcap, sinks=sinks,
        )
    return _batched_decode(q, k_cache, v_cache, batch, scale=scale, softcap=softcap,
                           sliding_window=sliding_window, sinks=sinks)


def _batched_decode(
    q: torch.Tensor,  # (B, H, D): one query per decoding sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (B, H, D)
    """All decode queries at once: gather their blocks, mask positions past each length."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = batch.decode_max_len
    keys = k_cache[batch.decode_block_tables].flatten(1, 2)[:, :max_len].to(q.dtype)  # (B, L, K, D)
    values = v_cache[batch.decode_block_tables].flatten(1, 2)[:, :max_len].to(q.dtype)
    positions = torch.arange(max_len, device=q.device)
    valid = positions[None, :] < batch.decode_seq_lens[:, None]  # (B, L)
    if sliding_window is not None:
        valid &= positions[None, :] >= batch.decode_seq_lens[:, None] - sliding_window
    # Slots past a sequence's end were never written (the cache is not zeroed) and may hold any
    # bits; a zero weight times a NaN there would still be NaN, so clear them in the copy.
    values.masked_fill_(~valid[:, :, None, None], 0.0)
    group = num_heads // num_kv_heads
    q = q.view(num_seqs, num_kv_heads, group, head_dim)  # (B, K, G, D)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.einsum("bkgd,blkd->bkgl", q, keys) * scale  # (B, K, G, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores.float() / softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    else:
        probs = softmax_with_sinks_(scores, sinks.view(num_kv_heads, group, 1)).to(q.dtype)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)  # (B, K, G, D)
    return out.reshape(num_seqs, num_heads, head_dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(seq_len, K, D): one sequence's keys or values in position order, in `dtype`."""
    return cache[block_table].flatten(0, 1)[:seq_len].to(dtype)


# In bf16, SDPA's fused CPU kernel is slower than two bf16 matmuls and an fp32 softmax for short
# sequences where oneDNN multiplies bf16 (measured on the AMD development machine: 0.85 vs 1.49 ms
# at 256 keys x 12 heads, a tie near 512); in fp32 the fused kernel wins at every length. Where
# oneDNN cannot multiply bf16 (AVX2 CPUs), a bf16 matmul falls back to PyTorch's reference GEMM and
# the fused kernel wins at every length too (Zen 3: 2.8 against 71-84 ms at 256 keys x 12 heads).
_BF16_MATMUL_ATTENTION_MAX_KEYS = 384


_SCORE_PIECE_BYTES = 64 << 20
"""The most fp32 scores `_matmul_attention` holds at once: a chunk's queries go in pieces of rows
under it (a 512-token chunk over 8k keys on 16 heads is 256 MiB of scores; whole, with the scaled
and the softmax copies beside it, it held three times that)."""


def _matmul_attention(
    q: torch.Tensor,  # (1, H, T, D)
    keys: torch.Tensor,  # (1, H, L, D)
    values: torch.Tensor,  # (1, H, L, D)
    mask: torch.Tensor,  # (T, L) bool, True = may attend
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (1, H, T, D)
    """Two matmuls and an fp32 softmax, over pieces of the query rows whose scores each fit in
    `_SCORE_PIECE_BYTES`, each pass on the scores in place."""
    num_heads, num_queries, num_keys = q.shape[1], q.shape[2], keys.shape[2]
    rows = max(1, _SCORE_PIECE_BYTES // (4 * num_heads * num_keys))
    out = q.new_empty(*q.shape[:-1], values.shape[-1])
    for start in range(0, num_queries, rows):
        piece = slice(start, start + rows)
        scores = torch.matmul(q[:, :, piece], keys.transpose(-1, -2)).float().mul_(scale)  # (1, H, t, L)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        scores.masked_fill_(~mask[piece], float("-inf"))
        probs = (torch.softmax(scores, dim=-1) if sinks is None
                 else softmax_with_sinks_(scores, sinks[:, None, None]))
        out[:, :, piece] = torch.matmul(probs.to(q.dtype), values)
    return out


def _attend(
    q: torch.Tensor,  # (T, H, D): the last T of the sequence's L positions
    keys: torch.Tensor,  # (L, K, D)
    values: torch.Tensor,  # (L, K, D)
    sliding_window: int | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
    bidirectional: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:  # (T, H, D)
    """Causal attention of a chunk's queries over its sequence's keys (both ways within the spans
    of `bidirectional`): SDPA's fused kernel, or two matmuls and an fp32 softmax where that is
    faster (short bf16 sequences) or where the scores are soft-capped or meet sinks, which SDPA
    cannot do."""
    num_queries, num_heads = q.shape[0], q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    num_keys, num_kv_heads = keys.shape[0], keys.shape[1]
    # 4-D (1, heads, len, D): SDPA's fused CPU kernels take only 4-D inputs (3-D falls back to
    # the unfused math path, about 40x slower here).
    q, keys, values = (x.transpose(0, 1)[None] for x in (q, keys, values))
    if num_kv_heads != num_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
    causal_only = (num_queries == num_keys and (sliding_window is None or num_keys <= sliding_window)
                   and not bidirectional)
    cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    explicit = softcap is not None or sinks is not None
    short_or_explicit = num_keys <= _BF16_MATMUL_ATTENTION_MAX_KEYS or explicit
    if cpu_bf16 and short_or_explicit and onednn_multiplies(torch.bfloat16):
        mask = causal_mask(num_queries, num_keys, sliding_window=sliding_window, bidirectional=bidirectional,
                           device=q.device)
        out = _matmul_attention(q, keys, values, mask, scale, softcap, sinks)
    elif explicit:  # in fp32 where a bf16 matmul would take PyTorch's reference GEMM
        mask = causal_mask(num_queries, num_keys, sliding_window=sliding_window, bidirectional=bidirectional,
                           device=q.device)
        wide = (x.float() for x in (q, keys, values)) if cpu_bf16 else (q, keys, values)
        out = _matmul_attention(*wide, mask, scale, softcap, sinks).to(q.dtype)
    elif causal_only:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
    else:
        mask = causal_mask(num_queries, num_keys, sliding_window=sliding_window, bidirectional=bidirectional,
                           device=q.device)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)
