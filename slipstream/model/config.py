"""ModelConfig: the Llama-family decoder shape, read from and written to Hugging Face `config.json`.

One frozen dataclass covers `llama` (with Llama 3 and linear RoPE scaling), `mistral` (optional
sliding window), `phi3` (Mistral's attention; its checkpoints store q/k/v and gate/up fused, which
`weights` splits), `qwen2` (q/k/v bias) and `qwen3` (per-head q/k RMSNorm), and their
mixture-of-experts variants `mixtral`, `qwen2_moe` (with a gated shared expert) and `qwen3_moe`,
whose attention is their dense family's, and `gemma` and `gemma2`: Gemma's RMSNorm multiplies by
(1 + weight), its embeddings are scaled by sqrt(hidden_size) and its MLP is GeGLU (tanh-approximated
GELU); Gemma 2 adds a norm after attention and after the MLP, a query scale of its own
(`query_pre_attn_scalar`), tanh soft-capping of attention scores and of the final logits, and a
sliding window on every other layer (`layer_types`); Gemma 3's text model (`gemma3_text`) is
Gemma 2 with per-head q/k norms, five windowed layers to a global one, no soft caps by default, and
a RoPE base of its own on the windowed layers (`rope_local_theta`). OLMo 2 (`olmo2`) norms the
outputs of attention and the MLP instead of their inputs, norms q and k over all heads at once, and
multiplies its norm weights in fp32; OLMo 3 (`olmo3`) adds a window on three layers of four, with
default RoPE there (`rope_local_theta`) and the scaled RoPE on the others. Granite (`granite`) is
Llama with four multipliers: of the embeddings, of each block's output before its residual sum, of
the attention scores (in place of head_dim**-0.5) and, dividing, of the logits. SmolLM3 (`smollm3`)
is Llama with no rotary embedding on every fourth layer (`no_rope_layers`). OpenAI's gpt-oss
(`gpt_oss`) routes every layer to experts with biases and a clamped SwiGLU (`swiglu_limit`,
`swiglu_alpha`), picks them by the top k of a biased router's logits (a softmax over those k), has
q/k/v/o biases, a learned attention sink per query head, a window on every other layer
(`layer_types`), YaRN RoPE, and OLMo 2's fp32-weight norms before attention and the MLP. The family
decides the structural switches (`qkv_bias`, `o_bias`, `qk_norm`, `qk_norm_across_heads`,
`gemma_norms`, `sandwich_norms`, `post_norms`, `fp32_weight_norms`, `attention_sinks`); everything
else is a plain field.

Both spellings Hugging Face has used are read: the transformers 4 keys `rope_theta` /
`rope_scaling` / `torch_dtype` and the transformers 5 keys `rope_parameters` / `dtype`, with
transformers 5's precedence where a file has both (vLLM reads configs through it). We write the
transformers 4 spelling (plus `dtype`), which both major versions load. Values of the wrong JSON
type (`"false"` for a flag, `"0"` for a token id) are ValueErrors naming the key, as transformers 5
refuses them, rather than read by Python's truthiness, and so is a null where transformers 5 refuses
one (`_NOT_NULL`); a key left out takes the default of the family's transformers config class.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2",
               "olmo3", "granite", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
MOE_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss"}
"""Each mixture-of-experts model type and the dense family whose attention and config keys it shares
(gpt-oss has no dense sibling: its attention is its own)."""
_WINDOWED = ("mistral", "phi3")
"""The families whose config.json `sliding_window` windows every layer (no `use_sliding_window`)."""
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_SANDWICH = ("gemma2", "gemma3_text")
"""The families with Gemma 2's layer and fields (`_GEMMA2_FIELDS`)."""
_OLMO = ("olmo2", "olmo3")
"""The families with OLMo 2's layer (`post_norms`, `qk_norm_across_heads`)."""
_LAYER_TYPED = (*_SANDWICH, "olmo3", "gpt_oss")
"""The families whose `layer_types` window some layers and not others; `rope_local_theta` is the
windowed layers' RoPE base in Gemma 3 and OLMo 3."""
_LAYER_PATTERN = {"gemma2": 2, "gemma3_text": 6, "olmo3": 4, "gpt_oss": 2}
"""transformers' default `layer_types`: every n-th layer "full_attention", the others windowed."""
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# config.json keys that are not ModelConfig fields but are understood: bookkeeping, training-time
# settings, or other spellings read by the helpers below. Other unknown keys are logged.
_IGNORED_KEYS = frozenset(
    {
        "architectures", "attention_dropout", "initializer_range", "transformers_version",
        "use_cache", "pretraining_tp", "max_window_layers", "layer_types", "use_sliding_window",
        "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
        "tie_encoder_decoder", "is_encoder_decoder", "is_decoder", "torch_dtype",
        "rope_parameters", "hidden_act", "id2label", "label2id", "problem_type",
        "chunk_size_feed_forward",
        "is_matryoshka", "matryoshka_dimensions",  # read by the pooling runner (serve/pooling.py)
        "num_local_experts", "qkv_bias",  # checked by _read_experts and the like
        "resid_pdrop", "embd_pdrop",  # Phi-3's training-time dropouts
        "original_max_position_embeddings",  # Phi-3's: read for its longrope (_read_longrope)
        "hidden_activation", "use_bidirectional_attention",  # Gemma's: checked by _read_gemma
        "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq",  # Gemma 3's
        "no_rope_layer_interval",  # SmolLM3's: read by _default_no_rope_layers
        "cache_implementation", "sliding_window_size",  # Gemma 2's generation settings, a duplicate
        "experts_per_token", "initial_context_length",  # gpt-oss's duplicates of other keys
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face defines it (`rope_type` "linear", "llama3", "yarn", or
    Phi-3's "longrope": each frequency divided by its own `short_factor`, or `long_factor` where the
    context passes `original_max_position_embeddings`, and cos and sin times `attention_factor`).

    YaRN (Peng et al. 2023, arXiv:2309.00071) keeps the fast-turning frequencies (more than
    `beta_fast` turns over `original_max_position_embeddings` positions), divides the slow ones
    (fewer than `beta_slow` turns) by `factor`, blends linearly in between, and scales cos and sin
    by `attention_factor`: by default 0.1 ln(factor) + 1, or DeepSeek's ratio of that formula with
    `mscale` to it with `mscale_all_dim` where both are given.

    The defaults are Llama 3.1's, for building configs in code; a config.json must name every key
    transformers requires (see `_read_rope`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    """longrope's and yarn's scale of cos and sin; None: transformers' default (longrope:
    sqrt(1 + ln(factor) / ln(original)) for a factor > 1, else 1; yarn: above). 1 for the others."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    """yarn: round the ends of the blended range of frequencies out to whole dimensions (False:
    gpt-oss's exact range)."""

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3", "yarn", "longrope"):
            raise ValueError(
                f"unsupported rope_scaling rope_type {self.rope_type!r}; "
                f"supported: {', '.join((*ROPE_TYPES, 'longrope'))}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, _positive_float(f"rope_scaling {name}", getattr(self, name)))
        object.__setattr__(self, "original_max_position_embeddings", _whole_positive_int(
            "rope_scaling original_max_position_embeddings", self.original_max_position_embeddings))
        for name in ("beta_fast", "beta_slow"):
            object.__setattr__(self, name, _positive_float(f"rope_scaling {name}", getattr(self, name)))
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_float(f"rope_scaling {name}", getattr(self, name)))
        _check_bool("rope_scaling truncate", self.truncate)
        if self.rope_type == "yarn" and self.beta_fast < self.beta_slow:
            raise ValueError(f"rope_scaling needs beta_fast >= beta_slow, got {self.beta_fast} and "
                             f"{self.beta_slow}")
        attention_factor = self.attention_factor
        if attention_factor is None:
            attention_factor = self._default_attention_factor()
        elif self.rope_type not in ("longrope", "yarn") and attention_factor != 1:
            raise ValueError(f"rope_scaling attention_factor={attention_factor!r} given for rope_type "
                             f"{self.rope_type!r}; only longrope and yarn scale cos and sin")
        object.__setattr__(self, "attention_factor",
                           _positive_float("rope_scaling attention_factor", attention_factor))
        for name in ("short_factor", "long_factor"):
            factors = getattr(self, name)
            if not isinstance(factors, (list, tuple)) or (self.rope_type == "longrope") != bool(factors):
                raise ValueError(f"rope_scaling {name} must list a factor per frequency for longrope (only), "
                                 f"got {factors!r}")
            object.__setattr__(self, name, tuple(_positive_float(f"rope_scaling {name}", f) for f in factors))
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )

    def _default_attention_factor(self) -> float:
        """transformers' scale of cos and sin where config.json gives none."""
        if self.rope_type == "longrope" and self.factor > 1:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def to_hf(self) -> dict[str, Any]:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "yarn":
            out = {"rope_type": "yarn", "factor": self.factor, "attention_factor": self.attention_factor,
                   "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate,
                   "original_max_position_embeddings": self.original_max_position_embeddings}
            return out | {k: getattr(self, k) for k in ("mscale", "mscale_all_dim") if getattr(self, k)}
        if self.rope_type == "longrope":
            return {"rope_type": "longrope", "factor": self.factor, "attention_factor": self.attention_factor,
                    "short_factor": list(self.short_factor), "long_factor": list(self.long_factor),
                    "original_max_position_embeddings": self.original_max_position_embeddings}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The shape and numerics of one decoder-only transformer of the Llama family."""

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    """Defaults to `num_attention_heads` (multi-head attention); fewer means GQA."""
    head_dim: int | None = None
    """Defaults to `hidden_size // num_attention_heads`; may be set independently (Qwen3, Mistral)."""
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0
    """The fraction of each head the rotary embedding turns: the first `rotary_dim` =
    int(head_dim * factor) dimensions, the rest pass through (Phi-4-mini's 0.75; phi3 only, as
    only transformers' Phi-3 honours it)."""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q, k, v and o projections (llama, qwen3). qwen2 always has q/k/v bias and no o bias."""
    mlp_bias: bool = False
    sliding_window: int | None = None
    """Mistral, Phi-3: each token attends to at most this many previous positions (itself included);
    Gemma 2: so do the tokens of the layers `layer_types` names "sliding_attention"."""
    layer_types: tuple[str, ...] = ()
    """Gemma 2 and 3: "sliding_attention" or "full_attention" for each layer (where not given,
    transformers' default: Gemma 2 windows the even layers, Gemma 3 all but every sixth); empty for
    the other families, whose window (if any) covers every layer. Read it through
    `layer_sliding_window`."""
    query_pre_attn_scalar: int | None = None
    """Gemma 2 and 3: attention scores are scaled by query_pre_attn_scalar**-0.5 (head_dim where
    not given), not head_dim**-0.5. The soft caps below are None (no cap) unless given, in a config
    built in code; config.json's defaults are transformers' (Gemma 2's 50 and 30)."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: attention scores (after scaling) become cap * tanh(score / cap) before the softmax."""
    final_logit_softcapping: float | None = None
    """Gemma 2: the output logits become cap * tanh(logit / cap)."""
    rope_local_theta: float | None = None
    """Gemma 3: the RoPE base of the "sliding_attention" layers, which take default RoPE;
    `rope_theta` and `rope_scaling` are the "full_attention" layers'. None for the other families."""
    embedding_multiplier: float = 1.0
    """Granite: the embeddings are multiplied by it (1 for the other families)."""
    residual_multiplier: float = 1.0
    """Granite: attention's and the MLP's outputs are multiplied by it before their residual sums."""
    attention_multiplier: float | None = None
    """Granite: what attention multiplies q . k by (transformers' default 1); None elsewhere."""
    logits_scaling: float = 1.0
    """Granite: the logits are divided by it."""
    no_rope_layers: tuple[int, ...] = ()
    """SmolLM3: for each layer 1 where it rotates q and k, 0 where it takes no position (NoPE);
    transformers' default (where not given) leaves out every fourth. Empty for the other families,
    whose layers all rotate. Read it through `layer_rotates`."""
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_experts: int | None = None
    """Routed experts in each mixture-of-experts layer (config.json's `num_local_experts` or
    `num_experts`); None exactly for the dense model types. Which layers route: `moe_layers`."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (the top k of the router's softmax)."""
    moe_intermediate_size: int | None = None
    """Width of each routed expert's SwiGLU; Mixtral's experts are `intermediate_size` wide."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to 1 (always so in Mixtral)."""
    decoder_sparse_step: int = 1
    """Qwen: layer i is a mixture-of-experts layer when (i + 1) % step == 0 and i is not in
    `mlp_only_layers`; the others have a dense MLP `intermediate_size` wide."""
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int | None = None
    """qwen2_moe: width of the shared expert every token also passes through, scaled by
    sigmoid(shared_expert_gate(x))."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss added to the training loss when `output_router_logits`."""
    output_router_logits: bool = False
    router_jitter_noise: float = 0.0
    """Mixtral: in training, the router's and experts' input is multiplied by noise drawn
    uniformly from [1 - noise, 1 + noise]; inference ignores it."""
    swiglu_limit: float = 7.0
    """gpt-oss: its experts clamp the gate to at most this and the up projection to within +-this."""
    swiglu_alpha: float = 1.702
    """gpt-oss: its experts' activation is (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""
    dtype: str = "float32"
    """The dtype the weights are stored in: config.json's `dtype` (or `torch_dtype`); where it names
    none, `from_pretrained` reads the safetensors headers' (as vLLM does), `from_hf_dict` assumes
    float32."""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        _check_positive_int("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self._check_partial_rotary()
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            if self.model_type != "phi3":
                raise ValueError(f"rope_type 'longrope' is only supported for model_type 'phi3', "
                                 f"not {self.model_type!r}")
            half = "head_dim / 2" if self.partial_rotary_factor == 1 else (
                "int(head_dim * partial_rotary_factor) / 2, rounded up,")
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ValueError(f"rope_scaling {name} must have {half} = {self.rotary_dim // 2} "
                                     f"factors, got {len(getattr(scaling, name))}")
        for name in ("rope_theta", "rms_norm_eps"):
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            _check_bool(name, getattr(self, name))
        for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
            _check_token_ids(name, getattr(self, name), many=name == "eos_token_id")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.attention_bias and self.family in ("mistral", "phi3", "qwen2"):
            raise ValueError(f"attention_bias=True is not supported for model_type {self.model_type!r}")
        if self.mlp_bias and self.model_type not in ("llama", "granite", "smollm3"):
            raise ValueError(f"mlp_bias=True is not supported for model_type {self.model_type!r}")
        if self.sliding_window is not None and self.family not in (*_WINDOWED, *_LAYER_TYPED):
            raise ValueError(
                "sliding_window is only supported for model_type 'mistral', 'mixtral', 'phi3', 'gemma2', "
                f"'gemma3_text' or 'olmo3', not {self.model_type!r}"
            )
        self._check_layer_types()
        self._check_gemma2()
        self._check_granite()
        self._check_no_rope_layers()
        self._check_experts()
        self._check_swiglu()

    def _refuse_fields(self, names: tuple[str, ...], family: str) -> None:
        """A ValueError naming each of another `family`'s fields given a value other than its default."""
        given = [f"{name}={getattr(self, name)!r}" for name in names
                 if getattr(self, name) != _field_default(type(self), name)]
        if given:
            raise ValueError(f"{', '.join(given)} given for model_type {self.model_type!r}; only {family} "
                             "has them")

    def _check_swiglu(self) -> None:
        """gpt-oss's clamped SwiGLU: a positive limit and gain; the other families leave them alone."""
        if self.model_type != "gpt_oss":
            self._refuse_fields(_SWIGLU_FIELDS, "gpt_oss")
            return
        for name in _SWIGLU_FIELDS:
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))

    def _check_layer_types(self) -> None:
        """`layer_types` and `rope_local_theta` of the families that have them (transformers'
        default pattern where none is given; an OLMo 3 built in code takes `rope_theta` for its
        windowed layers), refused for the others."""
        if self.model_type not in ("gemma3_text", "olmo3") and self.rope_local_theta is not None:
            raise ValueError(f"rope_local_theta={self.rope_local_theta!r} given for model_type "
                             f"{self.model_type!r}; only gemma3_text and olmo3 have it")
        if self.model_type not in _LAYER_TYPED:
            if self.layer_types:
                raise ValueError(f"layer_types={self.layer_types!r} given for model_type "
                                 f"{self.model_type!r}; only {', '.join(_LAYER_TYPED)} have them")
            return
        if not self.layer_types:
            object.__setattr__(self, "layer_types", _patterned_layer_types(
                self.num_hidden_layers, _LAYER_PATTERN[self.model_type]))
        if self.model_type == "olmo3" and self.rope_local_theta is None:
            object.__setattr__(self, "rope_local_theta", self.rope_theta)
        layer_types = self.layer_types
        if not isinstance(layer_types, (list, tuple)) or any(t not in LAYER_TYPES for t in layer_types):
            raise ValueError(f"layer_types must list one of {', '.join(LAYER_TYPES)} per layer, "
                             f"got {layer_types!r}")
        if len(layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types names {len(layer_types)} layers; the model has "
                             f"num_hidden_layers={self.num_hidden_layers}")
        object.__setattr__(self, "layer_types", tuple(layer_types))
        if self.rope_local_theta is not None:
            object.__setattr__(self, "rope_local_theta", _positive_float("rope_local_theta",
                                                                         self.rope_local_theta))

    def _check_no_rope_layers(self) -> None:
        """SmolLM3's `no_rope_layers`: a 0 or 1 per layer (transformers' default pattern where not
        given); refused for the other families."""
        if self.model_type != "smollm3":
            if self.no_rope_layers:
                raise ValueError(f"no_rope_layers={self.no_rope_layers!r} given for model_type "
                                 f"{self.model_type!r}; only smollm3 has them")
            return
        layers = self.no_rope_layers or tuple(int((i + 1) % 4 != 0) for i in range(self.num_hidden_layers))
        if (not isinstance(layers, (list, tuple)) or len(layers) != self.num_hidden_layers
                or any(isinstance(v, bool) or v not in (0, 1) for v in layers)):
            raise ValueError(f"no_rope_layers must list a 0 or 1 for each of the {self.num_hidden_layers} "
                             f"layers, got {self.no_rope_layers!r}")
        object.__setattr__(self, "no_rope_layers", tuple(layers))

    def _check_granite(self) -> None:
        """Granite's multipliers: positive numbers (the attention's 1 where not given, as in
        transformers); refused with other values for the other families."""
        if self.model_type != "granite":
            self._refuse_fields(_GRANITE_FIELDS, "granite")
            return
        if self.attention_multiplier is None:
            object.__setattr__(self, "attention_multiplier", 1.0)
        for name in _GRANITE_FIELDS:
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))

    def _check_gemma2(self) -> None:
        gemma2 = {name: getattr(self, name) for name in _GEMMA2_FIELDS}
        if self.model_type in _SANDWICH:
            if self.query_pre_attn_scalar is None:  # head_dim**-0.5, as for the other families
                object.__setattr__(self, "query_pre_attn_scalar", self.head_dim)
        else:
            given = [f"{name}={value!r}" for name, value in gemma2.items()
                     if value not in (None, ()) and name != "layer_types"]  # _check_layer_types
            if given:
                raise ValueError(f"{', '.join(given)} given for model_type {self.model_type!r}; only "
                                 "gemma2 and gemma3_text have them")
            return
        if self.model_type == "gemma3_text":
            if self.attn_logit_softcapping is not None:
                raise ValueError(f"attn_logit_softcapping={self.attn_logit_softcapping!r} given for "
                                 "model_type 'gemma3_text', whose attention transformers never soft-caps")
            if self.rope_local_theta is None:
                raise ValueError("model_type 'gemma3_text' needs rope_local_theta (a positive number)")
        if self.query_pre_attn_scalar is not None:
            object.__setattr__(self, "query_pre_attn_scalar",
                               _whole_positive_int("query_pre_attn_scalar", self.query_pre_attn_scalar))
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if gemma2[name] is not None:
                object.__setattr__(self, name, _positive_float(name, gemma2[name]))

    def _check_partial_rotary(self) -> None:
        factor = self.partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}")
        object.__setattr__(self, "partial_rotary_factor", float(factor))
        if factor != 1 and self.model_type != "phi3":  # the others' transformers code turns whole heads
            raise ValueError(f"partial_rotary_factor={factor!r} is only supported for model_type 'phi3', "
                             f"not {self.model_type!r}")
        if self.rotary_base_dim < 1:
            raise ValueError(f"partial_rotary_factor={factor!r} turns int({self.head_dim} * {factor!r}) = 0 "
                             "dimensions of each head")

    def _check_experts(self) -> None:
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.model_type not in MOE_FAMILY:
            given = [f"{name}={getattr(self, name)!r}" for name in _EXPERT_FIELDS
                     if getattr(self, name) != _field_default(type(self), name)]
            if given:
                raise ValueError(f"{', '.join(given)} given for model_type {self.model_type!r}, which has no "
                                 f"experts; mixture-of-experts types: {', '.join(MOE_FAMILY)}")
            return
        if self.num_experts is None:
            raise ValueError(f"model_type {self.model_type!r} needs num_experts (a positive integer)")
        for name in ("num_experts", "num_experts_per_tok", "decoder_sparse_step"):
            _check_positive_int(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        for name in ("norm_topk_prob", "output_router_logits"):
            _check_bool(name, getattr(self, name))
        for name in ("router_aux_loss_coef", "router_jitter_noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.router_jitter_noise and self.model_type != "mixtral":
            raise ValueError(f"router_jitter_noise is only supported for model_type 'mixtral', "
                             f"not {self.model_type!r}")
        layers = self.mlp_only_layers
        # An index past the layers names no layer, as in transformers.
        if not isinstance(layers, tuple) or any(isinstance(i, bool) or not isinstance(i, int)
                                                for i in layers):
            raise ValueError(f"mlp_only_layers must list layer indices (integers), got {layers!r}")
        if self.model_type in ("mixtral", "gpt_oss"):
            # Both route every layer, their weights sum to 1 and their experts are intermediate_size wide.
            if self.moe_intermediate_size not in (None, self.intermediate_size):
                raise ValueError(f"{self.model_type} experts are intermediate_size "
                                 f"({self.intermediate_size}) wide; got "
                                 f"moe_intermediate_size={self.moe_intermediate_size!r}")
            if self.decoder_sparse_step != 1 or layers:
                raise ValueError(f"{self.model_type} routes every layer: decoder_sparse_step and "
                                 "mlp_only_layers cannot change")
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
            object.__setattr__(self, "norm_topk_prob", True)
        _check_positive_int("moe_intermediate_size", self.moe_intermediate_size)
        if self.model_type == "qwen2_moe":
            _check_positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        elif self.shared_expert_intermediate_size is not None:
            raise ValueError(f"shared_expert_intermediate_size is only supported for model_type 'qwen2_moe', "
                             f"not {self.model_type!r}")

    # Structural switches decided by the family.
    @property
    def family(self) -> str:
        """The dense family whose attention this model has: the model type, or for a
        mixture-of-experts type its dense counterpart (mixtral: mistral)."""
        return MOE_FAMILY.get(self.model_type, self.model_type)

    @property
    def rotary_base_dim(self) -> int:
        """int(head_dim * partial_rotary_factor) (int, not round: 100 * 0.29 gives 28): the
        dimension transformers' frequencies are computed over, 1 / theta^(2i / this)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each query and key head that the rotary embedding turns: one
        frequency per pair of `rotary_base_dim`, rounded up, so one more where that is odd (as in
        transformers, whose cos and sin tables set the width turned)."""
        return self.rotary_base_dim + self.rotary_base_dim % 2

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "gemma3_text", *_OLMO)

    @property
    def qk_norm_across_heads(self) -> bool:
        """OLMo 2's q and k norms: one RMSNorm over all heads' features (num_heads * head_dim, and
        num_key_value_heads * head_dim), not one per head (Qwen 3's, Gemma 3's)."""
        return self.family in _OLMO

    @property
    def post_norms(self) -> bool:
        """OLMo 2's layer: a norm after attention and after the MLP (on their outputs, before the
        residual sums) and none before them; its norms multiply by the weight in fp32, rounding once."""
        return self.family in _OLMO

    @property
    def fp32_weight_norms(self) -> bool:
        """Norms that multiply by their weight in fp32 and round once (OLMo 2's and gpt-oss's)."""
        return self.family in (*_OLMO, "gpt_oss")

    @property
    def attention_sinks(self) -> bool:
        """gpt-oss: each query head has a learned logit (`self_attn.sinks`) that joins the softmax's
        denominator over every row of scores and takes no value: attention may go nowhere."""
        return self.family == "gpt_oss"

    @property
    def gemma_norms(self) -> bool:
        """Gemma's RMSNorm (times 1 + weight, in fp32), sqrt(hidden_size)-scaled embeddings and
        tanh-approximated GELU in the MLP."""
        return self.family in _GEMMA

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2's (and 3's) layer: norms before and after both attention and the MLP."""
        return self.family in _SANDWICH

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q . k by."""
        if self.attention_multiplier is not None:  # Granite
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rotates(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` applies the rotary embedding to q and k (all do but SmolLM3's
        NoPE layers)."""
        return not self.no_rope_layers or bool(self.no_rope_layers[layer_idx])

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`: `sliding_window`, except on Gemma 2's
        "full_attention" layers."""
        if self.layer_types and self.layer_types[layer_idx] == "full_attention":
            return None
        return self.sliding_window

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` routes tokens to experts (else it has a dense MLP)."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers that route tokens to experts: none for a dense model, and none for a
        mixture-of-experts type whose `mlp_only_layers` or `decoder_sparse_step` leave every layer
        dense (which then runs, trains and is priced as a dense model)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again). Mixtral's and gpt-oss's expert width follows a
        changed `intermediate_size`, as it is derived from it."""
        if (changes.get("model_type", self.model_type) in ("mixtral", "gpt_oss")
                and "moe_intermediate_size" not in changes):
            changes["moe_intermediate_size"] = None
        return dataclasses.replace(self, **changes)

    # Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face `config.json`; unsupported values raise ValueError."""
        d = language_model_dict(d)
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        null = sorted(k for k in _NOT_NULL[model_type] if k in d and d[k] is None)
        if null:
            raise ValueError(
                f"config.json gives null for {', '.join(null)}, which transformers refuses too; "
                "give a value, or leave the key out for the family's default"
            )
        if model_type in _GEMMA:
            d = _read_gemma(model_type, d)
        else:
            act = d.get("hidden_act", "silu")
            if act not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
                raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        if model_type == "gpt_oss":
            d = _read_gpt_oss(d)
        _check_unsupported_features(d, moe=model_type in MOE_FAMILY, softcapping=model_type in _SANDWICH)
        if model_type in MOE_FAMILY:
            d = _read_experts(model_type, d)
        else:  # expert settings of a dense family's config.json (a count is refused above) mean nothing
            d = {k: v for k, v in d.items() if k not in _EXPERT_FIELDS}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and k not in _IGNORED_KEYS)
        if unknown:
            logger.warning("ignoring config.json keys that slipstream does not use: %s", unknown)
        d = _FAMILY_DEFAULTS[model_type] | d
        kwargs: dict[str, Any] = {k: d[k] for k in known if k in d and d[k] is not None}
        if model_type not in _LAYER_TYPED:
            kwargs.pop("layer_types", None)  # Qwen's and SmolLM3's: read by _read_sliding_window
        if model_type == "smollm3" and d.get("no_rope_layers") is None:
            kwargs["no_rope_layers"] = _default_no_rope_layers(d)
        max_positions = kwargs.get("max_position_embeddings", _field_default(cls, "max_position_embeddings"))
        _check_positive_int("max_position_embeddings", max_positions)  # llama3's RoPE default reads it
        if model_type in ("gemma3_text", "olmo3"):
            kwargs["rope_theta"], kwargs["rope_scaling"], kwargs["rope_local_theta"] = _read_layer_type_rope(
                model_type, d, max_positions)
        else:
            kwargs["rope_theta"], kwargs["rope_scaling"] = _read_rope(model_type, d, max_positions)
        if model_type not in ("gemma3_text", "olmo3"):
            kwargs["partial_rotary_factor"] = _read_partial_rotary_factor(d)
        kwargs["dtype"] = _read_dtype(d) or "float32"
        kwargs["sliding_window"] = _read_sliding_window(model_type, d, max_positions, kwargs["rope_scaling"])
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` contents for this config."""
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "gelu_pytorch_tanh" if self.gemma_norms else "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        }
        if self.family in ("llama", "qwen3", *_GEMMA, *_OLMO, "granite", "smollm3"):
            out["attention_bias"] = self.attention_bias
        if self.model_type in ("llama", "granite", "smollm3"):
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "smollm3":
            out |= {"no_rope_layers": list(self.no_rope_layers), "use_sliding_window": False}
        if self.model_type == "granite":
            out |= {name: getattr(self, name) for name in _GRANITE_FIELDS}
        if self.family in _WINDOWED:
            out["sliding_window"] = self.sliding_window
        if self.model_type == "phi3":  # transformers' Phi-3 puts its own over the RoPE block's
            scaling = self.rope_scaling
            out["original_max_position_embeddings"] = (
                self.max_position_embeddings if scaling is None else scaling.original_max_position_embeddings)
            out["partial_rotary_factor"] = self.partial_rotary_factor  # both versions read the top-level key
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        if self.model_type in _SANDWICH:
            # transformers needs a window size even where no layer is windowed; one that covers the
            # context reads back as no window
            window = self.sliding_window or rope_scaled_context(self.model_type, self.max_position_embeddings,
                                                                self.rope_scaling)
            out |= {name: getattr(self, name) for name in _GEMMA2_FIELDS} | {
                "layer_types": list(self.layer_types), "sliding_window": window,
                "hidden_activation": "gelu_pytorch_tanh"}
        if self.model_type == "gemma3_text":  # transformers 4's keys, which transformers 5 reads too
            out["rope_local_base_freq"] = self.rope_local_theta
        if self.model_type == "olmo3":  # only transformers 5 has OLMo 3: its per-layer-type RoPE blocks
            window = self.sliding_window or rope_scaled_context(self.model_type, self.max_position_embeddings,
                                                                self.rope_scaling)
            full = {"rope_type": "default", "rope_theta": self.rope_theta} | (
                self.rope_scaling.to_hf() if self.rope_scaling else {})
            del out["rope_theta"], out["rope_scaling"]
            out |= {"layer_types": list(self.layer_types), "sliding_window": window, "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_theta}}}
        if self.model_type == "gpt_oss":
            window = self.sliding_window or self.max_position_embeddings
            out |= {"layer_types": list(self.layer_types), "sliding_window": window,
                    "attention_bias": self.attention_bias}
            out |= {name: getattr(self, name) for name in _SWIGLU_FIELDS}
        if self.is_moe:
            out |= self._experts_to_hf()
        return out

    def _experts_to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            ("num_local_experts" if self.model_type in ("mixtral", "gpt_oss") else "num_experts"):
                self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": self.output_router_logits,
        }
        if self.model_type == "mixtral":
            return out | {"router_jitter_noise": self.router_jitter_noise}
        if self.model_type == "gpt_oss":
            return out
        out |= {"moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers)}
        if self.model_type == "qwen2_moe":
            out |= {"shared_expert_intermediate_size": self.shared_expert_intermediate_size, "qkv_bias": True}
        return out

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read `model_dir/config.json`. Where it names no dtype, the dtype is the one the
        directory's safetensors headers record (`weights.stored_dtype`), as vLLM's `dtype="auto"`
        reads it, so a bf16 checkpoint is not served in float32; float32 without safetensors."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a JSON object")
        d = language_model_dict(d)
        config = cls.from_hf_dict(d)
        if _read_dtype(d) is None:
            from slipstream.model.weights import dtype_name, stored_dtype  # weights imports this module

            dtype = stored_dtype(model_dir)
            if dtype is not None:
                config = config.replace(dtype=dtype_name(dtype))
        return config

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Write `model_dir/config.json` (creating the directory)."""
        path = Path(model_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


_SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
_GEMMA_SHAPE = {"vocab_size": 256000, "head_dim": 256, "max_position_embeddings": 8192,
                "tie_word_embeddings": True}
_QWEN = _SHAPE | {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _SHAPE | {"vocab_size": 32000, "intermediate_size": 11008},
    "mistral": _SHAPE | {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                         "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "phi3": _SHAPE | {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "qwen2": _QWEN,
    "qwen3": _QWEN | {"head_dim": 128},
    "gemma": _GEMMA_SHAPE | {"hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
                             "num_attention_heads": 16, "num_key_value_heads": 16},
    "gemma2": _GEMMA_SHAPE | {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                              "num_attention_heads": 8, "num_key_value_heads": 4,
                              "query_pre_attn_scalar": 256, "sliding_window": 4096,
                              "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": _GEMMA_SHAPE | {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                   "num_hidden_layers": 26, "num_attention_heads": 8,
                                   "num_key_value_heads": 4, "max_position_embeddings": 131072,
                                   "query_pre_attn_scalar": 256,
                                   "sliding_window": 4096},
    "olmo2": _SHAPE | {"vocab_size": 50304, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5},
    "olmo3": _SHAPE | {"vocab_size": 50304, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "sliding_window": 4096},
    "granite": _SHAPE | {"vocab_size": 32000, "intermediate_size": 11008, "attention_multiplier": 1.0},
    "smollm3": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
                "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
                "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 2e6},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2, "num_experts": 8},
    "qwen2_moe": _QWEN | {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
                          "num_experts": 60},
    "qwen3_moe": _QWEN | {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                          "num_attention_heads": 32, "num_key_value_heads": 4, "moe_intermediate_size": 768,
                          "num_experts_per_tok": 8, "num_experts": 128},
    "gpt_oss": {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                "sliding_window": 128, "attention_bias": True, "num_experts": 128, "num_experts_per_tok": 4},
}
"""What the family's config class in transformers assumes for a key that config.json leaves out,
where ModelConfig has no default or another one (Qwen's `sliding_window` and `max_window_layers`
only matter with `use_sliding_window`). A key present with null keeps null's meaning where
transformers accepts the null (a Mistral without a window, a Llama's kv heads or head_dim derived)
and is refused where transformers refuses it (`_NOT_NULL`). vLLM reads configs through
transformers, so these are its defaults too. Not the special tokens (transformers' Llama assumes
ids 1 and 2): the tokenizer and generation_config.json name those."""

_NOT_NULL_ANY = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
    }
)
_NOT_NULL_EXPERTS = frozenset({"decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok",
                               "num_experts", "norm_topk_prob", "output_router_logits",
                               "router_aux_loss_coef"})
_NOT_NULL_GEMMA2 = (_NOT_NULL_ANY - {"hidden_act"}) | {
    "head_dim", "attention_bias", "attention_dropout", "num_key_value_heads", "hidden_activation",
    "query_pre_attn_scalar", "sliding_window"}  # a null window fails in transformers' forward
_NOT_NULL = {
    "llama": _NOT_NULL_ANY | {"attention_bias", "mlp_bias"},
    "mistral": _NOT_NULL_ANY | {"num_key_value_heads", "attention_dropout"},
    "phi3": _NOT_NULL_ANY | {"attention_dropout", "resid_pdrop", "embd_pdrop",
                             "original_max_position_embeddings"},
    "qwen2": _NOT_NULL_ANY | {"use_sliding_window", "max_window_layers", "attention_dropout"},
    "qwen3": _NOT_NULL_ANY | {"head_dim", "attention_bias", "use_sliding_window", "max_window_layers",
                              "attention_dropout"},
    "gemma": _NOT_NULL_ANY | {"head_dim", "attention_bias", "attention_dropout", "num_key_value_heads"},
    "gemma2": _NOT_NULL_GEMMA2,
    "gemma3_text": _NOT_NULL_GEMMA2,
    "olmo2": _NOT_NULL_ANY | {"attention_bias", "attention_dropout"},
    "olmo3": _NOT_NULL_ANY | {"attention_bias", "attention_dropout"},
    "smollm3": _NOT_NULL_ANY | {"attention_bias", "attention_dropout", "mlp_bias", "use_sliding_window",
                                "no_rope_layer_interval"},
    "granite": _NOT_NULL_ANY | {"attention_bias", "attention_dropout", "mlp_bias", "embedding_multiplier",
                                "logits_scaling", "residual_multiplier", "attention_multiplier"},
    "mixtral": _NOT_NULL_ANY | {"num_key_value_heads", "attention_dropout", "num_experts_per_tok",
                                "num_local_experts", "num_experts", "output_router_logits",
                                "router_aux_loss_coef", "router_jitter_noise"},
    "qwen2_moe": _NOT_NULL_ANY | _NOT_NULL_EXPERTS | {
        "use_sliding_window", "max_window_layers", "attention_dropout", "shared_expert_intermediate_size",
        "qkv_bias", "num_key_value_heads"},
    "qwen3_moe": _NOT_NULL_ANY | _NOT_NULL_EXPERTS | {
        "num_key_value_heads", "attention_bias", "use_sliding_window", "attention_dropout"},
    "gpt_oss": _NOT_NULL_ANY | {"num_local_experts", "num_experts", "head_dim", "num_key_value_heads",
                                "attention_dropout", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit",
                                "router_aux_loss_coef", "output_router_logits", "attention_bias"},
}
"""The config.json keys for which the family's config class in transformers 5 refuses null (a field
typed without None), or keeps a null its model cannot be built with (Mixtral's num_experts, Qwen2-MoE's
num_key_value_heads); for the others null means "derived" or "none" (or the key is no field of that
class, as `mlp_bias` of Mistral), and slipstream reads it so."""

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


# Keys whose presence (with a value other than the harmless one) changes the math in ways this
# decoder does not implement; better a clear error than wrong logits.
_UNSUPPORTED_FEATURES = {
    "quantization_config": None,
    "compression_config": None,  # compressed-tensors' older name for it
    "use_mrope": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}
_GRANITE_FIELDS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
"""ModelConfig's Granite fields, which the other model types leave at their defaults."""
_SWIGLU_FIELDS = ("swiglu_limit", "swiglu_alpha")
"""ModelConfig's gpt-oss expert activation fields, which the other model types leave at their defaults."""
_GEMMA2_FIELDS = ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
"""ModelConfig's Gemma 2 fields, which the other model types leave unset."""
_EXPERT_KEYS = ("num_experts", "num_local_experts")
_EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
                  "router_aux_loss_coef", "output_router_logits", "router_jitter_noise")
"""ModelConfig's mixture-of-experts fields, which a dense model type leaves at their defaults."""
"""The two spellings of the expert count: Mixtral's (which transformers 5 also writes for Qwen3-MoE)
and Qwen's."""


def _check_unsupported_features(d: dict[str, Any], *, moe: bool, softcapping: bool) -> None:
    """Refuse the keys of `_UNSUPPORTED_FEATURES` (but soft-capping where the family has it) and an
    expert count for a dense family."""
    # transformers 5 keeps use_mrope and the like in the RoPE block (Gemma 3's and OLMo 3's blocks
    # per layer type are read by _read_layer_type_rope)
    rope = {} if d.get("model_type") in ("gemma3_text", "olmo3") else _rope_block(d)[1]
    for fields in (d, rope):
        for key, harmless in _UNSUPPORTED_FEATURES.items():
            if softcapping and key in _GEMMA2_FIELDS:
                continue
            if key in fields and fields[key] != harmless:
                raise ValueError(f"unsupported config.json field {key}={fields[key]!r}")
    if not moe:
        for key in _EXPERT_KEYS:
            if d.get(key) is not None:
                raise ValueError(f"unsupported config.json field {key}={d[key]!r}: model_type "
                                 f"{d.get('model_type')!r} has no experts; use {', '.join(MOE_FAMILY)}")


def _read_experts(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """`d` with the expert count under `num_experts` whichever spelling it used, and the keys that
    only hold one value here checked (Mixtral has no norm_topk_prob: it always renormalises)."""
    given = {key: d[key] for key in _EXPERT_KEYS if d.get(key) is not None}
    for key, count in given.items():
        _check_positive_int(key, count)
    if len(set(given.values())) > 1:
        raise ValueError(f"config.json gives num_experts={given['num_experts']!r} and "
                         f"num_local_experts={given['num_local_experts']!r}; they name the same count")
    d = {k: v for k, v in d.items() if k != "num_local_experts"}
    if given:
        d["num_experts"] = next(iter(given.values()))
    if model_type in ("mixtral", "gpt_oss"):
        for key in ("norm_topk_prob", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
            d.pop(key, None)  # not Mixtral or gpt-oss config fields: transformers ignores them
    if model_type != "mixtral":
        d.pop("router_jitter_noise", None)  # Mixtral's alone
    if model_type == "qwen2_moe" and d.get("qkv_bias", True) is not True:
        raise ValueError(f"qwen2_moe with qkv_bias={d['qkv_bias']!r} is not supported (only q/k/v with bias)")
    if d.get("mlp_only_layers") is None:
        d.pop("mlp_only_layers", None)
    return d


_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
"""transformers' RoPE block for a gpt-oss config.json that gives none."""


def _read_gpt_oss(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with transformers' default RoPE block where it gives none, and its MXFP4 quantization
    taken (`weights` dequantizes the experts to the load dtype; any other is refused as for the
    other families), and `layer_types` checked as a list where given."""
    if not d.get("rope_scaling") and not d.get("rope_parameters"):
        d = d | {"rope_parameters": dict(_GPT_OSS_ROPE)}
    quantization = d.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        d = {k: v for k, v in d.items() if k != "quantization_config"}
    if d.get("layer_types") is not None and not isinstance(d["layer_types"], list):
        raise ValueError(f"layer_types must be a list or null, got {d['layer_types']!r}")
    return d


def _read_gemma(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """`d` with Gemma's activation checked and Gemma 2's and 3's `layer_types` filled in. Gemma
    reads `hidden_act`, in which transformers reads the "gelu" of the original releases as the tanh
    approximation they were trained with; Gemma 2 and 3 read `hidden_activation`. Without
    `layer_types`, as in transformers, Gemma 2's layers alternate from a windowed layer 0, and
    Gemma 3's window all but every `sliding_window_pattern`-th (6th by default)."""
    key = "hidden_activation" if model_type in _SANDWICH else "hidden_act"
    act = d.get(key, "gelu_pytorch_tanh")
    other = d.get("hidden_activation")
    if model_type == "gemma" and other not in (None, "gelu_pytorch_tanh"):
        # transformers' Gemma reads hidden_act only; vLLM's prefers this key (exact GELU for "gelu")
        raise ValueError(f"unsupported hidden_activation {other!r} for model_type 'gemma' (transformers "
                         "ignores it, vLLM does not); leave it out or give 'gelu_pytorch_tanh'")
    if act not in ("gelu_pytorch_tanh", "gelu") or (act == "gelu" and model_type in _SANDWICH):
        raise ValueError(f"unsupported {key} {act!r} for model_type {model_type!r}; only "
                         "'gelu_pytorch_tanh' (GeGLU with tanh-approximated GELU) is supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (a causal decoder only)")
    if model_type == "gemma":
        return d
    if model_type == "gemma3_text" and d.get("attn_logit_softcapping") is not None:
        logger.warning("ignoring attn_logit_softcapping=%r: transformers' Gemma 3 does not apply it",
                       d["attn_logit_softcapping"])
        d = d | {"attn_logit_softcapping": None}
    layers = d.get("num_hidden_layers", _FAMILY_DEFAULTS[model_type]["num_hidden_layers"])
    _check_positive_int("num_hidden_layers", layers)
    pattern = d.get("sliding_window_pattern", 6) if model_type == "gemma3_text" else 2
    _check_positive_int("sliding_window_pattern", pattern)
    if d.get("layer_types") is None:
        d = d | {"layer_types": list(_patterned_layer_types(layers, pattern))}
    elif not isinstance(d["layer_types"], list):
        raise ValueError(f"layer_types must be a list or null, got {d['layer_types']!r}")
    return d


def _default_no_rope_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` where config.json gives none, as transformers derives them: a
    NoPE layer (0) every `no_rope_layer_interval` (default 4) layers."""
    interval = d.get("no_rope_layer_interval", 4)
    _check_positive_int("no_rope_layer_interval", interval)
    layers = d["num_hidden_layers"]
    _check_positive_int("num_hidden_layers", layers)
    return tuple(int((i + 1) % interval != 0) for i in range(layers))


def _patterned_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every `pattern`-th layer "full_attention", the others "sliding_attention" (transformers'
    default: Gemma 2's pattern is 2, Gemma 3's `sliding_window_pattern`, 6, OLMo 3's 4)."""
    return tuple(LAYER_TYPES[(i + 1) % pattern != 0] for i in range(num_layers))


