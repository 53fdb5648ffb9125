"""Phi-3's longrope (the 128k models, Phi-3.5-mini): config keys read as transformers reads them,
logits equal to transformers' on both sides of the original context, and the serving engine's one
choice of frequencies per context (vLLM's), checked against transformers where it makes the same."""

from __future__ import annotations

import math

import pytest
import torch
from serve_fixtures import random_hf, uncached_greedy

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig, RopeScaling, load_model
from slipstream.model.create import stdlib_tokenizer

transformers = pytest.importorskip("transformers")

ORIGINAL, MAX_POSITIONS = 24, 192
HEAD_DIM = 16
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG = [1.5 + 0.9 * i for i in range(HEAD_DIM // 2)]
MAX_NEW_TOKENS = 8


def random_phi3(config) -> torch.nn.Module:
    """transformers' Phi-3 of `config`, seeded, in eval mode, with its norm weights moved off 1 so
    that they matter."""
    return random_hf(transformers.Phi3ForCausalLM, config, offset=0.2)


def _hf_model(tmp_path, short=SHORT, **rope):
    config = transformers.Phi3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": LONG} | rope,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, initializer_range=0.1)
    hf = random_phi3(config)
    if tmp_path is not None:
        hf.save_pretrained(tmp_path)
        stdlib_tokenizer(320).save_pretrained(tmp_path)
    return hf


def test_longrope_config_reads_as_transformers_reads_it(tmp_path):
    """The factors, the original context (config.json's top-level key), the factor it derives
    (max_position_embeddings / original) and the attention factor sqrt(1 + ln(factor) / ln(original))
    are transformers'; an explicit attention_factor wins; our config.json reads back in
    transformers to the same RoPE parameters."""
    hf = _hf_model(tmp_path)
    ours = ModelConfig.from_pretrained(tmp_path)
    scaling = ours.rope_scaling
    assert scaling.rope_type == "longrope" and scaling.original_max_position_embeddings == ORIGINAL
    assert list(scaling.short_factor) == SHORT and list(scaling.long_factor) == LONG
    _, attention_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu")
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    factor = MAX_POSITIONS / ORIGINAL
    assert attention_factor == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(ORIGINAL)))
    explicit = ModelConfig.from_hf_dict(hf.config.to_dict() | {
        "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                         "attention_factor": 1.25}})
    assert explicit.rope_scaling.attention_factor == 1.25
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    for key in ("rope_type", "short_factor", "long_factor", "original_max_position_embeddings"):
        assert again.rope_parameters[key] == hf.config.rope_parameters[key], key


@pytest.mark.parametrize("length", [ORIGINAL - 4, ORIGINAL, ORIGINAL + 1, 70])
def test_longrope_logits_equal_transformers_on_both_sides_of_the_original_context(tmp_path, length):
    """One forward over `length` tokens uses the short factors up to the original context and the
    long ones past it, with cos and sin scaled by the attention factor, as transformers' forward
    does: the logits agree to fp32 rounding (they differ by far more with the other factors)."""
    hf = _hf_model(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(3, 320, (2, length), generator=torch.Generator().manual_seed(length))
    positions = torch.arange(length).expand(2, length)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids, positions)
        ours.model.rope.fix_context(ORIGINAL if length > ORIGINAL else MAX_POSITIONS)  # the other set
        other = ours(ids, positions)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (other - expected).abs().max() > 1e-2


@pytest.mark.parametrize("max_model_len, prompt_lens",
                         [(ORIGINAL, [5, 9, 12]), (MAX_POSITIONS, [25, 31, 40])])
def test_the_engine_fixes_one_set_of_frequencies_per_context(tmp_path, max_model_len, prompt_lens):
    """The engine fixes one choice for every position, vLLM's: the short factors for a context
    within the original one, the long factors for one past it (so a sequence growing past the
    original length keeps its cached keys' rotations). Each agrees with transformers' greedy tokens
    where transformers makes the same choice: sequences that stay within the original context,
    and prompts already past it; both with the C kernels and the plain PyTorch path."""
    hf = _hf_model(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in prompt_lens]
    new_tokens = min(MAX_NEW_TOKENS, max_model_len - max(prompt_lens))
    expected = uncached_greedy(hf, prompts, new_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for fast in (True, False):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=max_model_len, block_size=4,
                  fast_cpu_kernels=fast)
        rope = llm.engine.runner.model.model.rope
        assert rope.long_inv_freq is None  # fixed
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, f"fast_cpu_kernels={fast}"


def test_sequences_crossing_the_original_context_keep_the_long_frequencies(tmp_path):
    """Past the original context the engine's sequences keep the long frequencies from their first
    token (their cached keys were rotated so): the tokens of prompts that grow across it equal
    transformers' uncached greedy tokens from the same weights with the long factors as its short
    ones too (so that transformers also uses them at every length)."""
    _hf_model(tmp_path)
    always_long = _hf_model(None, short=LONG)  # the same seed: the same weights
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (8, 14, 20, 23)]
    expected = uncached_greedy(always_long, prompts, 16)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=MAX_POSITIONS, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_the_original_context_is_config_jsons_top_level_one(caplog):
    """transformers' Phi3Config replaces the RoPE block's original_max_position_embeddings with its
    own top-level one (4096 when config.json has none), so a block-only value is not used (with a
    warning), and neither are Phi-3.5-MoE's short_mscale / long_mscale; a RopeScaling built in code
    derives its attention factor as one read from config.json does."""
    d = {"model_type": "phi3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 131072,
         "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                          "original_max_position_embeddings": 8192, "short_mscale": 1.1}}
    with caplog.at_level("WARNING"):
        ours = ModelConfig.from_hf_dict(d).rope_scaling
    assert "8192 is not used" in caplog.text and "short_mscale" in caplog.text
    hf = transformers.AutoConfig.for_model(**d)
    original = hf.rope_parameters["original_max_position_embeddings"]
    assert ours.original_max_position_embeddings == original == 4096
    _, attention_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    in_code = RopeScaling(rope_type="longrope", factor=131072 / 4096, original_max_position_embeddings=4096,
                          short_factor=tuple(SHORT), long_factor=tuple(LONG))
    assert in_code.attention_factor == pytest.approx(attention_factor, rel=1e-12)
