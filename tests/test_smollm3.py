"""SmolLM3 (`smollm3`) against transformers' SmolLM3ForCausalLM: Llama with no rotary embedding on
every fourth layer (NoPE), in fp32 and bf16 logits, config.json both ways and served greedy tokens
(the C decode graph, which rotates every layer, declines it)."""

from __future__ import annotations

from pathlib import Path

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
    transformers_greedy,
)

from slipstream.model import ModelConfig, load_model, save_model

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, rope_theta=5000.0,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")


def random_smollm3(**overrides) -> torch.nn.Module:
    """transformers' SmolLM3, seeded, in eval mode, with its norm weights moved off 1."""
    return random_hf(transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config(**SHAPE | overrides))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    hf = random_smollm3()
    return hf, save_with_tokenizer(hf, tmp_path_factory.mktemp("smollm3"))


@pytest.mark.parametrize("rope", [{}, {"no_rope_layers": [0, 1, 0, 1]}, {"no_rope_layer_interval": 2}],
                         ids=["default-every-fourth", "explicit-list", "interval-2"])
def test_logits_match_transformers(rope, tmp_path):
    """Guards the math and the reading of which layers rotate: fp32 logits equal transformers'."""
    hf = random_smollm3(**rope)
    model = load_model(save_with_tokenizer(hf, tmp_path))
    assert [model.config.layer_rotates(i) for i in range(4)] == [bool(v) for v in hf.config.no_rope_layers]
    token_ids = torch.randint(1, 320, (2, 14), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, token_ids)


def test_bf16_logits_equal_transformers_bf16(saved):
    """Guards bf16: logits bit for bit against transformers loaded in bf16."""
    _, path = saved
    token_ids = torch.randint(1, 320, (2, 11), generator=torch.Generator().manual_seed(2))
    assert_bf16_logits_equal_transformers(path, token_ids)


def test_a_saved_model_loads_in_transformers_as_the_same_function(saved, tmp_path):
    """Guards writing: our config.json names the NoPE layers; transformers loads the same function
    and the config reads back equal."""
    _, path = saved
    model = load_model(path)
    save_model(model, tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == model.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    token_ids = torch.randint(1, 320, (1, 9), generator=torch.Generator().manual_seed(3))
    assert_logits_match(model, hf, token_ids)


def test_the_engine_generates_as_transformers(saved):
    """Guards serving: greedy tokens under batching and chunked prefill equal transformers'; the C
    decode graph declines the NoPE layers (it would rotate them) and the layers run as modules."""
    hf, path = saved
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (4, 10, 19)]
    expected, gaps = transformers_greedy(hf, prompts, 12)
    got = engine_greedy(path, prompts, 12, max_num_batched_tokens=8, max_num_seqs=3)
    assert_same_tokens(expected, gaps, got, "smollm3")


@pytest.mark.parametrize("change, match", [
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True is not supported"),
    ({"no_rope_layers": [1, 1]}, "no_rope_layers must list a 0 or 1 for each of the 4 layers"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive"),
])
def test_bad_configs_name_the_key(change, match):
    """Guards the errors: a windowed SmolLM3, a wrong-length NoPE list, a zero interval."""
    d = {"model_type": "smollm3", **{k: v for k, v in SHAPE.items() if k != "attn_implementation"}} | change
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)
