"""Paged attention against dense attention over unpaged keys and values."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.ops import cpu_kernels
from slipstream.ops.paged_attention import PagedBatch, paged_attention, write_kv


def _dense_reference(q, keys, values, sliding_window, *, scale=None, softcap=None, spans=()):
    """softmax(q k^T / sqrt(d)) v for the last len(q) of len(keys) positions, each over the keys it
    sees (causal, within the window), in float64; with `scale` the scores are q k^T * scale, and
    with `softcap` they become softcap * tanh(score / softcap) before the mask and softmax. A query
    in one of `spans` ([start, stop) positions) also sees its span's later keys, within the window
    (transformers' Gemma 3 image mask: (causal or same image) and sliding window)."""
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2)  # (H, Q, L)
    scores = scores / head_dim**0.5 if scale is None else scores * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    positions = torch.arange(num_keys - num_queries, num_keys)[:, None]
    keys_at = torch.arange(num_keys)[None, :]
    visible = keys_at <= positions
    span_of = torch.full((num_keys,), -1)
    for index, (start, stop) in enumerate(spans):
        span_of[start:stop] = index
    query_span = span_of[num_keys - num_queries:][:, None]
    visible |= (query_span >= 0) & (query_span == span_of[None, :])
    if sliding_window is not None:
        visible &= keys_at > positions - sliding_window
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ v).transpose(0, 1).to(q.dtype)


@pytest.mark.parametrize("head_dim, block_size", [(8, 4), (64, 16), (128, 16)])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "pytorch"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (4, 1), (10, 2)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_kind", ["mixed", "decode-only", "many-decodes", "long-prefills",
                                        "long-decodes", "one-long-decode"])
def test_mixed_prefill_and_decode_batch_matches_dense(
    num_heads, num_kv_heads, sliding_window, dtype, use_kernel, head_dim, block_size, batch_kind
):
    """A batch mixing fresh prefills, chunks with earlier context and single-token decodes,
    over shuffled blocks, equals dense attention on each sequence's unpaged keys, with decodes
    through the C kernel and through the PyTorch path. "many-decodes" has enough sequences for
    the kernel's whole-sequence tasks (which request each thread's next sequence early);
    "long-prefills" has chunks of several query blocks and key tiles of the prefill kernel, one
    after cached context, one exactly a tile long. "long-decodes" and "one-long-decode" have
    sequences longer than the decode kernel's chunks (512 keys: split into chunks, each a task,
    merged afterwards), among short ones and alone (then, as a small batch, cut into shorter
    chunks); there a window of 700 keys (longer than a chunk) stands in for 5."""
    if use_kernel:
        assert cpu_kernels.library() is not None, "the C kernel must build on the CI machine"
    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 160 if "long-decode" not in batch_kind else 2000
    if "long-decode" in batch_kind and sliding_window is not None:
        sliding_window = 700
    # NaN everywhere not written: attention must never let an unwritten slot reach the output.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    # (tokens already cached, new tokens) per sequence
    shapes = [(0, 9), (0, 1), (7, 1), (13, 1), (6, 5), (0, 4), (22, 1), (3, 8), (60, 1)]
    if batch_kind == "decode-only":
        shapes = [(cached, new) for cached, new in shapes if new == 1]
    elif batch_kind == "many-decodes":
        shapes = [(cached, 1) for cached in [0, 1, 3, 4, 7, 8, 15, 16, 21, 31, 33, 40, 47, 52, 63, 70]]
    elif batch_kind == "long-prefills":
        shapes = [(0, 150), (70, 45), (0, 33), (130, 1), (5, 64)]
    elif batch_kind == "long-decodes":
        shapes = [(1100, 1), (40, 1), (513, 1), (511, 1), (2000, 1), (1025, 1)]
    elif batch_kind == "one-long-decode":
        shapes = [(1300, 1)]
    seq_lens, query_lens, tables, dense_keys, dense_values = [], [], [], [], []
    for cached, new in shapes:
        seq_len = cached + new
        table = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        keys = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        if cached:  # earlier steps wrote these
            earlier = PagedBatch.build(seq_lens=[cached], query_lens=[cached], block_tables=[table],
                                       block_size=block_size)
            write_kv(k_cache, v_cache, keys[:cached], values[:cached], earlier.slot_mapping,
                     use_kernel=use_kernel)
        seq_lens.append(seq_len), query_lens.append(new), tables.append(table)
        dense_keys.append(keys), dense_values.append(values)
    batch = PagedBatch.build(seq_lens=seq_lens, query_lens=query_lens, block_tables=tables,
                             block_size=block_size)
    new_keys = torch.cat([k[-n:] for k, n in zip(dense_keys, query_lens, strict=False)])
    new_values = torch.cat([v[-n:] for v, n in zip(dense_values, query_lens, strict=False)])
    write_kv(k_cache, v_cache, new_keys, new_values, batch.slot_mapping, use_kernel=use_kernel)
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype)
    got = paged_attention(q, k_cache, v_cache, batch, sliding_window=sliding_window, use_kernel=use_kernel)
    expected = torch.cat([
        _dense_reference(q_i, k, v, sliding_window)
        for q_i, k, v in zip(q.split(query_lens), dense_keys, dense_values, strict=False)
    ])
    diff = (got.float() - expected.float()).abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"{dtype} heads {num_heads}/{num_kv_heads} window {sliding_window}: max diff {diff:.3g}")
    assert diff < tolerance


