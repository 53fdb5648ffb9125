"""The C kernels over an fp8 KV cache (kv_cache_dtype "fp8"/"fp8_e5m2"): `write_kv` stores what
torch's saturating cast stores, the C prefill kernel equals float64 attention over keys and values
rounded by torch's casts, and the C decode graph writes and reads the cache exactly as the
module-by-module path does (the engine's tokens against transformers' are in
test_kv_cache_dtype.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from kv_reference import dense_attention, rounded
from serve_fixtures import random_model
from test_decode_graph import BLOCK_SIZE, decode_batch

from slipstream.model import ModelConfig
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.ops.paged_attention import PagedBatch, to_cache_dtype
from slipstream.serve.runner import PagedAttention
from slipstream.serve.sampler import argmax

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                     eos_token_id=0, pad_token_id=0)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes, every NaN as 0x7F: torch's vectorised and scalar casts give a NaN
    either sign (x86 makes a negative NaN of a positive one in vector registers)."""
    raw = x.view(torch.uint8)
    return torch.where(x.float().isnan(), 0x7F, raw)


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_kernel_stores_what_torchs_saturating_cast_stores(kv_name, dtype):
    """Every bf16 value (as bf16 and as fp32: NaN, inf, subnormals, ties) and a million random fp32
    bit patterns, through strided rows as the fused q/k/v product leaves them: the C kernel's bytes
    equal torch's clamp-then-cast (`to_cache_dtype`), NaN as NaN."""
    kv_dtype = FP8[kv_name]
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dtype)
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(0)
        noise = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int32)
        values = torch.cat([values, noise.view(torch.float32)])
    rows = values.view(-1, 2, 64)  # (N, K, D)
    fused = torch.cat([rows, -rows], dim=1)  # keys and values as views of one (N, 2K, D) product
    k, v = fused[:, :2], fused[:, 2:]
    num_rows = rows.shape[0]
    slots = torch.randperm(num_rows)
    k_cache = torch.empty(num_rows, 1, 2, 64, dtype=kv_dtype)
    v_cache = torch.empty_like(k_cache)
    cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    for cache, new in ((k_cache, k), (v_cache, v)):
        expected = to_cache_dtype(new, kv_dtype)
        assert torch.equal(_bytes(cache.view(num_rows, 2, 64)[slots]), _bytes(expected))


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, window, with_sinks",
                         [(64, 4, 4, None, False), (64, 6, 2, 50, False), (128, 4, 2, None, True)])
def test_c_prefill_kernel_over_fp8_cache_equals_dense_over_rounded_keys(
    kv_name, dtype, head_dim, num_heads, num_kv_heads, window, with_sinks
):
    """The C prefill kernel over shuffled blocks of an fp8 cache: a fresh prompt of 150 tokens (three
    query blocks, tiles of keys past the first) and a 70-token chunk after 90 tokens of context
    already in the cache, GQA, a window, sinks, values past the format's range (saturated): equal to
    float64 attention over the keys and values rounded by torch's casts."""
    if not cpu_kernels.supports_prefill_attention(torch.empty(1, num_heads, head_dim, dtype=dtype)):
        pytest.skip("no prefill kernel on this CPU")
    torch.manual_seed(1)
    kv_dtype, block_size = FP8[kv_name], 16
    seqs = [(150, 150), (160, 70)]  # (seq_len, new tokens)
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 3
    order = torch.randperm(num_blocks).tolist()
    tables = [order[:10], order[10:20]]
    k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    v_cache = torch.empty_like(k_cache)
    all_keys = [torch.randn(n, num_kv_heads, head_dim, dtype=dtype) for n, _ in seqs]
    all_values = [torch.randn(n, num_kv_heads, head_dim, dtype=dtype) for n, _ in seqs]
    all_values[1][3, 0, :2] = torch.tensor([1e9, -1e9])  # in the cached context: saturates
    batch = PagedBatch.build(seq_lens=[n for n, _ in seqs], query_lens=[q for _, q in seqs],
                             block_tables=tables, block_size=block_size)
    context = PagedBatch.build(seq_lens=[90], query_lens=[90], block_tables=[tables[1]],
                               block_size=block_size)
    cpu_kernels.write_kv(all_keys[1][:90], all_values[1][:90], k_cache, v_cache, context.slot_mapping)
    new_keys = torch.cat([all_keys[0], all_keys[1][90:]])
    new_values = torch.cat([all_values[0], all_values[1][90:]])
    cpu_kernels.write_kv(new_keys, new_values, k_cache, v_cache, batch.slot_mapping)
    q = torch.randn(220, num_heads, head_dim, dtype=dtype)
    sinks = torch.randn(num_heads) if with_sinks else None
    out = torch.zeros_like(q)
    cpu_kernels.paged_prefill_attention_(
        out, q, k_cache, v_cache, batch.prefill_rows, batch.prefill_query_lens, batch.prefill_seq_lens,
        batch.prefill_block_tables, window, sinks=sinks)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for keys, values, (_, new) in zip(all_keys, all_values, seqs, strict=True):
        keys, values = rounded(keys, kv_dtype), rounded(values, kv_dtype)
        expected = dense_attention(q[row:row + new], keys, values, window, sinks)
        diff = (out[row:row + new].double() - expected).abs().max().item()
        print(f"{kv_name} {dtype} D={head_dim}: max |diff| {diff:.3g}")
        torch.testing.assert_close(out[row:row + new].double(), expected, atol=tolerance, rtol=tolerance)
        row += new


def _optimised_model(dtype):
    return optimize_for_cpu_inference(random_model(CONFIG, dtype))


