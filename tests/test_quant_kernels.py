"""The C weight-only int8 kernel (cpu_kernels.int8_panel_gemm, behind PackedInt8Linear) against a
float64 product over the dequantized weight and against Int8Linear's plain path; the optimised
quantized model against the plain quantized one; the decode graph over int8 linears against the
module-by-module path."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import FAMILIES, MOE_FAMILIES
from serve_fixtures import random_model
from test_decode_graph import decode_batch, module_path
from torch import nn

from slipstream.model import ModelConfig
from slipstream.model.transformer import SparseMoeBlock
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import KernelMoeExperts, optimize_for_cpu_inference
from slipstream.ops.linear import MAX_PANEL_ROWS
from slipstream.ops.quant import Int8Linear, PackedInt8Linear, pack_int8_linears, quantize_linears

needs_int8_kernel = pytest.mark.skipif(
    cpu_kernels.library() is None or not cpu_kernels.supports_int8(torch.empty(0)),
    reason="no C int8 kernel here (no compiler, or neither AVX-512 nor AVX2)")

# (out_features, in_features): neither a multiple of 16 nor of the 48-column panels, K odd; one of
# the bench model's shapes (several 128-value chunks of bf16 rows widened on the stack).
SHAPES = [(37, 91), (200, 333), (96, 768)]


def _layers(out_features: int, in_features: int, dtype: torch.dtype, bias: bool):
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 1, out_features)[:, None])  # scales far apart
    plain = Int8Linear(linear.to(dtype))
    return plain, PackedInt8Linear(copy.deepcopy(plain))


@needs_int8_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
def test_int8_kernel_matches_a_float64_product_over_the_dequantized_weight(dtype, bias, shape, rows):
    """The kernel's math: y = s * (x q^T) + b, summed in fp32 and rounded once to x's dtype, for
    row counts that take one block, several, and partial blocks, and shapes that end mid-panel.
    Bound: fp32 summation error (4 units of 2^-24 times sum |x w|, times sqrt(K)) plus one
    rounding of the output; also within that of Int8Linear's plain path."""
    plain, packed = _layers(*shape, dtype, bias)
    x = torch.randn(rows, shape[1]).to(dtype)
    got = packed(x)
    weight = plain.dequantized_weight().double()
    reference = x.double() @ weight.T + (plain.bias.double() if bias else 0.0)
    magnitude = x.double().abs() @ weight.abs().T  # (rows, out): what the sum's rounding errors scale with
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    bound = 4 * 2.0**-24 * shape[1] ** 0.5 * magnitude + rounding * reference.abs() + 1e-30
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    excess = ((got.double() - reference).abs() / bound).max().item()
    print(f"{dtype} {shape} rows={rows}: max error / bound {excess:.3g}")
    assert excess <= 1.0
    assert ((got.double() - plain(x).double()).abs() <= 2 * bound).all()


@needs_int8_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_takes_a_long_prefill_chunk(dtype):
    """A long chunk (rows in bands of 64 from 1,024 rows, 3-D input): every row equals the product
    of that row alone, which goes through one block without bands, and matches the plain path."""
    plain, packed = _layers(200, 333, dtype, bias=True)
    x = torch.randn(2, 700, 333).to(dtype)
    got = packed(x)
    assert got.shape == (2, 700, 200)
    for row in (0, 63, 64, 1023, 1024, 1399):
        assert torch.equal(got.view(-1, 200)[row], packed(x.view(-1, 333)[row : row + 1])[0])
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), plain(x).float(), rtol=tolerance, atol=tolerance)


@needs_int8_kernel
def test_packed_int8_linear_refuses_inputs_the_kernel_does_not_take():
    """An fp16 input is a ValueError naming its dtype, and an input of the wrong width one naming
    its shape, not a wrong answer or a crash (the kernel reads in_features values a row)."""
    _, packed = _layers(37, 91, torch.float32, bias=False)
    with pytest.raises(ValueError, match="float16"):
        packed(torch.randn(2, 91, dtype=torch.float16))
    for width in (71, 7_000):
        with pytest.raises(ValueError, match=f"inputs of 91 features, got shape \\(2, {width}\\)"):
            packed(torch.randn(2, width))


