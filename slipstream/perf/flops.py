"""FLOPs, parameters and bytes per token of a `ModelConfig`, as plain functions.

Conventions (each function restates the one it uses):

- A FLOP is one multiply or one add, so a multiply-accumulate is 2 FLOPs (fvcore counts MACs,
  which is half of this).
- `N` in the FLOP formulas is `matmul_params(config)`: every weight that takes part in a matmul
  per token, the lm_head included even when it shares the embedding matrix. This equals
  torchtitan's `N_nonembedding` for untied models up to norm weights and biases (well under
  0.1 %), and avoids its undercount for tied models, where the lm_head matmul still runs.
- Attention FLOPs follow PaLM (arXiv 2204.02311, appendix B) and torchtitan
  (`get_dense_model_nparams_and_flops`): QK^T and AV cost `4 * L * H * Q` per token per key,
  with every query charged for all `T` keys (no causal halving) unless `causal=True` is asked for.
- Sliding windows are per layer (Gemma 2 windows only its "sliding_attention" layers): a count of
  keys or of KV positions read is the mean layer's, `sum over layers / L`, which is a fraction
  where the layers differ, so the functions that take such counts take floats.
- Mixture-of-experts models (Mixtral, Qwen-MoE): `num_params` holds every expert, while FLOPs
  count the weights a token uses (`matmul_params`: the router, its `num_experts_per_tok` experts
  and qwen2_moe's shared expert and gate in each layer that `config.is_moe_layer`), so MFU is on
  active FLOPs as Megatron and torchtitan count it. Bytes read per decode step count the experts
  a batch is expected to touch under uniform routing (`expected_experts_touched`). gpt-oss's
  experts, router and attention carry biases and its attention a sink per head: parameters, not
  matmul weights.
- Weight-only quantization (`quantization="int8"`, `ops.quant`) changes bytes, not FLOPs: every
  linear layer inside the decoder layers (experts included) holds 1 byte per weight and one fp32
  scale (4 bytes) per output channel; the embeddings, the LM head, a mixture-of-experts router,
  qwen2_moe's shared-expert gate, gpt-oss's stacked experts (no linears), norms and biases stay in
  the model's dtype.

Pure Python: no torch import, so planners and reports can use it without a runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations: importing slipstream.model would pull in torch
    from slipstream.model.config import ModelConfig

_BYTES_PER_ELEMENT = {
    "float64": 8, "fp64": 8,
    "float32": 4, "fp32": 4, "tf32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "int8": 1, "uint8": 1,
}


QUANTIZATION_METHODS = ("int8",)
"""The weight-only quantizations whose bytes these functions count (ops.quant's, which this module
cannot import: it would pull in torch)."""
INT8_BYTES_PER_WEIGHT = 1
INT8_BYTES_PER_CHANNEL = 4
"""One fp32 scale per output channel of an int8 linear layer."""


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of `dtype`: a name ("bfloat16", "bf16", ...) or a `torch.dtype`."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _BYTES_PER_ELEMENT:
        raise ValueError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(_BYTES_PER_ELEMENT))}"
        )
    return _BYTES_PER_ELEMENT[name]


def embedding_params(config: ModelConfig) -> int:
    """Parameters of the input embedding table: `vocab_size * hidden_size`."""
    return config.vocab_size * config.hidden_size


def _attention_matmul_params(config: ModelConfig) -> int:
    d, q = config.hidden_size, config.head_dim
    q_out = config.num_attention_heads * q
    kv_out = config.num_key_value_heads * q
    return d * q_out + 2 * d * kv_out + q_out * d  # q, k, v, o projections


def _attention_layer_params(config: ModelConfig) -> int:
    """One layer's weights outside its MLP: q, k, v, o with their biases, q/k norms, both norms."""
    d, q = config.hidden_size, config.head_dim
    n = _attention_matmul_params(config)
    if config.qkv_bias:
        n += (config.num_attention_heads + 2 * config.num_key_value_heads) * q
    if config.o_bias:
        n += d
    if config.attention_sinks:  # gpt-oss: a logit per query head
        n += config.num_attention_heads
    if config.qk_norm_across_heads:  # OLMo 2: one q and one k RMSNorm over all heads' features
        n += (config.num_attention_heads + config.num_key_value_heads) * q
    elif config.qk_norm:
        n += 2 * q  # per-head q and k RMSNorm weights, shared across heads
    if config.sandwich_norms:  # Gemma 2: pre_feedforward_layernorm, post_feedforward_layernorm
        n += 2 * d
    return n + 2 * d  # input_layernorm, post_attention_layernorm