def _read_layer_type_rope(
    model_type: str, d: dict[str, Any], max_positions: int
) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's and OLMo 3's RoPE as transformers 5 reads it (their configs'
    `convert_rope_params_to_dict`): `rope_parameters` holds a block per layer type (default RoPE for
    both where absent); a `rope_scaling` (transformers 4's key) updates the "full_attention" block.
    Gemma 3: the full block's theta defaults to config.json's `rope_theta` (else 1e6), the
    "sliding_attention" block's to `rope_local_base_freq` (else 1e4). OLMo 3: the full block's to
    `rope_theta` (else 5e5), and the sliding block's to 5e5 even where `rope_theta` is given
    (transformers takes the key for the full block only). Returns the full-attention layers' theta
    and scaling and the sliding ones' theta; those must take default RoPE."""
    blocks = d.get("rope_parameters") or {}
    if (not isinstance(blocks, dict) or any(k not in LAYER_TYPES for k in blocks)
            or any(not isinstance(blocks.get(t) or {}, dict) for t in LAYER_TYPES)):
        raise ValueError(f"{model_type} rope_parameters must hold a block per layer type "
                         f"({', '.join(LAYER_TYPES)}), got {blocks!r}")
    full = dict(blocks.get("full_attention") or {"rope_type": "default"})
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {scaling!r}")
    full.update(scaling or {})
    gemma = model_type == "gemma3_text"
    full.setdefault("rope_theta", d.get("rope_theta", 1e6 if gemma else 5e5))
    sliding = dict(blocks.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", d.get("rope_local_base_freq", 1e4) if gemma else 5e5)
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise ValueError(f"unsupported sliding_attention rope_type {sliding.get('rope_type')!r} for "
                         f"model_type {model_type!r}; supported: default")
    theta, rope_scaling = _read_rope(model_type, {"rope_parameters": full}, max_positions)
    name = "rope_local_base_freq" if gemma else "sliding_attention rope_theta"
    return theta, rope_scaling, _positive_float(name, sliding["rope_theta"])


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _whole_positive_int(name: str, value: Any) -> int:
    """`value` as an int, where it is a positive integer or a float with no fractional part (JSON
    writers such as transformers' own may spell 8192 as 8192.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    _check_positive_int(name, value)
    return value


def _positive_float(name: str, value: Any) -> float:
    """`value` as a float, where it is a positive finite JSON number (an int such as 1 included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _check_token_ids(name: str, value: Any, *, many: bool = False) -> None:
    """None, an integer token id or, where `many`, a list of them; not a string such as "0"."""
    ids = value if many and isinstance(value, (list, tuple)) else [value]
    if value is not None and any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        kind = "a token id or a list of them" if many else "a token id"
        raise ValueError(f"{name} must be {kind} (integers), got {value!r}")


def _field_default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _rope_block(d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The key and contents of the RoPE block transformers 5 reads (`convert_rope_params_to_dict`):
    a non-empty `rope_scaling` (the transformers 4 key, which model cards still tell users to add
    for longer contexts) replaces `rope_parameters` whole."""
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    block = d.get(key) or {}
    if not isinstance(block, dict):
        raise ValueError(f"{key} must be an object or null, got {block!r}")
    nested = sorted(k for k, v in block.items() if isinstance(v, dict))
    if nested:
        # transformers 5's per-layer-type spelling: its Llama reads it as default RoPE, dropping them
        raise ValueError(
            f"{key} holds a block per layer type ({', '.join(nested)}); slipstream reads one RoPE "
            "block for all layers"
        )
    return key, block


def _read_rope(
    model_type: str, d: dict[str, Any], max_position_embeddings: int
) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling as transformers 5 (and so vLLM) reads either spelling: the block of
    `_rope_block`, whose own `rope_theta` wins over a top-level one (10000 where neither is given),
    its keys required as transformers requires them, except that llama3's
    `original_max_position_embeddings` defaults to `max_position_embeddings`. Only the keys the
    rope type uses are read (a linear block's `original_max_position_embeddings` is ignored, as
    transformers ignores it). Phi-3 takes default RoPE or its longrope ("su" and "yarn" read as
    longrope, as transformers' Phi-3 reads them), whose `original_max_position_embeddings` is
    config.json's top-level one (Phi-3's default 4096 where it has none; a block's own is replaced,
    as transformers replaces it), whose `factor` defaults to max_position_embeddings / original and
    whose `attention_factor` to sqrt(1 + ln(factor) / ln(original)) (1 for a factor <= 1)."""
    key, block = _rope_block(d)
    theta = block["rope_theta"] if "rope_theta" in block else d.get("rope_theta", 10000.0)
    rope_type = block.get("rope_type", block.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    supported = ("default", "longrope") if model_type == "phi3" else ROPE_TYPES
    if rope_type not in supported:
        raise ValueError(
            f"unsupported {key} rope_type {rope_type!r} for model_type {model_type!r}; "
            f"supported: {', '.join(supported)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, _read_longrope(key, block, d, max_position_embeddings)
    required = (("factor",) if rope_type in ("linear", "yarn")
                else ("factor", "low_freq_factor", "high_freq_factor"))
    missing = [name for name in required if name not in block]
    if missing:
        raise ValueError(f"{key} of rope_type {rope_type!r} lacks {', '.join(missing)}")
    values = {name: block[name] for name in required}
    if rope_type in ("llama3", "yarn"):
        values["original_max_position_embeddings"] = block.get(
            "original_max_position_embeddings", max_position_embeddings
        )
    if rope_type == "yarn":
        values |= _read_yarn_options(block, values, max_position_embeddings)
    return theta, RopeScaling(rope_type=rope_type, **values)


def _read_yarn_options(block: dict[str, Any], values: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """A yarn block's keys beyond `factor`, as transformers' `_compute_yarn_parameters` reads them:
    a null factor is max_position_embeddings / original; a null or zero beta or mscale takes the
    default (its `or 32`, `or 1` and truthiness tests); `attention_factor` and `truncate` where given."""
    options: dict[str, Any] = {}
    if values["factor"] is None:
        original = _whole_positive_int("rope_scaling original_max_position_embeddings",
                                       values["original_max_position_embeddings"])
        options["factor"] = max_positions / original
    options |= {name: block[name] for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
                if block.get(name)}
    given = ("attention_factor", "truncate")
    return options | {name: block[name] for name in given if block.get(name) is not None}


def _read_partial_rotary_factor(d: dict[str, Any]) -> Any:
    """The RoPE block's `partial_rotary_factor` (transformers 5 writes it there and at the top
    level), else the top-level one (transformers 4's place), else 1; checked by ModelConfig."""
    _, block = _rope_block(d)
    return block.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))


def _read_longrope(
    key: str, block: dict[str, Any], d: dict[str, Any], max_position_embeddings: int
) -> RopeScaling:
    missing = [name for name in ("short_factor", "long_factor") if name not in block]
    if missing:
        raise ValueError(f"{key} of rope_type 'longrope' lacks {', '.join(missing)}")
    # transformers' Phi3Config always has a top-level value (4096 by default), and it replaces the
    # block's (`standardize_rope_params`); vLLM reads configs through transformers.
    original = _whole_positive_int("original_max_position_embeddings",
                                   d.get("original_max_position_embeddings", 4096))
    if block.get("original_max_position_embeddings", original) != original:
        logger.warning("%s original_max_position_embeddings %r is not used: config.json's top-level %d is "
                       "(as transformers reads it)", key, block["original_max_position_embeddings"], original)
    ignored = sorted(k for k in ("short_mscale", "long_mscale") if k in block)
    if ignored:
        logger.warning("ignoring %s keys %s, as transformers does (cos and sin are scaled by "
                       "attention_factor)", key, ignored)
    factor = block.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=block["short_factor"], long_factor=block["long_factor"],
                       attention_factor=block.get("attention_factor"))


MULTIMODAL_TEXT_TYPES = {"gemma3": "gemma3_text"}
"""Multimodal model types whose language model slipstream reads (text in, text out; the vision
tower is not loaded), with the model type of that language model."""

_MULTIMODAL_TOP_LEVEL_KEYS = ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
                              "quantization_config", "compression_config")
"""Keys a multimodal config.json gives at its top level for the whole model, its language model
included: they win over `text_config`'s (Gemma 3's checkpoints name their end-of-turn ids there,
which transformers' generation config takes, while transformers 5 writes `text_config`'s defaults
beside them), and a quantization there is refused as it is in a text model's config.json."""


def language_model_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of the language model: `d` itself, or for a multimodal checkpoint
    (Gemma 3's Gemma3ForConditionalGeneration) its `text_config`, with the top level's keys for
    the whole model (`_MULTIMODAL_TOP_LEVEL_KEYS`) over it, and `tie_word_embeddings` from the top
    level only (default true), since transformers ties the multimodal model's LM head by that flag. Its
    final logit soft cap is dropped, as the multimodal model never applies it (the released
    checkpoints have none)."""
    if d.get("model_type") == "llava":
        return _llava_language_model_dict(d)
    text_type = MULTIMODAL_TEXT_TYPES.get(d.get("model_type"))
    if text_type is None:
        return d
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"config.json's text_config must be an object, got {text!r}")
    if text.get("model_type", text_type) != text_type:
        raise ValueError(f"a {d['model_type']!r} config.json's text_config has model_type "
                         f"{text['model_type']!r}; expected {text_type!r}")
    top = {key: d[key] for key in _MULTIMODAL_TOP_LEVEL_KEYS if key in d}
    logger.info("reading the language model of a multimodal %r checkpoint (images are not supported)",
                d["model_type"])
    if text.get("final_logit_softcapping") is not None:
        logger.warning("ignoring text_config's final_logit_softcapping=%r: transformers' multimodal Gemma 3 "
                       "does not soft-cap its logits", text["final_logit_softcapping"])
    return text | top | {"model_type": text_type, "tie_word_embeddings": d.get("tie_word_embeddings", True),
                         "final_logit_softcapping": None}


def _llava_language_model_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA checkpoint's language model (LlavaForConditionalGeneration): its `text_config`, of
    any text family slipstream serves (transformers' default: llama), with the top level's keys for
    the whole model over it. As transformers' LlavaConfig, the model ties its head where the top
    level or the text config says so (each by its own default where it says nothing)."""
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"config.json's text_config must be an object, got {text!r}")
    text_type = text.get("model_type", "llama")
    if text_type not in MODEL_TYPES:
        raise ValueError(f"unsupported text_config.model_type {text_type!r} of a llava checkpoint; "
                         f"supported: {', '.join(MODEL_TYPES)}")
    top = {key: d[key] for key in _MULTIMODAL_TOP_LEVEL_KEYS if key in d}
    tie = {"tie_word_embeddings": True} if d.get("tie_word_embeddings") is True else {}
    return text | top | {"model_type": text_type} | tie


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times longer (Eq. 21 of arXiv:2309.00071:
    0.1 * mscale * ln(factor) + 1, and 1 for a factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _read_dtype(d: dict[str, Any]) -> str | None:
    """The dtype config.json names, None where it names none."""
    dtype = d.get("dtype") or d.get("torch_dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} in config.json; supported: {', '.join(DTYPES)}")
    return dtype


def rope_scaled_context(model_type: str, max_positions: int, rope_scaling: RopeScaling | None) -> int:
    """The longest context the model's positions cover, as vLLM's `_get_and_verify_max_len` derives
    it: `max_positions` times the factor of a linear RoPE scaling (whose positions are divided by
    it; llama3 scaling and longrope keep the original range), except for Gemma 3, whose
    `max_position_embeddings` counts the scaled positions already."""
    if rope_scaling is not None and rope_scaling.rope_type == "linear" and model_type != "gemma3_text":
        return int(max_positions * rope_scaling.factor)
    return max_positions


def _read_sliding_window(
    model_type: str, d: dict[str, Any], max_positions: int, rope_scaling: RopeScaling | None
) -> int | None:
    """Mistral's (and Gemma 2's) window, None where it covers the whole context (plain causal attention): the
    context the engine serves, `max_position_embeddings` times a linear RoPE factor. Qwen's
    windowed layers are refused; its window is none, as in transformers, unless
    `use_sliding_window` with a window and a windowed layer: one that `layer_types` names
    "sliding_attention" or, where config.json gives no `layer_types`, as transformers derives them:
    qwen2 and qwen3 window the layers at or past `max_window_layers`, qwen2_moe the even ones
    below it, and qwen3_moe (no `layer_types`) every layer."""
    if MOE_FAMILY.get(model_type, model_type) in (*_WINDOWED, *_LAYER_TYPED):
        window = d.get("sliding_window")
        if window is None:
            return None
        _check_positive_int("sliding_window", window)
        context = rope_scaled_context(model_type, max_positions, rope_scaling)
        return None if window >= context else window
    use = d.get("use_sliding_window")  # a null one is refused for Qwen (_NOT_NULL), no field of Llama
    if use is None:
        return None
    _check_bool("use_sliding_window", use)
    if use and model_type in ("llama", "smollm3"):
        raise ValueError(f"use_sliding_window=True is not supported for model_type {model_type!r}")
    if not use or d["sliding_window"] is None:
        return None
    layer_types = d.get("layer_types")
    if model_type == "qwen3_moe":
        windowed = True
    elif layer_types is None:
        first, layers = d["max_window_layers"], d["num_hidden_layers"]
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"max_window_layers must be an integer, got {first!r}")
        _check_positive_int("num_hidden_layers", layers)
        windowed = first > 0 if model_type == "qwen2_moe" else first < layers
    elif isinstance(layer_types, list):
        windowed = "sliding_attention" in layer_types
    else:
        raise ValueError(f"layer_types must be a list or null, got {layer_types!r}")
    if windowed:
        raise ValueError(
            f"use_sliding_window=True with windowed layers is not supported for model_type {model_type!r}"
        )
    return None
