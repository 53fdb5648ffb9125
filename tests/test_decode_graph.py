"""The CPU decode graph computes a decode step exactly as the model's modules do."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from serve_fixtures import random_model

from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.ops.linear import MAX_PANEL_ROWS
from slipstream.ops.paged_attention import PagedBatch
from slipstream.serve.runner import PagedAttention, PagedKVCache
from slipstream.serve.sampler import argmax

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")

BLOCK_SIZE, NUM_BLOCKS = 4, 48


def decode_batch(config, seq_lens, dtype, num_blocks=NUM_BLOCKS):
    """A cache filled with random keys and values for every earlier position of each sequence
    (over shuffled blocks), and the layout of one decode step that adds the last token."""
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    cache = PagedKVCache(config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype,
                         device=torch.device("cpu"))
    for tensor in [*cache.keys, *cache.values]:
        tensor.copy_(torch.randn(tensor.shape))
    batch = PagedBatch.build(seq_lens=seq_lens, query_lens=[1] * len(seq_lens), block_tables=tables,
                             block_size=BLOCK_SIZE)
    token_ids = torch.randint(0, config.vocab_size, (len(seq_lens),))
    positions = torch.tensor([n - 1 for n in seq_lens])
    return cache, batch, token_ids, positions


def module_path(model, cache, batch, token_ids, positions, use_kernel):
    attention = PagedAttention(cache, batch, use_kernel)
    with torch.inference_mode():
        return model.hidden_states(token_ids[None], positions[None], attention)[0]


# One or two sequences' products go through the matrix-vector kernel, more through the panel kernel
# (with the rows split among threads too where the model has few panels), or up to four through
# the matrix-vector kernel where the CPU has no panel kernel for the dtype.
# Sequences of over 512 keys are split into chunks by the attention (merged afterwards).
BATCHES = [[1], [9], [9, 3], [5, 17, 2], [30, 8, 13, 4], [5, 17, 2, 9, 1, 30],
           [3, 7, 11, 2, 5, 9, 1, 6, 4, 8, 10, 12, 2, 3, 7, 5, 9, 6, 1, 4], [700, 5, 530]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", BATCHES, ids=lambda s: f"{len(s)}seqs")
def test_decode_graph_equals_module_path(family_config, dtype, seq_lens):
    """Every family's quirks (biases, q/k norms, a sliding window shorter than the context, GQA,
    head_dim apart from hidden size, tied embeddings), one to twenty sequences and three of up to
    700 keys (the attention splits those into chunks): the graph's hidden states, its logits (the
    lm_head in the graph) and the keys and values it writes equal the module-by-module fast path
    bit for bit, and the plain PyTorch model (no kernels, no fusion) to rounding."""
    plain = random_model(family_config, dtype)
    fast = optimize_for_cpu_inference(copy.deepcopy(plain))
    num_blocks = max(NUM_BLOCKS, sum(-(-n // BLOCK_SIZE) for n in seq_lens))
    cache, batch, token_ids, positions = decode_batch(family_config, seq_lens, dtype, num_blocks)
    graph_cache, plain_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    graph = CpuDecodeGraph.build(fast, graph_cache.keys, graph_cache.values)
    assert graph is not None
    panels = cpu_kernels.supports_panel_gemm(torch.empty(1, dtype=dtype))
    assert graph.max_seqs == (MAX_PANEL_ROWS if panels else cpu_kernels.MAX_GEMV_ROWS)
    if len(seq_lens) > graph.max_seqs:
        pytest.skip(f"no {dtype} panel kernel on this CPU: the graph takes up to {graph.max_seqs} sequences")

    logits_cache = copy.deepcopy(cache)
    logits_graph = CpuDecodeGraph.build(fast, logits_cache.keys, logits_cache.values)
    expected = module_path(fast, cache, batch, token_ids, positions, use_kernel=True)
    with torch.inference_mode():
        got = graph(token_ids, positions, batch)
        got_logits = logits_graph(token_ids, positions, batch, logits=True)
        expected_logits = fast.compute_logits(expected)
    reference = module_path(plain, plain_cache, batch, token_ids, positions, use_kernel=False)

    assert got.shape == expected.shape == (len(seq_lens), family_config.hidden_size)
    assert torch.equal(got, expected)
    assert got_logits.shape == (len(seq_lens), family_config.vocab_size)
    assert torch.equal(got_logits, expected_logits)
    for layer in range(family_config.num_hidden_layers):
        for written in (graph_cache, logits_cache):
            assert torch.equal(written.keys[layer], cache.keys[layer])
            assert torch.equal(written.values[layer], cache.values[layer])
    diff = (got.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    print(f"{family_config.model_type} {dtype}: max |diff| vs plain model {diff:.3g} (scale {scale:.3g})")
    assert diff <= (3e-2 * scale if dtype == torch.bfloat16 else 1e-4 * scale)


def test_decode_graph_applies_only_to_the_optimised_model(family_config):
    """The plain model (separate projections, nn.Linear) gets no graph; callers keep the modules."""
    plain = random_model(family_config, torch.float32)
    cache = PagedKVCache(family_config, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32,
                         device=torch.device("cpu"))
    assert CpuDecodeGraph.build(plain, cache.keys, cache.values) is None


def test_decode_graph_rejects_batches_it_cannot_run(family_config):
    """More sequences than it was built for, or a prefill chunk: a ValueError, not a wrong answer."""
    fast = optimize_for_cpu_inference(random_model(family_config, torch.float32))
    cache = PagedKVCache(family_config, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32,
                         device=torch.device("cpu"))
    too_many = CpuDecodeGraph.build(fast, cache.keys, cache.values).max_seqs + 1
    cache, batch, token_ids, positions = decode_batch(family_config, [3] * too_many, torch.float32,
                                                       num_blocks=too_many)
    graph = CpuDecodeGraph.build(fast, cache.keys, cache.values)
    with pytest.raises(ValueError, match="decoding sequences"):
        graph(token_ids, positions, batch)
    prefill = PagedBatch.build(seq_lens=[3], query_lens=[3], block_tables=[[0]], block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="prefill"):
        graph(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), prefill)


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_decode_graph_rejects_token_ids_outside_the_vocabulary(family_config, bad):
    """The embedding lookup is in C: an id outside [0, vocab) is a ValueError naming it, as
    nn.Embedding refuses it, never a read past the table; nothing is written to the cache."""
    fast = optimize_for_cpu_inference(random_model(family_config, torch.float32))
    cache, batch, token_ids, positions = decode_batch(family_config, [5, 9], torch.float32)
    graph = CpuDecodeGraph.build(fast, cache.keys, cache.values)
    bad_id = family_config.vocab_size if bad == "vocab" else bad
    token_ids[1] = bad_id
    before = [t.clone() for t in cache.keys]
    with pytest.raises(ValueError, match=rf"\[0, {family_config.vocab_size}\).*{bad_id}"):
        graph(token_ids, positions, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys, strict=True))


def test_decode_graph_grows_its_rotary_tables(family_config):
    """Positions past the rotary tables built so far (1,024 at first) grow them: one graph runs a
    step of short sequences, then one with a sequence of 2,100 keys, each equal to the module path
    bit for bit."""
    fast = optimize_for_cpu_inference(random_model(family_config, torch.float32))
    seq_lens = [2100, 3]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens)
    cache, long_step, token_ids, positions = decode_batch(family_config, seq_lens, torch.float32, num_blocks)
    tables = long_step.decode_block_tables.tolist()
    short_step = PagedBatch.build(seq_lens=[5, 3], query_lens=[1, 1],
                                  block_tables=[tables[0][:2], tables[1][:1]], block_size=BLOCK_SIZE)
    graph_cache = copy.deepcopy(cache)
    graph = CpuDecodeGraph.build(fast, graph_cache.keys, graph_cache.values)
    for batch, step_positions in ((short_step, torch.tensor([4, 2])), (long_step, positions)):
        expected = module_path(fast, cache, batch, token_ids, step_positions, use_kernel=True)
        with torch.inference_mode():
            assert torch.equal(graph(token_ids, step_positions, batch), expected)


def test_decode_graph_rejects_positions_that_are_not_the_last_token(family_config):
    """A position past the sequence (beyond the rotary tables the graph keeps for its lengths) is a
    ValueError naming it, checked in C before any work: nothing is written to the cache."""
    fast = optimize_for_cpu_inference(random_model(family_config, torch.float32))
    cache, batch, token_ids, positions = decode_batch(family_config, [5, 9], torch.float32)
    graph = CpuDecodeGraph.build(fast, cache.keys, cache.values)
    before = [t.clone() for t in cache.keys]
    for bad in (-1, 1 << 20):
        positions[1] = bad
        with pytest.raises(ValueError, match=rf"position.*{bad}"):
            graph(token_ids, positions, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys, strict=True))


NUM_GREEDY_STEPS = 6  # with blocks of 4 tokens, every sequence crosses into a new block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 2], [5, 17, 2, 9, 1, 30]], ids=lambda s: f"{len(s)}seqs")
def test_greedy_steps_equal_one_step_at_a_time(family_config, dtype, seq_lens):
    """Several greedy steps in one call (multi-step decoding) feed each sequence the argmax of its
    last logits: the tokens and the keys and values written equal those of as many steps of the
    module-by-module fast path, each sampled by the sampler's argmax, bit for bit."""
    fast = optimize_for_cpu_inference(random_model(family_config, dtype))
    lengths = [n + NUM_GREEDY_STEPS - 1 for n in seq_lens]  # the last step's sequence lengths
    num_blocks = max(NUM_BLOCKS, sum(-(-n // BLOCK_SIZE) for n in lengths))
    cache, last_step, token_ids, _ = decode_batch(family_config, lengths, dtype, num_blocks)
    tables = last_step.decode_block_tables
    graph_cache = copy.deepcopy(cache)
    graph = CpuDecodeGraph.build(fast, graph_cache.keys, graph_cache.values)
    if len(seq_lens) > graph.max_seqs:
        pytest.skip(f"no {dtype} panel kernel on this CPU: the graph takes up to {graph.max_seqs} sequences")
    positions = torch.tensor([n - 1 for n in seq_lens])
    with torch.inference_mode():
        got = graph.greedy(token_ids.tolist(), positions.tolist(), tables.tolist(), NUM_GREEDY_STEPS)
    expected, tokens = [], token_ids
    for step in range(NUM_GREEDY_STEPS):
        batch = PagedBatch.build(seq_lens=[n + step for n in seq_lens], query_lens=[1] * len(seq_lens),
                                 block_tables=tables.tolist(), block_size=BLOCK_SIZE)
        hidden = module_path(fast, cache, batch, tokens, positions + step, use_kernel=True)
        with torch.inference_mode():
            tokens = argmax(fast.compute_logits(hidden))
        expected.append(tokens)
    assert got == torch.stack(expected).tolist()
    for layer in range(family_config.num_hidden_layers):
        assert torch.equal(graph_cache.keys[layer], cache.keys[layer])
        assert torch.equal(graph_cache.values[layer], cache.values[layer])


def test_greedy_steps_need_block_tables_that_cover_them(family_config):
    """A block table too short for the last step's position, a negative position, or token ids
    outside the vocabulary: a ValueError before any work, nothing written to the cache."""
    fast = optimize_for_cpu_inference(random_model(family_config, torch.float32))
    cache, batch, token_ids, positions = decode_batch(family_config, [5, 8], torch.float32)
    graph = CpuDecodeGraph.build(fast, cache.keys, cache.values)
    token_ids, positions = token_ids.tolist(), positions.tolist()
    tables = batch.decode_block_tables.tolist()  # 2 blocks of 4 each: positions up to 7
    before = [t.clone() for t in cache.keys]
    for bad_positions, num_steps in (([4, 7], 2), ([4, 6], 3), ([-1, 3], 1)):
        with pytest.raises(ValueError, match="block table"):
            graph.greedy(token_ids, bad_positions, tables, num_steps)
    with pytest.raises(ValueError, match="block table"):  # each sequence's own table, not the longest
        graph.greedy(token_ids, [4, 7], [tables[0], tables[1][:1]], 1)
    with pytest.raises(ValueError, match="token ids"):
        graph.greedy([token_ids[0], family_config.vocab_size], positions, tables, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys, strict=True))
    with pytest.raises(ValueError, match="at least one step"):
        graph.greedy(token_ids, positions, tables, 0)
