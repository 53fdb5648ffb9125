"""Parameter, FLOP and byte formulas of `slipstream.perf.flops` against reference models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from slipstream.model.config import ModelConfig
from slipstream.perf.flops import (
    attention_flops_per_token,
    decode_bytes_per_step,
    dtype_bytes,
    embedding_params,
    forward_flops_per_token,
    kv_cache_bytes_per_token,
    matmul_params,
    mbu,
    mean_keys_per_query,
    mfu,
    num_params,
    train_flops_per_token,
    weight_bytes,
)

transformers = pytest.importorskip("transformers")

_TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2)

# Every structural switch of every family: tied/untied, biases, GQA/MHA/MQA, qk norm, and
# head_dim != hidden_size / num_attention_heads.
TINY_CONFIGS = {
    "llama-mha-tied": ModelConfig(model_type="llama", num_attention_heads=4,
                                  tie_word_embeddings=True, **_TINY),
    "llama-gqa-bias-headdim": ModelConfig(model_type="llama", num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=8, attention_bias=True,
                                          mlp_bias=True, **_TINY),
    "mistral-mqa-window": ModelConfig(model_type="mistral", num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=24, sliding_window=8,
                                      max_position_embeddings=64, **_TINY),
    "qwen2-gqa-untied": ModelConfig(model_type="qwen2", num_attention_heads=4,
                                    num_key_value_heads=2, **_TINY),
    "qwen2-tied": ModelConfig(model_type="qwen2", num_attention_heads=6, num_key_value_heads=3,
                              tie_word_embeddings=True, **_TINY),
    "qwen3-tied-headdim": ModelConfig(model_type="qwen3", num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, **_TINY),
    "qwen3-bias-untied": ModelConfig(model_type="qwen3", num_attention_heads=4,
                                     num_key_value_heads=4, head_dim=32, attention_bias=True,
                                     **_TINY),
}

LLAMA3_8B = ModelConfig(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rope_theta=500000.0, dtype="bfloat16",
)
LLAMA2_7B = ModelConfig(
    model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
    num_hidden_layers=32, num_attention_heads=32, dtype="float16",
)

_LINEAR_OPS = {"aten.mm", "aten.addmm"}
_ATTENTION_OPS = {"aten.bmm", "aten.baddbmm"}


def _hf_model(config: ModelConfig, attn_implementation: str = "sdpa") -> torch.nn.Module:
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation=attn_implementation
    )
    return model.float().eval()


def _count_flops(model: torch.nn.Module, *args: torch.Tensor) -> tuple[int, int, dict]:
    """(linear FLOPs, attention bmm FLOPs, all counts) of one forward under FlopCounterMode."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*args)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = sum(n for op, n in counts.items() if op in _LINEAR_OPS)
    attention = sum(n for op, n in counts.items() if op in _ATTENTION_OPS)
    return linear, attention, counts


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_num_params_matches_hf_models(name):
    """Guards num_params against the HF model's own parameter list for every family switch."""
    config = TINY_CONFIGS[name]
    model = _hf_model(config)
    expected = sum(p.numel() for p in model.parameters())
    print(f"{name}: hf {expected}, ours {num_params(config)}, diff {num_params(config) - expected}")
    assert num_params(config) == expected
    embedding = model.get_input_embeddings().weight.numel()
    assert num_params(config, include_embedding=False) == expected - embedding


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_matmul_params_are_the_linear_weights(name):
    """Guards matmul_params: every nn.Linear weight, the lm_head counted even when tied."""
    config = TINY_CONFIGS[name]
    model = _hf_model(config)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert matmul_params(config) == sum(m.weight.numel() for m in linear)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == config.tie_word_embeddings


@pytest.mark.parametrize("name", ["llama-gqa-bias-headdim", "mistral-mqa-window",
                                  "qwen3-tied-headdim"])
def test_forward_flops_match_flop_counter_eager(name):
    """Guards forward_flops_per_token: exact against FlopCounterMode on HF eager attention.

    Eager attention runs QK^T and AV as bmm over the full (T, T) score matrix and masks after,
    which is exactly the non-causal PaLM convention, so linears and attention both match exactly.
    """
    config = TINY_CONFIGS[name]
    batch, seq_len = 2, 12
    token_ids = torch.randint(0, config.vocab_size, (batch, seq_len))  # (batch, seq)
    linear, attention, counts = _count_flops(_hf_model(config, "eager"), token_ids)
    tokens = batch * seq_len
    print(f"{name}: counter {counts}; ours linear {2 * matmul_params(config) * tokens}, "
          f"attention {attention_flops_per_token(config, seq_len) * tokens}")
    assert linear == 2 * matmul_params(config) * tokens
    assert attention == attention_flops_per_token(config, seq_len) * tokens
    assert linear + attention == forward_flops_per_token(config, seq_len) * tokens