def test_fp16_models_keep_the_plain_int8_path():
    """Where the C kernel does not take the dtype (fp16) the optimised model keeps Int8Linear,
    and its logits equal the plain quantized model's."""
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = random_model(config, torch.float16)
    plain = copy.deepcopy(model)
    quantize_linears(plain, "int8")
    fast = optimize_for_cpu_inference(model, quantization="int8")
    assert pack_int8_linears(fast) == 0
    assert sum(isinstance(m, Int8Linear) for m in fast.modules()) == 4
    ids, positions = torch.randint(0, 64, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(fast(ids, positions), plain(ids, positions))


def _quantized_pair(config: ModelConfig, dtype: torch.dtype):
    model = random_model(config, dtype)
    plain = copy.deepcopy(model)
    count = quantize_linears(plain, "int8")
    fast = optimize_for_cpu_inference(model, quantization="int8")
    return plain, fast, count


@needs_int8_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimised_quantized_model_matches_the_plain_quantized_model(family, dtype):
    """Llama and Qwen3 (q/k norms): every decoder linear of the optimised model is a
    PackedInt8Linear (fused q/k/v and gate/up), and its logits over a prompt match the plain
    model with the same linears quantized (`quantize_linears` on a copy, unfused, Int8Linear)."""
    config = _family_config(family)
    plain, fast, count = _quantized_pair(config, dtype)
    assert sum(isinstance(m, PackedInt8Linear) for m in fast.modules()) == 4 * config.num_hidden_layers
    assert count == 7 * config.num_hidden_layers
    ids = torch.randint(0, config.vocab_size, (2, 11))
    positions = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        expected, got = plain(ids, positions).float(), fast(ids, positions).float()
    diff, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    print(f"{family} {dtype}: max |logit diff| {diff:.3g} (scale {scale:.3g})")
    assert diff <= (3e-2 if dtype == torch.bfloat16 else 1e-4) * scale


def _family_config(family: str) -> ModelConfig:
    """conftest's tiny shape of a family, dense or mixture-of-experts, read through transformers."""
    transformers = pytest.importorskip("transformers")
    shape = (FAMILIES | MOE_FAMILIES)[family]
    return ModelConfig.from_hf_dict(transformers.AutoConfig.for_model(**shape).to_dict())


@needs_int8_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [[9], [9, 3], [5, 17, 2, 9, 1, 30], [3, 7, 11, 2, 5, 9, 1, 6, 4]],
                         ids=lambda s: f"{len(s)}seqs")
def test_decode_graph_runs_int8_linears_as_the_modules_do(family, dtype, seq_lens):
    """The C decode graph binds int8 projections (panels and scales) and its hidden states, logits
    and cache writes equal the module-by-module optimised model bit for bit (the same kernel),
    at one and two sequences, at six (beyond MAX_GEMV_ROWS, where the dense lm_head takes the
    panel kernel) and at nine (bf16 with AVX512-BF16: the int8 panels widened to bf16 pairs)."""
    config = _family_config(family)
    _, fast, _ = _quantized_pair(config, dtype)
    cache, batch, token_ids, positions = decode_batch(config, seq_lens, dtype)
    graph_cache = copy.deepcopy(cache)
    graph = CpuDecodeGraph.build(fast, graph_cache.keys, graph_cache.values)
    assert graph is not None
    if len(seq_lens) > graph.max_seqs:
        pytest.skip(f"the graph takes up to {graph.max_seqs} sequences here")
    assert graph.max_seqs in (MAX_PANEL_ROWS, cpu_kernels.MAX_GEMV_ROWS)
    expected = module_path(fast, cache, batch, token_ids, positions, use_kernel=True)
    with torch.inference_mode():
        got = graph(token_ids, positions, batch)
        expected_logits = fast.compute_logits(expected)
    assert torch.equal(got, expected)
    logits_cache = copy.deepcopy(graph_cache)
    for layer in range(config.num_hidden_layers):
        assert torch.equal(graph_cache.keys[layer], cache.keys[layer])
        assert torch.equal(graph_cache.values[layer], cache.values[layer])
    logits_graph = CpuDecodeGraph.build(fast, logits_cache.keys, logits_cache.values)
    with torch.inference_mode():
        assert torch.equal(logits_graph(token_ids, positions, batch, logits=True), expected_logits)


@needs_int8_kernel
def test_int8_experts_keep_the_blocks_own_path_and_the_graph_declines(caplog):
    """A mixture-of-experts model with int8 experts: no block gets the fused experts call (its C
    table holds dtype weights only), the decode graph declines with a logged reason, and the
    optimised model's logits match the plain quantized model's."""
    config = _family_config("qwen2_moe")
    plain, fast, _ = _quantized_pair(config, torch.float32)
    blocks = [m for m in fast.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(not KernelMoeExperts.applies_to(b) and b.fused_experts is None for b in blocks)
    cache, batch, token_ids, positions = decode_batch(config, [5, 9], torch.float32)
    with caplog.at_level(logging.INFO, logger="slipstream.ops.decode_graph"):
        graph = CpuDecodeGraph.build(fast, cache.keys, cache.values,
                                     fallback=lambda *args: pytest.fail("not a graph"))
    assert graph is None and "no CPU decode graph" in caplog.text
    ids, pos = torch.randint(0, config.vocab_size, (1, 7)), torch.arange(7)[None]
    with torch.no_grad():
        expected, got = plain(ids, pos), fast(ids, pos)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
