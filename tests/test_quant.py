"""Weight-only int8 quantization (slipstream.ops.quant): the stored values and scales, the layer's
product against a dense product over the dequantized weight, and which layers a model quantizes."""

import pytest
import torch
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.model.transformer import Transformer
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.ops.quant import Int8Linear, quantize_int8, quantize_linears


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    """Guards the format: s = max|row| / 127, q = round(W / s), and W is recovered within s / 2."""
    torch.manual_seed(0)
    weight = torch.randn(33, 70) * torch.logspace(-3, 2, 33)[:, None]
    weight[5] = 0.0
    q, s = quantize_int8(weight)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == weight.shape
    assert s[5] == 1.0 and (q[5] == 0).all()
    expected_scale = weight.abs().amax(dim=1) / 127
    assert torch.equal(s[torch.arange(33) != 5], expected_scale[torch.arange(33) != 5])
    assert q.abs().amax(dim=1)[torch.arange(33) != 5].eq(127).all()
    error = (q.float() * s[:, None] - weight).abs()
    assert (error <= s[:, None] / 2 * (1 + 1e-6)).all(), error.max()


@pytest.mark.parametrize("bad", [torch.ones(4), torch.ones(2, 3, dtype=torch.int32),
                                 torch.tensor([[1.0, float("inf")]])])
def test_quantize_int8_refuses_what_it_cannot_store(bad):
    """Guards the errors: a non-2-D, non-float or non-finite weight is a ValueError."""
    with pytest.raises(ValueError, match="quantize_int8"):
        quantize_int8(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_a_dense_product_over_the_dequantized_weight(dtype, bias):
    """Guards the math: y = x (s q)^T + b in fp32, rounded once to the input's dtype."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    layer = Int8Linear(linear)
    x = torch.randn(3, 5, 96, dtype=dtype)
    reference = x.double() @ layer.dequantized_weight().double().T
    if bias:
        reference = reference + linear.bias.double()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (3, 5, 40)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), reference, rtol=tolerance, atol=tolerance)


def test_quantize_linears_takes_decoder_layers_and_leaves_embeddings_head_and_router():
    """Guards the choice of layers: projections and experts become int8; embeddings, LM head,
    MoE router and shared-expert gate keep the model's dtype."""
    config = ModelConfig(model_type="qwen2_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, tie_word_embeddings=False)
    model = Transformer(config)
    count = quantize_linears(model, "int8")
    quantized = {name for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert len(quantized) == count == 2 * (4 + 3 * 4 + 3)
    plain = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert plain == {"lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                     "model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"}
    for bad in ("int4", None):
        with pytest.raises(ValueError, match=repr(bad)):
            quantize_linears(model, bad)


def test_a_row_of_tiny_weights_gets_a_normal_scale():
    """Guards the scale's floor: a row below 127 times the smallest normal fp32 gets that normal
    as its scale, not a subnormal one or a zero (amax / 127 underflows), and is recovered within
    half of it."""
    weight = torch.tensor([[1e-44, -3e-45, 0.0], [1e-37, 2e-38, 5e-38], [1.0, -0.5, 0.25]])
    q, s = quantize_int8(weight)
    tiny = torch.finfo(torch.float32).tiny
    assert s[0] == s[1] == tiny and s[2] == 1.0 / 127
    assert ((q.float() * s[:, None] - weight).abs() <= s[:, None] / 2).all()


def test_a_bad_quantization_leaves_the_model_unchanged():
    """Guards the order of the checks: optimize_for_cpu_inference refuses an unknown method before
    it fuses any projection."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Transformer(config)
    with pytest.raises(ValueError, match="'int4'"):
        optimize_for_cpu_inference(model, quantization="int4")
    assert model.model.layers[0].self_attn.qkv_proj is None