@pytest.mark.parametrize("num_threads", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[40], [320], [600], [1300], [600, 40, 320]])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(12, 4, 64), (8, 1, 256)])
def test_decode_kernel_matches_dense_however_it_splits_the_work(num_threads, dtype, lens, num_heads,
                                                                 num_kv_heads, head_dim):
    """The decode kernel cuts a batch's keys by the number of threads: a small batch into chunks
    of a few tens of keys (all kv heads per task), a larger one into chunks of 512, or, where
    there are too few keys for either to give every thread work, into (chunk, kv head) tasks.
    These lengths and thread counts reach each way, and each equals dense attention, for the
    bench model's heads and for Gemma's (head size 256, one kv head: its own kernel copies)."""
    if cpu_kernels.library() is None:
        pytest.skip("no C kernel library here")
    block_size = 16
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lens)
    order = torch.randperm(num_blocks).tolist()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, keys, values = [], [], []
    for n in lens:
        tables.append([order.pop() for _ in range(-(-n // block_size))])
        keys.append(torch.randn(n, num_kv_heads, head_dim, dtype=dtype))
        values.append(torch.randn(n, num_kv_heads, head_dim, dtype=dtype))
    written = PagedBatch.build(seq_lens=lens, query_lens=lens, block_tables=tables, block_size=block_size)
    write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values), written.slot_mapping)
    batch = PagedBatch.build(seq_lens=lens, query_lens=[1] * len(lens), block_tables=tables,
                             block_size=block_size)
    q = torch.randn(len(lens), num_heads, head_dim, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = paged_attention(q, k_cache, v_cache, batch, use_kernel=True)
    finally:
        torch.set_num_threads(threads)
    expected = torch.cat([_dense_reference(q[i : i + 1], keys[i], values[i], None) for i in range(len(lens))])
    diff = (got.float() - expected.float()).abs().max().item()
    assert diff < (1e-5 if dtype == torch.float32 else 2e-2), diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_the_fused_qkv_products_rows_in_place(dtype):
    """The cache writes and the prefill kernel take the queries, keys and values as the fused q/k/v
    product's splits leave them (rows 1.5x their width apart) and give what they give for
    contiguous copies, bit for bit."""
    if cpu_kernels.library() is None or not cpu_kernels.supports_prefill_attention(
            torch.empty(1, 4, 64, dtype=dtype)):
        pytest.skip("no C prefill kernel here")
    num_heads, num_kv_heads, head_dim, block_size, lens = 4, 2, 64, 16, [37, 70]
    torch.manual_seed(0)
    qkv = torch.randn(sum(lens), (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(sum(lens), -1, head_dim) for x in (q, k, v))
    assert not q.is_contiguous() and not k.is_contiguous()
    tables = [[4, 0, 2], [1, 5, 3, 6, 7]]
    batch = PagedBatch.build(seq_lens=lens, query_lens=lens, block_tables=tables, block_size=block_size)
    outputs = []
    for queries, keys, values in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        k_cache = torch.full((8, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        write_kv(k_cache, v_cache, keys, values, batch.slot_mapping)
        outputs.append((paged_attention(queries, k_cache, v_cache, batch), k_cache, v_cache))
    for strided, contiguous in zip(*outputs, strict=True):
        assert torch.equal(strided.nan_to_num(), contiguous.nan_to_num())


def test_kernels_compute_bf16_in_bf16_where_the_cpu_can():
    """The kernels multiply bf16 on vdpbf16ps exactly when the CPU has AVX512-BF16 (the build is
    -march=native); fp32 inputs always compute in fp32."""
    assert cpu_kernels.library() is not None
    cpu_flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "").split()
    expected = torch.bfloat16 if "avx512_bf16" in cpu_flags else torch.float32
    assert cpu_kernels.arithmetic_dtype(torch.bfloat16) == expected
    assert cpu_kernels.arithmetic_dtype(torch.float32) == torch.float32


def test_kernel_library_leaves_subnormals_alone():
    """Loading the C kernel library does not switch the process to flush-to-zero."""
    assert cpu_kernels.library() is not None
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0


@pytest.mark.slow  # ~18 s: two compiler runs of the kernel library
def test_kernel_library_builds_once_when_asked_from_two_threads(tmp_path):
    """A cold cache: the engine's background build and a caller's library() on another thread
    share one compilation, and both get the loaded library (in a fresh process)."""
    script = (
        "import threading\n"
        "from slipstream.ops import cpu_kernels as k\n"
        "builds = []\n"
        "compile_ = k._compile\n"
        "k._compile = lambda *a: (builds.append(a), compile_(*a))\n"
        "k.build_in_background()\n"
        "lib = k.library()\n"
        "others = []\n"
        "t = threading.Thread(target=lambda: others.append(k.library()))\n"
        "t.start(); t.join()\n"
        "assert lib is not None and others == [lib], (lib, others)\n"
        "assert len(builds) == 1, builds\n"
        "assert k.supports(__import__('torch').zeros(1))\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "slipstream" / "kernels").glob("*.so"))) == 1


# A CC that builds is slow (~13 s of compiling; CI skips it): every engine test builds with the default.
@pytest.mark.parametrize("cc, builds", [pytest.param("env gcc", True, marks=pytest.mark.slow),
                                        ("/nonexistent/gcc", False), ("gcc -x", False)])
def test_cc_may_hold_arguments_and_a_bad_one_falls_back_to_pytorch(cc, builds, tmp_path):
    """CC is split as make splits it ("ccache gcc" works), and a compiler that does not exist or
    fails leaves the kernels to PyTorch with a warning (a CC of more than a path raised
    FileNotFoundError in every engine, fast_cpu_kernels=False too: the sampler's argmax loads
    the library)."""
    if builds and subprocess.run(["gcc", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no gcc")
    script = "from slipstream.ops import cpu_kernels as k; print(k.library() is not None)"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), CC=cc)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(builds)
    assert builds or "building the CPU kernels failed" in result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_dense_over_random_chunks(dtype):
    """Chunks of random lengths after random cached context (so query blocks start anywhere in a
    key tile, and rows of a diagonal tile see anywhere from none to all of its keys), random
    head layouts, head sizes and windows: the C prefill kernel equals dense attention."""
    if not cpu_kernels.supports_prefill_attention(torch.empty(1, 4, 64, dtype=dtype)):
        pytest.skip("no prefill kernel on this CPU")
    rng = random.Random(1)
    torch.manual_seed(1)
    for case in range(24):
        num_kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4])
        head_dim, block_size = rng.choice([64, 128, 256]), rng.choice([8, 16, 32])
        window = rng.choice([None, None, rng.randint(1, 100)])
        shapes = [(rng.randint(0, 200), rng.randint(2, 200)) for _ in range(rng.randint(1, 3))]
        num_blocks = sum(-(-(cached + new) // block_size) for cached, new in shapes) + 4
        k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        free_blocks = list(range(num_blocks))
        rng.shuffle(free_blocks)
        tables, keys, values = [], [], []
        for cached, new in shapes:
            tables.append([free_blocks.pop() for _ in range(-(-(cached + new) // block_size))])
            keys.append(torch.randn(cached + new, num_kv_heads, head_dim, dtype=dtype))
            values.append(torch.randn(cached + new, num_kv_heads, head_dim, dtype=dtype))
        whole = PagedBatch.build(seq_lens=[c + n for c, n in shapes], query_lens=[c + n for c, n in shapes],
                                 block_tables=tables, block_size=block_size)
        write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values), whole.slot_mapping)
        batch = PagedBatch.build(seq_lens=[c + n for c, n in shapes], query_lens=[n for _, n in shapes],
                                 block_tables=tables, block_size=block_size)
        q = torch.randn(sum(n for _, n in shapes), num_kv_heads * group, head_dim, dtype=dtype)
        got = paged_attention(q, k_cache, v_cache, batch, sliding_window=window)
        expected = torch.cat([_dense_reference(q_i, k, v, window) for q_i, k, v in
                              zip(q.split([n for _, n in shapes]), keys, values, strict=True)])
        diff = (got.float() - expected.float()).abs().max().item()
        assert diff < (1e-5 if dtype == torch.float32 else 2e-2), (case, shapes, num_kv_heads, group,
                                                                   head_dim, window, diff)


@pytest.mark.parametrize("head_dim, block_size", [(8, 4), (64, 16), (128, 8), (256, 16)])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "pytorch"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_soft_capped_attention_matches_dense(head_dim, block_size, use_kernel, window, dtype):
    """Gemma 2's attention: scores times a scale of its own, then softcap * tanh(score / softcap),
    then the mask and the softmax, over a batch of fresh prefills (two of several key tiles),
    chunks after cached context, short decodes and two long ones (split into chunks by the
    decode kernel and merged), against the dense float64 reference; through the C kernels (head
    sizes 64, 128 and Gemma's 256 have their own decode copies and the prefill kernel; 8 takes
    the portable decode loop and PyTorch's prefill) and through the PyTorch path, which cannot
    use SDPA for a capped call. The cap is
    tight enough that ignoring it, or the scale, fails by far more than the tolerance."""
    if use_kernel:
        assert cpu_kernels.library() is not None, "the C kernel must build on the CI machine"
    scale, softcap = 0.5 * head_dim**-0.5, 2.0
    rng = random.Random(1)
    torch.manual_seed(1)
    shapes = [(0, 9), (0, 1), (13, 1), (6, 5), (70, 45), (0, 130), (40, 1), (600, 1), (1100, 1)]
    num_kv_heads, num_heads = 2, 4
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 4
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
    # Keys of a few times unit size, so that the scaled scores reach well past the cap.
    keys = [3 * torch.randn(c + n, num_kv_heads, head_dim).to(dtype) for c, n in shapes]
    values = [torch.randn(c + n, num_kv_heads, head_dim).to(dtype) for c, n in shapes]
    lens = [c + n for c, n in shapes]
    whole = PagedBatch.build(seq_lens=lens, query_lens=lens, block_tables=tables, block_size=block_size)
    write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values), whole.slot_mapping, use_kernel=use_kernel)
    query_lens = [n for _, n in shapes]
    batch = PagedBatch.build(seq_lens=lens, query_lens=query_lens, block_tables=tables, block_size=block_size)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    got = paged_attention(q, k_cache, v_cache, batch, scale=scale, softcap=softcap, sliding_window=window,
                          use_kernel=use_kernel)

    def reference(**scoring):
        return torch.cat([_dense_reference(q_i, k, v, window, **scoring).float()
                          for q_i, k, v in zip(q.split(query_lens), keys, values, strict=True)])

    expected = reference(scale=scale, softcap=softcap)
    diff = (got.float() - expected).abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    uncapped = (reference(scale=scale) - expected).abs().max().item()
    unscaled = (reference(softcap=softcap) - expected).abs().max().item()
    print(f"{dtype} D={head_dim} window {window}: max diff {diff:.3g} (uncapped {uncapped:.3g}, "
          f"head_dim**-0.5 {unscaled:.3g})")
    assert diff < tolerance
    assert min(uncapped, unscaled) > 10 * tolerance


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "pytorch"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bidirectional_spans_match_dense(use_kernel, window, dtype, monkeypatch):
    """Chunks holding spans whose tokens attend both ways (Gemma 3's images): a fresh prompt with
    two images, a chunk that starts inside a span (the span's first keys cached), one with a span
    longer than the window, beside a causal chunk and decodes, against the dense float64
    reference; the causal chunk keeps the C prefill kernel (and the decodes the decode kernel).
    Attending causally instead fails by far more than the tolerance."""
    kernel_chunks = []
    prefill_kernel = cpu_kernels.paged_prefill_attention_

    def spy(out, q, k_cache, v_cache, chunk_rows, *args, **kwargs):
        kernel_chunks.append(chunk_rows.tolist())
        return prefill_kernel(out, q, k_cache, v_cache, chunk_rows, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "paged_prefill_attention_", spy)
    rng = random.Random(2)
    torch.manual_seed(2)
    head_dim, block_size, num_heads, num_kv_heads = 64, 4, 4, 2
    # (tokens already cached, new tokens, spans in sequence positions)
    shapes = [(0, 20, ((3, 9), (12, 17))), (0, 7, ()), (8, 1, ()), (5, 10, ((2, 11),)), (0, 16, ((1, 15),)),
              (30, 1, ())]
    lens = [c + n for c, n, _ in shapes]
    num_blocks = sum(-(-length // block_size) for length in lens) + 2
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-length // block_size))] for length in lens]
    keys = [torch.randn(length, num_kv_heads, head_dim).to(dtype) for length in lens]
    values = [torch.randn(length, num_kv_heads, head_dim).to(dtype) for length in lens]
    whole = PagedBatch.build(seq_lens=lens, query_lens=lens, block_tables=tables, block_size=block_size)
    write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values), whole.slot_mapping, use_kernel=use_kernel)
    query_lens = [n for _, n, _ in shapes]
    spans = [s for _, _, s in shapes]
    batch = PagedBatch.build(seq_lens=lens, query_lens=query_lens, block_tables=tables, block_size=block_size,
                             bidirectional=spans)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    got = paged_attention(q, k_cache, v_cache, batch, sliding_window=window, use_kernel=use_kernel)

    def reference(both_ways):
        return torch.cat([_dense_reference(q_i, k, v, window, spans=s if both_ways else ()).float()
                          for q_i, k, v, s in zip(q.split(query_lens), keys, values, spans, strict=True)])

    expected = reference(True)
    diff = (got.float() - expected).abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    causal = (reference(False) - expected).abs().max().item()
    print(f"{dtype} window {window}: max diff {diff:.3g} (causal {causal:.3g})")
    assert diff < tolerance
    assert causal > 10 * tolerance
    takes_kernel = use_kernel and cpu_kernels.supports_prefill_attention(q)
    assert kernel_chunks == ([[20]] if takes_kernel else [])  # the causal chunk's first row


@pytest.mark.parametrize("bad", [{"softcap": 0.0}, {"softcap": -1.0}, {"sliding_window": 0}])
def test_paged_attention_refuses_a_bad_soft_cap_or_window(bad):
    """A soft cap that is not positive or a window under one key is a ValueError naming it."""
    batch = PagedBatch.build(seq_lens=[3], query_lens=[1], block_tables=[[0]], block_size=4)
    cache = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match=next(iter(bad))):
        paged_attention(torch.zeros(1, 1, 8), cache, cache, batch, **bad)


@pytest.mark.parametrize("seed", range(4))
def test_group_layouts_share_all_but_tables_and_slots(seed):
    """`PagedBatch.build_groups`: each group's slot of token p of a sequence is its table's block
    p // B at offset p % B, its prefill and decode tables its own rows padded with block 0; the
    lengths and rows are one set of tensors for every group; a table short of its sequence's
    blocks is a ValueError."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    seq_lens = [rng.randint(1, 60) for _ in range(rng.randint(1, 6))]
    query_lens = [rng.choice([1, rng.randint(1, n)]) for n in seq_lens]
    if seed == 0:
        query_lens = [1] * len(seq_lens)  # a decode step
    group_tables = [[[rng.randrange(1000) for _ in range(-(-n // block_size) + rng.randint(0, 2))]
                     for n in seq_lens] for _ in range(3)]
    batches = PagedBatch.build_groups(seq_lens=seq_lens, query_lens=query_lens, group_tables=group_tables,
                                      block_size=block_size)
    for tables, batch in zip(group_tables, batches, strict=True):
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, n, q in zip(tables, seq_lens, query_lens, strict=True) for p in range(n - q, n)]
        assert batch.slot_mapping.tolist() == slots
        for kind, is_kind in (("decode", lambda q: q == 1), ("prefill", lambda q: q > 1)):
            rows = [table[:-(-n // block_size)]
                    for table, n, q in zip(tables, seq_lens, query_lens, strict=True) if is_kind(q)]
            width = max(map(len, rows), default=0)
            padded = [r + [0] * (width - len(r)) for r in rows]
            assert getattr(batch, f"{kind}_block_tables").tolist() == padded
        for name in ("prefill_rows", "prefill_query_lens", "prefill_seq_lens", "decode_token_rows",
                     "decode_seq_lens"):
            assert getattr(batch, name) is getattr(batches[0], name)
    decode_lens = [n for n, q in zip(seq_lens, query_lens, strict=True) if q == 1]
    assert batches[0].decode_seq_lens.tolist() == decode_lens
    group_tables[1][0] = group_tables[1][0][:-(-seq_lens[0] // block_size) - 1]
    with pytest.raises(ValueError, match="block table"):
        PagedBatch.build_groups(seq_lens=seq_lens, query_lens=query_lens, group_tables=group_tables,
                                block_size=block_size)
