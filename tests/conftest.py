"""Shared fixtures: tiny model shapes for every supported family."""

from __future__ import annotations

import copy
import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist, each worker takes its share of the cores (torch's threads, and through
    OMP_NUM_THREADS the servers and `torchrun` jobs it starts): two workers of two threads each on
    two cores oversubscribe them, and OpenMP's waiting threads then ran the suite 2-3x slower."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = str(max(len(os.sched_getaffinity(0)) // int(workers), 1))
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# One tiny shape per family, each exercising that family's peculiarities: GQA, head_dim independent
# of hidden_size, Llama 3 RoPE scaling, biases, a sliding window shorter than the test sequences,
# tied embeddings, per-head q/k norms.
FAMILIES = {
    "llama": dict(
        model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        rope_theta=50000.0, max_position_embeddings=4096, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": dict(
        model_type="mistral", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        sliding_window=7, max_position_embeddings=512,
    ),
    "phi3": dict(
        model_type="phi3", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=11, max_position_embeddings=256, rope_theta=20000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,  # its defaults (32000) lie beyond this vocab
    ),
    "qwen2": dict(
        model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, rope_theta=1e6,
    ),
    "qwen3": dict(
        model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    ),
}

# One tiny shape per mixture-of-experts family: Mixtral (every layer routed, renormalised top-2),
# Qwen3-MoE (q/k norms, dense layers between routed ones, top-3 of 6 without renormalising) and
# Qwen2-MoE (q/k/v bias, a gated shared expert, a dense layer named in mlp_only_layers).
MOE_FAMILIES = {
    "mixtral": dict(
        model_type="mixtral", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512, sliding_window=9,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, decoder_sparse_step=2,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", vocab_size=320, hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=5,
        num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        mlp_only_layers=[1], norm_topk_prob=True,
    ),
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def family_config(family):
    """slipstream's ModelConfig for the family's tiny shape, read through transformers' config."""
    transformers = pytest.importorskip("transformers")
    from slipstream.model import ModelConfig

    return ModelConfig.from_hf_dict(transformers.AutoConfig.for_model(**FAMILIES[family]).to_dict())


@pytest.fixture(params=sorted(MOE_FAMILIES))
def moe_family(request) -> str:
    return request.param


@pytest.fixture
def make_hf_model():
    """Factory for transformers reference models (see `build_hf_model`)."""
    return build_hf_model


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A randomly initialised transformers model of the family, with non-trivial norms and biases
    (their default init of ones and zeros would hide a missing norm or bias)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    # A deep copy: transformers writes into nested dicts it is given (rope_scaling), which would
    # leak one test's overrides into the next build of the family.
    shape = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    config = transformers.AutoConfig.for_model(**(copy.deepcopy(shape) | overrides))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):
                # Routers far from uniform: top-k choices then rest on clear margins, not on rounding.
                param.normal_(0.0, 1.0)
    return model.eval()
