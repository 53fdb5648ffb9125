"""Greedy generation through the serving engine equals transformers' on unusual model shapes.

`test_engine_parity.py` covers every family at head_dim 64 with 4 query / 2 kv heads. These cases
take the shapes and settings it leaves out: head sizes the C kernels have no specialised copy for
(16, 48, 80, 256) next to the specialised ones (64, 128), multi-head, grouped (3 and 6 query heads
per kv head) and multi-query attention, hidden sizes that are not multiples of 16 nor equal to
heads x head_dim, odd intermediate and vocabulary sizes (tails of the panel and matrix-vector
kernels), every bias the families allow, tied embeddings, Llama 3 and linear RoPE scaling, and
Mistral windows of 1 and 5 tokens; on the engine side block sizes of 1, 3, 5 and 32, token budgets
of 1 to 16 (every prompt chunked), one to eight running requests (the C decode graph through the
matrix-vector and the panel kernels), a KV cache small enough to preempt, prefix caching over
shared prefixes and repeated prompts, the plain PyTorch path and `enforce_eager`.

The reference is transformers' greedy choice from a full forward over the whole sequence so far,
one prompt at a time (no padding, no cache): transformers' cached `generate` is itself wrong for
Mistral's `sliding_window=1` (its own uncached forward disagrees from the second token on).
"""

from __future__ import annotations

import copy

import pytest
import torch
from serve_fixtures import uncached_greedy

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.model.create import stdlib_tokenizer
from slipstream.perf.flops import kv_cache_bytes_per_token

pytest_plugins = ["serve_fixtures"]  # the one_torch_thread fixture

MAX_NEW_TOKENS = 16
TOKENIZER_VOCAB = 320  # the tokenizer test_engine_parity.py uses; prompts are token ids, so the
# model's vocabulary may be larger (ids past the tokenizer's only decode to empty text)

