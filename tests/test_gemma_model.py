"""Gemma, Gemma 2 and Gemma 3 (text) against transformers: config reading, logits, gradients and
bad configs."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
import transformers
from serve_fixtures import random_hf

from slipstream.model.config import ModelConfig, rope_scaled_context
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.transformer import GemmaRMSNorm, Transformer
from slipstream.model.weights import load_model

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=256, initializer_range=0.1,
             attn_implementation="eager")
GEMMA2 = dict(sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
              final_logit_softcapping=4.0)
"""A window shorter than the prompts, a query scale other than head_dim's, and caps that the
scores and logits reach."""
GEMMA3 = dict(sliding_window=5, query_pre_attn_scalar=20, rope_theta=5000.0, rope_local_base_freq=100.0,
              rope_scaling={"rope_type": "linear", "factor": 2.0}, final_logit_softcapping=4.0,
              sliding_window_pattern=3)
"""Gemma 2's, with two RoPE bases (and linear scaling on the global layer), two windowed layers
before the global one, and no attention soft cap (Gemma 3 has none)."""


def random_gemma(gemma2: bool, **overrides) -> torch.nn.Module:
    """transformers' Gemma (2), seeded, in eval mode, with its norm weights moved off 0."""
    if gemma2:
        return random_hf(transformers.Gemma2ForCausalLM,
                         transformers.Gemma2Config(**SHAPE | GEMMA2 | overrides))
    return random_hf(transformers.GemmaForCausalLM, transformers.GemmaConfig(**SHAPE | overrides))


def random_gemma3(**overrides) -> torch.nn.Module:
    """transformers' Gemma 3 text model, seeded, in eval mode, with its norm weights moved off 0."""
    return random_hf(transformers.Gemma3ForCausalLM,
                     transformers.Gemma3TextConfig(**SHAPE | GEMMA3 | overrides))


def random_family(family: str, **overrides) -> torch.nn.Module:
    if family == "gemma3_text":
        return random_gemma3(**overrides)
    return random_gemma(family == "gemma2", **overrides)


@pytest.fixture(scope="module", params=["gemma", "gemma2", "gemma3_text"])
def saved(request, tmp_path_factory):
    hf = random_family(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def _positions(token_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(token_ids.shape[1]).expand_as(token_ids)


def test_logits_match_transformers(saved):
    hf, path = saved
    model = load_model(path)
    token_ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(token_ids).logits
        got = model(token_ids, _positions(token_ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text"])
def test_bf16_logits_equal_transformers_bf16(family, tmp_path):
    """Loaded in bf16, the logits equal transformers' bf16 model bit for bit where both attend
    alike (SDPA, or explicit products where scores are soft-capped): the norms round once, after
    the (1 + w) product, and the embedding scale is sqrt(72) rounded to bf16."""
    hf = random_family(family, hidden_size=72)
    hf.save_pretrained(tmp_path)
    implementation = "eager" if getattr(hf.config, "attn_logit_softcapping", None) else "sdpa"
    expected = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation=implementation).eval()
    model = load_model(tmp_path, dtype=torch.bfloat16)
    token_ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(token_ids, _positions(token_ids)), expected(token_ids).logits,
                                   rtol=0, atol=0)


def test_gradients_match_transformers(saved):
    hf, path = saved
    model = load_model(path)
    hf.train()
    # Not the pad token 0, whose embedding row transformers' nn.Embedding(padding_idx=0) never
    # updates (a choice of the training recipe, as for Llama; ours learns it).
    token_ids = torch.randint(1, 320, (2, 13), generator=torch.Generator().manual_seed(3))
    hf(token_ids, labels=token_ids).loss.backward()
    logits = model(token_ids, _positions(token_ids))
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), token_ids[:, 1:].flatten()).backward()
    hf.eval()
    expected = dict(hf.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        checked += 1
    assert checked == len(expected)
    hf.zero_grad()


def test_gemma2_config_reads_as_transformers_reads_it():
    hf_config = transformers.Gemma2Config(num_hidden_layers=5, query_pre_attn_scalar=144)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert config.layer_types == tuple(hf_config.layer_types)
    windows = [config.layer_sliding_window(i) for i in range(5)]
    assert windows == [4096 if t == "sliding_attention" else None for t in hf_config.layer_types]
    assert config.attention_scale == 144**-0.5
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    back = transformers.Gemma2Config(**config.to_hf_dict())
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "hidden_activation", "head_dim", "tie_word_embeddings"):
        assert getattr(back, key) == getattr(hf_config, key), key
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_gemma_reads_the_legacy_gelu_as_transformers_does():
    """The original Gemma releases say hidden_act "gelu" and mean the tanh approximation."""
    d = transformers.GemmaConfig(num_hidden_layers=2).to_dict() | {"hidden_act": "gelu"}
    assert ModelConfig.from_hf_dict(d).gemma_norms
    assert transformers.GemmaConfig(**d).hidden_act == "gelu_pytorch_tanh"


