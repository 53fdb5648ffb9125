"""Granite (`granite`) against transformers' GraniteForCausalLM: its four multipliers (embeddings,
residual branches, attention scores, logits) in fp32 and bf16 logits and gradients, config.json
both ways, served greedy tokens, and the fields refused for other families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, transformers_greedy

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig, load_model, save_model
from slipstream.model.create import stdlib_tokenizer
from slipstream.perf.flops import num_params

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, bos_token_id=1,
             eos_token_id=2, pad_token_id=0, attn_implementation="eager")
MULTIPLIERS = dict(embedding_multiplier=12.3, residual_multiplier=0.22, attention_multiplier=0.0625,
                   logits_scaling=8.0)
"""Granite 3's kind of values: each far enough from 1 that a missing one changes every logit."""


def random_granite(**overrides) -> torch.nn.Module:
    """transformers' Granite, seeded, in eval mode, with norm weights and biases moved off 1 and 0."""
    torch.manual_seed(0)
    hf = transformers.GraniteForCausalLM(transformers.GraniteConfig(**SHAPE | MULTIPLIERS | overrides)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    hf = random_granite(attention_bias=True, mlp_bias=True)
    path = tmp_path_factory.mktemp("granite")
    hf.save_pretrained(path)
    stdlib_tokenizer(320).save_pretrained(path)
    return hf, path


def _logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids, torch.arange(token_ids.shape[1]).expand_as(token_ids))


def test_logits_and_gradients_match_transformers(saved):
    """Guards the math: the four multipliers and the biases, fp32 logits and every gradient."""
    hf, path = saved
    model = load_model(path)
    token_ids = torch.randint(1, 320, (2, 15), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, token_ids), hf(token_ids).logits.detach(), rtol=1e-5, atol=2e-5)
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                           attn_implementation="sdpa").eval()
    token_ids = torch.randint(1, 320, (2, 11), generator=torch.Generator().manual_seed(2))
    expected = hf(token_ids).logits.detach()
    got = _logits(load_model(path, dtype=torch.bfloat16), token_ids)
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()


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
    torch.testing.assert_close(_logits(model, token_ids), hf(token_ids).logits.detach(), rtol=1e-5, atol=2e-5)


def test_the_engine_generates_as_transformers(saved):
    """Guards serving: greedy tokens under batching and chunked prefill equal transformers'
    (the fast path's fused decoder and C decode graph leave Granite's layers to their modules)."""
    hf, path = saved
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (4, 10, 19)]
    expected, gaps = transformers_greedy(hf, prompts, 12)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8, max_num_seqs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert_same_tokens(expected, gaps, [list(o.outputs[0].token_ids) for o in outputs], "granite")


@pytest.mark.parametrize("field", list(MULTIPLIERS))
def test_the_multipliers_are_granite_only(field):
    """Guards the refusal: a multiplier given to another family is a ValueError naming it."""
    with pytest.raises(ValueError, match=f"{field}=.* only granite has them"):
        ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=1, num_attention_heads=4, **{field: 2.0})
