"""Named model shapes: small ones we create and train here, real ones for planning.

`tiny` (~16M parameters) and `small` (~125M) are the shapes the README, tests and benchmarks use
on a CPU; `tiny-gemma2` is `tiny` as Gemma 2 builds it; `tiny-moe` is a mixture-of-experts model
(Mixtral's shape) whose two active experts of eight are together as wide as `tiny`'s MLP, trained
with the load-balancing loss (`output_router_logits`, Switch Transformer's coefficient 0.01). The
larger presets are the published shapes of real models (as their Hugging Face `config.json` files
give them); they exist as configs for the performance model and are too big to initialise on a
small machine.
"""

from __future__ import annotations

import dataclasses

from slipstream.model.config import ModelConfig, RopeScaling


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    name: str
    config: ModelConfig
    description: str
    config_only: bool = False
    """Too large to create with random weights here; usable as a shape for planning."""


_LLAMA3_ROPE = dict(rope_theta=500000.0, max_position_embeddings=131072)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="tiny",
            description="~16M Llama shape for quick CPU training and tests",
            config=ModelConfig(
                vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
            ),
        ),
        Preset(
            name="tiny-moe",
            description="~37M Mixtral shape, 8 experts, top 2 (~16M active, as tiny), for CPU training",
            config=ModelConfig(
                model_type="mixtral", vocab_size=8192, hidden_size=384, intermediate_size=512,
                num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                max_position_embeddings=2048, num_experts=8, num_experts_per_tok=2,
                output_router_logits=True, router_aux_loss_coef=0.01,
            ),
        ),
        Preset(
            name="tiny-gemma2",
            description="~13M Gemma 2 shape (every other layer windowed, soft-capped scores and logits)",
            config=ModelConfig(
                model_type="gemma2", vocab_size=8192, hidden_size=384, intermediate_size=1024,
                num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=2048, sliding_window=512, tie_word_embeddings=True,
                layer_types=("sliding_attention", "full_attention") * 3, query_pre_attn_scalar=64,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            ),
        ),
        Preset(
            name="small",
            description="~125M Llama shape (GPT-2 small class), the serving benchmark model",
            config=ModelConfig(
                vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
            ),
        ),
        Preset(
            name="medium",
            description="~360M Llama shape",
            config=ModelConfig(
                vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
            ),
        ),
        Preset(
            name="llama3.2-1b",
            description="Llama 3.2 1B shape (meta-llama/Llama-3.2-1B config.json)",
            config_only=True,
            config=ModelConfig(
                vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                tie_word_embeddings=True, rms_norm_eps=1e-5, dtype="bfloat16",
                rope_scaling=RopeScaling(rope_type="llama3", factor=32.0), **_LLAMA3_ROPE,
            ),
        ),
        Preset(
            name="llama3-8b",
            description="Llama 3.1 8B shape (meta-llama/Llama-3.1-8B config.json)",
            config_only=True,
            config=ModelConfig(
                vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, dtype="bfloat16",
                rope_scaling=RopeScaling(rope_type="llama3", factor=8.0), **_LLAMA3_ROPE,
            ),
        ),
        Preset(
            name="llama3-70b",
            description="Llama 3.1 70B shape (meta-llama/Llama-3.1-70B config.json)",
            config_only=True,
            config=ModelConfig(
                vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, dtype="bfloat16",
                rope_scaling=RopeScaling(rope_type="llama3", factor=8.0), **_LLAMA3_ROPE,
            ),
        ),
        Preset(
            name="llama3-405b",
            description="Llama 3.1 405B shape (meta-llama/Llama-3.1-405B config.json)",
            config_only=True,
            config=ModelConfig(
                vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                rms_norm_eps=1e-5, dtype="bfloat16",
                rope_scaling=RopeScaling(rope_type="llama3", factor=8.0), **_LLAMA3_ROPE,
            ),
        ),
        Preset(
            name="gemma2-2b",
            description="Gemma 2 2B shape (google/gemma-2-2b config.json)",
            config_only=True,
            config=ModelConfig(
                model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                max_position_embeddings=8192, sliding_window=4096, tie_word_embeddings=True,
                layer_types=("sliding_attention", "full_attention") * 13, query_pre_attn_scalar=256,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, bos_token_id=2,
                eos_token_id=1, pad_token_id=0, dtype="float32",
            ),
        ),
        Preset(
            name="gemma3-1b",
            description="Gemma 3 1B shape (google/gemma-3-1b-pt config.json)",
            config_only=True,
            config=ModelConfig(
                model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                max_position_embeddings=32768, sliding_window=512, tie_word_embeddings=True,
                query_pre_attn_scalar=256, rope_theta=1e6, rope_local_theta=1e4, bos_token_id=2,
                eos_token_id=1, pad_token_id=0, dtype="bfloat16",
            ),
        ),
        Preset(
            name="mixtral-8x7b",
            description="Mixtral 8x7B shape, 8 experts, top 2 (mistralai/Mixtral-8x7B-v0.1 config.json)",
            config_only=True,
            config=ModelConfig(
                model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, num_experts=8,
                num_experts_per_tok=2, router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2,
                dtype="bfloat16",
            ),
        ),
        Preset(
            name="qwen3-30b-a3b",
            description="Qwen3-30B-A3B shape, 128 experts, top 8 (Qwen/Qwen3-30B-A3B config.json)",
            config_only=True,
            config=ModelConfig(
                model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, num_experts=128,
                num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
            ),
        ),
        *(Preset(
            name=f"gpt-oss-{size}",
            description=f"gpt-oss-{size} shape, {experts} experts, top 4, a 128-token window on every "
                        f"other layer (openai/gpt-oss-{size} config.json; experts dequantized from MXFP4)",
            config_only=True,
            config=ModelConfig(
                model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=131072, rope_theta=150000.0, rms_norm_eps=1e-5,
                rope_scaling=RopeScaling(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                         truncate=False, original_max_position_embeddings=4096),
                sliding_window=128, attention_bias=True, num_experts=experts, num_experts_per_tok=4,
                router_aux_loss_coef=0.9, swiglu_limit=7.0, eos_token_id=200002, pad_token_id=199999,
                dtype="bfloat16",
            ),
        ) for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))),
    ]
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; an unknown name is a ValueError listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]
