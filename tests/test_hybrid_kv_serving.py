"""The hybrid KV cache manager in the engine: windowed layers give back the blocks their window
passed, and the engine's greedy fp32 tokens stay transformers'.

Tiny random models with sliding windows of 2 blocks of 4 tokens and prompts of 17-36 tokens plus
20 generated, so that every sequence releases blocks while it runs: Mistral (every layer windowed:
one group, which the CPU decode graph takes), Gemma 3 (two windowed layers to one global: three
groups of one layer) and gpt-oss (windowed and global layers alternating, with sinks: two groups of
one layer). Each runs plain batching, a budget that chunks every prompt, a pool small enough to
preempt, the plain PyTorch modules, n-gram speculation and multi-step decoding, and gives
transformers' tokens (eager attention, batched `generate`). A pool that cannot hold the sequences'
whole history runs them all at once with the manager and not without it; pages no request holds
are poisoned with NaN after every step, so that an attention path reading a released block
unmasked would show.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, random_hf, save_with_tokenizer, transformers_greedy

from slipstream import LLM, SamplingParams
from slipstream.cli import build_parser
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.serve.engine import EngineConfig

pytest_plugins = ["serve_fixtures"]
pytestmark = [pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler"),
              pytest.mark.usefixtures("one_torch_thread")]

VOCAB, WINDOW, BLOCK_SIZE, MAX_NEW_TOKENS = 320, 8, 4, 20
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, sliding_window=WINDOW)
FAMILIES = {
    "mistral": lambda: random_hf(transformers.MistralForCausalLM,
                                 transformers.MistralConfig(**COMMON, num_hidden_layers=2)),
    "gemma3_text": lambda: random_hf(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=3, query_pre_attn_scalar=20, sliding_window_pattern=3,
        rope_local_base_freq=100.0, final_logit_softcapping=4.0)),
    "gpt_oss": lambda: random_hf(transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
        names=("norm", "sinks", "bias")),
}
GROUPS = {"mistral": 1, "gemma3_text": 3, "gpt_oss": 2}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    hf = FAMILIES[request.param]()
    return request.param, save_with_tokenizer(hf, tmp_path_factory.mktemp(request.param), VOCAB)


def _prompts(seed: int, shared_prefix_len: int = 0, num_prompts: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared_prefix_len,), generator=g).tolist()
    lengths = torch.randint(17, 37 - shared_prefix_len, (num_prompts,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _reference(model_dir, prompts):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    return transformers_greedy(hf, prompts, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(family_dir):
    prompts = _prompts(seed=1)
    return prompts, *_reference(family_dir[1], prompts)


def _run(model_dir, prompts, *, poison: bool = False, **engine_args):
    """The engine's greedy tokens, its peak of running sequences, its preemptions and the most
    blocks any step held; with `poison`, every page of a block no request holds is set to NaN
    after every step (the null block's excepted: it stays zero)."""
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, **engine_args)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    kv, cache = engine.scheduler.kv_cache, engine.runner.cache
    tokens: dict[str, list[int]] = {}
    peak_running = peak_blocks = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        peak_running = max(peak_running, engine.scheduler.num_running)
        peak_blocks = max(peak_blocks, kv.num_used_blocks)
        if poison:
            unheld = sorted(set(range(kv.num_blocks)) - kv.held_block_ids())
            for pages in (*cache.keys, *cache.values):
                pages[unheld] = float("nan")
    assert kv.num_used_blocks == 0
    kv.check_invariants()
    got = [tokens[str(i)] for i in range(len(prompts))]
    return got, peak_running, engine.scheduler.num_preemptions, llm


def _pool_bytes(llm: LLM, num_blocks: int) -> int:
    """kv_cache_memory for `num_blocks` blocks under `llm`'s grouping (a block is a page in each
    of the groups' slots)."""
    cache = llm.engine.runner.cache
    return num_blocks * sum(pages[0].numel() * pages.element_size() for pages in (*cache.keys, *cache.values))