def test_flop_counter_misses_cpu_sdpa():
    """Guards our reading of FlopCounterMode with SDPA on CPU: the linears count, attention not.

    On CPU, SDPA dispatches to `aten._scaled_dot_product_flash_attention_for_cpu`, which has no
    flop formula in torch.utils.flop_counter, so it counts 0. Should torch add one, it must
    equal our non-causal term (its formula ignores causal masks).
    """
    config = TINY_CONFIGS["llama-gqa-bias-headdim"]
    batch, seq_len = 2, 12
    token_ids = torch.randint(0, config.vocab_size, (batch, seq_len))  # (batch, seq)
    linear, attention, counts = _count_flops(_hf_model(config, "sdpa"), token_ids)
    tokens = batch * seq_len
    sdpa = sum(n for op, n in counts.items() if "scaled_dot_product" in op)
    print(f"sdpa counts {counts}")
    assert linear == 2 * matmul_params(config) * tokens
    assert attention == 0
    assert sdpa in (0, attention_flops_per_token(config, seq_len) * tokens)


def _slipstream_model(config: ModelConfig) -> torch.nn.Module:
    module = pytest.importorskip("slipstream.model.transformer")
    return module.Transformer(config).float().eval()


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_num_params_matches_slipstream_transformer(name):
    """Guards num_params against slipstream's own decoder (skipped until it exists)."""
    config = TINY_CONFIGS[name]
    model = _slipstream_model(config)
    expected = sum(p.numel() for p in model.parameters())
    print(f"{name}: slipstream {expected}, ours {num_params(config)}")
    assert num_params(config) == expected


def test_forward_flops_match_slipstream_transformer():
    """Guards that slipstream's decoder does the matmul work the formula charges, no more.

    Linears must match exactly; attention counts either 0 (SDPA on CPU is not counted) or the
    non-causal term (bmm over full scores).
    """
    config = TINY_CONFIGS["qwen3-tied-headdim"]
    model = _slipstream_model(config)
    batch, seq_len = 2, 12
    token_ids = torch.randint(0, config.vocab_size, (batch, seq_len))  # (batch, seq)
    positions = torch.arange(seq_len).expand(batch, seq_len)  # (batch, seq)
    linear, attention, counts = _count_flops(model, token_ids, positions)
    tokens = batch * seq_len
    print(f"slipstream counts {counts}")
    assert linear == 2 * matmul_params(config) * tokens
    assert attention in (0, attention_flops_per_token(config, seq_len) * tokens)


def test_published_parameter_counts():
    """Guards num_params against the published totals of Llama-3-8B and Llama-2-7B."""
    assert num_params(LLAMA3_8B) == 8_030_261_248
    assert num_params(LLAMA2_7B) == 6_738_415_616
    assert num_params(LLAMA3_8B, include_embedding=False) == 8_030_261_248 - 128256 * 4096


def test_non_embedding_count_of_tied_model_excludes_shared_matrix():
    """Guards the stated tied convention: the shared matrix is embedding, not counted again."""
    config = LLAMA3_8B.replace(tie_word_embeddings=True)
    assert num_params(config) == num_params(LLAMA3_8B) - embedding_params(config)
    embedding = embedding_params(config)
    assert num_params(config, include_embedding=False) == num_params(config) - embedding
    assert matmul_params(config) == matmul_params(LLAMA3_8B)  # the lm_head matmul still runs


def test_kv_cache_bytes_closed_forms():
    """Guards the KV formula on known shapes: 128 KiB (8B), 320 KiB (70B), 512 KiB (MHA 7B)."""
    assert kv_cache_bytes_per_token(LLAMA3_8B, "bfloat16") == 131072
    llama3_70b = LLAMA3_8B.replace(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64)
    assert kv_cache_bytes_per_token(llama3_70b, torch.bfloat16) == 320 * 1024
    assert kv_cache_bytes_per_token(LLAMA2_7B) == 512 * 1024  # config dtype float16
    assert kv_cache_bytes_per_token(LLAMA3_8B, "float32") == 2 * 131072


def test_train_flops_conventions():
    """Guards train = 3 x forward = 6N + 12 L H Q T, reducing to 6N as seq_len -> 0."""
    n = matmul_params(LLAMA3_8B)
    assert train_flops_per_token(LLAMA3_8B, 0) == 6 * n
    seq_len = 8192
    palm = 6 * n + 12 * 32 * 32 * 128 * seq_len
    assert train_flops_per_token(LLAMA3_8B, seq_len) == palm
    forward = forward_flops_per_token(LLAMA3_8B, seq_len)
    assert train_flops_per_token(LLAMA3_8B, seq_len) == 3 * forward
    causal = train_flops_per_token(LLAMA3_8B, seq_len, causal=True)
    assert causal == 6 * n + 12 * 32 * 32 * 128 * (seq_len + 1) / 2


@pytest.mark.parametrize("seq_len,window", [(1, None), (10, None), (10, 4), (3, 8), (64, 64)])
def test_mean_keys_per_query_brute_force(seq_len, window):
    """Guards the causal (and sliding-window) mean key count against a direct sum."""
    config = TINY_CONFIGS["mistral-mqa-window"].replace(sliding_window=window)
    expected = sum(min(i, window or i) for i in range(1, seq_len + 1)) / seq_len
    assert mean_keys_per_query(config, seq_len) == pytest.approx(expected)