def _attention_output_channels(config: ModelConfig) -> int:
    """Output features of q, k, v and o together."""
    q_out = config.num_attention_heads * config.head_dim
    return q_out + 2 * config.num_key_value_heads * config.head_dim + config.hidden_size


def _dense_mlp_params(config: ModelConfig) -> int:
    d, i = config.hidden_size, config.intermediate_size
    return 3 * d * i + (2 * i + d if config.mlp_bias else 0)  # gate, up, down (and their biases)


def expert_params(config: ModelConfig) -> int:
    """Weights of one routed expert: a SwiGLU `moe_intermediate_size` wide, without biases."""
    return 3 * config.hidden_size * config.moe_intermediate_size


def expert_bias_params(config: ModelConfig) -> int:
    """Biases of one routed expert: gpt-oss's gate/up (2 x moe_intermediate_size) and down
    (hidden_size) biases; 0 for the other types."""
    return 2 * config.moe_intermediate_size + config.hidden_size if config.model_type == "gpt_oss" else 0


def _shared_expert_params(config: ModelConfig) -> int:
    """qwen2_moe's shared expert and its 1-wide sigmoid gate; 0 for the other types."""
    width = config.shared_expert_intermediate_size
    return 0 if width is None else 3 * config.hidden_size * width + config.hidden_size


def _moe_mlp_params(config: ModelConfig, num_experts: int) -> int:
    """A mixture-of-experts MLP with `num_experts` of its experts: the router (hidden x
    num_experts, all of it whatever the count), the experts, and the shared expert with its gate."""
    router = config.hidden_size * config.num_experts
    return router + num_experts * expert_params(config) + _shared_expert_params(config)


def num_moe_layers(config: ModelConfig) -> int:
    """Layers that route to experts (`config.is_moe_layer`); the others have the dense MLP."""
    return len(config.moe_layers)


def _mlp_params(config: ModelConfig, *, active: bool) -> int:
    """Every layer's MLP weights: the dense ones, and each MoE layer's all experts (`active`:
    the `num_experts_per_tok` a token uses), with gpt-oss's expert and router biases."""
    moe_layers = num_moe_layers(config)
    total = (config.num_hidden_layers - moe_layers) * _dense_mlp_params(config)
    if moe_layers:
        experts = config.num_experts_per_tok if active else config.num_experts
        biases = experts * expert_bias_params(config) + (config.num_experts if config.model_type == "gpt_oss"
                                                         else 0)
        total += moe_layers * (_moe_mlp_params(config, experts) + biases)
    return total


def num_params(config: ModelConfig, *, include_embedding: bool = True) -> int:
    """Exact parameter count, equal to `sum(p.numel() for p in model.parameters())`.

    Counts every weight of the Hugging Face model of this family: biases, qwen3's q/k norms, Gemma
    2's four norms per layer, the final norm, and the lm_head once when it is not tied (a tied
    lm_head is the embedding matrix and is counted once); in a mixture-of-experts model every
    expert, each MoE layer's router and qwen2_moe's shared expert and its gate.
    `include_embedding=False` follows torchtitan's convention: the total minus the input embedding
    table. An untied lm_head is then non-embedding; a tied one is the embedding table and is
    excluded with it.
    """
    return _params(config, include_embedding=include_embedding, active=False)


def active_params(config: ModelConfig, *, include_embedding: bool = True) -> int:
    """Parameters one token uses: `num_params` with each MoE layer's experts cut to the
    `num_experts_per_tok` the token is routed to (router and shared expert whole); the "A3B" of
    Qwen3-30B-A3B. Equal to `num_params` for a dense model; embedding as in `num_params`."""
    return _params(config, include_embedding=include_embedding, active=True)