# (family, model overrides, engine arguments). Hidden sizes are multiples of the head count only
# (transformers' requirement), never heads x head_dim.
CASES = {
    "llama-mha-d16-biases-llama3-block1-budget7": (
        "llama",
        dict(hidden_size=200, num_attention_heads=8, num_key_value_heads=8, head_dim=16,
             intermediate_size=333, vocab_size=997, attention_bias=True, mlp_bias=True,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        dict(block_size=1, max_num_batched_tokens=7, max_num_seqs=8),
    ),
    "qwen2-gqa6-d80-tied-block3-decode-graph": (
        "qwen2",
        dict(hidden_size=204, num_attention_heads=12, num_key_value_heads=2, head_dim=80,
             intermediate_size=257, vocab_size=321, tie_word_embeddings=True),
        dict(block_size=3, max_num_seqs=3),
    ),
    "qwen3-mqa-d256-bias-preempt": (
        "qwen3",
        dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=256,
             intermediate_size=333, vocab_size=997, attention_bias=True),
        dict(block_size=32, max_num_seqs=8, kv_one_sequence=True),
    ),
    "mistral-window1-gqa4-d128-block5-budget16-batch8": (
        "mistral",
        dict(hidden_size=232, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             intermediate_size=200, vocab_size=512, sliding_window=1),
        dict(block_size=5, max_num_batched_tokens=16),
    ),
    "mistral-window5-gqa3-d64-block1-budget1": (
        "mistral",
        dict(hidden_size=120, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             intermediate_size=96, vocab_size=997, sliding_window=5),
        dict(block_size=1, max_num_batched_tokens=1, max_num_seqs=2),
    ),
    "llama-gqa2-d48-linear-rope-eager": (
        "llama",
        dict(hidden_size=72, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
             intermediate_size=600, vocab_size=997, attention_bias=False,
             rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(block_size=16, max_num_batched_tokens=16, enforce_eager=True),
    ),
    "qwen3-gqa2-d48-plain-pytorch": (
        "qwen3",
        dict(hidden_size=250, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
             intermediate_size=333, vocab_size=997, tie_word_embeddings=True),
        dict(block_size=5, max_num_batched_tokens=7, fast_cpu_kernels=False),
    ),
}


def _prompts(vocab_size: int, block_size: int) -> list[list[int]]:
    """Lengths 1 to ~60: single tokens, exact block multiples, a shared prefix of two blocks and a
    bit (prefix-cache hits that end mid-block), a prompt equal to that prefix, and a repeat."""
    g = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    prefix = ids(2 * block_size + 3)
    prompts = [ids(1), prefix + ids(9), ids(2), prefix + ids(25), ids(2 * block_size), ids(60), list(prefix)]
    return prompts + [list(prompts[3])]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("case", sorted(CASES))
def test_unusual_shapes_match_transformers(case, make_hf_model, tmp_path):
    """The engine's fp32 greedy tokens equal transformers' for every prompt, the engine ends with
    every KV block freed, and the settings the case names took effect (decode graph, preemption,
    prefix-cache hits)."""
    family, overrides, engine_args = CASES[case]
    # transformers 5 writes into a config's rope_scaling dict (rope_theta and more): copy it
    overrides, engine_args = copy.deepcopy(overrides), dict(engine_args)
    hf = make_hf_model(family, num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.1,
                       **overrides)
    hf.save_pretrained(tmp_path)
    stdlib_tokenizer(TOKENIZER_VOCAB).save_pretrained(tmp_path)
    prompts = _prompts(overrides["vocab_size"], engine_args.get("block_size", 16))
    max_model_len = max(map(len, prompts)) + MAX_NEW_TOKENS
    preempts = engine_args.pop("kv_one_sequence", False)
    if preempts:  # KV for one full-length sequence: the others wait or are preempted
        block_size = engine_args["block_size"]
        per_token = kv_cache_bytes_per_token(ModelConfig.from_pretrained(tmp_path), "float32")
        engine_args["kv_cache_memory"] = -(-max_model_len // block_size) * block_size * per_token
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=max_model_len, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    assert engine.scheduler.kv_cache.num_used_blocks == 0
    graph_expected = engine_args.get("fast_cpu_kernels", True) and not engine_args.get("enforce_eager", False)
    assert (engine.runner.decode_graph is not None) == graph_expected
    if preempts:
        assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv_cache.prefix_cache_hits > 0

    expected = uncached_greedy(hf, prompts, MAX_NEW_TOKENS)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert g == e, f"{case}: prompt {i} (length {len(prompts[i])}) diverges from transformers"


@pytest.mark.usefixtures("one_torch_thread")
def test_linear_rope_scaling_extends_the_context_as_in_vllm(make_hf_model, tmp_path):
    """vLLM's context for a linear RoPE scaling is `max_position_embeddings` x factor (positions
    are divided by the factor); a prompt past the unscaled range generates transformers' tokens.
    A tokenizer's smaller `model_max_length` caps the unscaled length, before the factor (vLLM's
    `_get_and_verify_max_len` gives 96 for 24 x 4, and 128 for a limit of 48 above the model's 32)."""
    hf = make_hf_model("llama", num_hidden_layers=2, max_position_embeddings=32, initializer_range=0.1,
                       hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       vocab_size=TOKENIZER_VOCAB, rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf.save_pretrained(tmp_path)
    tokenizer = stdlib_tokenizer(TOKENIZER_VOCAB)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=16)
    assert llm.engine.limits.max_model_len == 128
    prompt = torch.randint(3, TOKENIZER_VOCAB, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == uncached_greedy(hf, [prompt], MAX_NEW_TOKENS)[0]

    for model_max_length, expected in ((24, 96), (48, 128)):
        tokenizer.model_max_length = model_max_length
        tokenizer.save_pretrained(tmp_path)
        assert LLM(str(tmp_path), dtype="float32", block_size=16).engine.limits.max_model_len == expected
    with pytest.raises(ValueError, match="max_model_len 129 exceeds the model's 128"):
        LLM(str(tmp_path), dtype="float32", max_model_len=129)
