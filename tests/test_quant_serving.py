"""Weight-only int8 quantization in the serving engine (`quantization="int8"`, vLLM's argument).

The reference is transformers' greedy `generate` (fp32, eager attention) on the same model with
every linear weight of its decoder layers replaced by its int8 round trip, computed here from the
definition (s = max |row| / 127, q = round(W / s) clamped to [-127, 127], W' = s * q), not by
slipstream's code. The engine must give those tokens, with the CPU fast path and with the plain
PyTorch modules, batched, under chunked prefill and with prefix-cache hits, for Llama (the
serving fixtures' model) and Gemma 2 (sliding windows, soft caps, four norms a layer), for
Qwen2-MoE (experts, a shared expert; router and shared-expert gate kept), and for Llama split
over two tensor-parallel processes (about 2 s), where each rank quantizes its shard. The
unquantized model's tokens differ from the reference's (checked), so an engine that ignored the
argument would fail. Bad values are ValueErrors naming `quantization`, from `LLM`, `EngineConfig`
and `slipstream serve`; the KV cache sized by gpu_memory_utilization gets the bytes int8 frees, and
the metrics records count the bytes the quantized modules hold.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, transformers_greedy
from test_gemma_model import random_family
from test_moe_serving import write_moe_model

from slipstream import LLM, SamplingParams
from slipstream.cli import main
from slipstream.model import ModelConfig
from slipstream.model.create import stdlib_tokenizer
from slipstream.ops import cpu_kernels
from slipstream.ops.quant import Int8Linear
from slipstream.perf.flops import weight_bytes
from slipstream.serve.engine import EngineConfig
from slipstream.serve.llm import with_memory_utilization

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_PROMPTS, MAX_NEW_TOKENS, SHARED_PREFIX_LEN = 4, 16, 40
PROMPT_SEEDS = {"llama": 1, "gemma2": 2}
"""Prompts on which the int8 round trip changes greedy tokens of the family's random model (most
draws of 4 prompts change some; these are the first that do for both)."""


def int8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """W' = s * round(W / s) per output row, s = max |W[row]| / 127 (1 for a row of zeros)."""
    amax = weight.abs().amax(dim=1, keepdim=True)  # (out, 1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (weight / scale).round().clamp(-127, 127) * scale


