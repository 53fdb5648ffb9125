"""The routed experts of a mixture-of-experts block in one C call (`KernelMoeExperts`,
`cpu_kernels.moe_experts_`) give the block's own path bit for bit: the same kernels per expert,
the weighted rows rounded and added in the same order. The references are the block's own path
(the fused call switched off) and the loop over experts of transformers' eager implementation,
both on the same packed experts; fp32 and bf16, Mixtral's fp32 routing weights and Qwen's rounded
ones, top-1 and top-2, experts without tokens."""

from __future__ import annotations

import pytest
import torch

from slipstream.model import ModelConfig, Transformer
from slipstream.model.transformer import SparseMoeBlock, route
from slipstream.ops import cpu_kernels
from slipstream.ops.inference import KernelMoeExperts, optimize_for_cpu_inference

pytestmark = pytest.mark.skipif(not cpu_kernels.supports_panel_gemm(torch.empty(0)),
                                reason="no C compiler or no panel kernel here")

HIDDEN, EXPERT_WIDTH, NUM_EXPERTS = 112, 72, 8  # widths not multiples of the kernels' 16 and 48


def _optimised_block(family: str, dtype: torch.dtype, top_k: int, seed: int = 0) -> SparseMoeBlock:
    """The MoE block of a one-layer model of `family` after optimize_for_cpu_inference, with
    routers far from uniform (std 1), so that the choices spread over the experts."""
    width = {"intermediate_size": EXPERT_WIDTH} if family == "mixtral" else {
        "intermediate_size": 96, "moe_intermediate_size": EXPERT_WIDTH}
    config = ModelConfig(model_type=family, vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=NUM_EXPERTS,
                         num_experts_per_tok=top_k, **width)
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights(std=0.1)
    block = model.model.layers[0].mlp
    torch.nn.init.normal_(block.gate.weight, 0.0, 1.0)
    return optimize_for_cpu_inference(model.to(dtype).eval()).model.layers[0].mlp


