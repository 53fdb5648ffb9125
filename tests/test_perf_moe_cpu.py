"""The serving model's price of a mixture-of-experts block on slipstream's CPU engine against the
engine itself: the calls one block step makes (aten ops in a torch profiler trace plus the C
kernel calls), the fused call's switch at the engine's own limits (`cpu_kernels.moe_experts_`
taking or declining routings built to sit on each side), and dense predictions, which pay none
of it, against the formula they had."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from slipstream.model import ModelConfig, Transformer
from slipstream.model.transformer import SparseMoeBlock
from slipstream.ops import cpu_kernels
from slipstream.ops.inference import KernelMoeExperts, optimize_for_cpu_inference
from slipstream.ops.linear import MAX_PANEL_ROWS
from slipstream.perf.accelerators import Accelerator
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.hardware import get_accelerator
from slipstream.perf.layers import (
    Device,
    FusedExperts,
    LayerSpec,
    attention_core_forward,
    cpu_moe_block,
    layer_gemms,
    pointwise_forward,
)
from slipstream.perf.serving import STEP_KERNELS, ServeSetup, cpu_fused_experts, step_time
from slipstream.perf.shapes import TransformerShape, resolve_model
from slipstream.perf.work import Work

pytestmark = pytest.mark.skipif(not cpu_kernels.supports_panel_gemm(torch.empty(0)),
                                reason="no C compiler or no panel kernel here")

HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 112, 72, 4, 2
_ATTENTION = dict(vocab_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64)
CONFIGS = {
    "mixtral": ModelConfig(model_type="mixtral", hidden_size=HIDDEN, intermediate_size=EXPERT_WIDTH,
                           num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, **_ATTENTION),
    "qwen2_moe": ModelConfig(model_type="qwen2_moe", hidden_size=HIDDEN, intermediate_size=96,
                             moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=40,
                             num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                             **_ATTENTION),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

CPU = Accelerator(name="test CPU (calibrated)", peak_flops_per_s={"fp32": 2e11, "bf16": 4e11},
                  memory_bandwidth_bytes_per_s=5e10, memory_bytes=64 * 2**30,
                  cache_read_bytes_per_s={2**23: 9e10, 2**25: 5e10},
                  sources={"peak_flops_per_s": "test", "memory_bandwidth_bytes_per_s": "test",
                           "memory_bytes": "test", "cache_read_bytes_per_s": "test"}, calibrated=True)

NO_WORK = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::reshape",
           "aten::_reshape_alias", "aten::as_strided", "aten::select", "aten::slice", "aten::unsqueeze",
           "aten::split", "aten::split_with_sizes", "aten::detach", "aten::detach_", "aten::lift_fresh",
           "aten::alias", "aten::flatten", "aten::to", "aten::expand", "aten::resolve_conj",
           "aten::resolve_neg", "aten::item", "aten::_local_scalar_dense"}
"""aten ops that only allocate, view or dispatch: a call is an op with work in it or below it."""

C_CALLS = ("gemv", "panel_gemm", "moe_experts_", "silu_and_mul")
"""The C kernels a MoE block reaches (its linears, the fused experts, the experts' activation)."""


_MODELS: list[Transformer] = []  # the optimised models whose blocks `_block` gave


@functools.cache
def _block(family: str, dtype: str) -> SparseMoeBlock:
    """The MoE block of a one-layer model after optimize_for_cpu_inference (the engine's fast
    path), with a router far from uniform so that the choices spread over the experts."""
    torch.manual_seed(0)
    model = Transformer(CONFIGS[family])
    model.init_weights(std=0.1)
    torch.nn.init.normal_(model.model.layers[0].mlp.gate.weight, 0.0, 1.0)
    _MODELS.append(optimize_for_cpu_inference(model.to(DTYPES[dtype]).eval()))
    return _MODELS[-1].model.layers[0].mlp


def _engine_calls(block: SparseMoeBlock, x: torch.Tensor, monkeypatch) -> int:
    """The calls one forward of `block` makes: top-level aten ops with work (the profiler's
    trace), and C kernel calls, which the profiler does not see (counted at the module's door)."""
    calls = []
    for name in C_CALLS:
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name,
                            lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.inference_mode(), torch.profiler.profile(activities=activities) as trace:
        block(x)
    monkeypatch.undo()

    def works(event) -> bool:
        return (event.name.startswith("aten::") and event.name not in NO_WORK) or any(
            works(child) for child in event.cpu_children)

    top = [e for e in trace.events() if e.name.startswith("aten::") and not _has_aten_parent(e)]
    return sum(map(works, top)) + len(calls)


def _has_aten_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _priced_calls(family: str, dtype: str, num_tokens: int, fused: FusedExperts | None) -> float:
    """The calls `cpu_moe_block` prices for the block: its overhead at 1 s a call."""
    shape = TransformerShape.from_model_config(CONFIGS[family])
    counting = Efficiency(gemm_overhead_s=1.0, kernel_overhead_s=1.0)
    e = 4 if dtype == "fp32" else 2
    device = Device(accelerator=CPU, efficiency=counting, dtype=dtype, element_bytes=e)
    spec = LayerSpec(shape=shape, num_tokens=num_tokens, moe=True, cpu_moe=True)
    return cpu_moe_block(spec, device, device, fused).overhead_s


@pytest.mark.parametrize(("family", "dtype"),
                         [("mixtral", "fp32"), ("mixtral", "bf16"), ("qwen2_moe", "fp32")])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_priced_calls_equal_the_fused_blocks_trace(family, dtype, num_tokens, monkeypatch):
    """A decode step's block on the fast path: the router's linear, the routing ops (fp32 cast
    of bf16 logits, softmax, top-k, renormalising sum and division, zeroed output), one call for
    every routed expert, the shared expert and its gate: as many calls as the profiler trace and
    the C calls of the real block, which took the fused call. (A shape does not say how its family
    routes: Mixtral's way is priced, so a bf16 Qwen block's cast of its weights, one call more, is
    not; in fp32 that cast does nothing.)"""
    block = _block(family, dtype)
    assert isinstance(block.fused_experts, KernelMoeExperts)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DTYPES[dtype])
    taken = block.fused_experts.num_calls
    calls = _engine_calls(block, x, monkeypatch)
    assert block.fused_experts.num_calls == taken + 1
    fused = cpu_fused_experts(dtype)
    assert fused is not None and fused.takes(TransformerShape.from_model_config(CONFIGS[family]), num_tokens,
                                             DTYPES[dtype].itemsize)
    assert _priced_calls(family, dtype, num_tokens, fused) == calls


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_priced_calls_equal_the_declined_blocks_trace(dtype, monkeypatch):
    """The block's own path, expert by expert (where the fused call declines): argsort, bincount,
    token indices, the gather, each touched expert's gate-up, activation and down, the
    concatenation, the weights gathered and multiplied in, the cast of bf16 outputs' fp32
    products, an index_add per expert. 64 tokens touch all 4 experts (each is left out with
    probability 2^-64 under uniform routing), as the trace's bincount confirms."""
    block = _block("mixtral", dtype)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DTYPES[dtype])
    fused, block.fused_experts = block.fused_experts, None
    try:
        calls = _engine_calls(block, x, monkeypatch)
        with torch.inference_mode():
            experts = torch.topk(block.gate(x).float(), TOP_K, dim=-1).indices
    finally:
        block.fused_experts = fused
    assert len(experts.unique()) == NUM_EXPERTS
    assert _priced_calls("mixtral", dtype, 64, None) == pytest.approx(calls, abs=1e-6)


