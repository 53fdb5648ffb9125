"""Mixture-of-experts models served by the engine give transformers' greedy tokens.

One tiny random model per family: Mixtral (every layer routed, renormalised top-2, a sliding
window shorter than the prompts), Qwen3-MoE (q/k norms, routed layers between dense ones by
decoder_sparse_step, top-2 of 6 not renormalised) and Qwen2-MoE (q/k/v bias, a gated shared
expert, a dense layer named in mlp_only_layers). The reference is transformers' batched greedy
`generate` (left padding) on the same checkpoint; the engine must match it under continuous
batching, chunked prefill, preemption, prefix caching, multi-step and speculative decoding, with
the CPU fast path and without; the fast path runs each block's routed experts in one C call
(`KernelMoeExperts`; its bit-for-bit tests are in test_moe_kernel.py). The fast path's other piece
for these models (oneDNN products of the experts on padded rows) equals its reference, and the C
decode graph runs their decode steps where PyTorch runs its AVX-512 kernels (test_moe_decode_graph.py
checks it bit for bit against the module path); CUDA graphs decline the models.
"""

from __future__ import annotations

import copy
import json
import logging
import sys

import pytest
import torch
from serve_fixtures import assert_same_tokens, random_model, transformers_greedy

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig, load_model
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.transformer import SparseMoeBlock
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import KernelDecoder, KernelMoeExperts, optimize_for_cpu_inference
from slipstream.ops.linear import ONEDNN_ROW_MULTIPLE, PackedLinear
from slipstream.perf.flops import kv_cache_bytes_per_token
from slipstream.serve.cuda_graph import can_capture
from slipstream.serve.runner import PagedKVCache

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE, NUM_PROMPTS, MAX_NEW_TOKENS, BLOCK_SIZE = 8192, 6, 28, 16
# head_dim 64: the size the CPU attention kernels are specialised for.
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              eos_token_id=0, pad_token_id=0)
SHAPES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=48),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                      decoder_sparse_step=2, norm_topk_prob=False),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True),
}


