"""`TransformerShape`: parameter and FLOP counts against flops.py, closed forms and real models."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.model.presets import PRESETS
from slipstream.perf import flops
from slipstream.perf.shapes import GPT_SHAPES, TransformerShape, resolve_model


@pytest.mark.parametrize("name", [n for n in PRESETS])
def test_shape_matches_flops_for_presets(name):
    """Guards the ModelConfig mapping: the same counts as slipstream.perf.flops for every preset."""
    config = PRESETS[name].config
    shape = resolve_model(name)
    assert shape.num_params() == flops.num_params(config)
    assert shape.matmul_params() == flops.matmul_params(config)
    assert shape.train_flops_per_token(2048) == flops.train_flops_per_token(config, 2048)
    assert shape.kv_bytes_per_token(2) == flops.kv_cache_bytes_per_token(config, "bf16")


def test_shape_matches_flops_for_every_family(family_config):
    """Guards biases, q/k norms, tied heads and head_dim != hidden/heads through the mapping."""
    shape = TransformerShape.from_model_config(family_config)
    assert shape.num_params() == flops.num_params(family_config)
    assert shape.matmul_params() == flops.matmul_params(family_config)


def test_megatron_flops_closed_form():
    """Guards Korthikanti et al. eq. 7: 72 B L s h^2 (1 + s/6h + v/12hL) per iteration."""
    for shape in GPT_SHAPES.values():
        b, s, h, layers, v = 4, 2048, shape.hidden_size, shape.num_layers, shape.vocab_size
        closed = 72 * b * layers * s * h**2 * (1 + s / (6 * h) + v / (12 * h * layers))
        assert b * s * shape.train_flops_per_token(s) == pytest.approx(closed, rel=1e-12)


def test_published_parameter_counts_of_gpt_shapes():
    """Guards the GPT shapes against their names: GPT-3 175.0B (Brown et al.), 22B ... 1T."""
    expected = {"gpt3-175b": 175e9, "megatron-22b": 22e9, "megatron-175b": 175e9,
                "megatron-530b": 530e9, "megatron-1t": 1.0e12}
    for name, count in expected.items():
        print(f"{name}: {GPT_SHAPES[name].num_params() / 1e9:.2f}B")
        assert GPT_SHAPES[name].num_params() == pytest.approx(count, rel=0.02)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=3, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    return config, model.eval()


def test_gpt2_config_json_params_and_flops_against_a_real_model(tmp_path):
    """Guards the GPT-style mapping (LayerNorm bias, GELU 4h, learned positions, tied head)
    against transformers' GPT-2: parameter count and FlopCounterMode forward FLOPs, exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    config, model = _tiny_gpt2()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    shape = resolve_model(str(tmp_path))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    batch, seq = 2, 16
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 300, (batch, seq)))  # (batch, seq)
    counted = counter.get_total_flops()
    expected = batch * seq * (2 * shape.matmul_params() + shape.attention_flops_per_token(seq))
    print(f"FlopCounterMode {counted}, shape {expected}")
    assert counted == expected


def test_unknown_model_lists_names():
    """Guards the error for a model that is neither a preset, a GPT shape nor a path."""
    with pytest.raises(ValueError, match="known: .*llama3-70b.*megatron-1t"):
        resolve_model("gpt5")


def test_moe_config_json_maps_to_a_shape_with_experts(tmp_path):
    """Guards the mixture-of-experts mapping from a config.json (Qwen2-MoE: a dense layer named in
    mlp_only_layers, a shared expert): the same counts as slipstream.perf.flops, total and active."""
    from slipstream.model.config import ModelConfig

    config = ModelConfig(model_type="qwen2_moe", vocab_size=96, hidden_size=48, intermediate_size=72,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=5,
                         num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=56,
                         mlp_only_layers=(1,))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    shape = resolve_model(str(tmp_path))
    assert (shape.num_experts, shape.experts_per_token, shape.moe_layers) == (5, 2, (0, 2))
    assert shape.num_params() == flops.num_params(config)
    assert shape.active_params() == flops.active_params(config) < shape.num_params()
    assert shape.matmul_params() == flops.matmul_params(config)
    assert shape.train_flops_per_token(512) == flops.train_flops_per_token(config, 512)


def test_moe_config_without_routed_layers_is_dense():
    """Guards a Qwen-MoE config whose decoder_sparse_step leaves every layer dense: a dense shape,
    with the dense counts."""
    from slipstream.model.config import ModelConfig

    config = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=48, intermediate_size=72,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=20, decoder_sparse_step=3)
    shape = TransformerShape.from_model_config(config)
    assert not shape.is_moe
    assert shape.num_params() == flops.num_params(config) == flops.active_params(config)