def _module_step(model, cache, batch, token_ids, positions):
    with torch.inference_mode():
        return model.hidden_states(token_ids[None], positions[None], PagedAttention(cache, batch, True))[0]


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [[9], [5, 17, 2], [700, 5, 530]], ids=lambda s: f"{len(s)}seqs")
def test_decode_graph_over_fp8_cache_equals_module_path(kv_name, dtype, seq_lens):
    """A decode step through the C decode graph over an fp8 cache (GQA; sequences of up to 700
    keys, split into chunks by the attention): its hidden states and the fp8 keys and values it
    writes equal the module-by-module path's (write_kv and the decode kernel) bit for bit."""
    model = _optimised_model(dtype)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4
    cache, batch, token_ids, positions = decode_batch(CONFIG, seq_lens, FP8[kv_name], num_blocks)
    graph_cache = copy.deepcopy(cache)
    graph = CpuDecodeGraph.build(model, graph_cache.keys, graph_cache.values)
    assert graph is not None, "the decode graph must take an fp8 cache"
    expected = _module_step(model, cache, batch, token_ids, positions)
    with torch.inference_mode():
        got = graph(token_ids, positions, batch)
    assert torch.equal(got, expected)
    for layer in range(CONFIG.num_hidden_layers):
        assert torch.equal(graph_cache.keys[layer].view(torch.uint8), cache.keys[layer].view(torch.uint8))
        assert torch.equal(graph_cache.values[layer].view(torch.uint8), cache.values[layer].view(torch.uint8))


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_steps_over_fp8_cache_equal_module_steps(kv_name, dtype):
    """Six greedy steps in one C call over an fp8 cache (every sequence crossing into a new block):
    the tokens and the cache's bytes equal six module-by-module steps sampled by the sampler's
    argmax."""
    seq_lens, num_steps = [5, 17, 2], 6
    lengths = [n + num_steps - 1 for n in seq_lens]
    model = _optimised_model(dtype)
    cache, batch, _, _ = decode_batch(CONFIG, lengths, FP8[kv_name])
    rows = batch.decode_block_tables.tolist()
    tables = [row[:-(-n // BLOCK_SIZE)] for row, n in zip(rows, lengths, strict=True)]
    graph_cache = copy.deepcopy(cache)
    graph = CpuDecodeGraph.build(model, graph_cache.keys, graph_cache.values)
    tokens = torch.randint(0, CONFIG.vocab_size, (len(seq_lens),))
    positions = torch.tensor([n - 1 for n in seq_lens])
    with torch.inference_mode():
        got = graph.greedy(tokens.tolist(), positions.tolist(), tables, num_steps)
    expected = []
    for step in range(num_steps):
        batch = PagedBatch.build(seq_lens=[n + step for n in seq_lens], query_lens=[1] * len(seq_lens),
                                 block_tables=tables, block_size=BLOCK_SIZE)
        hidden = _module_step(model, cache, batch, tokens, positions + step)
        with torch.inference_mode():
            tokens = argmax(model.compute_logits(hidden))
        expected.append(tokens.tolist())
    assert got == expected
    for layer in range(CONFIG.num_hidden_layers):
        assert torch.equal(graph_cache.keys[layer].view(torch.uint8), cache.keys[layer].view(torch.uint8))
        assert torch.equal(graph_cache.values[layer].view(torch.uint8), cache.values[layer].view(torch.uint8))


@pytest.mark.parametrize("code", [0x02, 0x10, 0x11, 0x41, 0xF0, 0x120, -1])
def test_write_and_prefill_kernels_refuse_a_dtype_code_they_do_not_take(code):
    """write_kv and the prefill kernel return status 2 (a bad argument) for a dtype argument other
    than fp32/bf16 activations over their own cache or e4m3fn/e5m2, writing nothing."""
    lib = cpu_kernels.library()
    k = torch.randn(4, 2, 64)
    k_cache = torch.zeros(2, 16, 2, 64)
    v_cache, out = torch.zeros_like(k_cache), torch.zeros(4, 4, 64)
    slots = torch.arange(4)
    status = lib.write_kv(k.data_ptr(), k.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), 4, 128, 128, 128, code, 1)
    assert status == 2 and not k_cache.any() and not v_cache.any()
    q = torch.randn(4, 4, 64)
    rows, lens, tables = torch.tensor([0]), torch.tensor([4]), torch.tensor([[0]])
    status = lib.paged_prefill_attention(
        q.data_ptr(), 256, k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), rows.data_ptr(),
        lens.data_ptr(), lens.data_ptr(), tables.data_ptr(), 1, 1, 4, 2, 64, 16, 0, 0.125, 0.0, code, 1, None)
    assert status == 2 and not out.any()


@pytest.mark.parametrize("kv_dtype", [1, 4, 16, -1])
def test_decode_graph_refuses_a_cache_dtype_code_it_does_not_take(kv_dtype):
    """A decode shape whose cache code is not 0 (the model's dtype) or fp8 (2, 3): decode_layers
    returns status 2 before writing the cache."""
    cache, batch, _, _ = decode_batch(CONFIG, [5], torch.float8_e4m3fn)
    graph = CpuDecodeGraph.build(_optimised_model(torch.float32), cache.keys, cache.values)
    graph._shape.kv_dtype = kv_dtype
    before = [c.clone() for c in cache.keys]
    with pytest.raises(RuntimeError, match="status 2"):
        graph(torch.tensor([3]), torch.tensor([4]), batch)
    for old, now in zip(before, cache.keys, strict=True):
        assert torch.equal(old.view(torch.uint8), now.view(torch.uint8))
