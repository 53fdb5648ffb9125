"""The KV cache in another dtype than the model's (`kv_cache_dtype`, vLLM's values): paged attention
over an fp8 cache against dense attention over keys and values rounded through the same format by
torch's own casts, and the engine's greedy tokens against transformers' with its attention seeing
keys and values rounded the same way."""

from __future__ import annotations

import json

import pytest
import torch
from kv_reference import dense_attention, rounded
from serve_fixtures import assert_same_tokens, transformers_greedy

from slipstream import LLM, SamplingParams
from slipstream.cli import main
from slipstream.model import ModelConfig, Transformer, save_model
from slipstream.model.create import stdlib_tokenizer
from slipstream.ops import cpu_kernels
from slipstream.ops import paged_attention as paged_attention_module
from slipstream.ops.paged_attention import PagedBatch, paged_attention, write_kv
from slipstream.perf.flops import kv_cache_bytes_per_token
from slipstream.serve.engine import EngineConfig
from slipstream.serve.runner import Runner

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernels-asked", "pytorch"])
@pytest.mark.parametrize("num_heads, num_kv_heads, window, with_sinks",
                         [(4, 4, None, False), (6, 2, 5, False), (4, 2, None, True)])
def test_paged_attention_over_fp8_cache_equals_dense_over_rounded_keys(
    kv_name, dtype, use_kernel, num_heads, num_kv_heads, window, with_sinks
):
    """A batch of a fresh prefill, a chunk after cached context and two decodes, over shuffled
    blocks of an fp8 cache, equals dense attention over the keys and values rounded by torch's
    casts; values past the format's range saturate (no inf or NaN)."""
    torch.manual_seed(0)
    kv_dtype, head_dim, block_size = FP8[kv_name], 64, 4
    seqs = [(9, 9), (13, 6), (7, 1), (11, 1)]  # (seq_len, new tokens)
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 2
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n, _ in seqs:
        count = -(-n // block_size)
        tables.append(order[used:used + count])
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.empty(shape, dtype=kv_dtype), torch.empty(shape, dtype=kv_dtype)
    all_keys = [torch.randn(n, num_kv_heads, head_dim, dtype=dtype) for n, _ in seqs]
    all_values = [torch.randn(n, num_kv_heads, head_dim, dtype=dtype) for n, _ in seqs]
    big = 2 * torch.finfo(kv_dtype).max  # beyond the range: must saturate
    all_values[0][0, 0, :3] = torch.tensor([big, -big, 1e30])
    all_keys[1][2, 0, 0] = big / 100 if kv_dtype == torch.float8_e4m3fn else -big  # large scores
    for keys, values, (n, new), table in zip(all_keys, all_values, seqs, tables, strict=True):
        if n > new:  # the earlier context, written by an earlier step
            earlier = PagedBatch.build(seq_lens=[n - new], query_lens=[n - new], block_tables=[table],
                                       block_size=block_size)
            write_kv(k_cache, v_cache, keys[:n - new], values[:n - new], earlier.slot_mapping,
                     use_kernel=use_kernel)
    batch = PagedBatch.build(seq_lens=[n for n, _ in seqs], query_lens=[q for _, q in seqs],
                             block_tables=tables, block_size=block_size)
    new_keys = torch.cat([k[n - q:] for k, (n, q) in zip(all_keys, seqs, strict=True)])
    new_values = torch.cat([v[n - q:] for v, (n, q) in zip(all_values, seqs, strict=True)])
    write_kv(k_cache, v_cache, new_keys, new_values, batch.slot_mapping, use_kernel=use_kernel)
    q = torch.randn(sum(q for _, q in seqs), num_heads, head_dim, dtype=dtype)
    sinks = torch.randn(num_heads) if with_sinks else None
    out = paged_attention(q, k_cache, v_cache, batch, sliding_window=window, sinks=sinks,
                          use_kernel=use_kernel)
    assert torch.isfinite(out).all()
    row = 0
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    for keys, values, (_, new) in zip(all_keys, all_values, seqs, strict=True):
        keys, values = rounded(keys, kv_dtype), rounded(values, kv_dtype)
        expected = dense_attention(q[row:row + new], keys, values, window, sinks)
        torch.testing.assert_close(out[row:row + new].double(), expected, atol=tolerance, rtol=tolerance)
        row += new


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [40, 48, 64, 128, 256])
def test_c_decode_kernel_reads_fp8_exactly(kv_name, dtype, head_dim):
    """The C decode kernel over an fp8 cache (every byte pattern but NaN among the keys: zero,
    subnormals, the largest; sequences long enough to be split into chunks; GQA and a window)
    equals dense attention over the keys and values torch's casts widen from the same bytes; head
    size 40 takes the portable loop, 48 the AVX-512 path's copy over any multiple of 16 (the portable
    loop on AVX2), 64, 128 and 256 the vector path on AVX-512 and AVX2."""
    assert cpu_kernels.library() is not None, "the C kernel must build on the CI machine"
    torch.manual_seed(2)
    kv_dtype, block_size, num_heads, num_kv_heads = FP8[kv_name], 16, 8, 2
    lens = [700, 33, 1]
    tables, num_blocks = [], sum(-(-n // block_size) for n in lens)
    order = torch.randperm(num_blocks).tolist()
    for n in lens:
        tables.append(order[:-(-n // block_size)])
        order = order[-(-n // block_size):]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    patterns = torch.arange(256, dtype=torch.uint8).view(kv_dtype)
    finite = patterns[torch.isfinite(patterns.float())]
    k_cache = finite[torch.randint(len(finite), shape)]
    v_cache = (torch.randn(shape) * 0.05).to(kv_dtype)  # many subnormals
    q = (torch.randn(len(lens), num_heads, head_dim) * 0.01).to(dtype)  # scores of a sane size
    batch = PagedBatch.build(seq_lens=lens, query_lens=[1] * len(lens), block_tables=tables,
                             block_size=block_size)
    for window in (None, 100):
        out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, batch.decode_block_tables,
                                                 batch.decode_seq_lens, window)
        for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
            keys = k_cache[table].flatten(0, 1)[:n].float()
            values = v_cache[table].flatten(0, 1)[:n].float()
            expected = dense_attention(q[i:i + 1].float(), keys, values, window, None)
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[i:i + 1].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kv_name", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128, 256])
def test_c_decode_kernel_reads_every_fp8_byte_as_torch_does(kv_name, dtype, head_dim):
    """All 256 byte patterns, NaN and inf included, as value elements: with a zero query the two
    keys weigh 1/2 each and the second's values are zero, so each output is half of what torch's
    cast reads from that byte (NaN where torch reads NaN, inf where inf); head size 8 takes the
    portable loop, 32 the AVX-512 path's copy over any multiple of 16 (the portable loop on AVX2),
    64, 128 and 256 the vector path on AVX-512 and AVX2."""
    kv_dtype, block_size = FP8[kv_name], 16
    patterns = torch.arange(256, dtype=torch.uint8)
    num_seqs = 256 // head_dim  # sequence i holds patterns [i * head_dim, (i + 1) * head_dim) in key 0
    v_cache = torch.zeros(num_seqs, block_size, 1, head_dim, dtype=torch.uint8)
    v_cache[:, 0, 0] = patterns.view(num_seqs, head_dim)
    k_cache = torch.zeros_like(v_cache).view(kv_dtype)
    batch = PagedBatch.build(seq_lens=[2] * num_seqs, query_lens=[1] * num_seqs,
                             block_tables=[[i] for i in range(num_seqs)], block_size=block_size)
    q = torch.zeros(num_seqs, 1, head_dim, dtype=dtype)
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache.view(kv_dtype), batch.decode_block_tables,
                                             batch.decode_seq_lens, None)
    expected = (patterns.view(kv_dtype).float() / 2).to(dtype)
    torch.testing.assert_close(out.flatten(), expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("code", [0x02, 0x0F, 0x10, 0x11, 0x41, 0x42, 0xF0, 0x120, -1])
def test_c_decode_entry_point_refuses_a_dtype_code_it_does_not_read(code, head_dim):
    """Query codes other than fp32/bf16 (0, 1) and cache codes other than the queries' own (0) or
    fp8 (2, 3) return status 2 (a bad argument) instead of reading past the kernel tables or
    misreading the cache."""
    lib = cpu_kernels.library()
    q = torch.randn(1, 4, head_dim)
    k_cache = torch.randn(2, 16, 2, head_dim)
    v_cache, out = k_cache.clone(), torch.zeros_like(q)
    batch = PagedBatch.build(seq_lens=[20], query_lens=[1], block_tables=[[1, 0]], block_size=16)
    tables, lens = batch.decode_block_tables, batch.decode_seq_lens
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), 1, tables.shape[1], 4, 2, head_dim, 16, 0, head_dim**-0.5, 0.0, code, 1, None)
    assert status == 2
    assert not out.any()


def test_bfloat16_cache_under_an_fp32_model_equals_dense_over_bf16_keys():
    """kv_cache_dtype "bfloat16" under an fp32 model: the cache rounds to bf16, attention in fp32."""
    torch.manual_seed(1)
    k_cache = torch.empty(4, 4, 2, 64, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    keys, values, q = torch.randn(10, 2, 64), torch.randn(10, 2, 64), torch.randn(10, 4, 64)
    batch = PagedBatch.build(seq_lens=[10], query_lens=[10], block_tables=[[2, 0, 3]], block_size=4)
    write_kv(k_cache, v_cache, keys, values, batch.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, batch)
    expected = dense_attention(q, keys.bfloat16().float(), values.bfloat16().float(), None, None)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


NUM_PROMPTS, MAX_NEW_TOKENS, BLOCK_SIZE = 6, 16, 16
CONFIG = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                     eos_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv-dtype-model")
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    model.init_weights(std=0.1)
    save_model(model, out)
    stdlib_tokenizer(CONFIG.vocab_size).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return out


def _prompts() -> list[list[int]]:
    """Prompts of 20 to 60 tokens after a shared 32-token prefix (two blocks: prefix-cache hits)."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, CONFIG.vocab_size, (32,), generator=g).tolist()
    lengths = torch.randint(20, 60, (NUM_PROMPTS,), generator=g).tolist()
    return [prefix + torch.randint(3, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _transformers_greedy(model_dir, prompts, kv_dtype):
    """transformers' greedy tokens, its eager attention seeing keys and values (after RoPE, as
    cached) rounded through `kv_dtype` by torch's casts; None: unrounded."""
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama import modeling_llama

    def rounded_eager(module, query, key, value, *args, **kwargs):
        if kv_dtype is not None:
            key, value = rounded(key, kv_dtype), rounded(value, kv_dtype)
        return modeling_llama.eager_attention_forward(module, query, key, value, *args, **kwargs)

    transformers.AttentionInterface.register("kv_rounded_eager", rounded_eager)
    AttentionMaskInterface.register("kv_rounded_eager", eager_mask)  # the additive mask eager adds
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="kv_rounded_eager")
    return transformers_greedy(hf, prompts, MAX_NEW_TOKENS)


def _engine(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, max_num_seqs=4, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    top1 = [[max(step.values(), key=lambda lp: lp.logprob).logprob for step in o.logprobs] for o in outputs]
    return [list(o.token_ids) for o in outputs], torch.tensor(top1), llm


def _kernels_only(monkeypatch):
    """Make a pure decode step run module by module, or (where this CPU has the C prefill kernel) a
    prefill chunk through PyTorch's attention, an error: the C kernels must run them."""
    module_step = Runner.hidden_states

    def hidden_states(self, token_ids, positions, batch, **kwargs):
        assert batch.prefills, "a pure decode step ran module by module, not through the C decode graph"
        return module_step(self, token_ids, positions, batch, **kwargs)

    def no_pytorch_prefill(*args, **kwargs):
        raise AssertionError("a prefill chunk ran PyTorch's attention, not the C prefill kernel")

    monkeypatch.setattr(Runner, "hidden_states", hidden_states)
    if cpu_kernels.supports_prefill_attention(torch.empty(1, CONFIG.num_attention_heads, CONFIG.head_dim)):
        monkeypatch.setattr(paged_attention_module, "_attend", no_pytorch_prefill)


@pytest.fixture(scope="module")
def plain(model_dir):
    """The prompts, and the engine's tokens and top-1 logprobs over a cache in the model's dtype."""
    prompts = _prompts()
    return prompts, *_engine(model_dir, prompts)[:2]


@pytest.fixture(scope="module", params=sorted(FP8))
def rounded_reference(request, model_dir, plain):
    """(format name, transformers' greedy tokens and top-2 gaps over keys rounded through it)."""
    return request.param, *_transformers_greedy(model_dir, plain[0], FP8[request.param])


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["fast-path", "pytorch-modules"])
def test_engine_over_fp8_cache_matches_transformers_over_rounded_keys(
    model_dir, plain, rounded_reference, fast, monkeypatch
):
    """Greedy tokens through the fast path (every decode step in the C decode graph, every prefill
    chunk in the C prefill kernel; with logprobs one step a call, without them several greedy
    steps a call) and the plain PyTorch modules, with chunked prefill and prefix-cache hits, equal
    transformers' over keys and values rounded through the format; they differ from the
    unquantized cache's somewhere, top-1 logprobs staying close."""
    prompts, plain_tokens, plain_top1 = plain
    kv_name, expected, gaps = rounded_reference
    if fast:
        _kernels_only(monkeypatch)
    got, top1, llm = _engine(model_dir, prompts, kv_cache_dtype=kv_name, fast_cpu_kernels=fast,
                             max_num_batched_tokens=24)
    engine = llm.engine
    assert engine.runner.cache.keys[0].dtype == FP8[kv_name]
    assert (engine.runner.decode_graph is not None) == fast
    assert engine.scheduler.kv_cache.prefix_cache_hits > 0
    assert_same_tokens(expected, gaps, got, f"{kv_name} fast_cpu_kernels={fast}")
    if fast:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        bursts = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert engine.config.num_scheduler_steps > 1
        assert bursts == got
    assert got != plain_tokens
    # Over the first tokens where both runs chose the same: e5m2 keeps 2 mantissa bits (values off by
    # up to 1/8), this random model's logits are wide (init std 0.1), so "close" is within 0.5 nats.
    same = [i for i, (a, b) in enumerate(zip(got, plain_tokens, strict=True)) if a[:4] == b[:4]]
    assert same
    torch.testing.assert_close(top1[same, :4], plain_top1[same, :4], atol=0.5, rtol=0)


def test_fp8_cache_holds_twice_bf16s_and_four_times_fp32s_tokens(model_dir):
    """The same kv_cache_memory: num_blocks in the ratio of the element sizes, each block's bytes
    the closed form 2 * layers * kv_heads * head_dim * bytes * block_size (the perf model's too)."""
    per_token_fp32 = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * CONFIG.head_dim * 4
    memory = 40 * BLOCK_SIZE * per_token_fp32
    blocks = {}
    for kv, size in (("auto", 4), ("bfloat16", 2), ("fp8", 1), ("fp8_e5m2", 1)):
        llm = LLM(str(model_dir), block_size=BLOCK_SIZE, kv_cache_memory=memory, kv_cache_dtype=kv,
                  max_model_len=256)
        blocks[kv] = llm.engine.limits.num_blocks
        assert llm.engine.runner.cache.keys[0].element_size() == size
        perf_dtype = "float32" if kv == "auto" else kv
        assert kv_cache_bytes_per_token(CONFIG, perf_dtype) == per_token_fp32 // 4 * size
    assert blocks == {"auto": 40, "bfloat16": 80, "fp8": 160, "fp8_e5m2": 160}


@pytest.mark.parametrize("bad", ["fp8_inc", "fp8_ds_mla", "int8", "float16x", None])
def test_bad_kv_cache_dtype_is_a_value_error(bad):
    with pytest.raises(ValueError, match=f"kv_cache_dtype={bad!r}"):
        EngineConfig(model="m", kv_cache_dtype=bad)


def test_calculate_kv_scales_is_refused():
    with pytest.raises(ValueError, match="calculate_kv_scales=True is not supported"):
        EngineConfig(model="m", calculate_kv_scales=True)
    for bad in (0, None, "false", 1):
        with pytest.raises(ValueError, match=f"calculate_kv_scales must be a bool, got {bad!r}"):
            EngineConfig(model="m", calculate_kv_scales=bad)
    EngineConfig(model="m", calculate_kv_scales=False)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "bfloat16"])
def test_metrics_records_price_kv_positions_in_the_cache_dtype(model_dir, tmp_path, kv):
    """Each decode step's read_bytes against an auto cache's, for one sequence of P prompt tokens:
    decode step i reads P + i positions, each 2 x layers x kv_heads x head_dim elements of the
    cache dtype's size instead of fp32's, so the difference is that closed form; the header names
    the cache dtype."""
    prompt, steps = list(range(3, 203)), 4
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    read, headers = {}, {}
    for name in ("auto", kv):
        directory = tmp_path / name
        llm = LLM(str(model_dir), block_size=BLOCK_SIZE, kv_cache_dtype=name, metrics_dir=str(directory),
                  num_scheduler_steps=1)
        llm.generate([prompt], params, use_tqdm=False)
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        headers[name] = records[0]
        read[name] = [r["read_bytes"] for r in records if r["kind"] == "engine_step"]
    element = {"fp8": 1, "fp8_e5m2": 1, "bfloat16": 2}[kv]
    assert headers["auto"]["kv_cache_dtype"] == "float32"
    assert headers[kv]["kv_cache_dtype"] == {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                                             "bfloat16": "bfloat16"}[kv]
    per_position = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * CONFIG.head_dim
    assert len(read[kv]) == len(read["auto"]) == steps
    for i in range(1, steps):
        assert read["auto"][i] - read[kv][i] == (len(prompt) + i) * per_position * (4 - element)


def test_a_checkpoint_with_calibrated_kv_scales_is_refused_naming_them(model_dir, tmp_path):
    """vLLM's k_scale/v_scale tensors (and compressed-tensors' k/v output scales) name the cause."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "scaled"
    out.mkdir()
    for path in model_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(tensors, weights, metadata={"format": "pt"})
    names = "model.layers.0.self_attn.k_scale, model.layers.0.self_attn.v_scale"
    with pytest.raises(ValueError, match=f"calibrated KV-cache scales are not supported.*{names}"):
        LLM(str(out), kv_cache_dtype="fp8")


def test_logs_name_the_kv_cache_dtype(model_dir, caplog):
    """The engine-ready line names the cache dtype; the decode graph takes an fp8 cache, and its
    decline of a bf16 cache under fp32 weights names the cache as the cause."""
    with caplog.at_level("INFO"):
        LLM(str(model_dir), block_size=BLOCK_SIZE, kv_cache_dtype="fp8_e5m2")
    assert "KV blocks of 16 tokens in float8_e5m2" in caplog.text
    assert "no CPU decode graph" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        LLM(str(model_dir), block_size=BLOCK_SIZE, kv_cache_dtype="bfloat16")
    declined = "no CPU decode graph for this model (a bfloat16 KV cache (kv_cache_dtype) under float32"
    assert declined in caplog.text


def test_server_refuses_a_bad_kv_cache_dtype_at_start_up(model_dir, capsys):
    assert main(["serve", str(model_dir), "--kv-cache-dtype", "fp8_inc"]) == 2
    assert "kv_cache_dtype='fp8_inc'" in capsys.readouterr().err


def test_tensor_parallel_fp8_cache_equals_one_process(model_dir):
    """tensor_parallel_size=2 over an fp8 cache: each rank's cache is fp8, tokens as one process's."""
    prompts = _prompts()[:3]
    one = _engine(model_dir, prompts, kv_cache_dtype="fp8")[0]
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        two = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.runner.cache.keys[0].dtype == torch.float8_e4m3fn
    finally:
        llm.engine.shutdown()
    assert two == one