def _params(config: ModelConfig, *, include_embedding: bool, active: bool) -> int:
    embedding = embedding_params(config)
    layers = config.num_hidden_layers * _attention_layer_params(config) + _mlp_params(config, active=active)
    total = embedding + layers + config.hidden_size  # + the final norm
    if not config.tie_word_embeddings:
        total += embedding  # lm_head
    return total if include_embedding else total - embedding


def matmul_params(config: ModelConfig) -> int:
    """Weights that take part in a matmul for each token: all linear layers and the lm_head.

    The lm_head counts also when it is tied to the embedding (the logits matmul runs either
    way); the embedding lookup itself is a gather, not a matmul, and norms and biases are
    elementwise, so none of those count. In a mixture-of-experts layer a token runs the router,
    its `num_experts_per_tok` experts and qwen2_moe's shared expert and gate: whatever the routing,
    every token runs exactly that many, so these are the active weights of every token.
    """
    moe_layers = num_moe_layers(config)
    dense = 3 * config.hidden_size * config.intermediate_size
    total = config.num_hidden_layers * _attention_matmul_params(config)
    total += (config.num_hidden_layers - moe_layers) * dense + embedding_params(config)
    if moe_layers:
        total += moe_layers * _moe_mlp_params(config, config.num_experts_per_tok)
    return total


def expected_experts_touched(num_experts: int, experts_per_token: int, num_tokens: float) -> float:
    """Expected distinct experts one MoE layer runs for `num_tokens` tokens: X (1 - (1 - k/X)^B).

    Assumes uniform, independent routing: each token's k experts are a uniformly random k-subset
    of the X, so a given expert escapes one token with probability 1 - k/X and all B tokens with
    (1 - k/X)^B. One token touches exactly k, a large batch all X. Real routers are skewed, which
    touches fewer experts than this (so it errs towards more bytes).
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if (isinstance(experts_per_token, bool) or not isinstance(experts_per_token, int)
            or not 1 <= experts_per_token <= num_experts):
        raise ValueError(f"experts_per_token must be an integer from 1 to num_experts ({num_experts}), "
                         f"got {experts_per_token!r}")
    if isinstance(num_tokens, bool) or not num_tokens >= 0:
        raise ValueError(f"num_tokens must be a number >= 0, got {num_tokens!r}")
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)


def layer_windows(config: ModelConfig) -> dict[int | None, int]:
    """Each sliding window (None: none) the layers have and how many layers have it: one entry
    but for Gemma 2, whose "full_attention" layers have none."""
    counts: dict[int | None, int] = {}
    for i in range(config.num_hidden_layers):
        window = config.layer_sliding_window(i)
        counts[window] = counts.get(window, 0) + 1
    return counts


def _mean_over_layers(config: ModelConfig, count: Callable[[int | None], int]) -> float:
    """The mean layer's `count(window)`: the count itself where every layer has one window (an
    int, as it always was), else the layers' weighted mean."""
    windows = layer_windows(config)
    if len(windows) == 1:
        return count(next(iter(windows)))
    return sum(layers * count(window) for window, layers in windows.items()) / config.num_hidden_layers


def mean_keys_per_query(config: ModelConfig, seq_len: int) -> float:
    """Mean number of keys a query attends to over a causal sequence of `seq_len` tokens.

    Query i (1-based) sees min(i, window) keys, where window is the layer's sliding window
    (unbounded otherwise): (T + 1) / 2 without a window; the mean over the layers.
    """
    _check_non_negative("seq_len", seq_len)
    if seq_len == 0:
        return 0.0
    return _keys_up_to(config, seq_len) / seq_len


def _keys_up_to(config: ModelConfig, seq_len: int) -> float:
    """Keys all queries of a causal sequence of `seq_len` tokens attend to together, in the mean layer."""
    return _mean_over_layers(config, lambda window: _window_keys_up_to(window, seq_len))