def test_decode_bytes_per_step():
    """Guards the decode byte count: weights minus the unread embedding rows, plus KV reads."""
    kv = kv_cache_bytes_per_token(LLAMA3_8B)
    weights = (num_params(LLAMA3_8B) - embedding_params(LLAMA3_8B)) * 2
    rows = 4096 * 2
    assert decode_bytes_per_step(LLAMA3_8B, "bfloat16", 1, 0) == weights + rows
    batched = decode_bytes_per_step(LLAMA3_8B, "bfloat16", 8, 4096)
    assert batched == weights + 8 * rows + 8 * 4096 * kv
    tied = LLAMA3_8B.replace(tie_word_embeddings=True)
    assert decode_bytes_per_step(tied, None, 1, 0) == weight_bytes(tied) + rows  # lm_head reads it
    window = TINY_CONFIGS["mistral-mqa-window"]  # sliding_window=8
    capped = decode_bytes_per_step(window, "float32", 2, 100)
    assert capped == decode_bytes_per_step(window, "float32", 2, 8)


def test_weight_bytes_and_dtypes():
    """Guards weight bytes and the dtype spellings accepted (names, short names, torch.dtype)."""
    assert weight_bytes(LLAMA3_8B) == 8_030_261_248 * 2
    assert weight_bytes(LLAMA3_8B, torch.float32) == 8_030_261_248 * 4
    assert dtype_bytes("bf16") == dtype_bytes(torch.bfloat16) == dtype_bytes("float16") == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("float7")


def test_utilization_helpers():
    """Guards mfu/mbu arithmetic and their rejection of a zero peak."""
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert mbu(100.0, 16e9, 3.2e12) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        forward_flops_per_token(LLAMA3_8B, -1)


def test_flops_and_hardware_import_without_torch():
    """Guards that planners and reports can use the formulas and table without importing torch,
    and so can `slipstream perf plan` (its commands and the model presets; torch took ~2 s of
    each command's ~3 s) and the tokenizer."""
    code = (
        "import sys, slipstream.perf.flops, slipstream.perf.hardware, slipstream.perf.commands, "
        "slipstream.model.presets, slipstream.model.tokenizer; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def _eager_transformers_model():
    """A small GQA config and transformers' model of it with eager attention (whose matmuls
    FlopCounterMode counts, attention included), for the FLOP formulas' independent check."""
    transformers = pytest.importorskip("transformers")
    from slipstream.model import ModelConfig

    config = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config.to_hf_dict()), attn_implementation="eager"
    ).eval()
    return config, hf


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_generation_flops_matches_flop_counter_on_engine_shapes():
    """generation_flops equals FlopCounterMode's matmul count for a dense prefill that computes
    logits only at the last position, plus decode steps (eager attention counted by bmm)."""
    from torch.utils.flop_counter import FlopCounterMode

    from slipstream.perf.flops import generation_flops

    config, hf = _eager_transformers_model()
    prompt_len, output_len = 7, 4
    ids = torch.randint(0, 97, (1, prompt_len + output_len))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = hf(input_ids=ids[:, :prompt_len], use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        for j in range(output_len - 1):
            out = hf(input_ids=ids[:, prompt_len + j : prompt_len + j + 1], past_key_values=cache,
                     use_cache=True)
            cache = out.past_key_values
    counted = counter.get_total_flops()
    # the counter charges eager prefill attention for the full (non-causal) score matrix:
    # replace its prefill attention (4*L*H*D*T*T) by the causal count generation_flops uses
    per_key = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    causal_keys = prompt_len * (prompt_len + 1) // 2
    counted += per_key * (causal_keys - prompt_len * prompt_len)
    expected = generation_flops(config, prompt_len, output_len)
    print(f"counted {counted}, generation_flops {expected}")
    assert counted == expected


def test_forward_flops_matches_flop_counter_for_a_prefill_and_a_decode_step():
    """forward_flops (the engine records' FLOPs of a step) equals FlopCounterMode's matmul count for
    a prompt of 7 tokens with logits at every position, and for one decode token after it (eager
    attention counted by bmm; the prefill's full score matrix replaced by the causal count)."""
    from torch.utils.flop_counter import FlopCounterMode

    from slipstream.perf.flops import causal_keys, forward_flops

    config, hf = _eager_transformers_model()
    prompt_len = 7
    ids = torch.randint(0, 97, (1, prompt_len + 1))
    per_key = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    with torch.no_grad(), FlopCounterMode(display=False) as prefill:
        cache = hf(input_ids=ids[:, :prompt_len], use_cache=True).past_key_values
    counted = prefill.get_total_flops() + per_key * (causal_keys(config, 0, prompt_len) - prompt_len ** 2)
    assert counted == forward_flops(config, prompt_len, prompt_len, causal_keys(config, 0, prompt_len))
    with torch.no_grad(), FlopCounterMode(display=False) as decode:
        hf(input_ids=ids[:, prompt_len:], past_key_values=cache, use_cache=True)
    assert decode.get_total_flops() == forward_flops(config, 1, 1, causal_keys(config, prompt_len, 1))