def _routing_with_rows(rows_per_expert: list[int]) -> torch.Tensor:
    """(N, TOP_K) expert ids giving each expert its number of rows, distinct within a token."""
    order = [e for e, rows in enumerate(rows_per_expert) for _ in range(rows)]
    half = len(order) // TOP_K
    return torch.tensor([order[i::half] for i in range(half)])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_call_switch_at_the_engines_limits(dtype):
    """`FusedExperts.takes` (as `cpu_fused_experts` reads the engine's limits here) against the
    engine's own `moe_experts_`: every expert at the row limit, where there is one, is taken, one
    row more declined; without a row limit (the panel kernel takes every size) both are taken.
    The workspace limit (`MOE_WORKSPACE_LIMIT_BYTES`) at its edge: taken at it, declined past it."""
    fused = cpu_fused_experts(dtype)
    assert fused is not None and fused.workspace_limit_bytes == cpu_kernels.MOE_WORKSPACE_LIMIT_BYTES
    block = _block("mixtral", dtype)
    shape = TransformerShape.from_model_config(CONFIGS["mixtral"])
    limit = fused.max_rows_per_expert
    assert limit in (None, MAX_PANEL_ROWS)
    for rows in (MAX_PANEL_ROWS, MAX_PANEL_ROWS + 1):
        experts = _routing_with_rows([rows] * NUM_EXPERTS)
        tokens = len(experts)
        x = torch.randn(tokens, HIDDEN).to(DTYPES[dtype])
        out = torch.zeros_like(x)
        weights = torch.full(experts.shape, 0.5)
        taken = cpu_kernels.moe_experts_(out, x, experts, weights, block.fused_experts.experts,
                                         block.fused_experts.max_panel_rows)
        assert shape.experts_touched(tokens) == pytest.approx(NUM_EXPERTS)
        assert fused.takes(shape, tokens, DTYPES[dtype].itemsize) == taken == (limit is None or rows <= limit)
    per_pair = (2 * HIDDEN + 3 * EXPERT_WIDTH) * DTYPES[dtype].itemsize
    edge = cpu_kernels.MOE_WORKSPACE_LIMIT_BYTES // per_pair // TOP_K  # tokens whose workspace fits
    unlimited = dataclasses.replace(fused, max_rows_per_expert=None)
    assert unlimited.takes(shape, edge, DTYPES[dtype].itemsize)
    assert not unlimited.takes(shape, edge + 1, DTYPES[dtype].itemsize)