def _window_keys_up_to(window: int | None, seq_len: int) -> int:
    w = min(window or seq_len, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w  # ramp up to w, then w keys each


def causal_keys(config: ModelConfig, start: int, num_tokens: int) -> float:
    """Keys the queries at positions `start` .. `start + num_tokens - 1` of one sequence attend to
    in all, in the mean layer: the query at position p sees min(p + 1, window) keys under the
    causal mask and the layer's sliding window. A chunk that continues a sequence (a prompt chunk
    after earlier ones or after a prefix-cache hit, a decode token at `start` = its cached
    context) is charged for the keys it really attends, which `mean_keys_per_query` (from
    position 0) is not."""
    _check_non_negative("start", start)
    _check_non_negative("num_tokens", num_tokens)
    return _mean_over_layers(config, lambda window: _window_keys_up_to(window, start + num_tokens)
                             - _window_keys_up_to(window, start))


def decode_keys(config: ModelConfig, contexts: Sequence[int], num_steps: int = 1) -> float:
    """Keys `num_steps` decode steps of sequences with `contexts` cached positions attend to in all
    (the mean layer's): the sum of `causal_keys(config, context, num_steps)`, in closed form for
    the layers without a sliding window (an engine's step of hundreds of sequences counts them in
    microseconds)."""
    _check_non_negative("num_steps", num_steps)
    if contexts and min(contexts) < 0:
        raise ValueError(f"contexts must be non-negative, got {min(contexts)}")

    def keys(window: int | None) -> int:
        if window is None:  # context c + 1, c + 2, ... c + num_steps keys
            return num_steps * sum(contexts) + len(contexts) * num_steps * (num_steps + 1) // 2
        return sum(_window_keys_up_to(window, c + num_steps) - _window_keys_up_to(window, c)
                   for c in contexts)

    return _mean_over_layers(config, keys)


def kv_positions_read(config: ModelConfig, start: int, num_tokens: int) -> float:
    """KV-cache positions a chunk of queries at positions `start` .. `start + num_tokens - 1`
    reads when its attention reads each cached position once (a fused prefill kernel), in the
    mean layer: the union of their windows, `min(start + num_tokens, window + num_tokens - 1)`;
    for one decode token at context c, min(c + 1, window), as `decode_bytes_per_step` counts it."""
    _check_non_negative("start", start)
    _check_non_negative("num_tokens", num_tokens)
    if num_tokens == 0:
        return 0
    end = start + num_tokens
    return _mean_over_layers(config, lambda window: min(end, window + num_tokens - 1) if window else end)


def attention_flops_per_token(
    config: ModelConfig, context_len: int, *, causal: bool = False
) -> float:
    """QK^T and AV FLOPs per token: `4 * L * H * Q * keys` (2 matmuls, 2 FLOPs per MAC).

    `causal=False` (PaLM / torchtitan convention): keys = `context_len`, every query is charged
    for the whole context and masks are ignored. It is also the exact cost of one decode token
    that attends `context_len` cached positions (with a sliding window, pass the mean layer's
    `causal_keys(config, context_len - 1, 1)`). `causal=True`: keys = the mean over a sequence
    of `context_len` tokens of the keys each query really attends to under the causal mask and
    the layers' sliding windows, `mean_keys_per_query` (about half). Gemma 2's soft-capped
    attention computes every query against every key in training (`causal=False`'s count,
    which is what `torch.utils.flop_counter` counts for its explicit matmuls, and for SDPA's
    flash, memory-efficient and cuDNN kernels; it counts nothing for the CPU's fused SDPA kernel,
    `_scaled_dot_product_flash_attention_for_cpu`, in torch 2.13)."""
    _check_non_negative("context_len", context_len)
    keys = mean_keys_per_query(config, context_len) if causal else context_len
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * keys


def forward_flops_per_token(
    config: ModelConfig, context_len: int, *, causal: bool = False
) -> float:
    """Forward FLOPs per token: `2 * matmul_params + attention_flops_per_token(context_len)`.

    Elementwise work (norms, activations, softmax, RoPE) is not counted, as in PaLM appendix B.
    For a sequence of T tokens pass `context_len=T`; see `attention_flops_per_token` for
    `causal`.
    """
    return 2 * matmul_params(config) + attention_flops_per_token(config, context_len, causal=causal)


def forward_flops(config: ModelConfig, num_tokens: int, num_logits: int, num_keys: float) -> float:
    """FLOPs of forward passes that run `num_tokens` tokens through every layer, the lm_head at
    `num_logits` of them, and attention over `num_keys` keys in all (the sum of each sequence's
    `causal_keys`): `(2N - 2VE) * num_tokens + 2VE * num_logits + 4 * L * H * Q * num_keys`, N the
    `matmul_params`, VE the lm_head's weights.

    What a serving engine computes, which runs the lm_head only where it samples: a prompt of P
    tokens and its first token, `forward_flops(config, P, 1, causal_keys(config, 0, P))`, is
    `generation_flops(config, P, 1)`; one decode token at context c is
    `forward_flops_per_token(config, c + 1)`; k decode steps of one sequence cost what one chunk of
    k tokens with k logits does. Same conventions as `generation_flops`. `ForwardCost` prices many
    passes of one model.
    """
    return ForwardCost(config).flops(num_tokens, num_logits, num_keys)


def train_flops_per_token(config: ModelConfig, seq_len: int, *, causal: bool = False) -> float:
    """Training FLOPs per token: 3x the forward, `6 * N + 12 * L * H * Q * T`.

    The backward pass costs twice the forward (Transformer Math 101; PaLM appendix B;
    nanoGPT `estimate_mfu`; torchtitan `get_dense_model_nparams_and_flops`). N is
    `matmul_params` (see the module docstring), T is `seq_len`, the training sequence length.
    Activation recomputation is not counted (this is MFU, not HFU). `causal=False` is the
    PaLM/torchtitan convention; `causal=True` charges each query only the keys it attends to.
    """
    return 3 * forward_flops_per_token(config, seq_len, causal=causal)


def weight_bytes(config: ModelConfig, dtype: Any = None, quantization: str | None = None) -> int:
    """Bytes of all parameters (a tied lm_head once, every expert) in `dtype` (default:
    `config.dtype`), the decoder layers' linears in `quantization` where one is given (see the
    module docstring)."""
    element_bytes = dtype_bytes(config.dtype if dtype is None else dtype)
    return num_params(config) * element_bytes - _quantization_savings(config, element_bytes, quantization)


def _check_quantization(quantization: Any) -> None:
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {quantization!r}")


def _quantized_expert_bytes(config: ModelConfig) -> int:
    """Bytes of one routed expert's three int8 linears: the weights and a scale per output channel."""
    channels = 2 * config.moe_intermediate_size + config.hidden_size
    return expert_params(config) * INT8_BYTES_PER_WEIGHT + channels * INT8_BYTES_PER_CHANNEL


def _quantization_savings(config: ModelConfig, element_bytes: int, quantization: str | None) -> int:
    """Bytes that quantizing every linear of the decoder layers saves over keeping them in a dtype of
    `element_bytes` (0 for `quantization` None; negative where int8 is larger, which only a
    one-byte dtype would make it). gpt-oss's stacked experts are no linears and stay in the dtype,
    as its router does (as every router)."""
    _check_quantization(quantization)
    if quantization is None:
        return 0
    weights = config.num_hidden_layers * _attention_matmul_params(config)
    channels = config.num_hidden_layers * _attention_output_channels(config)
    num_moe = num_moe_layers(config)
    weights += (config.num_hidden_layers - num_moe) * 3 * config.hidden_size * config.intermediate_size
    channels += (config.num_hidden_layers - num_moe) * (2 * config.intermediate_size + config.hidden_size)
    width = config.shared_expert_intermediate_size
    if num_moe and width is not None:  # qwen2_moe's shared expert, a SwiGLU `width` wide
        weights += num_moe * 3 * config.hidden_size * width
        channels += num_moe * (2 * width + config.hidden_size)
    saved = weights * element_bytes - weights * INT8_BYTES_PER_WEIGHT - channels * INT8_BYTES_PER_CHANNEL
    if num_moe and config.model_type != "gpt_oss":
        saved += num_moe * config.num_experts * (expert_params(config) * element_bytes
                                                 - _quantized_expert_bytes(config))
    return saved


def kv_cache_bytes_per_token(config: ModelConfig, dtype: Any = None) -> int:
    """KV cache bytes per token: `2 * L * kv_heads * head_dim * bytes` (K and V, all layers).

    Source: Scaling Book `inference.md` ("2 * bytes * H * K * L * T"); `dtype` defaults to
    `config.dtype`.
    """
    per_layer = 2 * config.num_key_value_heads * config.head_dim  # K and V
    element_bytes = dtype_bytes(config.dtype if dtype is None else dtype)
    return config.num_hidden_layers * per_layer * element_bytes


def decode_bytes_per_step(
    config: ModelConfig, dtype: Any, batch_size: int, context_len: int, *, quantization: str | None = None
) -> float:
    """Bytes read from memory by one decode step of `batch_size` sequences (a roofline bound).

    Every weight is read once, except the input embedding table, of which only the `batch_size`
    gathered rows are read (a tied table is read in full anyway, by the lm_head), and the routed
    experts of a mixture-of-experts layer, of which only those the batch touches are read
    (`expected_experts_touched` under uniform routing: k experts at batch 1). Each sequence
    reads its KV cache: `context_len` positions (the cache length including the new token),
    capped at the layer's sliding window (the mean layer's). Activations and the new token's KV
    write are not counted (both are O(batch * hidden), small next to the weights). Scaling Book
    `inference.md`. `quantization`: the decoder layers' linears in it (`weight_bytes`).
    """
    _check_non_negative("batch_size", batch_size)
    _check_non_negative("context_len", context_len)
    kv_positions = _mean_over_layers(config, lambda window: min(context_len, window or context_len))
    return forward_bytes_read(config, dtype, batch_size, batch_size * kv_positions, quantization=quantization)


def forward_bytes_read(
    config: ModelConfig, dtype: Any, num_tokens: int, num_kv_positions: float, *, num_passes: int = 1,
    quantization: str | None = None,
) -> float:
    """Bytes read from memory by `num_passes` forward passes of `num_tokens` tokens each that read
    `num_kv_positions` KV-cache positions in all (a roofline bound, as `decode_bytes_per_step`
    counts a decode step: each pass reads every weight once, but of the input embedding table only
    its `num_tokens` gathered rows and of each mixture-of-experts layer only the experts its tokens
    are expected to touch; activations and KV writes are not counted). The KV positions of a
    prefill chunk are `kv_positions_read`; a decode token reads its `causal_keys`. `quantization`:
    the decoder layers' linears in it (`weight_bytes`). `ForwardCost` prices many passes of one
    model.
    """
    return ForwardCost(config, dtype, quantization).bytes_read(num_tokens, num_kv_positions,
                                                               num_passes=num_passes)


class ForwardCost:
    """`forward_flops` and `forward_bytes_read` of one model in one dtype (default: the config's),
    its decoder layers' linears in `quantization` where one is given (bytes change, FLOPs do not),
    its KV cache's positions read in `kv_dtype` (None: the model's dtype; an fp8 cache's are a
    byte an element), with the model's sums taken once: a running engine prices every step, where
    summing the parameters again each time cost more than the rest of the step's record."""

    def __init__(self, config: ModelConfig, dtype: Any = None, quantization: str | None = None,
                 kv_dtype: Any = None) -> None:
        self.config = config
        lm_head = 2 * embedding_params(config)
        self._flops_per_token = 2 * matmul_params(config) - lm_head
        self._flops_per_logit = lm_head
        self._flops_per_key = attention_flops_per_token(config, 1)
        self._element_bytes = element_bytes = dtype_bytes(config.dtype if dtype is None else dtype)
        untied_embedding = 0 if config.tie_word_embeddings else embedding_params(config)
        # Every weight read once per pass but the input embedding table, of which rows are gathered.
        self._weight_bytes = (weight_bytes(config, dtype, quantization)
                              - untied_embedding * element_bytes)
        self._expert_bytes = 0
        if config.is_moe:  # gpt-oss's stacked experts (biases too) stay in the dtype under int8
            self._expert_bytes = (expert_params(config) * element_bytes if quantization is None
                                  else _quantized_expert_bytes(config))
            if config.model_type == "gpt_oss":
                self._expert_bytes = (expert_params(config) + expert_bias_params(config)) * element_bytes
        self._kv_bytes_per_position = kv_cache_bytes_per_token(config, kv_dtype or dtype)

    def flops(self, num_tokens: int, num_logits: int, num_keys: float) -> float:
        """`forward_flops`."""
        _check_non_negative("num_tokens", num_tokens)
        _check_non_negative("num_logits", num_logits)
        _check_non_negative_count("num_keys", num_keys)
        return (self._flops_per_token * num_tokens + self._flops_per_logit * num_logits
                + self._flops_per_key * num_keys)

    def bytes_read(self, num_tokens: int, num_kv_positions: float, *, num_passes: int = 1,
                   reads_lm_head: bool = True) -> float:
        """`forward_bytes_read`; without the lm_head's weights where `reads_lm_head` is False (a
        forward that takes no logits, as a pooling model's: its embedding table only gathered)."""
        _check_non_negative("num_tokens", num_tokens)
        _check_non_negative_count("num_kv_positions", num_kv_positions)
        _check_non_negative("num_passes", num_passes)
        config, weights = self.config, self._weight_bytes
        if not reads_lm_head:
            weights -= embedding_params(config) * self._element_bytes
        if config.is_moe and num_tokens:
            touched = expected_experts_touched(config.num_experts, config.num_experts_per_tok, num_tokens)
            weights -= num_moe_layers(config) * (config.num_experts - touched) * self._expert_bytes
        gathered_rows = num_tokens * config.hidden_size * self._element_bytes
        return num_passes * (weights + gathered_rows) + num_kv_positions * self._kv_bytes_per_position


def generation_flops(config: ModelConfig, prompt_len: int, output_len: int) -> float:
    """Model FLOPs to serve one request: prefill `prompt_len` tokens, then generate `output_len`.

    What an engine that computes logits only where it samples must do: every prompt token runs
    all layers (attention causal: token i attends i + 1 keys, capped by a sliding window; a
    mixture-of-experts layer its active weights, `matmul_params`), the lm_head runs once per
    generated token (the first from the last prompt position), and
    generated token j attends `prompt_len + j` keys (each layer capped by its own window). Same
    per-FLOP conventions as above.
    """
    _check_non_negative("prompt_len", prompt_len)
    _check_non_negative("output_len", output_len)
    lm_head = 2 * embedding_params(config)
    layers = 2 * matmul_params(config) - lm_head
    attention_per_key = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    keys = causal_keys(config, 0, prompt_len) + causal_keys(config, prompt_len, max(output_len - 1, 0))
    num_layer_tokens = prompt_len + max(output_len - 1, 0)
    return layers * num_layer_tokens + lm_head * output_len + attention_per_key * keys


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilization: `tokens_per_s * flops_per_token / peak_flops_per_s` (0..1)."""
    if not peak_flops_per_s > 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    return tokens_per_s * flops_per_token / peak_flops_per_s


def mbu(steps_per_s: float, bytes_per_step: float, peak_bytes_per_s: float) -> float:
    """Memory bandwidth utilization: `steps_per_s * bytes_per_step / peak_bytes_per_s` (0..1)."""
    if not peak_bytes_per_s > 0:
        raise ValueError(f"peak_bytes_per_s must be > 0, got {peak_bytes_per_s}")
    return steps_per_s * bytes_per_step / peak_bytes_per_s


def _check_non_negative(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _check_non_negative_count(name: str, value: float) -> None:
    """A count of keys or KV positions: the mean layer's, a fraction where the layers' windows differ."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
