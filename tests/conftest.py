"""Shared fixtures: tiny model shapes for every supported family."""

from __future__ import annotations

import copy

import pytest
import torch

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


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def family_config(family):
    """slipstream's ModelConfig for the family's tiny shape, read through transformers' config."""
    transformers = pytest.importorskip("transformers")
    from slipstream.model import ModelConfig

    return ModelConfig.from_hf_dict(transformers.AutoConfig.for_model(**FAMILIES[family]).to_dict())


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
    config = transformers.AutoConfig.for_model(**(copy.deepcopy(FAMILIES[family]) | overrides))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()