CASES = {
    "batched": dict(),
    "chunked prefill": dict(max_num_batched_tokens=8),
    "plain modules": dict(fast_cpu_kernels=False),
    "multi-step": dict(num_scheduler_steps=4),
    "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 2}),
    "disabled": dict(disable_hybrid_kv_cache_manager=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers(family_dir, reference, case):
    """Every scheduling case (chunked prompts among decodes, several decode steps at once, guesses
    verified in one pass, the PyTorch paths) with windows releasing blocks, and with the manager
    disabled: transformers' tokens. The layers are grouped as vLLM groups them."""
    family, model_dir = family_dir
    prompts, expected, gaps = reference
    got, _, _, llm = _run(model_dir, prompts, **CASES[case])
    groups = llm.engine.limits.kv_groups
    assert groups.num_groups == (1 if case == "disabled" else GROUPS[family])
    assert groups.has_windows == (case != "disabled")
    assert_same_tokens(expected, gaps, got, f"{family}, {case}")


def test_preempting_pool_matches_transformers(family_dir, reference):
    """A pool of 12 blocks for 4 sequences (one sequence's window and chunk fit; all four do not):
    preemption by recompute under released blocks, transformers' tokens."""
    family, model_dir = family_dir
    prompts, expected, gaps = reference
    probe = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, max_model_len=64,
                max_num_batched_tokens=16)
    memory = _pool_bytes(probe, 3 * GROUPS[family] * 4 if family != "mistral" else 12)
    got, _, num_preemptions, _ = _run(model_dir, prompts, kv_cache_memory=memory, max_model_len=64,
                                      max_num_batched_tokens=16)
    print(f"{family}: {num_preemptions} preemptions")
    assert num_preemptions > 0
    assert_same_tokens(expected, gaps, got, f"{family}, preempting")


def test_prefix_caching_on_and_off_agree_with_transformers(family_dir):
    """Prompts sharing a 16-token prefix (past the window), two at a time so that later ones hit
    the first ones' blocks: the same tokens with prefix caching on and off, transformers'; and on,
    some prompt tokens hit (for Mistral, where every layer is windowed, only while the whole
    prefix is still cached: kv_cache.py's module docstring)."""
    family, model_dir = family_dir
    prompts = _prompts(seed=2, shared_prefix_len=16)
    expected, gaps = _reference(model_dir, prompts)
    on, _, _, llm = _run(model_dir, prompts, max_num_seqs=2)
    off, _, _, _ = _run(model_dir, prompts, max_num_seqs=2, enable_prefix_caching=False)
    kv = llm.engine.scheduler.kv_cache
    print(f"{family}: {kv.prefix_cache_hits} of {kv.prefix_cache_queries} prompt tokens hit")
    assert kv.prefix_cache_hits >= 2 * 16
    assert on == off
    assert_same_tokens(expected, gaps, on, f"{family}, prefix caching")


@pytest.mark.parametrize("variant", ["fast", "plain", "fp8"])
def test_no_path_reads_a_released_block(family_dir, variant):
    """Pages of blocks no request holds are set to NaN after every step (prefix caching off, so
    that no free block is read legitimately): the C decode and prefill kernels, the CPU decode
    graph (Mistral's one group), the PyTorch paths and an fp8 cache give the tokens they give
    without poisoning and with the manager disabled (itself checked against transformers above)."""
    family, model_dir = family_dir
    prompts = _prompts(seed=3)
    args = dict(enable_prefix_caching=False, max_num_batched_tokens=16,
                fast_cpu_kernels=variant != "plain", kv_cache_dtype="fp8" if variant == "fp8" else "auto")
    got, _, _, llm = _run(model_dir, prompts, poison=True, **args)
    if family == "mistral" and variant == "fast":
        assert isinstance(llm.engine.runner.decode_graph, CpuDecodeGraph)
    expected, _, _, _ = _run(model_dir, prompts, disable_hybrid_kv_cache_manager=True, **args)
    assert got == expected


def test_a_pool_too_small_for_whole_histories_runs_them_together(family_dir):
    """A pool holding 4 sequences' windows but not their whole histories: the manager runs all 4 at
    once without preempting, while with it disabled the same kv_cache_memory preempts."""
    family, model_dir = family_dir
    prompts = _prompts(seed=4)
    probe = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, max_model_len=64,
                max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True)
    # Three quarters of the four sequences' whole histories (the last token's KV is never kept).
    whole = sum(-(-(len(prompt) + MAX_NEW_TOKENS - 1) // BLOCK_SIZE) for prompt in prompts)
    memory = _pool_bytes(probe, whole * 3 // 4)
    args = dict(kv_cache_memory=memory, max_model_len=64, max_num_batched_tokens=16)
    _, peak, preemptions, _ = _run(model_dir, prompts, **args)
    _, peak_disabled, preemptions_disabled, _ = _run(model_dir, prompts, disable_hybrid_kv_cache_manager=True,
                                                     **args)
    print(f"{family}: peak {peak} running, {preemptions} preemptions; disabled: {peak_disabled}, "
          f"{preemptions_disabled}")
    assert (peak, preemptions) == (4, 0)
    assert preemptions_disabled > 0


@pytest.mark.parametrize("family", ["gemma3_text", pytest.param("gpt_oss", marks=pytest.mark.slow),
                                    pytest.param("mistral", marks=pytest.mark.slow)])
def test_tensor_parallel_matches_transformers(family, tmp_path):
    """Split over a driver and a worker process (tensor_parallel_size=2): the worker builds the
    same groups and reads each layer through its group's tables: transformers' tokens."""
    model_dir = save_with_tokenizer(FAMILIES[family](), tmp_path, VOCAB)
    prompts = _prompts(seed=1)
    expected, gaps = _reference(model_dir, prompts)
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, tensor_parallel_size=2,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    try:
        assert llm.engine.limits.kv_groups.num_groups == GROUPS[family]
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert_same_tokens(expected, gaps, got, f"{family}, tensor parallel")


def test_the_switch_is_vllms_and_checked(tmp_path):
    """`disable_hybrid_kv_cache_manager` is an EngineConfig field (so `LLM(...)` takes it), the
    server's `--disable-hybrid-kv-cache-manager` flag sets it, and anything but a bool is a
    ValueError naming it."""
    args = build_parser().parse_args(["serve", str(tmp_path), "--disable-hybrid-kv-cache-manager"])
    assert args.disable_hybrid_kv_cache_manager is True
    assert build_parser().parse_args(["serve", str(tmp_path)]).disable_hybrid_kv_cache_manager is False
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager must be True or False, got 'yes'"):
        EngineConfig(model=str(tmp_path), disable_hybrid_kv_cache_manager="yes")


def test_a_window_no_request_outgrows_is_full_attention(tmp_path):
    """Gemma 3 served at a max_model_len whose last position (10) puts no whole 4-token block
    before its 8-token window: one group (nothing would ever be released), and transformers'
    tokens; one more token of length and the windowed layers are grouped apart again."""
    model_dir = save_with_tokenizer(FAMILIES["gemma3_text"](), tmp_path, VOCAB)
    prompts = [[5, 9, 14], [7, 3, 12, 40]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    expected, gaps = transformers_greedy(hf, prompts, 6)
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, max_model_len=WINDOW + BLOCK_SIZE - 1)
    assert llm.engine.limits.kv_groups.windows == (None,)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert_same_tokens(expected, gaps, got, "gemma3_text, one group")
    longer = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, max_model_len=WINDOW + BLOCK_SIZE)
    assert longer.engine.limits.kv_groups.num_groups == GROUPS["gemma3_text"]


def test_multi_step_records_each_position_under_the_current_tables(family_dir, reference):
    """Several decode steps at once are recorded one position at a time, each an update of its
    own that may release blocks: every chunk the scheduler is handed carries its request's block
    tables as they stand then (`ScheduledChunk.block_ids`), not the ones taken before the steps,
    whose released blocks another request may hold by then."""
    _, model_dir = family_dir
    prompts, expected, gaps = reference
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, num_scheduler_steps=4)
    scheduler = llm.engine.scheduler
    update, stale = scheduler.update, []

    def checked_update(plan, *args, **kwargs):
        stale.extend(chunk.request.request_id for chunk in plan.chunks
                     if chunk.block_ids != scheduler.kv_cache.block_tables(chunk.request.request_id))
        return update(plan, *args, **kwargs)

    scheduler.update = checked_update
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert_same_tokens(expected, gaps, got, "multi-step")
    assert stale == []
