"""Greedy generation through the serving engine equals transformers' generate, token for token.

The reference is `transformers` batched greedy `generate` (left padding) on the same checkpoint.
The engine must match it under plain continuous batching, with a token budget small enough to
chunk every prompt, with a KV cache small enough to force preemptions, and with prefix caching
over prompts that share long prefixes (where caching on and off must agree too).
"""

from __future__ import annotations

import json

import pytest
import torch
from serve_fixtures import assert_same_tokens, transformers_greedy

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig, Transformer, save_model
from slipstream.model.create import stdlib_tokenizer
from slipstream.perf.flops import kv_cache_bytes_per_token

NUM_PROMPTS, MAX_NEW_TOKENS, BLOCK_SIZE = 32, 128, 16
SMALL_BATCH_PROMPTS = 8
# head_dim 64: the size the CPU attention kernels (prefill and decode) are specialised for.
CONFIG = ModelConfig(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                     eos_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random model whose logits are spread widely enough (init std 0.1) that fp32 rounding
    differences between GEMM paths cannot flip a greedy choice."""
    out = tmp_path_factory.mktemp("parity-model")
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    model.init_weights(std=0.1)
    save_model(model, out)
    tokenizer = stdlib_tokenizer(CONFIG.vocab_size)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return out


def _prompts(seed: int, shared_prefix_len: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, CONFIG.vocab_size, (shared_prefix_len,), generator=g).tolist()
    lengths = torch.randint(17, 100, (NUM_PROMPTS,), generator=g).tolist()
    return [prefix + torch.randint(3, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _transformers_greedy(model_dir, prompts):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    return transformers_greedy(hf, prompts, MAX_NEW_TOKENS)


def _engine_greedy(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def reference(model_dir):
    prompts = _prompts(seed=1)
    return prompts, *_transformers_greedy(model_dir, prompts)


@pytest.fixture(scope="module")
def small_reference(reference):
    """The first SMALL_BATCH_PROMPTS prompts of `reference`: enough for tests of 3 requests at a
    time to run every decode path through several waves of requests, in a quarter of the time."""
    prompts, expected, gaps = reference
    return prompts[:SMALL_BATCH_PROMPTS], expected[:SMALL_BATCH_PROMPTS], gaps[:SMALL_BATCH_PROMPTS]


@pytest.mark.parametrize("fast_cpu_kernels", [True, False])
def test_continuous_batching_matches_transformers(model_dir, reference, fast_cpu_kernels):
    """(a) All prompts batched together: identical tokens, with the CPU fast path (oneDNN linears,
    C kernels) and with the model's plain PyTorch modules."""
    prompts, expected, gaps = reference
    got, _ = _engine_greedy(model_dir, prompts, fast_cpu_kernels=fast_cpu_kernels)
    assert_same_tokens(expected, gaps, got, f"continuous batching, fast_cpu_kernels={fast_cpu_kernels}")


def test_small_batch_decode_graph_matches_transformers(model_dir, small_reference):
    """At most 3 running requests: every decode step runs the layer stack in one C call (the CPU
    decode graph), and the tokens are still transformers', and those of enforce_eager=True."""
    prompts, expected, gaps = small_reference
    got, llm = _engine_greedy(model_dir, prompts, max_num_seqs=3)
    assert llm.engine.runner.decode_graph is not None
    assert_same_tokens(expected, gaps, got, "decode graph, max_num_seqs=3")
    eager, llm = _engine_greedy(model_dir, prompts, max_num_seqs=3, enforce_eager=True)
    assert llm.engine.runner.decode_graph is None
    assert eager == got


@pytest.mark.parametrize("max_num_seqs", [3, 32])
def test_multi_step_decoding_matches_transformers(model_dir, reference, small_reference, max_num_seqs):
    """Eight greedy decode steps per engine step (num_scheduler_steps=8: one C call with the decode
    graph) for up to 3 requests at once (of 8) or all 32: transformers' tokens, also module by
    module."""
    prompts, expected, gaps = small_reference if max_num_seqs < SMALL_BATCH_PROMPTS else reference
    got, _ = _engine_greedy(model_dir, prompts, max_num_seqs=max_num_seqs, num_scheduler_steps=8)
    assert_same_tokens(expected, gaps, got, f"multi-step decoding, max_num_seqs={max_num_seqs}")
    eager, _ = _engine_greedy(model_dir, prompts, max_num_seqs=max_num_seqs, num_scheduler_steps=8,
                              enforce_eager=True)
    assert eager == got


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_seqs=3), dict(kv_cache_memory="small")],
                         ids=["batched", "decode graph", "preempting"])