def _prompts(vocab_size: int, seed: int, shared_prefix_len: int = SHARED_PREFIX_LEN) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab_size, (shared_prefix_len,), generator=g).tolist()
    lengths = torch.randint(9, 40, (NUM_PROMPTS,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def family_dir(request, model_dir, tmp_path_factory):
    """(family, model directory, vocabulary size)."""
    if request.param == "llama":
        return "llama", model_dir, 8192
    path = tmp_path_factory.mktemp("gemma2-int8")
    random_family("gemma2", head_dim=64).save_pretrained(path)
    stdlib_tokenizer(320).save_pretrained(path)
    return "gemma2", path, 320


@torch.no_grad()
def _references(model_dir, prompts) -> tuple[list[list[int]], torch.Tensor, list[list[int]]]:
    """(transformers' greedy tokens with int8 round-tripped decoder linears, their top-2 gaps, the
    unquantized model's greedy tokens)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    plain, _ = transformers_greedy(hf, prompts, MAX_NEW_TOKENS)
    for linear in hf.model.layers.modules():
        if isinstance(linear, torch.nn.Linear):
            linear.weight.copy_(int8_round_trip(linear.weight))
    return *transformers_greedy(hf, prompts, MAX_NEW_TOKENS), plain


@pytest.fixture(scope="module")
def reference(family_dir):
    """Prompts sharing a 40-token prefix (past Gemma 2's window of 8), the reference's tokens and gaps."""
    family, model_dir, vocab_size = family_dir
    prompts = _prompts(vocab_size, PROMPT_SEEDS[family])
    expected, gaps, plain = _references(model_dir, prompts)
    assert plain != expected, "quantizing changes no greedy token: the tests below could not fail"
    return prompts, expected, gaps


def _engine_greedy(model_dir, prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), quantization="int8", dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outputs], llm


ENGINE_CASES = {
    "batched": dict(enable_prefix_caching=False),
    "plain modules": dict(enable_prefix_caching=False, fast_cpu_kernels=False),
    "chunked prefill": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
    "chunked prefill, plain modules": dict(enable_prefix_caching=False, max_num_batched_tokens=16,
                                           fast_cpu_kernels=False),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_greedy_tokens_match_transformers_on_round_tripped_weights(family_dir, reference, case):
    """All prompts batched, or a 16-token budget that chunks the longer prompts among decodes, with
    the CPU fast path and with the plain modules: transformers' tokens on the int8 round trip."""
    family, model_dir, _ = family_dir
    if case in ("batched", "chunked prefill") and cpu_kernels.library() is None:
        pytest.skip("no C compiler: the fast path is the plain one")
    prompts, expected, gaps = reference
    got, _ = _engine_greedy(model_dir, prompts, **ENGINE_CASES[case])
    assert_same_tokens(expected, gaps, got, f"{family} int8, {case}")


@torch.no_grad()
def _token_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token | what precedes it) of each of `tokens` after `prompt`, by one forward."""
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_logprobs_follow_the_round_trip_not_the_unquantized_model(model_dir):
    """Guards the numbers, not only the greedy choices (which int8 rarely flips): the engine's
    log-probabilities of its tokens (fast path) are the round-tripped transformers model's within
    1e-4 (measured: 1e-6), while the unquantized model's are further away than that (2e-3: an
    engine that quantized part of the model, or none, would fail)."""
    prompts = _prompts(8192, PROMPT_SEEDS["llama"])[:2]
    llm = LLM(str(model_dir), quantization="int8", dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    unquantized = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    round_trip = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        for linear in round_trip.model.layers.modules():
            if isinstance(linear, torch.nn.Linear):
                linear.weight.copy_(int8_round_trip(linear.weight))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        got = torch.tensor([position[t].logprob for position, t in zip(output.outputs[0].logprobs, tokens,
                                                                         strict=True)])
        expected = _token_logprobs(round_trip, prompt, tokens)
        away = (_token_logprobs(unquantized, prompt, tokens) - expected).abs().max().item()
        error = (got - expected).abs().max().item()
        print(f"engine vs round trip {error:.2e}, unquantized vs round trip {away:.2e}")
        assert error < 1e-4 < away


@pytest.mark.parametrize("fast_cpu_kernels", [True, False])
def test_prefix_caching_matches_transformers(family_dir, reference, fast_cpu_kernels):
    """Two at a time, the prompts after the first two hit the prefix cache for their shared
    40-token prefix and give the reference's tokens."""
    family, model_dir, _ = family_dir
    if fast_cpu_kernels and cpu_kernels.library() is None:
        pytest.skip("no C compiler: the fast path is the plain one")
    prompts, expected, gaps = reference
    got, llm = _engine_greedy(model_dir, prompts, max_num_seqs=2, fast_cpu_kernels=fast_cpu_kernels)
    kv = llm.engine.scheduler.kv_cache
    print(f"prefix cache: {kv.prefix_cache_hits} of {kv.prefix_cache_queries} prompt tokens hit")
    assert kv.prefix_cache_hits >= (NUM_PROMPTS - 2) * 32
    assert_same_tokens(expected, gaps, got, f"{family} int8, prefix caching, fast={fast_cpu_kernels}")


@pytest.mark.parametrize("fast_cpu_kernels", [True, False])
def test_mixture_of_experts_matches_transformers(tmp_path, fast_cpu_kernels):
    """Qwen2-MoE (routed experts, a shared expert and its gate, a dense layer): every expert's
    linears and the shared expert's are quantized, the router and the shared expert's gate are
    not; transformers' experts are one (experts, out, in) tensor each, round-tripped expert by
    expert."""
    if fast_cpu_kernels and cpu_kernels.library() is None:
        pytest.skip("no C compiler: the fast path is the plain one")
    write_moe_model("qwen2_moe", tmp_path)
    prompts = _prompts(8192, seed=1, shared_prefix_len=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    plain, _ = transformers_greedy(hf, prompts, MAX_NEW_TOKENS)
    kept = [name for name, _ in hf.model.layers.named_parameters() if name.endswith(("mlp.gate.weight",
                                                                                    "shared_expert_gate.weight"))]
    assert len(kept) == 4  # the two routed layers' router and shared-expert gate
    with torch.no_grad():
        for name, weight in hf.model.layers.named_parameters():
            if name in kept or "norm" in name or "bias" in name:
                continue
            weight.copy_(torch.stack([int8_round_trip(w) for w in weight]) if weight.dim() == 3
                         else int8_round_trip(weight))
    expected, gaps = transformers_greedy(hf, prompts, MAX_NEW_TOKENS)
    assert plain != expected, "quantizing changes no greedy token: the test could not fail"
    got, _ = _engine_greedy(tmp_path, prompts, fast_cpu_kernels=fast_cpu_kernels)
    assert_same_tokens(expected, gaps, got, f"qwen2_moe int8, fast={fast_cpu_kernels}")


def test_tensor_parallel_matches_transformers(model_dir):
    """Split over a driver and a worker (tensor_parallel_size=2), each rank quantizes its shard:
    the column-split q/k/v, gate and up keep the whole model's row scales, while the row-split o
    and down projections get one scale per row and rank, so the reference round-trips each rank's
    half of their input columns on its own."""
    prompts = _prompts(8192, PROMPT_SEEDS["llama"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        for name, linear in hf.model.layers.named_modules():
            if not isinstance(linear, torch.nn.Linear):
                continue
            if name.endswith(("o_proj", "down_proj")):
                halves = linear.weight.chunk(2, dim=1)
                linear.weight.copy_(torch.cat([int8_round_trip(h) for h in halves], dim=1))
            else:
                linear.weight.copy_(int8_round_trip(linear.weight))
    expected, gaps = transformers_greedy(hf, prompts, MAX_NEW_TOKENS)
    llm = LLM(str(model_dir), quantization="int8", dtype="float32", tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
            use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert_same_tokens(expected, gaps, got, "llama int8, tensor parallel")


@pytest.mark.parametrize("value", ["int4", "INT8", "fp8", "", True, 8])
def test_bad_quantization_is_a_value_error(model_dir, value):
    """A method slipstream does not implement is a ValueError naming quantization, the value and
    the choices, from EngineConfig and from LLM (before any weight is loaded)."""
    with pytest.raises(ValueError, match=r"quantization must be None or one of 'int8', got") as error:
        EngineConfig(model=str(model_dir), quantization=value)
    assert repr(value) in str(error.value)
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(model_dir), quantization=value)


def test_serve_refuses_a_bad_quantization(model_dir, capsys):
    """`slipstream serve --quantization int4` exits with status 2 and a one-line error naming the
    argument, before loading the model or opening a port."""
    assert main(["serve", str(model_dir), "--quantization", "int4", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "slipstream serve: error: quantization must be None or one of 'int8', got 'int4'" in err


def test_memory_utilization_gives_the_kv_cache_what_int8_frees(tmp_path):
    """Under gpu_memory_utilization the KV cache gets the fraction less the weights: int8 weights
    leave it the bytes they save (within what the process's own memory moves between the two
    calls). A 0.3B-parameter config (only its config.json: no weights are loaded) makes the saving
    ~0.6 GiB in fp32."""
    config = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    config.save_pretrained(tmp_path)
    plain, quantized = (with_memory_utilization(
        EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", quantization=q), 0.15)
        for q in (None, "int8"))
    saved = weight_bytes(config, "float32") - weight_bytes(config, "float32", "int8")
    print(f"int8 saves {saved / 2**30:.2f} GiB; the KV cache got "
          f"{(quantized.kv_cache_memory - plain.kv_cache_memory) / 2**30:.2f} GiB more")
    assert saved > 2**29
    assert quantized.kv_cache_memory - plain.kv_cache_memory == pytest.approx(saved, abs=64 * 2**20)


def test_metrics_records_count_the_int8_bytes(model_dir, tmp_path):
    """The engine's step records read the quantized weights: a prefill's read_bytes is what the
    served model holds (its parameters and each Int8Linear's int8 weights and fp32 scales, counted
    off the engine's own modules) less the untied input table, plus the prompt's gathered rows and
    KV positions; the header names the quantization."""
    llm = LLM(str(model_dir), quantization="int8", dtype="float32", fast_cpu_kernels=False,
              metrics_dir=tmp_path)
    prompt_len = 10
    llm.generate([list(range(3, 3 + prompt_len))], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    header, prefill, *_ = [json.loads(line) for line in lines]
    model, config = llm.engine.runner.model, llm.engine.model_config
    tensors = {id(p): p for p in model.parameters()}
    for linear in model.modules():
        if isinstance(linear, Int8Linear):
            tensors |= {id(linear.qweight): linear.qweight, id(linear.scale): linear.scale}
    assert not config.tie_word_embeddings
    held = sum(t.nbytes for t in tensors.values()) - model.model.embed_tokens.weight.nbytes
    kv_bytes = 4 * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim  # K, V
    row_and_kv = 4 * config.hidden_size + kv_bytes
    assert header["quantization"] == "int8"
    assert (prefill["phase"], prefill["prompt_len"]) == ("prefill", prompt_len)
    assert prefill["read_bytes"] == held + prompt_len * row_and_kv
