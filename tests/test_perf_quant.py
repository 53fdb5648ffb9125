"""perf.flops under weight-only int8 quantization: the bytes it counts are the bytes a quantized
model holds.

The reference is independent of the formulas: the summed nbytes of the tensors of a built model
after `ops.quant.quantize_linears` (its parameters, a tied table once, and each Int8Linear's int8
weights and fp32 scales), for dense models (Llama with untied embeddings and biases on every
linear, Qwen2 with q/k/v biases, Gemma 2 with four norms a layer and a tied table) and
mixture-of-experts ones (Mixtral; Qwen2-MoE with a shared expert, its gate and a dense layer), in
fp32 and bf16.
"""

from __future__ import annotations

import json

import pytest
import torch

from slipstream import cli
from slipstream.model.config import ModelConfig
from slipstream.model.transformer import SparseMoeBlock, Transformer
from slipstream.ops.quant import QUANTIZATION_METHODS, Int8Linear, quantize_linears
from slipstream.perf import flops

_ATTENTION = dict(vocab_size=96, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "llama": ModelConfig(model_type="llama", intermediate_size=80, num_hidden_layers=2, attention_bias=True,
                         mlp_bias=True, **_ATTENTION),
    "qwen2": ModelConfig(model_type="qwen2", intermediate_size=80, num_hidden_layers=2, **_ATTENTION),
    "gemma2": ModelConfig(model_type="gemma2", intermediate_size=80, num_hidden_layers=2, head_dim=16,
                          sliding_window=8, tie_word_embeddings=True, **_ATTENTION),
    "mixtral": ModelConfig(model_type="mixtral", intermediate_size=40, num_hidden_layers=2, num_experts=4,
                           num_experts_per_tok=2, **_ATTENTION),
    "qwen2_moe": ModelConfig(model_type="qwen2_moe", intermediate_size=72, num_hidden_layers=3, num_experts=5,
                             num_experts_per_tok=2, moe_intermediate_size=20,
                             shared_expert_intermediate_size=56, mlp_only_layers=(1,),
                             tie_word_embeddings=True, **_ATTENTION),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _quantized(config: ModelConfig, dtype: str) -> Transformer:
    model = Transformer(config).to(DTYPES[dtype])
    quantize_linears(model, "int8")
    return model


def _held_bytes(module: torch.nn.Module) -> int:
    """nbytes of every parameter (a shared one once) and every int8 weight and scale under `module`."""
    tensors = {id(p): p for p in module.parameters()}
    for linear in module.modules():
        if isinstance(linear, Int8Linear):
            tensors |= {id(linear.qweight): linear.qweight, id(linear.scale): linear.scale}
    return sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_weight_bytes_are_the_quantized_models_bytes(family, dtype):
    """weight_bytes(quantization="int8") is the bytes the quantized model holds, less than the
    unquantized count, which is its unquantized twin's."""
    config = CONFIGS[family]
    model = _quantized(config, dtype)
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) > 0
    assert flops.weight_bytes(config, dtype, "int8") == _held_bytes(model)
    assert flops.weight_bytes(config, dtype) == _held_bytes(Transformer(config).to(DTYPES[dtype]))
    assert flops.weight_bytes(config, dtype, "int8") < flops.weight_bytes(config, dtype)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_decode_bytes_read_the_quantized_weights(family):
    """A decode step reads the quantized model's bytes but the untied input table (its gathered rows
    only, in the dtype) and, at batch 1, the routed experts it does not touch (each as many bytes as
    one quantized expert holds); FLOPs do not change."""
    config, dtype, batch = CONFIGS[family], "bfloat16", 1
    model = _quantized(config, dtype)
    expected = _held_bytes(model) + batch * config.hidden_size * 2
    if not config.tie_word_embeddings:
        expected -= model.model.embed_tokens.weight.nbytes
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        expected -= (config.num_experts - config.num_experts_per_tok) * _held_bytes(block.experts[0])
    got = flops.decode_bytes_per_step(config, dtype, batch, 0, quantization="int8")
    assert got == pytest.approx(expected, rel=1e-12)
    kv = 7 * flops.kv_cache_bytes_per_token(config, dtype)
    assert flops.forward_bytes_read(config, dtype, batch, 7, quantization="int8") == pytest.approx(got + kv)
    quantized, plain = flops.ForwardCost(config, dtype, "int8"), flops.ForwardCost(config, dtype)
    assert quantized.flops(9, 2, 40.5) == plain.flops(9, 2, 40.5)


def test_bad_quantization_is_a_value_error():
    """A method perf.flops does not count is a ValueError naming quantization; the methods it counts
    are the ones ops.quant implements."""
    assert flops.QUANTIZATION_METHODS == QUANTIZATION_METHODS
    for call in (lambda: flops.weight_bytes(CONFIGS["llama"], "float32", "int4"),
                 lambda: flops.ForwardCost(CONFIGS["llama"], "float32", "fp8"),
                 lambda: flops.decode_bytes_per_step(CONFIGS["llama"], "float32", 1, 0, quantization="INT8")):
        with pytest.raises(ValueError, match="quantization"):
            call()


@pytest.mark.parametrize("command", [["roofline", "--records"],
                                     ["fit", "--hardware", "h100", "--engine-records"]])
def test_perf_refuses_records_of_a_quantized_engine(tmp_path, capsys, command):
    """perf's serving model prices weights in the engine's dtype: records of an engine that served
    int8 weights are refused by name, not priced or fitted as if unquantized."""
    header = {"kind": "engine_config", "engine_id": "e1", "model": str(tmp_path), "dtype": "float32",
              "quantization": "int8", "device": "cpu", "tensor_parallel_size": 1}
    step = {"kind": "engine_step", "engine_id": "e1", "phase": "decode", "batch_size": 1, "context_len": 8,
            "step_s": 0.01}
    records = tmp_path / "metrics.jsonl"
    records.write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")
    assert cli.main(["perf", *command, str(records), "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"{records}: written by engines serving int8 weights (EngineConfig.quantization)" in err