def test_speculative_decoding_matches_transformers(model_dir, reference, small_reference, engine_args):
    """N-gram speculative decoding (speculative_config, 4 guesses a step) keeps transformers'
    tokens, batched, beside the decode graph (8 prompts, 3 at a time) and under preemption. This
    model rarely repeats itself, so most guesses are refused (tests/test_speculative.py has one
    that loops)."""
    small = engine_args.get("max_num_seqs", NUM_PROMPTS) < SMALL_BATCH_PROMPTS
    prompts, expected, gaps = small_reference if small else reference
    if engine_args.get("kv_cache_memory") == "small":
        engine_args = dict(max_model_len=256, kv_cache_memory=24 * BLOCK_SIZE * kv_cache_bytes_per_token(
            CONFIG, "float32"))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    got, llm = _engine_greedy(model_dir, prompts, speculative_config=spec, **engine_args)
    engine = llm.engine
    print(f"speculative: {engine.num_accepted_tokens} of {engine.num_draft_tokens} guesses confirmed")
    assert engine.num_draft_tokens > 30 * len(prompts) and engine.num_accepted_tokens > 0
    assert_same_tokens(expected, gaps, got, f"speculative decoding {engine_args}")


def test_chunked_prefill_matches_transformers(model_dir, reference):
    """(b) A 16-token budget chunks every prompt (all are longer) and mixes chunks with decodes."""
    prompts, expected, gaps = reference
    got, _ = _engine_greedy(model_dir, prompts, max_num_batched_tokens=16)
    assert_same_tokens(expected, gaps, got, "chunked prefill")


def test_preemption_matches_transformers(model_dir, reference):
    """(c) A KV cache of 24 blocks (384 tokens) for 32 requests forces preemption by recompute."""
    prompts, expected, gaps = reference
    bytes_per_block = BLOCK_SIZE * kv_cache_bytes_per_token(CONFIG, "float32")
    got, llm = _engine_greedy(model_dir, prompts, max_model_len=256, kv_cache_memory=24 * bytes_per_block)
    print(f"preemptions: {llm.engine.scheduler.num_preemptions}")
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_tokens(expected, gaps, got, "preemption")


def test_prefix_caching_matches_transformers(model_dir):
    """(d) Prompts sharing a 64-token prefix hit the prefix cache (after the first), and give the
    same tokens as transformers and as the engine without prefix caching."""
    prompts = _prompts(seed=2, shared_prefix_len=64)
    expected, gaps = _transformers_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    cached = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kv = llm.engine.scheduler.kv_cache
    print(f"prefix cache: {kv.prefix_cache_hits} of {kv.prefix_cache_queries} prompt tokens hit")
    assert kv.prefix_cache_hits >= (NUM_PROMPTS - 8) * 64
    uncached, _ = _engine_greedy(model_dir, prompts, enable_prefix_caching=False)
    assert cached == uncached
    assert_same_tokens(expected, gaps, cached, "prefix caching")


@pytest.mark.parametrize(("max_num_batched_tokens", "num_scheduler_steps"), [(2048, 1), (48, 1), (2048, 6)])
def test_families_at_the_kernels_head_size_match_transformers(family, make_hf_model, tmp_path,
                                                             max_num_batched_tokens, num_scheduler_steps):
    """Every family at head_dim 64 (biases, q/k norms, tied embeddings, and mistral's sliding
    window of 40, shorter than the prompts), prompts of 70-150 tokens (several query blocks and
    key tiles of the prefill kernel), whole or chunked by a 48-token budget, decoding one step or
    six at a time: the engine's greedy tokens are transformers'."""
    window = {"sliding_window": 40} if family == "mistral" else {}
    hf = make_hf_model(family, hidden_size=256, num_attention_heads=4, head_dim=64, initializer_range=0.1,
                       **window)
    hf.save_pretrained(tmp_path)
    tokenizer = stdlib_tokenizer(hf.config.vocab_size)
    tokenizer.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in torch.randint(70, 150, (6,), generator=g).tolist()]
    expected, gaps = transformers_greedy(hf, prompts, 24)
    llm = LLM(str(tmp_path), max_num_batched_tokens=max_num_batched_tokens,
              num_scheduler_steps=num_scheduler_steps)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_same_tokens(expected, gaps, got,
                       f"{family}, budget {max_num_batched_tokens}, {num_scheduler_steps} steps at once")