def _old_formula(
    setup: ServeSetup, accelerator: Accelerator, contexts: list[int], layer_call_s: float = 5e-6
) -> tuple[float, Efficiency]:
    """A dense decode step as the serving model priced it before MoE steps were priced as the CPU
    engine runs them: the layer's GEMMs, attention core and pointwise kernels (each call at
    `layer_call_s`), the lm_head and the step's own kernels (at 5 us), host time, at the bandwidth
    of the step's bytes."""
    def once(acc: Accelerator):
        device = Device(accelerator=acc, efficiency=efficiency, dtype=setup.activation_dtype,
                        element_bytes=setup.activation_bytes)
        layer_device = dataclasses.replace(device, efficiency=efficiency.replace(
            gemm_overhead_s=layer_call_s, kernel_overhead_s=layer_call_s))
        n, shape = len(contexts), setup.shape
        spec = LayerSpec(shape=shape, num_tokens=n, attention_pairs=sum(c + 1 for c in contexts),
                         kv_read_tokens=sum(c + 1 for c in contexts))
        layer = attention_core_forward(spec, layer_device) + pointwise_forward(spec, layer_device)
        for m, k, width, count in layer_gemms(shape, n, 1):
            layer = layer + layer_device.gemm(m, k, width, count)
        head = device.gemm(n, shape.hidden_size, shape.vocab_size)
        extra = device.stream(2.0 * n * shape.hidden_size * setup.activation_bytes, STEP_KERNELS)
        host = efficiency.step_overhead_s + n * efficiency.sequence_overhead_s
        return layer * shape.num_layers + head + extra + Work(overhead_s=host)

    efficiency = Efficiency(gemm_fraction=1.0, memory_fraction=1.0, roofline_overlap=0.5,
                            gemm_overhead_s=5e-6, kernel_overhead_s=5e-6, step_overhead_s=2e-4,
                            sequence_overhead_s=2e-5)
    first = once(accelerator)
    cached = dataclasses.replace(accelerator, memory_bandwidth_bytes_per_s=accelerator.read_bandwidth(
        first.memory_bytes))
    return once(cached).total_s, efficiency


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 16])
def test_dense_decode_in_the_graph_keeps_its_formula_and_eager_decode_pays_module_calls(preset, dtype, batch):
    """A dense decode step the CPU decode graph replays is the formula it was (recomputed from its
    parts, no per-call cost in the layers), whatever the module-by-module call cost; the same step
    outside the graph (enforce_eager: a graph budget of 0) pays that cost on every layer call, as
    the engine runs it module by module."""
    graphed = ServeSetup(shape=resolve_model(preset), dtype=dtype, decode_graph_max_batch=256)
    expected, efficiency = _old_formula(graphed, CPU, [100] * batch, layer_call_s=0.0)
    for call in (None, 1e-3):
        got = step_time(graphed, CPU, decode_contexts=[100] * batch,
                        efficiency=efficiency.replace(module_call_overhead_s=call)).total_s
        assert got == pytest.approx(expected, rel=1e-12)
        eager = dataclasses.replace(graphed, decode_graph_max_batch=0)
        got = step_time(eager, CPU, decode_contexts=[100] * batch,
                        efficiency=efficiency.replace(module_call_overhead_s=call)).total_s
        assert got == pytest.approx(_old_formula(eager, CPU, [100] * batch, layer_call_s=call or 5e-6)[0],
                                    rel=1e-12)


