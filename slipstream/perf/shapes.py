"""`TransformerShape`: the few numbers of a decoder-only transformer the performance model needs.

Why a shape of its own rather than `ModelConfig`: the published performance points we validate
against are GPT-style models (LayerNorm with bias, a GELU MLP of width 4h, learned positions,
multi-head attention, biased linears), which slipstream cannot run and `ModelConfig` (the Llama
family slipstream serves and trains) must not pretend to describe. Both map onto this shape:
`TransformerShape.from_model_config` for anything slipstream runs (presets or a config.json),
`GPT_SHAPES` for the published GPT shapes. FLOP conventions are those of `slipstream.perf.flops`
(a multiply-accumulate is 2 FLOPs, attention charged for the whole context unless causal).

Gemma, Gemma 2 and Gemma 3 (gemma3_text) map onto it too: a GeGLU MLP (`mlp="geglu"`: three
matrices, tanh-approximated GELU), Gemma 2's four norms per layer (`norms_per_layer`), its sliding
window on only some layers (the others in `full_attention_layers`, so that key counts are the mean
layer's), and its soft-capped attention scores (`attention_softcap`: slipstream then computes them
with explicit matrix products, every query against every key, where SDPA would run a fused kernel)
and logits (`logit_softcap`), and Gemma 3's rotary tables of their own base on the windowed layers
(`local_rotary`).

A mixture-of-experts shape (Mixtral, Qwen-MoE) names its routed layers (`moe_layers`); each holds
a router, `num_experts` SwiGLU experts and optionally a shared expert with a 1-wide gate, while
the other layers keep the dense MLP. Parameter counts hold every expert; `matmul_params` and the
FLOPs count the active ones (the router, `experts_per_token` experts, the shared expert). gpt-oss's
experts have biases (`expert_bias_params`), its router's bias and attention sinks are
`extra_params_per_layer`.

Pure Python; importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from slipstream.perf.flops import expected_experts_touched, expert_bias_params

MLP_KINDS = ("swiglu", "geglu", "gelu")
NORM_KINDS = ("rmsnorm", "gemma_rmsnorm", "layernorm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """Layer counts and widths of one decoder-only transformer."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    mlp: str = "swiglu"
    """"swiglu" or "geglu" (gate, up and down matrices; silu or tanh-approximated gelu of the gate)
    or "gelu" (two matrices)."""
    norm: str = "rmsnorm"
    """"rmsnorm" (a weight), "gemma_rmsnorm" (Gemma's: a weight, all in fp32, times 1 + weight) or
    "layernorm" (a weight and a bias)."""
    norms_per_layer: int = 2
    """Norms over the hidden size in each layer: 2, or 4 in Gemma 2's sandwich layer."""
    fp32_weight_norms: bool = False
    """The RMSNorms multiply by their weight in fp32 and round once (OLMo 2's, gpt-oss's), so each
    keeps its fp32 normalised input for the weight's gradient as well as its input."""
    tied_embeddings: bool = False
    learned_positions: int = 0
    """Rows of a learned position-embedding table (GPT); 0 for rotary models."""
    linear_bias: bool = False
    """Every linear layer has a bias (GPT)."""
    extra_params_per_layer: int = 0
    """Small per-layer weights outside this description (Qwen q/k/v biases, q/k norms)."""
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    """Layers the sliding window leaves out (Gemma 2's "full_attention" ones); empty: it covers all."""
    attention_softcap: bool = False
    """Scores soft-capped before the softmax (Gemma 2), which slipstream computes with explicit
    matmuls: the whole T x T score matrix, kept for the backward."""
    logit_softcap: bool = False
    """Logits soft-capped (Gemma 2's tanh over the vocabulary)."""
    attention_sinks: bool = False
    """A learned logit per head in each softmax's denominator (gpt-oss), which slipstream computes
    with explicit matmuls too (no fused kernel takes it)."""
    qk_norm: bool = False
    """An RMSNorm on every head's query and key before the rotary embedding (Qwen3)."""
    local_rotary: bool = False
    """The windowed layers take rotary tables of their own base (Gemma 3's rope_local_theta)."""
    max_position_embeddings: int | None = None
    """The most positions a sequence may take (a config's max_position_embeddings, a GPT's
    learned position table); None: not known, not checked."""
    num_experts: int = 0
    """Routed experts in each mixture-of-experts layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Experts each token runs (the router's top k)."""
    expert_ffn_hidden_size: int = 0
    """Width of each routed expert's SwiGLU."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert every token also runs, with its 1-wide gate (qwen2_moe); 0: none."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers with experts; the others have the dense MLP `ffn_hidden_size` wide."""
    expert_bias_params: int = 0
    """Biases of each routed expert (gpt-oss's gate/up and down biases); 0: none."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "ffn_hidden_size", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"{self.name}: mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"{self.name}: norm must be one of {NORM_KINDS}, got {self.norm!r}")
        if self.fp32_weight_norms and self.norm != "rmsnorm":
            raise ValueError(f"{self.name}: fp32_weight_norms=True is an RMSNorm's (norm='rmsnorm'), "
                             f"got norm={self.norm!r}")
        limit = self.max_position_embeddings
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{self.name}: max_position_embeddings must be a positive integer or None, "
                             f"got {limit!r}")
        if isinstance(self.norms_per_layer, bool) or self.norms_per_layer not in (2, 4):
            raise ValueError(f"{self.name}: norms_per_layer must be 2 or 4, got {self.norms_per_layer!r}")
        full = tuple(self.full_attention_layers)
        if full and (self.sliding_window is None or len(set(full)) != len(full) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in full)):
            raise ValueError(f"{self.name}: full_attention_layers must be distinct layer indices below "
                             f"num_layers ({self.num_layers}) of a shape with a sliding_window, got {full!r}")
        object.__setattr__(self, "full_attention_layers", full)
        self._check_experts()

    def _check_experts(self) -> None:
        fields = ("num_experts", "experts_per_token", "expert_ffn_hidden_size",
                  "shared_expert_ffn_hidden_size", "expert_bias_params")
        for field in fields:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{self.name}: {field} must be a non-negative integer, got {value!r}")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if not self.num_experts:
            given = [f"{f}={getattr(self, f)!r}" for f in fields[1:] + ("moe_layers",) if getattr(self, f)]
            if given:
                raise ValueError(f"{self.name}: {', '.join(given)} without experts (num_experts=0)")
            return
        if not 1 <= self.experts_per_token <= self.num_experts or self.expert_ffn_hidden_size < 1:
            raise ValueError(f"{self.name}: experts need experts_per_token from 1 to num_experts "
                             f"({self.num_experts}) and expert_ffn_hidden_size >= 1, got "
                             f"{self.experts_per_token} and {self.expert_ffn_hidden_size}")
        layers = self.moe_layers
        if (not layers or len(set(layers)) != len(layers)
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers
                       for i in layers)):
            raise ValueError(f"{self.name}: moe_layers must be distinct layer indices below num_layers "
                             f"({self.num_layers}), at least one, got {layers!r}")
        if self.mlp != "swiglu" or self.linear_bias:
            raise ValueError(f"{self.name}: experts are SwiGLU without biases (mlp='swiglu', "
                             f"linear_bias=False), got mlp={self.mlp!r}, linear_bias={self.linear_bias}")

    @classmethod
    def from_model_config(cls, config: Any, name: str = "model") -> TransformerShape:
        """The shape of a slipstream `ModelConfig` (the Llama family: RMSNorm, SwiGLU, RoPE, its
        mixture-of-experts types, Gemma's GeGLU and Gemma 2's sandwich norms and per-layer windows,
        OLMo 2's q/k norms over all heads)."""
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        extra = (q + 2 * kv) if config.qkv_bias else 0
        extra += config.hidden_size if config.o_bias else 0
        extra += (2 * config.intermediate_size + config.hidden_size) if config.mlp_bias else 0
        if config.attention_sinks:  # gpt-oss: a sink per query head, and its router's bias
            extra += config.num_attention_heads + config.num_experts
        if config.qk_norm:  # per head (Qwen 3, Gemma 3) or over all heads' features (OLMo 2)
            extra += q + kv if config.qk_norm_across_heads else 2 * config.head_dim
        windows = [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)]
        full = tuple(i for i, w in enumerate(windows) if w is None) if config.sliding_window else ()
        return cls(
            name=name, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size, tied_embeddings=config.tie_word_embeddings,
            extra_params_per_layer=extra, sliding_window=config.sliding_window,
            qk_norm=config.qk_norm, max_position_embeddings=config.max_position_embeddings,
            local_rotary=config.rope_local_theta is not None,
            mlp="geglu" if config.gemma_norms else "swiglu",
            norm="gemma_rmsnorm" if config.gemma_norms else "rmsnorm",
            norms_per_layer=4 if config.sandwich_norms else 2, fp32_weight_norms=config.fp32_weight_norms,
            full_attention_layers=full, attention_softcap=config.attn_logit_softcapping is not None,
            logit_softcap=config.final_logit_softcapping is not None,
            attention_sinks=config.attention_sinks, **_experts_of(config),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)

    @property
    def uniform_layers(self) -> bool:
        """Every layer alike: all dense or all with experts (what pipeline stages of whole
        layers need to be priced without knowing which layers each holds)."""
        return self.num_dense_layers in (0, self.num_layers)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 2 if self.mlp == "gelu" else 3

    @property
    def windowed_layer_share(self) -> float:
        """The share of the layers the sliding window covers (0 without one)."""
        if self.sliding_window is None:
            return 0.0
        return 1.0 - len(self.full_attention_layers) / self.num_layers

    def causal_pairs(self, num_tokens: int) -> float:
        """Query-key pairs of causal attention over `num_tokens` in the mean layer (each query
        sees itself and its past, at most the sliding window of them where the layer has one)."""
        full = num_tokens * (num_tokens + 1) / 2
        window, share = self.sliding_window, self.windowed_layer_share
        if window is None or window >= num_tokens:
            return full
        windowed = window * (window + 1) / 2 + (num_tokens - window) * window
        return share * windowed + (1.0 - share) * full

    def decode_kv_positions(self, context: int) -> float:
        """KV positions a decode token with `context` cached positions reads in the mean layer:
        c + 1, at most the sliding window where the layer has one."""
        share, window = self.windowed_layer_share, self.sliding_window
        if window is None or window >= context + 1:
            return context + 1
        return share * window + (1.0 - share) * (context + 1)

    def tensor_parallel_error(self, tp: int, *, serving: bool = False) -> str | None:
        """Why `tp`-way tensor parallelism cannot split this shape, None when it can. Heads and MLP
        columns must divide (each expert's too: tensor parallelism splits every expert as it does
        the dense MLP, vLLM's default for MoE); so must the K/V heads in training (Megatron's query
        groups), while serving may also replicate them when tp is a multiple of them (vLLM's rule).
        slipstream's tensor-parallel training has no plan for attention sinks (gpt-oss's, with its
        stacked experts): it refuses them, and so does this for training."""
        if self.attention_sinks and tp > 1 and not serving:
            return f"tp={tp}: slipstream's tensor-parallel training does not split attention sinks (gpt-oss)"
        widths = [self.ffn_hidden_size] if self.num_dense_layers else []
        widths += [w for w in (self.expert_ffn_hidden_size, self.shared_expert_ffn_hidden_size) if w]
        if self.num_heads % tp or any(w % tp for w in widths):
            columns = " and ".join(str(w) for w in widths)
            return f"tp={tp} does not divide {self.num_heads} heads and {columns} MLP columns"
        if self.num_kv_heads % tp and not (serving and tp % self.num_kv_heads == 0):
            rule = ("divide them or be a multiple of them (vLLM replicates K/V heads)" if serving
                    else "divide them (Megatron's query groups)")
            return f"tp={tp} does not suit the {self.num_kv_heads} K/V heads: it must {rule}"
        return None

    def mlp_width(self, *, moe: bool = False) -> int:
        """Intermediate activations per token of a layer's MLP: the dense width, or (`moe`) the
        `experts_per_token` experts' and the shared expert's."""
        if not moe:
            return self.ffn_hidden_size
        return self.experts_per_token * self.expert_ffn_hidden_size + self.shared_expert_ffn_hidden_size

    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.expert_ffn_hidden_size

    def experts_touched(self, num_tokens: float) -> float:
        """Expected distinct experts a MoE layer runs for `num_tokens` tokens under uniform
        routing (`flops.expected_experts_touched`); 0 for a dense shape."""
        if not self.is_moe:
            return 0.0
        return expected_experts_touched(self.num_experts, self.experts_per_token, num_tokens)

    def moe_mlp_matmul_params(self, num_experts: float | None = None) -> float:
        """A MoE layer's MLP weights with `num_experts` of its routed experts (default all): the
        router (hidden x num_experts), the experts, the shared expert and its 1-wide gate."""
        h, shared = self.hidden_size, self.shared_expert_ffn_hidden_size
        experts = self.num_experts if num_experts is None else num_experts
        return h * self.num_experts + experts * self.expert_params() + (3 * h * shared + h if shared else 0)

    def layer_matmul_params(self, *, moe: bool = False, num_experts: float | None = None) -> float:
        """Weights of one layer's linear layers: q, k, v, o and the MLP matrices (`moe`: those of
        a layer with experts, `num_experts` of them, default all)."""
        h = self.hidden_size
        attention = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if moe:
            return attention + self.moe_mlp_matmul_params(num_experts)
        return attention + self.mlp_matrices * h * self.ffn_hidden_size

    def layer_params(self, *, moe: bool = False) -> int:
        """All weights of one layer: linears, their biases, the norms, extras (`moe`: a layer
        with experts, every expert)."""
        h, norm = self.hidden_size, 2 if self.norm == "layernorm" else 1
        bias = 0
        if self.linear_bias:
            up = self.ffn_hidden_size * (self.mlp_matrices - 1)
            bias = self.q_dim + 2 * self.kv_dim + h + up + h
        norms = self.norms_per_layer * norm * h
        if moe:
            bias += self.num_experts * self.expert_bias_params
        return int(self.layer_matmul_params(moe=moe)) + bias + norms + self.extra_params_per_layer

    def layers_params(self) -> int:
        """Every layer's weights: the dense layers' and the MoE layers' (all experts)."""
        moe = len(self.moe_layers) * self.layer_params(moe=True) if self.is_moe else 0
        return self.num_dense_layers * self.layer_params() + moe

    def layers_matmul_params(self, num_experts: float | None = None) -> float:
        """Every layer's linear weights, each MoE layer with `num_experts` routed experts (all by
        default; `experts_per_token` for a token's active weights)."""
        moe = len(self.moe_layers) * self.layer_matmul_params(moe=True, num_experts=num_experts)
        return self.num_dense_layers * self.layer_matmul_params() + (moe if self.is_moe else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """Every weight once (a tied lm_head is the embedding matrix, counted once; every expert)."""
        final_norm = self.hidden_size * (2 if self.norm == "layernorm" else 1)
        total = self.embedding_params() + self.learned_positions * self.hidden_size
        total += self.layers_params() + final_norm
        return total + (0 if self.tied_embeddings else self.embedding_params())

    def active_params(self) -> int:
        """The weights one token uses: `num_params` with each MoE layer's routed experts cut to
        `experts_per_token`."""
        idle = len(self.moe_layers) * (self.num_experts - self.experts_per_token) * (
            self.expert_params() + self.expert_bias_params)
        return self.num_params() - idle

    def matmul_params(self) -> int:
        """Weights used in a matmul per token: all linears (of a MoE layer the router, the
        `experts_per_token` experts a token runs and the shared expert) and the lm_head (tied or not)."""
        return int(self.layers_matmul_params(self.experts_per_token)) + self.embedding_params()

    def attention_flops_per_token(self, keys: float) -> float:
        """QK^T and AV: `4 * L * H * head_dim * keys` (PaLM appendix B)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * keys

    def train_flops_per_token(self, seq_len: int) -> float:
        """`6 N + 12 L H Q T` (PaLM / torchtitan / Korthikanti eq. 7; no causal halving)."""
        return 3 * (2 * self.matmul_params() + self.attention_flops_per_token(seq_len))

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V of every layer: `2 * L * kv_heads * head_dim * bytes`."""
        return 2 * self.num_layers * self.kv_dim * bytes_per_element

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _gpt(
    name: str, layers: int, hidden: int, heads: int, vocab: int, positions: int = 2048
) -> TransformerShape:
    return TransformerShape(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, ffn_hidden_size=4 * hidden, vocab_size=vocab, mlp="gelu",
        norm="layernorm", tied_embeddings=True, learned_positions=positions, linear_bias=True,
        max_position_embeddings=positions,
    )


# GPT-3 175B: Brown et al. 2020, "Language Models are Few-Shot Learners", arXiv 2005.14165,
# Table 2.1 (96 layers, d_model 12288, 96 heads of 128, context 2048; GPT-2's 50257-token BPE).
# Megatron shapes: Korthikanti et al. 2022, arXiv 2205.05198, Table 3 (heads, hidden, layers) and
# section 6 (sequence 2048, vocabulary 51200, 4h MLP, tied embeddings, learned positions).
GPT_SHAPES: dict[str, TransformerShape] = {
    s.name: s
    for s in (
        _gpt("gpt3-175b", 96, 12288, 96, 50257),
        _gpt("megatron-22b", 48, 6144, 64, 51200),
        _gpt("megatron-175b", 96, 12288, 96, 51200),
        _gpt("megatron-530b", 105, 20480, 128, 51200),
        _gpt("megatron-1t", 128, 25600, 160, 51200),
    )
}


def _experts_of(config: Any) -> dict[str, Any]:
    """The expert fields of a ModelConfig's shape; none when no layer routes (a Qwen-MoE config
    whose decoder_sparse_step or mlp_only_layers leave every layer dense)."""
    layers = config.moe_layers
    if not layers:
        return {}
    return {"num_experts": config.num_experts, "experts_per_token": config.num_experts_per_tok,
            "expert_ffn_hidden_size": config.moe_intermediate_size,
            "shared_expert_ffn_hidden_size": config.shared_expert_intermediate_size or 0,
            "moe_layers": layers, "expert_bias_params": expert_bias_params(config)}


def model_names() -> list[str]:
    """Every name `resolve_model` accepts besides a config.json path."""
    from slipstream.model.presets import PRESETS

    return list(PRESETS) + list(GPT_SHAPES)


def resolve_model(name_or_path: str) -> TransformerShape:
    """A shape from a slipstream preset, a GPT shape name, or a config.json (file or its dir).

    A config.json of a slipstream family (llama, mistral, phi3, qwen2, qwen3, gemma, gemma2,
    gemma3_text, olmo2 and the mixture-of-experts mixtral, qwen2_moe, qwen3_moe, gpt_oss) is read through
    `ModelConfig`, which names the families it reads for any other model_type; of Gemma 3's
    multimodal "gemma3", the language model; a GPT-2-style one (`n_embd`, `n_layer`, `n_head`)
    maps to a GPT shape.
    """
    if name_or_path in GPT_SHAPES:
        return GPT_SHAPES[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no config.json at {name_or_path!r}")
        return _shape_from_config_json(_read_config_json(path), path.parent.name or str(path), path)
    from slipstream.model.presets import PRESETS

    if name_or_path in PRESETS:
        return TransformerShape.from_model_config(PRESETS[name_or_path].config, name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}; known: {', '.join(model_names())}, or a config.json path"
    )


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object of model settings, got {type(d).__name__}")
    return d


# Keys without which a config.json does not describe a shape (ModelConfig requires them too).
_GPT2_KEYS = ("n_embd", "n_layer", "n_head", "vocab_size")
_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _shape_from_config_json(d: dict[str, Any], name: str, path: Path) -> TransformerShape:
    from slipstream.model.config import MODEL_TYPES, MULTIMODAL_TEXT_TYPES, ModelConfig

    multimodal = "n_embd" not in d and d.get("model_type") in MULTIMODAL_TEXT_TYPES
    if multimodal or ("n_embd" not in d and "model_type" in d and d["model_type"] not in MODEL_TYPES):
        # ModelConfig's own message names the families it reads; a multimodal checkpoint's language
        # model takes transformers' defaults for what its text_config leaves out (Gemma 3's do).
        try:
            return TransformerShape.from_model_config(ModelConfig.from_hf_dict(d), name)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    required = _GPT2_KEYS if "n_embd" in d else _HF_KEYS
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    if "n_embd" in d:  # GPT-2 family keys
        hidden, heads = _config_int(d, "n_embd", path), _config_int(d, "n_head", path)
        if hidden % heads:
            raise ValueError(f"{path}: n_embd ({hidden}) must be a multiple of n_head ({heads})")
        return dataclasses.replace(
            _gpt(name, _config_int(d, "n_layer", path), hidden, heads, _config_int(d, "vocab_size", path),
                 _config_int(d, "n_positions", path, 1024)),
            ffn_hidden_size=_config_int(d, "n_inner", path, 4 * hidden),
            tied_embeddings=bool(d.get("tie_word_embeddings", True)),
        )
    try:
        config = ModelConfig.from_hf_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return TransformerShape.from_model_config(config, name)


def _config_int(d: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = d.get(key) if d.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value
