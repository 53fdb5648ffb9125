"""OLMo 3 (`olmo3`) against transformers' Olmo3ForCausalLM: OLMo 2's layer with a window on three
layers of four, default RoPE there and YaRN on the others; config reading in both spellings,
logits in fp32 and bf16, config.json round trips, and served greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from serve_fixtures import (
    assert_bf16_logits_equal_transformers,
    assert_logits_match,
    assert_same_tokens,
    engine_greedy,
    random_hf,
    save_with_tokenizer,
    uncached_greedy,
)

from slipstream.model import ModelConfig, load_model, save_model

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, sliding_window=5,
             eos_token_id=1, attn_implementation="eager")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
SPELLINGS = {
    # transformers 4's keys: rope_theta and rope_scaling go to the full-attention layers only
    "legacy": dict(rope_theta=1000.0, rope_scaling=dict(YARN)),
    "per-layer-type": dict(rope_parameters={
        "full_attention": {"rope_theta": 1000.0, **YARN},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
}


def random_olmo3(**overrides) -> torch.nn.Module:
    """transformers' OLMo 3, seeded, in eval mode, with its norm weights moved off 1."""
    return random_hf(transformers.Olmo3ForCausalLM, transformers.Olmo3Config(**SHAPE | overrides))


@pytest.fixture(scope="module", params=list(SPELLINGS))
def saved(request, tmp_path_factory):
    hf = random_olmo3(**SPELLINGS[request.param])
    return hf, save_with_tokenizer(hf, tmp_path_factory.mktemp("olmo3"))


def test_the_config_reads_as_transformers_reads_it(saved):
    """Guards reading: layer types, window and each layer type's RoPE as transformers has them
    (the legacy rope_theta reaches the full-attention layers only; the windowed ones take 5e5)."""
    hf, path = saved
    config = ModelConfig.from_pretrained(path)
    rope = hf.config.rope_parameters
    assert list(config.layer_types) == hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert config.sliding_window == 5
    assert [config.layer_sliding_window(i) for i in range(4)] == [5, 5, 5, None]
    assert config.rope_theta == rope["full_attention"]["rope_theta"] == 1000.0
    assert config.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.factor == 4.0


def test_logits_match_transformers(saved):
    """Guards the math: past the window (5) and the original context (16), fp32 logits equal."""
    hf, path = saved
    model = load_model(path)
    token_ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, token_ids)


def test_bf16_logits_equal_transformers_bf16(tmp_path):
    """Guards the rounding in bf16 (fp32 norm weights and fp32 rotary for both kinds of layer):
    logits bit for bit against transformers loaded in bf16."""
    save_with_tokenizer(random_olmo3(**SPELLINGS["per-layer-type"]), tmp_path)
    token_ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_bf16_logits_equal_transformers(tmp_path, token_ids)


def test_a_saved_model_loads_in_transformers_as_the_same_function(saved, tmp_path):
    """Guards writing: our config.json (per-layer-type RoPE blocks, layer types, window) and
    weights load in transformers into the same logits, and read back to an equal config."""
    _, path = saved
    model = load_model(path)
    save_model(model, tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == model.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    token_ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(3))
    assert_logits_match(model, hf, token_ids)


def test_the_engine_generates_as_transformers(tmp_path):
    """Guards serving: the per-layer windows and the two rotary tables under batching and chunked
    prefill give transformers' greedy tokens (each from a full uncached forward)."""
    hf = random_olmo3(**SPELLINGS["per-layer-type"])
    path = save_with_tokenizer(hf, tmp_path)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 320, (n,), generator=generator).tolist() for n in (3, 9, 17)]
    expected = uncached_greedy(hf, prompts, 10)
    got = engine_greedy(path, prompts, 10, max_num_batched_tokens=8, max_num_seqs=3)
    assert_same_tokens(expected, torch.full((3, 10), float("nan")), got, "olmo3")