def test_moe_layers_pay_the_module_call_cost_on_a_cpu_only():
    """A MoE decode step on a calibrated CPU rises with the module-by-module call cost (every call
    of its layers); on an H100 (the CUDA path's pricing) it does not."""
    setup = ServeSetup(shape=TransformerShape.from_model_config(CONFIGS["mixtral"]), dtype="fp32")
    base = Efficiency(gemm_overhead_s=5e-6, kernel_overhead_s=5e-6)
    for accelerator in (CPU, get_accelerator("h100")):
        cheap, dear = (step_time(setup, accelerator, decode_contexts=[10], efficiency=efficiency)
                       for efficiency in (base, base.replace(module_call_overhead_s=15e-6)))
        if accelerator is CPU:
            assert dear.overhead_s > cheap.overhead_s
        else:
            assert dear.total_s == cheap.total_s


def test_moe_decode_replays_the_cpu_decode_graph_where_the_engines_graph_holds_it():
    """A MoE decode step within the graph budget pays no per-call cost in its layers where the
    engine's CPU decode graph holds MoE layers (`CpuDecodeGraph.build` takes the optimised model,
    as the runner builds it), module calls otherwise and always in a prefill; on an H100 a MoE
    decode stays eager whatever the budget (no CUDA graph holds its routing)."""
    from slipstream.ops.decode_graph import CpuDecodeGraph
    from slipstream.serve.runner import PagedKVCache

    config = CONFIGS["mixtral"]
    block = _block("mixtral", "fp32")
    model = next(m for m in _MODELS if m.model.layers[0].mlp is block)
    cache = PagedKVCache(config, num_blocks=4, block_size=16, dtype=torch.float32,
                         device=torch.device("cpu"))
    graph = CpuDecodeGraph.build(model, cache.keys, cache.values, fallback=lambda *args: None)
    shape = TransformerShape.from_model_config(config)
    fused = cpu_fused_experts("fp32")
    assert fused.in_decode_graph(shape, 4, 4) == (graph is not None)
    base = Efficiency(gemm_overhead_s=5e-6, kernel_overhead_s=5e-6, module_call_overhead_s=5e-6)
    dear = base.replace(module_call_overhead_s=15e-6)
    for accelerator, graphed in ((CPU, graph is not None), (get_accelerator("h100"), False)):
        setup = ServeSetup(shape=shape, dtype="fp32", decode_graph_max_batch=256)
        steps = [step_time(setup, accelerator, decode_contexts=[10] * 4, efficiency=e) for e in (base, dear)]
        assert (steps[0].total_s == steps[1].total_s) == (graphed or accelerator is not CPU)
        eager = step_time(dataclasses.replace(setup, decode_graph_max_batch=0), accelerator,
                          decode_contexts=[10] * 4, efficiency=base)
        assert (eager.overhead_s > steps[0].overhead_s) == graphed
    prefills = [step_time(ServeSetup(shape=shape, dtype="fp32"), CPU, prefill_lens=[8], efficiency=e)
                for e in (base, dear)]
    assert prefills[1].overhead_s > prefills[0].overhead_s
