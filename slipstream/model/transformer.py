"""The Llama-family decoder (and Gemma's): one definition of the math for training and serving.

`Transformer(config)(token_ids, positions)` returns logits. With `attn=None` every sequence in the
batch attends causally to itself (SDPA); the serving engine instead passes an attention metadata
object, which each layer calls as `attn(layer_idx, q, k, v, scale=..., softcap=...,
sliding_window=..., sinks=...)` to write the new keys and values into the paged cache and attend
over it.
Parameter names equal Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so
checkpoints load without renaming, except Mixtral's experts, which take Qwen-MoE's names here
(`mlp.experts.0.gate_proj` for `block_sparse_moe.experts.0.w1`; `model.weights` renames them on
the way in and out). gpt-oss's experts keep its stacked layout (`GptOssExperts`).

The numerics follow Hugging Face's implementation step for step (RMSNorm in fp32, RoPE tables
in fp32 cast to the activation dtype, `rotate_half` pairing), so fp32 logits agree to rounding.
Gemma and Gemma 2 take their own norm (`GemmaRMSNorm`), activation (`GeluTanhAndMul`) and, for
Gemma 2, layer (`SandwichDecoderLayer`), as separate classes, so that code which replaces the
Llama ones (the CPU fast path) leaves them alone.

Layout legend: B batch, T tokens, E hidden size, H query heads, K key/value heads, D head dim,
R rotary dims (D, or fewer with a partial rotary factor), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.model.config import ModelConfig, RopeScaling
from slipstream.ops.attention import dense_causal_attention


class AttentionMetadata(Protocol):
    """What the serving engine passes as `attn`: a callable that owns the KV cache. Each layer
    passes its own score scale, soft cap, sliding window (Gemma 2's differ between layers) and
    attention sinks (gpt-oss's, one logit per query head; None elsewhere)."""

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
        softcap: float | None, sliding_window: int | None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class _RMSNormFunction(torch.autograd.Function):
    """weight * norm(x), saving only x and the per-row 1/rms for the backward.

    Autograd of the three-op forward would also save the normalised fp32 copy of x, 4 bytes per
    element; the backward recomputes it from x and the 1/rms instead.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as the reference implementation does.
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # (..., dim) fp32
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd: rstd * (g - normed * mean(g * normed)) along the normalised dim.
            grad_normed = (grad_out * weight).float()
            grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            rounded = normed.to(x.dtype).float()  # what the forward multiplied the weight by
            grad_weight = (grad_out.float() * rounded).flatten(0, -2).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in fp32 (the norms that multiply by
    their weight before rounding: Gemma's, OLMo's)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: norm(x) * (1 + weight), both in fp32, rounded to x's dtype once at the
    end (Llama's rounds norm(x) before the multiply). The weight starts at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class FP32WeightRMSNorm(nn.Module):
    """OLMo 2's (and gpt-oss's) RMSNorm: weight * norm(x) in fp32, rounded to x's dtype once at
    the end (Llama's rounds norm(x) before the multiply). The weight starts at one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms_normalized(x, self.eps)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def make_norm(config: ModelConfig, dim: int) -> RMSNorm | GemmaRMSNorm | FP32WeightRMSNorm:
    """The family's RMSNorm over `dim` features."""
    if config.gemma_norms:
        return GemmaRMSNorm(dim, config.rms_norm_eps)
    if config.fp32_weight_norms:
        return FP32WeightRMSNorm(dim, config.rms_norm_eps)
    return RMSNorm(dim, config.rms_norm_eps)


def rope_inv_freq(
    config: ModelConfig, device: torch.device | str | None = None, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies (R/2,) in fp32 for the R = `config.rotary_dim` dimensions the rotary
    embedding turns, with linear or Llama 3 scaling applied, or longrope's short factors (its long
    ones where `long`), as transformers computes them."""
    dim = config.rotary_base_dim  # R, or R - 1 where it is odd: transformers' exponents are over it
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32,
                               device=device)
        return 1.0 / (factors * config.rope_theta ** exponents)
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta ** exponents, scaling, dim, config.rope_theta)
    # Llama 3: leave high frequencies alone, divide low ones by `factor`, interpolate between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(theta_powers: torch.Tensor, scaling: RopeScaling, dim: int, theta: float) -> torch.Tensor:
    """YaRN's frequencies (`RopeScaling`) from theta^(2i / dim): frequency i keeps its value where
    it turns more than beta_fast times over the original context, is divided by `factor` where it
    turns fewer than beta_slow times, and is blended linearly in between (by dimension index, and
    with transformers' roundings)."""

    def dimension_of(num_turns: float) -> float:  # the index whose frequency turns this many times
        return dim * math.log(scaling.original_max_position_embeddings / (num_turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    steps = torch.arange(dim // 2, dtype=torch.float32, device=theta_powers.device)
    ramp = ((steps - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency, 0: divided by factor
    return 1.0 / (scaling.factor * theta_powers) * (1 - kept) + 1.0 / theta_powers * kept


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (*positions.shape, R), R twice the frequencies, computed in fp32 (times
    `scale`, longrope's or yarn's attention factor) and cast to `dtype`."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # (..., R/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., R)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


class RopeTables(nn.Module):
    """The rotary embedding's cos and sin at given positions (`rope_cos_sin`).

    Phi-3's longrope has two sets of frequencies: the short factors' for a context within
    `original_max_position_embeddings`, the long factors' beyond. Called as is, each call picks
    them by its largest position, as transformers does for each forward. Serving fixes one choice
    for every position (`fix_context`), as vLLM does: the long factors wherever the engine's
    context passes the original one, so that a sequence that grows past it keeps the cached keys'
    rotations."""

    def __init__(self, config: ModelConfig, on_meta: bool) -> None:
        super().__init__()
        self.config = config
        scaling = config.rope_scaling
        longrope = scaling is not None and scaling.rope_type == "longrope"
        self.scale = scaling.attention_factor if scaling is not None else 1.0  # 1 but for longrope, yarn
        self.original = scaling.original_max_position_embeddings if longrope else None
        inv_freq = torch.empty(config.rotary_dim // 2) if on_meta else rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        long_inv_freq = None
        if longrope:
            long_inv_freq = (torch.empty(config.rotary_dim // 2) if on_meta
                             else rope_inv_freq(config, long=True))
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        """longrope's long frequencies until `fix_context` chooses; None otherwise."""
        self.fixed_context: int | None = None
        """The context `fix_context` chose for, which `init` chooses for again."""

    def init(self, device: torch.device) -> None:
        """Compute the frequencies on `device` (from the meta device, or again), keeping a fixed
        choice."""
        self.inv_freq = rope_inv_freq(self.config, device=device)
        if self.original is not None:
            self.long_inv_freq = rope_inv_freq(self.config, device=device, long=True)
            if self.fixed_context is not None:
                self.fix_context(self.fixed_context)

    def fix_context(self, max_len: int) -> None:
        """Use one set of frequencies for every position from now on, in place: longrope's long
        ones where `max_len` passes `original_max_position_embeddings`, else its short ones
        (nothing to do for other RoPE)."""
        if self.original is None:
            return
        if self.long_inv_freq is not None and max_len > self.original:
            self.inv_freq.copy_(self.long_inv_freq)
        self.long_inv_freq = None
        self.fixed_context = max_len

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and positions.numel():  # no host read: it traces
            inv_freq = torch.where(positions.max() >= self.original, self.long_inv_freq, self.inv_freq)
        return rope_cos_sin(inv_freq, positions, dtype, self.scale)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dimensions of (B, T, heads, D) by per-token angles, R = cos.shape[-1],
    pairing dimension i with i + R/2; the other D - R pass through (a partial rotary factor)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (B, T, 1, R)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return _rotate(x, cos, sin)
    # Under autocast the turned part is fp32 (the tables are) and the rest not: cat promotes it all
    # to fp32, as in transformers.
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def cast_once_for_autocast(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on, else x unchanged.

    Autocast casts each op's input itself, so the projections that read one activation (q, k and
    v; gate and up) would each save their own low-precision copy of it for the backward. Cast once
    before them and they share one.
    """
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class Rotary(nn.Module):
    """Applies the rotary embedding to queries and keys. A module (with no parameters) so that
    an inference fast path can swap in a fused kernel without touching the attention code."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class FP32Rotary(nn.Module):
    """OLMo 2's rotary embedding: from fp32 cos and sin tables, in fp32, rounded to the inputs'
    dtype once (`Decoder` computes its tables in fp32 where `ModelConfig.post_norms`). Another
    class than `Rotary`, so that the fast path's kernel, which rotates in the inputs' dtype, does
    not replace it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping
        E, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(E, self.num_heads * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(E, self.num_kv_heads * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(E, self.num_kv_heads * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * D, E, bias=config.o_bias)
        self.qk_norm_across_heads = config.qk_norm_across_heads
        if config.qk_norm:  # per head, or (OLMo 2) over all heads' features at once
            self.q_norm = make_norm(config, D * (self.num_heads if self.qk_norm_across_heads else 1))
            self.k_norm = make_norm(config, D * (self.num_kv_heads if self.qk_norm_across_heads else 1))
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        """gpt-oss: a logit per query head that joins each softmax's denominator (`ops.attention`)."""
        self.rotary = FP32Rotary() if config.post_norms else Rotary()
        self.rotates = config.layer_rotates(layer_idx)
        """False for SmolLM3's NoPE layers, whose q and k take no position."""
        # One linear computing q, k and v together, set by the inference fast path
        # (ops.inference.fuse_projections) in place of the three above.
        self.qkv_proj: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,  # (B, T, E)
        cos: torch.Tensor,  # (B, T, R)
        sin: torch.Tensor,  # (B, T, R)
        attn: AttentionMetadata | None,
    ) -> torch.Tensor:  # (B, T, E)
        B, T, _ = x.shape
        if self.qkv_proj is None:
            x = cast_once_for_autocast(x)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        if self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)  # (B, T, H * D), (B, T, KV * D)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates:
            q, k = self.rotary(q, k, cos, sin)
        if attn is None:
            out = dense_causal_attention(q, k, v, sliding_window=self.sliding_window, scale=self.scale,
                                         softcap=self.softcap, sinks=self.sinks)
        else:
            out = attn(self.layer_idx, q, k, v, scale=self.scale, softcap=self.softcap,
                       sliding_window=self.sliding_window, sinks=self.sinks)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class _SiluAndMulFunction(torch.autograd.Function):
    """silu(gate) * up, saving only gate and up for the backward, which recomputes silu(gate).

    Autograd of the two ops would also save silu(gate), an intermediate-sized tensor per layer.
    The backward runs the same ops autograd would, so gradients are bitwise the same.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad_out * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate, up] along the last dimension. A module so that the inference
    fast path can swap in a fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., 2F) -> (..., F)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate) * up (GELU's tanh approximation; Gemma's GeGLU) for x = [gate, up] along the
    last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., 2F) -> (..., F)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), `intermediate_size` wide unless told otherwise (experts);
    Gemma's GeGLU in place of silu."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        E, F_ = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(E, F_, bias=config.mlp_bias)
        self.up_proj = nn.Linear(E, F_, bias=config.mlp_bias)
        self.down_proj = nn.Linear(F_, E, bias=config.mlp_bias)
        # One linear computing [gate, up], set by the inference fast path in place of the two
        # above, and the activation that consumes it.
        self.gate_up_proj: nn.Module | None = None
        self.act = GeluTanhAndMul() if config.gemma_norms else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            x = cast_once_for_autocast(x)
            gate, up = self.gate_proj(x), self.up_proj(x)
            if isinstance(self.act, GeluTanhAndMul):
                return self.down_proj(F.gelu(gate, approximate="tanh") * up)
            return self.down_proj(_SiluAndMulFunction.apply(gate, up))
        return self.down_proj(self.act(self.gate_up_proj(x)))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # (N, X) -> (N, k) fp32 weights, (N, k) expert ids
    """Each token's `top_k` experts and their weights: the largest softmax probabilities (in
    fp32), renormalised to sum to 1 where `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def group_by_expert(
    experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:  # (N, k) expert ids -> (N * k,), (N * k,), X ints
    """The (token, choice) pairs of `experts` grouped by expert, as transformers' loop over
    experts visits them: `order` indexes the flattened (N * k) choices sorted by expert, stably
    (an expert's tokens keep their order), `tokens` is each sorted choice's token and `counts`
    each expert's number of choices, in increasing expert order, to split both by."""
    flat = experts.flatten()  # (N * k,): choice j of token t at t * k + j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // experts.shape[-1], counts


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP (Mixtral, Qwen-MoE): a linear router picks `num_experts_per_tok`
    SwiGLU experts per token, whose outputs are summed weighted by the routing weights; qwen2_moe
    adds a shared expert scaled by sigmoid(shared_expert_gate(x)).

    The experts run one after another on the tokens routed to them, as Hugging Face's eager
    implementation runs them (in increasing expert order, so sums round alike; `_routed`).
    Mixtral multiplies expert outputs by the fp32 routing weights, Qwen by weights cast to the
    activation dtype, as their reference implementations do.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.fp32_weights = config.model_type == "mixtral"
        self.jitter_noise = config.router_jitter_noise
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        if config.shared_expert_intermediate_size is not None:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # `_routed` in one call, set by the inference fast path (ops.inference.KernelMoeExperts);
        # it returns False, leaving `out` as it was, for a call it does not take.
        self.fused_experts: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., E) -> (..., E)
        shape, dtype = x.shape, x.dtype
        x = cast_once_for_autocast(x).reshape(-1, shape[-1])  # (N, E)
        if self.training and self.jitter_noise > 0:  # Mixtral's: router and experts see the noisy input
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        router_logits = self.gate(x)  # (N, X)
        weights, experts = route(router_logits, self.top_k, self.renormalize)  # (N, k) each
        if not self.fp32_weights:
            weights = weights.to(router_logits.dtype)
        # Summed in the input's dtype (fp32 under autocast, as in transformers), not the experts'.
        out = torch.zeros(x.shape, dtype=dtype, device=x.device)
        if self.fused_experts is None or not self.fused_experts(x, weights, experts, out):
            out = self._routed(x, weights, experts, out)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _routed(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' outputs, weighted and summed per token into `out` (zeros). The
        (token, choice) pairs grouped by expert (`group_by_expert`) give one gather of the routed
        rows, of which each expert multiplies a contiguous slice, in increasing expert order; one
        `index_add_` per expert then adds its rows (distinct tokens) to `out`, as transformers'
        loop over experts does. One call for all experts would add a token's k rows before
        rounding to a 16-bit dtype once, not after each expert, and on a GPU with atomics, in no
        fixed order."""
        order, tokens, counts = group_by_expert(experts, self.num_experts)
        if not len(tokens):
            return out
        chunks = x[tokens].split(counts)  # each expert's rows, experts in increasing order
        outputs = torch.cat([self.experts[e](chunk) for e, chunk in enumerate(chunks) if counts[e]])
        contributions = (outputs * weights.flatten()[order, None]).to(out.dtype)  # (N * k, E)
        for expert_tokens, expert_rows in zip(tokens.split(counts), contributions.split(counts), strict=True):
            if len(expert_tokens):
                out.index_add_(0, expert_tokens, expert_rows)
        return out


class GptOssExperts(nn.Module):
    """gpt-oss's experts, stacked as its checkpoints store them (transposed: x @ weight): each
    computes gate_up = x @ gate_up_proj[e] + bias, whose even columns are the gate and odd ones the
    up projection, then (up + 1) * gate * sigmoid(alpha * gate) with the gate clamped to at most
    `limit` and up to within +-limit, then that @ down_proj[e] + bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        X, E, F_ = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(X, E, 2 * F_))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(X, 2 * F_))
        self.down_proj = nn.Parameter(torch.empty(X, F_, E))
        self.down_proj_bias = nn.Parameter(torch.empty(X, E))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def expert_weights(self) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """Expert e's (gate_up, gate_up bias, down, down bias), for one forward. Where autograd
        records, the stacked parameters are taken apart once: indexing them per expert would make
        the backward write a zeroed gradient of all X experts per expert called (select_backward)
        and sum those, where unbind's backward stacks the experts' gradients once. Without
        autograd, indexing only the experts called costs fewer views than unbinding all X."""
        stacked = (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
        if torch.is_grad_enabled() and any(p.requires_grad for p in stacked):
            return list(zip(*(p.unbind(0) for p in stacked), strict=True)).__getitem__
        return lambda e: tuple(p[e] for p in stacked)

    def expert(self, weights: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:  # (n, E) -> (n, E)
        """One expert on its rows, with its `expert_weights`."""
        gate_up_proj, gate_up_bias, down_proj, down_bias = weights
        gate_up = x @ gate_up_proj + gate_up_bias  # (n, 2F)
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        glu = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # (n, F)
        return glu @ down_proj + down_bias

    @torch.no_grad()
    def reset_parameters(self, std: float, residual_std: float, generator: torch.Generator | None) -> None:
        """As `Transformer.init_weights` initialises linears: down, writing to the residual stream,
        at `residual_std`; zero biases."""
        nn.init.normal_(self.gate_up_proj, std=std, generator=generator)
        nn.init.normal_(self.down_proj, std=residual_std, generator=generator)
        nn.init.zeros_(self.gate_up_proj_bias)
        nn.init.zeros_(self.down_proj_bias)


class GptOssMoeBlock(nn.Module):
    """gpt-oss's mixture-of-experts MLP: a router with a bias picks each token's top k experts by
    their raw logits and weighs them by a softmax over those k logits (in the logits' dtype); the
    experts' weighted outputs are summed in increasing expert order, as transformers' loop adds
    them. No shared expert. Another class than `SparseMoeBlock`, so that the fused CPU experts
    kernel and the C decode graph, which implement SwiGLU experts without biases, leave it alone."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., E) -> (..., E)
        shape, dtype = x.shape, x.dtype
        x = cast_once_for_autocast(x).reshape(-1, shape[-1])  # (N, E)
        logits, experts = torch.topk(self.router(x), self.top_k, dim=-1)  # (N, k) each
        weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)
        order, tokens, counts = group_by_expert(experts, self.num_experts)
        rows = weights.flatten()[order, None]  # (N * k, 1)
        out = torch.zeros(x.shape, dtype=dtype, device=x.device)
        weights_of = self.experts.expert_weights()
        for e, (expert_tokens, expert_weights) in enumerate(
                zip(tokens.split(counts), rows.split(counts), strict=True)):
            if len(expert_tokens):
                expert_out = self.experts.expert(weights_of(e), x[expert_tokens])  # (n, E)
                out.index_add_(0, expert_tokens, (expert_out * expert_weights).to(dtype))
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        moe = GptOssMoeBlock if config.model_type == "gpt_oss" else SparseMoeBlock
        self.mlp = moe(config) if config.is_moe_layer(layer_idx) else MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class SandwichDecoderLayer(nn.Module):
    """Gemma 2's layer: attention and the MLP each between two norms,
    h = x + post_attention_layernorm(attn(input_layernorm(x))), then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). (Its post_attention_layernorm
    normalises the attention's output, not the MLP's input as in `DecoderLayer`.)"""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None
    ) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class ScaledResidualDecoderLayer(DecoderLayer):
    """Granite's layer: Llama's, with attention's and the MLP's outputs multiplied by
    `residual_multiplier` before their residual sums. (Its own class: the fast path's fused decoder
    takes only the layers whose sums it computes.)"""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn) * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's layer: h = x + post_attention_layernorm(attn(x)), then
    h + post_feedforward_layernorm(mlp(h)); the inputs of attention and the MLP are not normed."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None
    ) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attn))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Decoder(nn.Module):
    """Embedding, the layer stack and the final norm: token ids to hidden states."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # On the meta device (a model built to be loaded or materialized later) nothing is computed,
        # so the embedding's initialisation and the RoPE frequencies are skipped there: in PyTorch
        # both (normal_, a division) import torch._dynamo on meta, ~1.5 s of the time to a first
        # token. `init_buffers` computes the frequencies once the model is on a real device.
        on_meta = torch.get_default_device().type == "meta"
        weight = torch.empty(config.vocab_size, config.hidden_size) if on_meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        layer = (SandwichDecoderLayer if config.sandwich_norms
                 else PostNormDecoderLayer if config.post_norms
                 else ScaledResidualDecoderLayer if config.model_type == "granite" else DecoderLayer)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.rope = RopeTables(config, on_meta)
        self.local_rope: RopeTables | None = None
        """Gemma 3's and OLMo 3's tables for their "sliding_attention" layers (`local_rope_layers`):
        default RoPE of base `rope_local_theta`; `rope` serves the other layers."""
        self.local_rope_layers: frozenset[int] = frozenset()
        if config.rope_local_theta is not None:
            local = config.replace(rope_theta=config.rope_local_theta, rope_scaling=None)
            self.local_rope = RopeTables(local, on_meta)
            self.local_rope_layers = frozenset(i for i, kind in enumerate(config.layer_types)
                                               if kind == "sliding_attention")
        self.embed_scale = config.hidden_size**0.5 if config.gemma_norms else None
        """Gemma multiplies the embeddings by sqrt(hidden_size), rounded to their dtype."""
        self.embedding_multiplier = config.embedding_multiplier if config.model_type == "granite" else None
        """Granite multiplies the embeddings by this Python float (not rounded to their dtype first)."""
        self.rope_dtype = torch.float32 if config.post_norms else None
        """The dtype of the cos and sin tables: OLMo 2 rotates in fp32 (`FP32Rotary`); None: the
        activations'."""

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, T, E)
        """`inputs_embeds` (B, T, E), when given, replaces `embed(token_ids)` (a multimodal model's
        prompt: image embeddings at its placeholder positions)."""
        x = self.embed(token_ids) if inputs_embeds is None else inputs_embeds
        return self.norm(self.run_layers(x, positions, attn))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, E)
        """The input embeddings of `token_ids`, scaled as the family scales them: the first
        layer's input."""
        x = self.embed_tokens(token_ids)  # (B, T, E)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        return x

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata | None,
        layers: nn.Module | None = None,
    ) -> torch.Tensor:  # (B, T, E) -> (B, T, E)
        """The layer stack (or `layers`, some of it) on hidden states `x`. A layer's index is its
        name: a ModuleList's position, or the key of a ModuleDict holding some of the layers (a
        pipeline stage's), so each layer gets its own RoPE tables either way."""
        layers = self.layers if layers is None else layers
        tables = self.rope(positions, self.rope_dtype or x.dtype)  # cos and sin, (B, T, R) each
        local = tables if self.local_rope is None else self.local_rope(positions, self.rope_dtype or x.dtype)
        for name, layer in layers.named_children():
            x = layer(x, *(local if int(name) in self.local_rope_layers else tables), attn)
        return x


class Transformer(nn.Module):
    """A causal language model: `forward(token_ids, positions, attn=None) -> logits`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self,
        token_ids: torch.Tensor,  # (B, T) int64
        positions: torch.Tensor,  # (B, T) int64
        attn: AttentionMetadata | None = None,
    ) -> torch.Tensor:  # (B, T, V)
        return self.compute_logits(self.hidden_states(token_ids, positions, attn))

    def hidden_states(
        self,
        token_ids: torch.Tensor,  # (B, T)
        positions: torch.Tensor,  # (B, T)
        attn: AttentionMetadata | None = None,
        inputs_embeds: torch.Tensor | None = None,  # (B, T, E)
    ) -> torch.Tensor:  # (B, T, E)
        """The final-norm hidden states, for callers that need logits at only some positions;
        `inputs_embeds` in place of the token ids' embeddings (`Decoder.forward`)."""
        if token_ids.dim() != 2 or positions.shape != token_ids.shape:
            raise ValueError(
                "token_ids and positions must both have shape (batch, seq); got "
                f"{tuple(token_ids.shape)} and {tuple(positions.shape)}"
            )
        if inputs_embeds is None:
            return self.model(token_ids, positions, attn)
        return self.model(token_ids, positions, attn, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (..., E) -> (..., V)
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        return logits

    def tie_weights(self) -> None:
        """Share the embedding table with the output projection when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, *, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random initialisation for training from scratch, on whatever device the model is on.

        Normal(0, std) for embeddings and projections as Hugging Face's Llama does, with the projections
        that write into the residual stream (o_proj, down_proj) scaled down by sqrt(2 * layers) as
        in GPT-2, zero biases, unit norms (Gemma's: zero weights), gpt-oss's stacked experts alike
        and its attention sinks zero. Also rebuilds the RoPE buffer,
        so a model built on the meta device and moved with `to_empty` is usable afterwards.
        """
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scale = residual_std if name.endswith(("o_proj", "down_proj")) else std
                nn.init.normal_(module.weight, mean=0.0, std=scale, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, GemmaRMSNorm, FP32WeightRMSNorm)):
                module.reset_parameters()
            elif isinstance(module, GptOssExperts):
                module.reset_parameters(std, residual_std, generator)
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.zeros_(module.sinks)
        self.tie_weights()
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (the RoPE frequencies) on the model's device."""
        device = next(self.parameters()).device  # a pipeline stage may hold no embedding
        for rope in (self.model.rope, self.model.local_rope):
            if rope is not None:
                rope.init(device)
