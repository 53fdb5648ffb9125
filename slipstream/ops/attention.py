"""Attention backends behind one call.

`dense_causal_attention` is what training and the reference forward use: every query attends to
the keys at or before its own position in the same sequence (optionally within a sliding window).
The serving engine's paged attention lives beside it and is reached through the attention
metadata object the engine passes to the model.

Layout legend: B batch, T tokens, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_causal_attention(
    q: torch.Tensor,  # (B, T, H, D)
    k: torch.Tensor,  # (B, T, K, D)
    v: torch.Tensor,  # (B, T, K, D)
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:  # (B, T, H, D)
    """Causal self-attention over whole sequences with SDPA; grouped-query heads are expanded."""
    num_tokens, num_heads, num_kv_heads = q.shape[1], q.shape[2], k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, heads, T, D)
    if num_kv_heads != num_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    if sliding_window is None or num_tokens <= sliding_window:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = causal_mask(num_tokens, num_tokens, sliding_window=sliding_window, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


def causal_mask(
    num_queries: int,
    num_keys: int,
    *,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # (num_queries, num_keys) bool, True = may attend
    """Queries are the last `num_queries` of `num_keys` positions; each sees keys at or before it,
    and with a sliding window only the `sliding_window` most recent of those (itself included)."""
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key_pos = torch.arange(num_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask
