"""The CPU decode graph runs mixture-of-experts layers exactly as the model's modules do."""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import sys
import weakref

import pytest
import torch
from conftest import MOE_FAMILIES
from serve_fixtures import random_model
from test_decode_graph import BLOCK_SIZE, NUM_BLOCKS, decode_batch, module_path

from slipstream.model import ModelConfig
from slipstream.model.transformer import SparseMoeBlock
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.ops.paged_attention import PagedBatch
from slipstream.serve.sampler import argmax

pytestmark = [
    pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler"),
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                       reason="the graph's routing reproduces PyTorch's AVX512 kernels only"),
]

# conftest's three families (Mixtral: renormalised top-2 of 4; Qwen3-MoE: top-3 of 6 between dense
# layers; Qwen2-MoE: a gated shared expert, renormalised top-2 of 5), and Qwen3-MoE's real routing
# shape in small: renormalised top-8 of 40 (softmax sums over 16-lane vectors and a tail).
SHAPES = {name: (name, {}) for name in MOE_FAMILIES} | {
    "qwen3_moe-top8of40": ("qwen3_moe", dict(num_experts=40, num_experts_per_tok=8, norm_topk_prob=True)),
}


def _config(shape: str, **overrides) -> ModelConfig:
    transformers = pytest.importorskip("transformers")
    family, shape_overrides = SHAPES[shape]
    hf = transformers.AutoConfig.for_model(**(MOE_FAMILIES[family] | shape_overrides | overrides))
    return ModelConfig.from_hf_dict(hf.to_dict())


def _graph(fast, cache):
    """A graph over `cache` whose fallback runs the module path over the same cache, and the list
    of the fallback's calls (each step's positions)."""
    calls = []

    def fallback(token_ids, positions, batch):
        calls.append(positions.tolist())
        return module_path(fast, cache, batch, token_ids, positions, use_kernel=True)

    return CpuDecodeGraph.build(fast, cache.keys, cache.values, fallback=fallback), calls


