"""OLMo 2 (`olmo2`) against transformers' Olmo2ForCausalLM: config reading and writing, logits in
fp32 and bf16, gradients, served greedy tokens, and the parallelism it refuses."""

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
    random_model,
    save_with_tokenizer,
    transformers_greedy,
)

from slipstream.model.config import ModelConfig
from slipstream.model.weights import load_model, save_model
from slipstream.perf.flops import num_params
from slipstream.perf.shapes import TransformerShape
from slipstream.train.config import check_tensor_parallel, from_dict

pytest_plugins = ["serve_fixtures"]

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rope_theta=500.0,
             eos_token_id=1, attn_implementation="eager")


def random_olmo2(**overrides) -> torch.nn.Module:
    """transformers' OLMo 2, seeded, in eval mode, with its norm weights (q/k norms included) and
    biases moved off 1 and 0."""
    return random_hf(transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**SHAPE | overrides),
                     names=("norm", "bias"))


def _save(hf: torch.nn.Module, path: Path) -> tuple[torch.nn.Module, Path]:
    return hf, save_with_tokenizer(hf, path)


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "attention-bias"])
def saved(request, tmp_path_factory):
    return _save(random_olmo2(attention_bias=request.param), tmp_path_factory.mktemp("olmo2"))


@pytest.fixture(scope="module")
def unbiased(tmp_path_factory):
    return _save(random_olmo2(), tmp_path_factory.mktemp("olmo2"))


def test_logits_match_transformers(saved):
    """Guards the math: norms of the block outputs, q/k norms over all heads, fp32 norm weights."""
    hf, path = saved
    model = load_model(path)
    assert model.config.model_type == "olmo2" and model.config.qkv_bias == hf.config.attention_bias
    token_ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, token_ids)


def test_bf16_logits_equal_transformers_bf16(tmp_path):
    """Guards the rounding: in bf16 the norms multiply by their weight in fp32 and round once, as
    transformers' Olmo2RMSNorm does (Llama's rounds before the multiply), and the rotary embedding
    runs in fp32 from fp32 tables, as transformers' OLMo 2 rotates; logits bit for bit."""
    random_olmo2().save_pretrained(tmp_path)
    token_ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(2))
    assert_bf16_logits_equal_transformers(tmp_path, token_ids)


def test_gradients_match_transformers(saved):
    """Guards training: every parameter's gradient of the next-token loss equals transformers'."""
    hf, path = saved
    model = load_model(path).train()
    hf = hf.train()
    token_ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(3))
    logits = model(token_ids, torch.arange(12).expand(2, 12))
    ours = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), token_ids[:, 1:].flatten())
    theirs = hf(token_ids, labels=token_ids).loss
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    expected = dict(hf.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    hf.zero_grad()
    hf.eval()


def test_a_config_built_in_code_saves_what_transformers_runs(tmp_path):
    """Guards writing: a model built from a ModelConfig saves a config.json and weights that
    transformers loads into the same function, the config reads back equal, and the performance
    model counts transformers' parameters (q/k norms over all heads)."""
    config = ModelConfig(model_type="olmo2", vocab_size=96, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=300.0,
                         rms_norm_eps=1e-5)
    model = random_model(config)
    save_model(model, tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Olmo2ForCausalLM"
    count = sum(p.numel() for p in hf.parameters())
    assert num_params(config) == TransformerShape.from_model_config(config).num_params() == count
    token_ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    assert_logits_match(model, hf, token_ids)


def test_the_engine_generates_as_transformers(unbiased):
    """Guards serving: greedy tokens under batching and chunked prefill equal transformers'
    `generate` (the CPU fast path runs OLMo 2's layers module by module, as without it)."""
    hf, path = unbiased
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 320, (n,), generator=generator).tolist() for n in (4, 11, 19, 26)]
    expected, gaps = transformers_greedy(hf, prompts, 12)
    got = engine_greedy(path, prompts, 12, max_num_batched_tokens=16, max_num_seqs=4)
    assert_same_tokens(expected, gaps, got, "olmo2")


def test_tensor_parallel_training_is_refused(unbiased):
    """Guards the refusal: the q/k norms span all heads, which tensor-parallel training would split
    (its plan has no collective for them), so it is a ValueError naming the degree and the model
    type (data parallelism stays available)."""
    _, path = unbiased
    config = from_dict({"model": {"path": str(path)}, "parallel": {"tensor_parallel_degree": 2}})
    with pytest.raises(ValueError, match=r"degree \(2\) is not supported for model_type 'olmo2'"):
        check_tensor_parallel(config, ModelConfig.from_pretrained(path))


@pytest.mark.usefixtures("one_torch_thread")
# One K/V head on both ranks covers the split queries and a key norm both ranks compute; the split
# K/V heads (~5 s more) are slow.
@pytest.mark.parametrize("num_kv_heads", [pytest.param(2, marks=pytest.mark.slow), 1],
                         ids=["kv-heads-split", "kv-head-on-both-ranks"])
def test_tensor_parallel_serving_generates_as_transformers(num_kv_heads, tmp_path):
    """Guards serving on two ranks: the q and k norms take their statistics over all heads by an
    all-reduce of the ranks' sums of squares (a K/V head that both ranks hold counted once), so
    greedy tokens equal transformers'."""
    hf, path = _save(random_olmo2(num_key_value_heads=num_kv_heads), tmp_path)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 320, (n,), generator=generator).tolist() for n in (5, 12, 21)]
    expected, gaps = transformers_greedy(hf, prompts, 10)
    got = engine_greedy(path, prompts, 10, tensor_parallel_size=2, max_num_batched_tokens=16)
    assert_same_tokens(expected, gaps, got, "olmo2 tp=2")