def test_gemma3_config_reads_as_transformers_reads_it():
    """Both spellings of Gemma 3's RoPE (transformers 4's rope_theta / rope_local_base_freq /
    rope_scaling, transformers 5's block per layer type), its default layer types, and the
    context vLLM derives (max_position_embeddings, not times the linear factor)."""
    legacy = {"model_type": "gemma3_text", "num_hidden_layers": 8, "rope_theta": 1e6,
              "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "max_position_embeddings": 4096, "sliding_window": 1024}
    hf_config = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    for d in (legacy, hf_config.to_dict()):
        config = ModelConfig.from_hf_dict(d)
        assert config.layer_types == tuple(hf_config.layer_types)
        assert config.layer_types.count("full_attention") == 1  # layer 5 of 8
        assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
        assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 8.0
        assert config.sliding_window == 1024 and config.qk_norm and config.sandwich_norms
        assert rope_scaled_context(config.model_type, 4096, config.rope_scaling) == 4096
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    back = transformers.Gemma3TextConfig(**config.to_hf_dict())
    assert back.rope_parameters == hf_config.rope_parameters
    assert back.layer_types == hf_config.layer_types


def test_gemma3_ignores_the_attention_soft_cap_as_transformers_does(caplog):
    d = {"model_type": "gemma3_text", "num_hidden_layers": 2, "attn_logit_softcapping": 50.0}
    assert ModelConfig.from_hf_dict(d).attn_logit_softcapping is None
    assert "transformers' Gemma 3 does not apply it" in caplog.text


@pytest.mark.parametrize("model_type, change, message", [
    ("gemma2", {"layer_types": ["full_attention"]}, "layer_types names 1 layers"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must list"),
    ("gemma2", {"hidden_activation": "relu"}, "unsupported hidden_activation 'relu'"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive integer"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma", {"hidden_act": "silu"}, "unsupported hidden_act 'silu'"),
    ("gemma", {"attn_logit_softcapping": 50.0}, "unsupported config.json field attn_logit_softcapping"),
    ("gemma", {"query_pre_attn_scalar": 256}, "only gemma2 and gemma3_text have them"),
    ("llama", {"final_logit_softcapping": 30.0}, "unsupported config.json field final_logit_softcapping"),
    ("gemma2", {"rope_local_base_freq": 1e4, "rope_local_theta": 1e4}, "only gemma3_text and olmo3 have it"),
    ("gemma3_text", {"rope_parameters": {"rope_type": "default"}}, "must hold a block per layer type"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "unsupported sliding_attention rope_type 'linear'"),
    ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern must be a positive integer"),
    ("gemma", {"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu' for model_type 'gemma'"),
    ("gemma2", {"sliding_window": None}, "gives null for sliding_window"),
    ("gemma2", {"attention_dropout": None}, "gives null for attention_dropout"),
    ("gemma", {"num_key_value_heads": None}, "gives null for num_key_value_heads"),
])
def test_bad_configs_name_the_key(model_type, change, message):
    base = {"model_type": model_type, "num_hidden_layers": 2, "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(base | change)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_configs_built_in_code_save_what_transformers_runs(family):
    """A config built in code (no query scale, no layer types, no window: transformers' defaults,
    head_dim's scale, every layer attending to all) saves a config.json that transformers builds and
    runs to the same logits, and that reads back to the same config."""
    config = ModelConfig(model_type=family, vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=6, num_attention_heads=2, head_dim=16, max_position_embeddings=64,
                         rope_local_theta=100.0 if family == "gemma3_text" else None)
    assert config.query_pre_attn_scalar == 16 and len(config.layer_types) == 6
    assert all(config.layer_sliding_window(i) is None for i in range(6))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    model = Transformer(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict() | {"attn_implementation": "eager"})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    token_ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(token_ids, _positions(token_ids)), hf(token_ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_init_weights_gives_gemma_norms_zero_weights():
    config = ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    model = Transformer(config)
    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert len(norms) == 2 * 4 + 1  # four per Gemma 2 layer and the final one
    for norm in norms:
        norm.weight.data.fill_(1.0)
    model.init_weights()
    assert all(torch.equal(norm.weight, torch.zeros_like(norm.weight)) for norm in norms)


@pytest.mark.parametrize("tokenizer_class", ["GemmaTokenizer", None])
def test_gemma_tokenizer_layout_reads_as_autotokenizer_reads_it(tmp_path, tokenizer_class):
    """Gemma's tokenizer.json layout (spaces to "▁" by the normalizer, byte fallback, a <bos>
    template, add_bos_token): the same ids and text as transformers' AutoTokenizer, which builds
    its own GemmaTokenizer pipeline from the file's vocabulary."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    pieces = [*specials, "▁", "▁the", "▁end", "a", "b", "the", ",", "(", ")", "\n",
              *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True,
                                                         fuse_unk=True))
    backend.add_special_tokens(specials)
    backend.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    decoders = tokenizers.decoders
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": True} | ({"tokenizer_class": tokenizer_class} if tokenizer_class else {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    for text in ["a the end, b", " the  end\n(a)", "é日本", "thethe a"]:
        ids = expected(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == text
        assert expected.decode(ids, skip_special_tokens=True) == text
