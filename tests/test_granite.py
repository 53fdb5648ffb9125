"""Granite (`granite`) against transformers' GraniteForCausalLM: its four multipliers (embeddings,
residual branches, attention scores, logits) in fp32 and bf16 logits and gradients, config.json
both ways, served greedy tokens, and the fields refused for other families."""

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
from slipstream.perf.flops import num_params

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, bos_token_id=1,
             eos_token_id=2, pad_token_id=0, attn_implementation="eager")
MULTIPLIERS = dict(embedding_multiplier=12.3, residual_multiplier=0.22, attention_multiplier=0.0625,
                   logits_scaling=8.0)
"""Granite 3's kind of values: each far enough from 1 that a missing one changes every logit."""


def random_granite(**overrides) -> torch.nn.Module:
    """transformers' Granite, seeded, in eval mode, with norm weights and biases moved off 1 and 0."""
    return random_hf(transformers.GraniteForCausalLM,
                     transformers.GraniteConfig(**SHAPE | MULTIPLIERS | overrides), names=("norm", "bias"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    hf = random_granite(attention_bias=True, mlp_bias=True)
    return hf, save_with_tokenizer(hf, tmp_path_factory.mktemp("granite"))


def test_logits_and_gradients_match_transformers(saved):
    """Guards the math: the four multipliers and the biases, fp32 logits and every gradient."""
    hf, path = saved
    model = load_model(path)
    token_ids = torch.randint(1, 320, (2, 15), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, token_ids)
    model.train()
    hf.train()
    logits = model(token_ids, torch.arange(15).expand(2, 15))
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), token_ids[:, 1:].flatten()).backward()
    hf(token_ids, labels=token_ids).loss.backward()
    expected = dict(hf.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    hf.zero_grad()
    hf.eval()


def test_bf16_logits_equal_transformers_bf16(saved):
    """Guards the rounding in bf16: the embedding multiplier is a Python float (not rounded to
    bf16 first, as Gemma's scale is); logits bit for bit."""
    _, path = saved
    token_ids = torch.randint(1, 320, (2, 11), generator=torch.Generator().manual_seed(2))
    assert_bf16_logits_equal_transformers(path, token_ids)


def test_a_saved_model_loads_in_transformers_as_the_same_function(saved, tmp_path):
    """Guards writing: our config.json carries the multipliers and biases; transformers loads the
    same function, the config reads back equal, and perf counts transformers' parameters."""
    _, path = saved
    model = load_model(path)
    save_model(model, tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == model.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert sum(p.numel() for p in hf.parameters()) == num_params(model.config)
    token_ids = torch.randint(1, 320, (1, 9), generator=torch.Generator().manual_seed(3))
    assert_logits_match(model, hf, token_ids)


def test_the_engine_generates_as_transformers(saved):
    """Guards serving: greedy tokens under batching and chunked prefill equal transformers'
    (the fast path's fused decoder and C decode graph leave Granite's layers to their modules)."""
    hf, path = saved
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (4, 10, 19)]
    expected, gaps = transformers_greedy(hf, prompts, 12)
    got = engine_greedy(path, prompts, 12, max_num_batched_tokens=8, max_num_seqs=3)
    assert_same_tokens(expected, gaps, got, "granite")


@pytest.mark.parametrize("field", list(MULTIPLIERS))
def test_the_multipliers_are_granite_only(field):
    """Guards the refusal: a multiplier given to another family is a ValueError naming it."""
    with pytest.raises(ValueError, match=f"{field}=.* only granite has them"):
        ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=1, num_attention_heads=4, **{field: 2.0})
