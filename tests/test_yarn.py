"""YaRN RoPE scaling (Qwen 2.5 and 3's long-context configs, gpt-oss's, DeepSeek's mscale pair):
frequencies and attention factor equal transformers', logits equal on both sides of the original
context, config.json round trips, and the engine's fast paths take the scaled tables."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from serve_fixtures import (
    assert_logits_match,
    assert_same_tokens,
    engine_greedy,
    random_hf,
    save_with_tokenizer,
    transformers_greedy,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from slipstream.model import ModelConfig, RopeScaling, load_model
from slipstream.model.config import rope_scaled_context

ORIGINAL, MAX_POSITIONS = 16, 64
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, initializer_range=0.1,
             rope_theta=1000.0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
ROPES = {
    "qwen2.5": YARN,
    "legacy-type-key": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "no-original": {"rope_type": "yarn", "factor": 2.0},  # original: max_position_embeddings
    "gpt-oss": YARN | {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "mscale-pair": YARN | {"mscale": 1.0, "mscale_all_dim": 0.5},
    "attention-factor": YARN | {"attention_factor": 1.3},
    "null-factor": YARN | {"factor": None},  # max_position_embeddings / original
    "zero-betas-and-mscale": YARN | {"beta_fast": 0, "mscale": 0, "mscale_all_dim": 1.0},  # the defaults
}


def _hf_model(family: str, rope: dict, tmp_path=None) -> torch.nn.Module:
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    hf = random_hf(model_class, config_class(**SHAPE, rope_scaling=dict(rope)), offset=0.2)
    if tmp_path is not None:
        save_with_tokenizer(hf, tmp_path)
    return hf


@pytest.mark.parametrize("name", ROPES)
def test_frequencies_and_attention_factor_equal_transformers(name, tmp_path):
    """Guards the formula and the keys read: inv_freq bit for bit and the scale of cos and sin
    equal transformers' yarn initialisation; our config.json reads back in transformers alike."""
    hf = _hf_model("llama", ROPES[name], tmp_path)
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config)
    model = load_model(tmp_path)
    assert torch.equal(model.model.rope.inv_freq, expected_inv_freq)
    assert model.model.rope.scale == pytest.approx(expected_factor, rel=1e-12)
    (tmp_path / "ours").mkdir()
    model.config.save_pretrained(tmp_path / "ours")
    again = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](again)
    assert torch.equal(inv_freq, expected_inv_freq) and factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("family, name", [("llama", "qwen2.5"), ("qwen3", "gpt-oss"),
                                          ("qwen3", "mscale-pair")])
def test_logits_equal_transformers_past_the_original_context(family, name, tmp_path):
    """Guards the model: fp32 logits over 50 positions (past the original 16) equal transformers'."""
    hf = _hf_model(family, ROPES[name], tmp_path)
    model = load_model(tmp_path)
    token_ids = torch.randint(0, 320, (2, 50), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, token_ids)


def test_the_engine_generates_as_transformers_with_yarn(tmp_path):
    """Guards serving: the fast path (fused decoder, C decode graph) and chunked prefill take the
    yarn tables and their scale; greedy tokens past the original context equal transformers'."""
    hf = _hf_model("llama", ROPES["qwen2.5"], tmp_path)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (5, 14, 23)]
    expected, gaps = transformers_greedy(hf, prompts, 20)
    got = engine_greedy(tmp_path, prompts, 20, max_num_batched_tokens=16, max_num_seqs=4)
    assert_same_tokens(expected, gaps, got, "yarn")


def test_the_context_is_max_position_embeddings():
    """Guards the served context: yarn's max_position_embeddings is the scaled one already, so it
    is not multiplied by the factor (vLLM 0.32's _get_and_verify_max_len; a linear factor is)."""
    yarn = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
    assert rope_scaled_context("qwen3", 131072, yarn) == 131072
    assert rope_scaled_context("llama", 4096, RopeScaling(rope_type="linear", factor=2.0)) == 8192


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "yarn"}, "lacks factor"),
    (YARN | {"beta_fast": 1.0, "beta_slow": 4.0}, "beta_fast >= beta_slow"),
    (YARN | {"truncate": "no"}, "truncate"),
    (YARN | {"mscale": -1.0}, "mscale"),
    (YARN | {"attention_factor": 0.0}, "attention_factor"),
])
def test_bad_yarn_blocks_are_errors_naming_the_key(rope, match):
    """Guards the errors: a yarn block without its factor or with an impossible value names it."""
    d = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if k != "attn_implementation"},
         "rope_scaling": rope}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(json.loads(json.dumps(d)))


def test_a_linear_scaling_built_in_code_takes_no_attention_factor():
    """Guards the code-built config: only longrope and yarn scale cos and sin, so another type's
    attention_factor is refused (config.json's is ignored, as transformers ignores it) rather
    than applied and then lost on saving."""
    with pytest.raises(ValueError, match="only longrope and yarn scale cos and sin"):
        RopeScaling(rope_type="linear", factor=2.0, attention_factor=1.5)
    d = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if k != "attn_implementation"},
         "rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 1.5}}
    assert ModelConfig.from_hf_dict(d).rope_scaling.attention_factor == 1.0