# One sequence (matrix-vector products), six (panels), 40 and 64: the shared expert's sigmoid
# takes PyTorch's vectorised exp for whole 32-value pairs of fp32 vectors (64 of bf16) and the C
# library's for the rest.
BATCHES = [[1], [5, 17, 2, 9, 1, 30], list(range(1, 41)), list(range(1, 65))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_moe_decode_graph_equals_module_path(shape, dtype):
    """Routed layers (and the dense layers between them) in the graph, for 1 to 64 sequences: its
    hidden states, its logits and the keys and values it writes equal the module-by-module fast
    path bit for bit (the router's softmax, top-k, renormalisation and cast, the shared expert's
    sigmoid gate); no step falls back to the modules. In fp32 they equal the plain PyTorch model to
    rounding (in bf16 the plain model's own rounding may route a token to other experts)."""
    config = _config(shape)
    plain = random_model(config, dtype)
    fast = optimize_for_cpu_inference(copy.deepcopy(plain))
    for seq_lens in BATCHES:
        num_blocks = max(NUM_BLOCKS, sum(-(-n // BLOCK_SIZE) for n in seq_lens))
        cache, batch, token_ids, positions = decode_batch(config, seq_lens, dtype, num_blocks)
        graph_cache, logits_cache, plain_cache = (copy.deepcopy(cache) for _ in range(3))
        graph, calls = _graph(fast, graph_cache)
        logits_graph, logits_calls = _graph(fast, logits_cache)
        assert graph is not None and len(seq_lens) <= graph.max_seqs
        expected = module_path(fast, cache, batch, token_ids, positions, use_kernel=True)
        with torch.inference_mode():
            got = graph(token_ids, positions, batch)
            got_logits = logits_graph(token_ids, positions, batch, logits=True)
            expected_logits = fast.compute_logits(expected)
        assert torch.equal(got, expected), f"{len(seq_lens)} sequences"
        assert torch.equal(got_logits, expected_logits), f"{len(seq_lens)} sequences"
        for layer in range(config.num_hidden_layers):
            for written in (graph_cache, logits_cache):
                assert torch.equal(written.keys[layer], cache.keys[layer])
                assert torch.equal(written.values[layer], cache.values[layer])
        assert calls == logits_calls == []
        if dtype == torch.float32:
            reference = module_path(plain, plain_cache, batch, token_ids, positions, use_kernel=False)
            diff = (got - reference).abs().max().item()
            scale = reference.abs().max().item()
            print(f"  max |diff| vs plain model {diff:.3g} (scale {scale:.3g})")
            assert diff <= 1e-4 * scale


def _with_routers(config: ModelConfig, dtype: torch.dtype, change) -> torch.nn.Module:
    """The fast model of a random model whose routers' weights (num_experts, E) `change` edits in
    place first (with the router's layer index)."""
    plain = random_model(config, dtype)
    with torch.no_grad():
        for index, layer in enumerate(plain.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                change(layer.mlp.gate.weight, index)
    return optimize_for_cpu_inference(plain)


def _triplicate_rows(weight: torch.Tensor, index: int) -> None:
    """Experts in threes (0 to 2, 3 to 5, ...) share their router weights: their probabilities tie
    for every token, and with top-2 (or top-8) a tie straddles the top-k boundary wherever a group
    is chosen first (or third)."""
    for offset in (1, 2):
        rows = weight[offset::3]
        rows.copy_(weight[0::3][: rows.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["mixtral", "qwen3_moe-top8of40"])
def test_tied_routing_chooses_as_torch_topk(shape, dtype):
    """Experts whose probabilities tie: torch.topk's choice among them follows libstdc++'s
    nth_element and sort, which the C routing replays; the graph routes every token in C and
    equals the module path bit for bit (bf16 router logits tie often on their own)."""
    config = _config(shape)
    fast = _with_routers(config, dtype, _triplicate_rows)
    for seq_lens in ([5, 17, 2, 9, 1, 30], list(range(1, 65))):
        num_blocks = max(NUM_BLOCKS, sum(-(-n // BLOCK_SIZE) for n in seq_lens))
        cache, batch, token_ids, positions = decode_batch(config, seq_lens, dtype, num_blocks)
        graph_cache = copy.deepcopy(cache)
        graph, calls = _graph(fast, graph_cache)
        expected = module_path(fast, cache, batch, token_ids, positions, use_kernel=True)
        with torch.inference_mode():
            got = graph(token_ids, positions, batch)
        assert calls == []
        assert torch.equal(got, expected), f"{len(seq_lens)} sequences"
        for layer in range(config.num_hidden_layers):
            assert torch.equal(graph_cache.keys[layer], cache.keys[layer])


def _infinite_last_router(weight: torch.Tensor, index: int) -> None:
    """In the last layer, experts 0 and 1 get an infinite router weight on the first feature: for a
    token whose normed first feature is not negative both logits are +inf (a NaN probability), else
    both -inf. The NaN stays in that token's logits: the next step's keys and values are finite."""
    if index == 1:
        weight[:2, 0] = float("inf")


def test_declined_routing_falls_back_to_the_module_path():
    """A token whose routing the C code does not replay (a NaN probability): the call stops and
    the graph runs the step module by module through its fallback, equal to the module path."""
    config = _config("mixtral")
    fast = _with_routers(config, torch.float32, _infinite_last_router)
    cache, batch, token_ids, positions = decode_batch(config, [5, 17, 2, 9], torch.float32)
    graph_cache = copy.deepcopy(cache)
    graph, calls = _graph(fast, graph_cache)
    expected = module_path(fast, cache, batch, token_ids, positions, use_kernel=True)
    with torch.inference_mode():
        got = graph(token_ids, positions, batch)
    assert calls == [positions.tolist()]
    assert expected.isnan().any()
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    for layer in range(config.num_hidden_layers):
        assert torch.equal(graph_cache.keys[layer], cache.keys[layer])


NUM_GREEDY_STEPS = 12


def test_greedy_steps_with_declined_routings_equal_one_step_at_a_time():
    """Multi-step greedy decoding where some steps' routing is declined: the C call stops before
    such a step, which runs module by module, and the C steps resume after it. The tokens and the
    cache equal as many steps of the module path, each sampled by the sampler's argmax."""
    config = _config("mixtral")
    fast = _with_routers(config, torch.float32, _infinite_last_router)
    seq_lens = [3]
    lengths = [n + NUM_GREEDY_STEPS - 1 for n in seq_lens]
    cache, last_step, token_ids, _ = decode_batch(config, lengths, torch.float32)
    tables = last_step.decode_block_tables.tolist()
    graph_cache = copy.deepcopy(cache)
    graph, calls = _graph(fast, graph_cache)
    positions = torch.tensor([n - 1 for n in seq_lens])
    with torch.inference_mode():
        got = graph.greedy(token_ids.tolist(), positions.tolist(), tables, NUM_GREEDY_STEPS)
    expected, tokens = [], token_ids
    for step in range(NUM_GREEDY_STEPS):
        batch = PagedBatch.build(seq_lens=[n + step for n in seq_lens], query_lens=[1] * len(seq_lens),
                                 block_tables=tables, block_size=BLOCK_SIZE)
        hidden = module_path(fast, cache, batch, tokens, positions + step, use_kernel=True)
        with torch.inference_mode():
            tokens = argmax(fast.compute_logits(hidden))
        expected.append(tokens)
    print(f"steps at positions {calls} of {positions.tolist()} on fell back")
    fell_back = [step_positions[0] - positions[0].item() for step_positions in calls]
    assert 0 < len(fell_back) and min(fell_back) < NUM_GREEDY_STEPS - 2  # C steps after a fallback
    assert got == torch.stack(expected).tolist()
    for layer in range(config.num_hidden_layers):
        assert torch.equal(graph_cache.keys[layer], cache.keys[layer])
        assert torch.equal(graph_cache.values[layer], cache.values[layer])


def test_decode_graph_declines_renormalised_top_k_it_cannot_sum(caplog):
    """torch sums 5 to 7 routing weights of a row in an order the C routing does not reproduce:
    the graph declines such a model (with a log line) rather than differ."""
    config = _config("qwen3_moe", num_experts=8, num_experts_per_tok=5, norm_topk_prob=True)
    fast = optimize_for_cpu_inference(random_model(config, torch.float32))
    cache, *_ = decode_batch(config, [3], torch.float32)
    with caplog.at_level(logging.INFO, logger="slipstream.ops.decode_graph"):
        assert CpuDecodeGraph.build(fast, cache.keys, cache.values, fallback=lambda *args: None) is None
    assert "top_k=5" in caplog.text


def _nan_routers(weight: torch.Tensor, index: int) -> None:
    """Every router logit of every layer NaN: every token's routing is declined in every step."""
    weight[:, 0] = float("nan")


def test_greedy_steps_all_declined_run_in_a_loop_not_a_recursion():
    """Greedy decoding in which every step's routing is declined runs each step module by module
    one after another: the depth of the Python stack does not grow with the steps (it did, two
    frames a step, past the recursion limit for a few hundred steps of `num_scheduler_steps`)."""
    config = _config("mixtral")
    fast = _with_routers(config, torch.float32, _nan_routers)
    steps = 40
    cache, last_step, token_ids, _ = decode_batch(config, [3 + steps - 1], torch.float32)
    graph, calls = _graph(fast, cache)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + steps)  # room for the calls, not for 2 frames a step
    try:
        with torch.inference_mode():
            got = graph.greedy(token_ids.tolist(), [2], last_step.decode_block_tables.tolist(), steps)
    finally:
        sys.setrecursionlimit(limit)
    assert len(got) == steps and [c[0] for c in calls] == list(range(2, 2 + steps))


def test_a_methods_fallback_does_not_keep_its_owner_alive():
    """The runner hands its own method as the fallback and keeps the graph: the graph holds the
    method weakly, so dropping the runner frees it (and its cache) at once, with no cycle for the
    garbage collector to find; while the owner lives, the method still runs."""
    config = _config("mixtral")
    fast = _with_routers(config, torch.float32, _infinite_last_router)
    cache, batch, token_ids, positions = decode_batch(config, [5, 17, 2, 9], torch.float32)

    class Owner:
        def __init__(self):
            self.calls = 0
            self.graph = CpuDecodeGraph.build(fast, cache.keys, cache.values, fallback=self.step)

        def step(self, token_ids, positions, batch):
            self.calls += 1
            return module_path(fast, cache, batch, token_ids, positions, use_kernel=True)

    owner = Owner()
    with torch.inference_mode():
        owner.graph(token_ids, positions, batch)
    assert owner.calls == 1
    gone = weakref.ref(owner)
    gc.disable()
    try:
        del owner
        assert gone() is None
    finally:
        gc.enable()