def _loop_over_experts(block: SparseMoeBlock, x: torch.Tensor, weights: torch.Tensor | None = None,
                       experts: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' eager loop: each expert on its tokens, its rows times the routing weight,
    rounded to the dtype and added in increasing expert order (routed by the block's router unless
    given the weights and experts)."""
    if experts is None:
        weights, experts = route(block.gate(x), block.top_k, block.renormalize)
        if not block.fp32_weights:
            weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(block.num_experts):
        tokens, choice = torch.where(experts == e)
        if len(tokens):
            rows = block.experts[e](x[tokens]) * weights[tokens, choice, None]
            out.index_add_(0, tokens, rows.to(x.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_fused_experts_equal_the_block_bit_for_bit(dtype, family, top_k, num_rows):
    """The fused call takes the block's routed experts (its call counter moves) and its output
    equals, bit for bit, the block with the call switched off and transformers' loop over experts:
    few rows (the matrix-vector kernel below 3, experts without tokens) to 300 (tens per expert)."""
    block = _optimised_block(family, dtype, top_k)
    assert isinstance(block.fused_experts, KernelMoeExperts)
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
    with torch.inference_mode():
        got = block(x)
        assert block.fused_experts.num_calls == 1
        counts = torch.bincount(route(block.gate(x), top_k, block.renormalize)[1].flatten(),
                                minlength=NUM_EXPERTS)
        looped = _loop_over_experts(block, x)
        fused, block.fused_experts = block.fused_experts, None
        expected = block(x)
        block.fused_experts = fused
    print(f"{family} {dtype} top-{top_k}, {num_rows} rows: rows per expert {counts.tolist()}")
    assert torch.equal(got, expected)
    assert torch.equal(got, looped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declined_above_the_panel_rows(dtype):
    """Where the panel kernel does not take every size (bf16 on a CPU with bf16 arithmetic), a call
    that gives an expert more than MAX_PANEL_ROWS rows is declined, with `out` untouched, and the
    block's own path gives the result; fp32 with AVX-512 takes every size."""
    block = _optimised_block("mixtral", dtype, top_k=2)
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    experts = torch.tensor([[1, 0]]).expand(300, 2)  # 300 rows for each of experts 0 and 1
    weights = torch.rand(300, 2, generator=torch.Generator().manual_seed(2))
    fused = block.fused_experts
    with torch.inference_mode():
        out = torch.zeros_like(x)
        taken = fused(x, weights, experts, out)
    assert taken == (fused.max_panel_rows is None)
    if not taken:
        assert not out.any()
    else:
        with torch.inference_mode():
            expected = _loop_over_experts(block, x, weights, experts)
        assert torch.equal(out, expected)


def _expert_weights(dtype: torch.dtype, bias: bool, seed: int = 0):
    """Random experts as (ExpertWeights, [(gate_up weight, bias, down weight, bias)])."""
    g = torch.Generator().manual_seed(seed)
    plain = []
    for _ in range(4):
        layer = []
        for shape in ((2 * EXPERT_WIDTH, HIDDEN), (HIDDEN, EXPERT_WIDTH)):
            layer += [(0.1 * torch.randn(*shape, generator=g)).to(dtype),
                      (0.1 * torch.randn(shape[0], generator=g)).to(dtype) if bias else None]
        plain.append(layer)
    copies = [[(w.contiguous(), cpu_kernels.pack_panels(w), b) for w, b in (e[:2], e[2:])] for e in plain]
    weights = cpu_kernels.ExpertWeights([c[0] for c in copies], [c[1] for c in copies], HIDDEN, EXPERT_WIDTH,
                                        dtype)
    return weights, plain


def _kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product as a PackedLinear with both copies computes it for this many rows."""
    if len(x) < cpu_kernels.min_panel_rows(x.dtype):
        return cpu_kernels.gemv(x, weight, bias)
    return cpu_kernels.panel_gemm(x, cpu_kernels.pack_panels(weight), bias, weight.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_and_rounded_weights_through_the_wrapper(dtype):
    """moe_experts_ with biased experts and weights in the dtype (Qwen's rounding), added into an
    out that is not zero: per expert the per-op kernels' product, silu-and-mul and product, each
    row times its weight rounded to the dtype and added in increasing expert order."""
    experts, plain = _expert_weights(dtype, bias=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, HIDDEN, generator=g).to(dtype)
    expert_ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])  # (9, 2)
    expert_ids[0] = torch.tensor([3, 1])  # an expert with two rows, below the panel kernel's 3
    weights = torch.rand(9, 2, generator=g).to(dtype)
    start = torch.randn(9, HIDDEN, generator=g).to(dtype)
    expected = start.clone()
    for e, (up, up_bias, down, down_bias) in enumerate(plain):
        tokens, choice = torch.where(expert_ids == e)
        if len(tokens):
            act = cpu_kernels.silu_and_mul(_kernel_linear(x[tokens], up, up_bias))
            rows = _kernel_linear(act, down, down_bias)
            expected.index_add_(0, tokens, (rows * weights[tokens, choice, None]).to(dtype))
    out = start.clone()
    assert cpu_kernels.moe_experts_(out, x, expert_ids, weights, experts)
    assert torch.equal(out, expected)


def test_bad_inputs_are_value_errors():
    """Wrong dtypes, shapes, devices, top_k or expert ids raise ValueError naming the argument,
    before any work (a tensor off the CPU once reached the C code and crashed the process)."""
    experts, _ = _expert_weights(torch.float32, bias=False)
    x, out = torch.randn(5, HIDDEN), torch.zeros(5, HIDDEN)
    ids, weights = torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2)
    ids[:, 1] = 1
    bad_calls = {
        "x and out": (out, x.double(), ids, weights),
        "x and out ": (out, x[:, :-1], ids, weights),
        "x and out  ": (out[:4], x, ids, weights),
        "expert_ids": (out, x, ids.int(), weights),
        "expert_ids ": (out, x, ids[:4], weights),
        "weights": (out, x, ids, weights.half()),
        "weights ": (out, x, ids, weights[:, :1]),
        "expert_ids must lie": (out, x, ids + 3, weights),
        "on the CPU": (out, x, ids.to("meta"), weights),
        "on the CPU ": (out, x, ids, weights.to("meta")),
        "top_k": (out, x, torch.zeros(5, 0, dtype=torch.long), torch.rand(5, 0)),
        "top_k ": (out, x, torch.zeros(5, 9, dtype=torch.long), torch.rand(5, 9)),
    }
    for message, args in bad_calls.items():
        with pytest.raises(ValueError, match=message.strip()):
            cpu_kernels.moe_experts_(*args, experts)
    assert not out.any()
    with pytest.raises(ValueError, match="panels"):
        cpu_kernels.ExpertWeights([(None, torch.zeros(3), None)], [(None, torch.zeros(3), None)], HIDDEN,
                                  EXPERT_WIDTH, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernels.ExpertWeights([], [], HIDDEN, EXPERT_WIDTH, torch.float16)
    up, down = torch.zeros(2 * EXPERT_WIDTH, HIDDEN), torch.zeros(HIDDEN, EXPERT_WIDTH)
    with pytest.raises(ValueError, match="CPU tensors"):
        cpu_kernels.ExpertWeights([(None, cpu_kernels.pack_panels(up).to("meta"), None)],
                                  [(None, cpu_kernels.pack_panels(down), None)], HIDDEN, EXPERT_WIDTH,
                                  torch.float32)


def test_a_call_whose_workspace_would_pass_the_limit_is_declined(monkeypatch):
    """A call whose routed rows' intermediates would pass MOE_WORKSPACE_LIMIT_BYTES is declined
    with out untouched (the block then runs its own path, one expert at a time)."""
    experts, _ = _expert_weights(torch.float32, bias=False)
    x, out = torch.randn(5, HIDDEN), torch.zeros(5, HIDDEN)
    ids, weights = torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2)
    ids[:, 1] = 1
    workspace = ids.numel() * (2 * HIDDEN + 3 * EXPERT_WIDTH) * 4
    monkeypatch.setattr(cpu_kernels, "MOE_WORKSPACE_LIMIT_BYTES", workspace - 1)
    assert not cpu_kernels.moe_experts_(out, x, ids, weights, experts)
    assert not out.any()
    monkeypatch.setattr(cpu_kernels, "MOE_WORKSPACE_LIMIT_BYTES", workspace)
    assert cpu_kernels.moe_experts_(out, x, ids, weights, experts)
    assert out.any()