def write_moe_model(family: str, out_dir) -> None:
    """A random transformers model of `family` with the stdlib tokenizer. Matrices (routers
    included) are drawn with std 0.1, so that logits and router scores spread widely enough that
    fp32 rounding differences between GEMM paths flip neither a greedy choice nor an expert
    choice; norms and biases are non-trivial (ones and zeros would hide a missing one)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**COMMON, **SHAPES[family])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif "bias" in name:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    stdlib_tokenizer(VOCAB_SIZE).save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))


def _prompts(seed: int, shared_prefix_len: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB_SIZE, (shared_prefix_len,), generator=g).tolist()
    lengths = torch.randint(17, 70, (NUM_PROMPTS,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def _transformers_greedy(model_dir, prompts):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    return transformers_greedy(hf, prompts, MAX_NEW_TOKENS)


def _engine_greedy(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    # The C decode graph runs the decode steps wherever the fast path is on and PyTorch runs the
    # AVX-512 kernels whose routing it replays (on Linux: libstdc++'s order among tied experts).
    graph = (engine_args.get("fast_cpu_kernels", True) and sys.platform == "linux"
             and torch.backends.cpu.get_cpu_capability() == "AVX512")
    assert isinstance(llm.engine.runner.decode_graph, CpuDecodeGraph) == graph
    return [o.outputs[0].token_ids for o in outputs], llm


def _fused_expert_calls(llm) -> int | None:
    """How many block calls ran their routed experts in one C call; None where the blocks have none."""
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    fused = [block.fused_experts for block in blocks]
    if not any(fused):
        return None
    assert all(isinstance(f, KernelMoeExperts) for f in fused)
    return sum(f.num_calls for f in fused)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def moe_model(request, tmp_path_factory):
    """(family, model directory, prompts, transformers' tokens, their top-2 logit gaps)."""
    model_dir = tmp_path_factory.mktemp(request.param)
    write_moe_model(request.param, model_dir)
    prompts = _prompts(seed=1)
    return request.param, model_dir, prompts, *_transformers_greedy(model_dir, prompts)


def _kv_bytes(model_dir, num_blocks: int) -> int:
    config = ModelConfig.from_pretrained(model_dir)
    return num_blocks * BLOCK_SIZE * kv_cache_bytes_per_token(config, "float32")


ENGINE_CASES = {
    "batched": dict(),
    "plain modules": dict(fast_cpu_kernels=False),
    "chunked prefill": dict(max_num_batched_tokens=16),
    "preempting": dict(max_model_len=128, kv_cache_memory=12),
    "multi-step": dict(max_num_seqs=3, num_scheduler_steps=8),
    "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 2}),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_greedy_tokens_match_transformers(moe_model, case):
    """Every family, (a) all prompts batched, with the CPU fast path and with the plain PyTorch
    modules, (b) a 16-token budget that chunks every prompt (all are longer) among decodes, (c) a
    KV cache of 12 blocks for 6 requests of up to 97 tokens (preemption by recompute), eight
    greedy decode steps per engine step, and n-gram speculation (a verify pass over several rows
    per sequence): transformers' tokens."""
    family, model_dir, prompts, expected, gaps = moe_model
    engine_args = dict(ENGINE_CASES[case])
    if "kv_cache_memory" in engine_args:
        engine_args["kv_cache_memory"] = _kv_bytes(model_dir, engine_args["kv_cache_memory"])
    got, llm = _engine_greedy(model_dir, prompts, **engine_args)
    if case == "plain modules":
        assert _fused_expert_calls(llm) is None
    elif cpu_kernels.supports_panel_gemm(torch.empty(0)):
        assert _fused_expert_calls(llm) > 0
    if case == "preempting":
        print(f"preemptions: {llm.engine.scheduler.num_preemptions}")
        assert llm.engine.scheduler.num_preemptions > 0
    if case == "speculative":
        assert llm.engine.num_draft_tokens > 0
    assert_same_tokens(expected, gaps, got, f"{family}, {case}")


def test_prefix_caching_matches_transformers(moe_model):
    """(d) Prompts sharing a 48-token prefix hit the prefix cache (after the first 3, which run
    together), and give transformers' tokens, as the engine does without prefix caching."""
    family, model_dir = moe_model[:2]
    prompts = _prompts(seed=2, shared_prefix_len=48)
    expected, gaps = _transformers_greedy(model_dir, prompts)
    cached, llm = _engine_greedy(model_dir, prompts, max_num_seqs=3)
    kv = llm.engine.scheduler.kv_cache
    print(f"prefix cache: {kv.prefix_cache_hits} of {kv.prefix_cache_queries} prompt tokens hit")
    assert kv.prefix_cache_hits >= (NUM_PROMPTS - 3) * 48
    uncached, _ = _engine_greedy(model_dir, prompts, max_num_seqs=3, enable_prefix_caching=False)
    assert cached == uncached
    assert_same_tokens(expected, gaps, cached, f"{family}, prefix caching")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_plain_model(moe_model, dtype):
    """optimize_for_cpu_inference on an MoE model (each expert's gate/up fused and packed with
    padded oneDNN rows, routers packed, C kernels, the fused-residual decoder) gives the plain
    model's logits."""
    model_dir = moe_model[1]
    plain = load_model(model_dir, dtype=dtype).eval()
    fast = optimize_for_cpu_inference(copy.deepcopy(plain))
    blocks = [m for m in fast.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == sum(isinstance(m, SparseMoeBlock) for m in plain.modules()) > 0
    assert all(isinstance(expert.gate_up_proj, PackedLinear | torch.nn.Linear)
               for block in blocks for expert in block.experts)
    packed = [m for m in fast.modules() if isinstance(m, PackedLinear)]
    in_experts = {id(m) for block in blocks for m in block.experts.modules()}
    assert all(m.pad_rows_to == (ONEDNN_ROW_MULTIPLE if id(m) in in_experts else 1) for m in packed)
    if cpu_kernels.supports(next(fast.parameters())):
        assert isinstance(fast.model, KernelDecoder)
    if cpu_kernels.supports_panel_gemm(next(fast.parameters())):
        assert all(isinstance(block.fused_experts, KernelMoeExperts) for block in blocks)
    ids = torch.randint(3, VOCAB_SIZE, (2, 37))
    positions = torch.arange(37).expand(2, 37)
    with torch.inference_mode():
        expected, got = plain(ids, positions).float(), fast(ids, positions).float()
    diff = (expected - got).abs().max().item()
    scale = expected.abs().max().item()
    print(f"{dtype}: max |logit diff| {diff:.3g} (logit scale {scale:.3g})")
    assert diff < (5e-2 * scale if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [31, 33, 100, 300])
def test_packed_linear_pads_onednn_rows(dtype, num_rows, monkeypatch):
    """An expert's PackedLinear (without extra copies) hands products of 32 rows or more to oneDNN
    padded to a multiple of 32 rows (an expert's row count changes every step; see
    linear.ONEDNN_ROW_MULTIPLE), fewer as they are, and a dense layer's never: the result keeps the
    input's leading dimensions and equals nn.Linear's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).to(dtype)
    packed = PackedLinear(linear)
    if packed.packed_weight is None:
        pytest.skip("no oneDNN product for this dtype here")
    rows_to_onednn = []
    mkldnn_linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *args: rows_to_onednn.append(x.numel() // 64) or mkldnn_linear(x, *args))
    x = torch.randn(1, num_rows, 64, dtype=dtype)
    with torch.inference_mode():
        expected, unpadded = linear(x), packed(x)
        packed.pad_rows_to = ONEDNN_ROW_MULTIPLE
        got = packed(x)
    padded = num_rows if num_rows < 32 else -(-num_rows // 32) * 32
    assert rows_to_onednn == [num_rows, padded]
    assert got.shape == unpadded.shape == (1, num_rows, 96)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_bfloat16_generation_follows_the_reference(moe_model):
    """bf16 generation runs and its tokens are the model's: in bf16 a rounding difference can flip
    a near-tied expert choice, after which the logits move by whole units (transformers' own bf16
    model, teacher-forced on a sequence, disagrees with itself generating it), so exact tokens
    cannot be asked. Instead, under transformers' fp32 model teacher-forced on the engine's own
    sequences, every engine token must rank among the top 32 of the 8192 (a broken expert path
    picks tokens of rank in the thousands) and at least 85% must be the top choice."""
    transformers = pytest.importorskip("transformers")
    family, model_dir, prompts = moe_model[:3]
    llm = LLM(str(model_dir), dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ranks = []
    for prompt, output in zip(prompts, outputs, strict=True):
        generated = output.outputs[0].token_ids
        assert len(generated) == MAX_NEW_TOKENS and output.outputs[0].text
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]  # (T, V)
        chosen = logits.gather(1, torch.tensor(generated)[:, None])  # (T, 1)
        ranks += (logits > chosen).sum(dim=1).tolist()
    num_top = ranks.count(0)
    print(f"{family} bf16: {num_top} of {len(ranks)} tokens are fp32's top choice; worst rank {max(ranks)}")
    assert max(ranks) < 32 and num_top >= 0.85 * len(ranks)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
def test_decode_graph_declines_moe_models_without_a_fallback(moe_model, caplog):
    """CpuDecodeGraph.build without a module-by-module fallback (which a routing tie needs) returns
    None for an optimised model with MoE layers, cleanly and with a log line that says why."""
    fast = optimize_for_cpu_inference(load_model(moe_model[1]))
    cache = PagedKVCache(fast.config, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32,
                         device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="slipstream.ops.decode_graph"):
        assert CpuDecodeGraph.build(fast, cache.keys, cache.values) is None
    assert "no CPU decode graph for this model (mixture-of-experts layers" in caplog.text


def test_cuda_graphs_decline_moe_models(moe_model, caplog):
    """CUDA-graph capture is declined, with a log line, for a model with MoE layers (whose token
    counts per expert go to the host) and taken for a dense one."""
    with caplog.at_level(logging.INFO, logger="slipstream.serve.cuda_graph"):
        assert not can_capture(load_model(moe_model[1]))
    assert "no CUDA graphs for this model" in caplog.text
    dense = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    assert can_capture(random_model(dense))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_decodes_moe_models_eagerly(moe_model):
    """On a GPU an MoE model takes no CUDA graphs (its routing reads counts on the host) and its
    greedy tokens are transformers' (fp32, eager decode)."""
    family, model_dir, prompts, expected, gaps = moe_model
    got, llm = _engine_greedy(model_dir, prompts, device="cuda")
    assert llm.engine.runner.decode_graph is None
    assert_same_tokens(expected, gaps, got, f"{family} on CUDA")
