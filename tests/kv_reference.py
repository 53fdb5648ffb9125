"""References for a KV cache in another dtype than the model's: values rounded through the cache's
format by torch's own casts, and float64 attention over them."""

from __future__ import annotations

import torch


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` through `dtype` and back by torch's casts, saturated to its finite range first."""
    limit = torch.finfo(dtype).max
    return torch.clamp(x, -limit, limit).to(dtype).to(x.dtype)


def dense_attention(q, keys, values, window, sinks):
    """float64 causal attention of the last len(q) positions over all keys (GQA, window, sinks)."""
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / head_dim**0.5  # (H, Q, L)
    positions = torch.arange(num_keys - num_queries, num_keys)[:, None]
    keys_at = torch.arange(num_keys)[None, :]
    visible = keys_at <= positions
    if window is not None:
        visible &= keys_at > positions - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(num_heads, num_queries, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return (weights @ v).transpose(0, 1)
