"""Attention backends behind one call.

`dense_causal_attention` is what training and the reference forward use: every query attends to
the keys at or before its own position in the same sequence (optionally within a sliding window,
with soft-capped scores, or with attention sinks: `softmax_with_sinks`).
The serving engine's paged attention lives beside it and is reached through the attention
metadata object the engine passes to the model.

Layout legend: B batch, T tokens, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def dense_causal_attention(
    q: torch.Tensor,  # (B, T, H, D)
    k: torch.Tensor,  # (B, T, K, D)
    v: torch.Tensor,  # (B, T, K, D)
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (B, T, H, D)
    """Causal self-attention over whole sequences with SDPA: softmax(q . k * scale) v, scale
    head_dim**-0.5 where None. A `softcap` (Gemma 2) turns each scaled score s into
    softcap * tanh(s / softcap) before the mask, and `sinks` (gpt-oss) join each row's softmax
    (`softmax_with_sinks`), neither of which SDPA can, so those go through explicit matrix
    products, as transformers' eager attention computes them."""
    num_tokens = q.shape[1]
    masked = softcap is not None or sinks is not None or (sliding_window is not None
                                                          and num_tokens > sliding_window)
    mask = _additive_causal_mask(num_tokens, sliding_window, q.device, sdpa_dtype(q)) if masked else None
    return masked_attention(q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks)


def masked_attention(
    q: torch.Tensor,  # (B, Tq, H, D)
    k: torch.Tensor,  # (B, Tk, K, D)
    v: torch.Tensor,  # (B, Tk, K, D)
    mask: torch.Tensor | None,  # (Tq, Tk) additive: 0 where a query may attend a key, -inf elsewhere
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (B, Tq, H, D)
    """softmax(q . k * scale + mask) v with grouped K/V heads, through SDPA, or with a soft cap or
    sinks through explicit products (`dense_causal_attention`'s, and context parallelism's
    attention of a rank's queries to the gathered keys). Every query must see some key. A mask
    of None is the causal mask of whole sequences (Tq = Tk), which SDPA applies itself; a soft cap
    or sinks need a mask given."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, heads, T, D)
    explicit = softcap is not None or sinks is not None
    gqa = num_kv_heads != num_heads and not explicit and _sdpa_takes_gqa(q, masked=mask is not None)
    if num_kv_heads != num_heads and not gqa:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    if not explicit:
        attn_mask = None if mask is None else mask.to(sdpa_dtype(q))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=mask is None,
                                             enable_gqa=gqa, scale=scale)
        return out.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # (B, H, Tq, Tk)
    scores = scores + mask.to(scores.dtype)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        probs = softmax_with_sinks(scores.float(), sinks[:, None, None])
    return torch.matmul(probs.to(q.dtype), v).transpose(1, 2)


def softmax_with_sinks(
    scores: torch.Tensor,  # (..., L) fp32, -inf where masked
    sinks: torch.Tensor,  # broadcastable to (..., 1): a logit per row (per head)
) -> torch.Tensor:  # (..., L)
    """The softmax of each row of `scores` with its sink logit as one more entry, that entry then
    dropped (gpt-oss's attention sinks): the probabilities sum to less than one, the rest going to
    no value. A row all masked keeps all its weight on the sink (zeros, not NaN)."""
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def softmax_with_sinks_(
    scores: torch.Tensor,  # (..., L) fp32, -inf where masked; overwritten
    sinks: torch.Tensor,  # broadcastable to (..., 1)
) -> torch.Tensor:  # scores, now the probabilities
    """`softmax_with_sinks` in place, for inference (no autograd): exp(s - m) / (sum exp(s - m)
    + exp(sink - m)) with m the larger of the row's maximum and its sink, so no (..., L + 1) copy
    of the scores is made (the serving fallback's scores can be the largest tensor of a step)."""
    sinks = sinks.to(scores.dtype)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # finite: sinks are
    total = scores.sub_(top).exp_().sum(dim=-1, keepdim=True).add_(torch.exp(sinks - top))
    return scores.div_(total)


@functools.lru_cache(maxsize=2)
def _additive_causal_mask(num_tokens: int, sliding_window: int | None, device: torch.device,
                          dtype: torch.dtype) -> torch.Tensor:  # (T, T): 0 may attend, -inf not
    """`causal_mask` as SDPA's additive mask in the dtype it computes in, one tensor for every layer of a
    forward (the last two kept for the next: Gemma 2's layers alternate windows). SDPA saves such
    a mask for the backward as it is, where it turns a bool mask (or one of another dtype) into a
    new tensor in each layer: L copies of T x T kept until the backward. Made outside inference
    mode, so that a mask first made for inference still serves a training forward."""
    with torch.inference_mode(False):
        allowed = causal_mask(num_tokens, num_tokens, sliding_window=sliding_window, device=device)
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)


def sdpa_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype SDPA runs in: autocast's where it is on (rotary leaves q in fp32), else q's."""
    device_type = q.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype


def _sdpa_takes_gqa(q: torch.Tensor, masked: bool) -> bool:
    """Whether a fused SDPA kernel attends grouped K/V heads without expanding them first.

    Expanded K and V are what the backward saves, H / K times their own bytes. PyTorch's CPU
    flash kernel takes grouped heads with or without a mask. On CUDA only flash attention does
    (fp16/bf16, head dim up to 256, no mask); elsewhere `enable_gqa` silently falls back to the
    unfused math kernel, slower than expanding (pytorch/pytorch#181528,
    huggingface/transformers#46960).
    """
    if q.device.type == "cpu":
        return True
    return (q.device.type == "cuda" and sdpa_dtype(q) in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and not masked)


def causal_mask(
    num_queries: int,
    num_keys: int,
    *,
    sliding_window: int | None = None,
    bidirectional: Sequence[tuple[int, int]] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:  # (num_queries, num_keys) bool, True = may attend
    """Queries are the last `num_queries` of `num_keys` positions; each sees keys at or before it,
    and with a sliding window only the `sliding_window` most recent of those (itself included).
    Within each span [start, stop) of `bidirectional` (Gemma 3's image tokens) queries also see
    the later keys of their span; the window still bounds them, as transformers composes Gemma 3's
    sliding mask: (causal or same span) and within the window."""
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key_pos = torch.arange(num_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    for start, stop in bidirectional:
        mask |= (query_pos >= start) & (query_pos < stop) & (key_pos >= start) & (key_pos < stop)
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask
