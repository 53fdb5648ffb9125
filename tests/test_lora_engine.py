"""The engine under LoRA adapters: several adapters and the base model in one batch, each request's
greedy tokens equal to transformers' over the base model with that request's adapter merged into
its weights (tests/lora_fixtures.py), through every way the engine runs a step; adapters never
share prefix-cache blocks; loading, eviction and removal."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers

from slipstream import LLM, LoRARequest, SamplingParams
from slipstream.serve.request import RequestStatus
from tests.lora_fixtures import merge_adapter, save_random_adapter
from tests.serve_fixtures import assert_same_tokens, random_hf, save_with_tokenizer, transformers_greedy

pytest_plugins = ["tests.serve_fixtures"]

MAX_TOKENS = 10
VOCAB = 320
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x fp32 bytes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random two-layer Llama, two adapters (every projection at rank 8; q, v and down at rank
    4 under rsLoRA), prompts, and transformers' greedy tokens for the base and each adapter."""
    root = tmp_path_factory.mktemp("lora_engine")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    hf = random_hf(transformers.LlamaForCausalLM, config)
    model_dir = save_with_tokenizer(hf, root / "model", VOCAB)
    paths = {
        "a": save_random_adapter(root / "a", hf, rank=8, alpha=16, seed=1),
        "b": save_random_adapter(root / "b", hf, rank=4, alpha=8, seed=2, use_rslora=True,
                                 target_modules=("q_proj", "v_proj", "down_proj")),
    }
    rng = random.Random(0)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    prompts += [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(3)]
    references = {None: transformers_greedy(hf, prompts, MAX_TOKENS)}
    for name, path in paths.items():
        references[name] = transformers_greedy(merge_adapter(copy.deepcopy(hf), path), prompts, MAX_TOKENS)
    for name in paths:  # each adapter changes what the model says: a mixed-up one cannot pass
        assert references[name][0] != references[None][0]
    assert references["a"][0] != references["b"][0]
    requests = {None: None, **{n: LoRARequest(n, i, str(paths[n])) for i, n in enumerate("ab", 1)}}
    return model_dir, prompts, references, requests


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], adapters: list[LoRARequest | None]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False,
                           lora_request=adapters)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check(setup, tokens: list[list[int]], names: list[str | None], label: str) -> None:
    """Prompt i's tokens equal transformers' under adapter names[i]."""
    _, prompts, references, _ = setup
    expected = [references[name][0][i] for i, name in enumerate(names)]
    gaps = torch.stack([references[name][1][i] for i, name in enumerate(names)])
    assert_same_tokens(expected, gaps, tokens, label)


ENGINES = {
    "fast path": {},
    "plain modules": {"fast_cpu_kernels": False},
    "chunked prefill": {"max_num_batched_tokens": 16},
    "preempting": {"kv_cache_memory": 10 * 16 * KV_BYTES_PER_TOKEN, "max_model_len": 128},
    "multi-step": {"num_scheduler_steps": 4},
    "ngram speculation": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "one adapter at a time": {"max_loras": 1},
    "tensor parallel": {"tensor_parallel_size": 2},
}


@pytest.mark.parametrize("engine_args", ENGINES.values(), ids=ENGINES.keys())
def test_mixed_batches_match_transformers_with_each_adapter_merged(setup, engine_args):
    """Every prompt under adapter a, adapter b or none, in one generate call."""
    model_dir, prompts, _, requests = setup
    names = [["a", "b", None][i % 3] for i in range(len(prompts))]
    llm = LLM(str(model_dir), **{"dtype": "float32", "enable_lora": True, "max_loras": 2} | engine_args)
    tokens = generate(llm, prompts, [requests[name] for name in names])
    check(setup, tokens, names, str(engine_args))
    scheduler = llm.engine.scheduler
    if "kv_cache_memory" in engine_args:
        assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache.num_used_blocks == 0 and not scheduler.has_unfinished()


def test_prefix_cache_is_shared_within_an_adapter_only(setup):
    """The prompts sharing a 40-token prefix (two full blocks), one call after another under a, b,
    none and a again: only the second call under a finds the prefix cached (by the first), and
    every call's tokens are its adapter's."""
    model_dir, prompts, references, requests = setup
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=2)
    kv_cache = llm.engine.scheduler.kv_cache
    shared = [6, 7, 8]
    hits = []
    for name in ("a", "b", None, "a"):
        before = kv_cache.prefix_cache_hits
        tokens = generate(llm, [prompts[i] for i in shared], [requests[name]] * len(shared))
        assert tokens == [references[name][0][i] for i in shared], name
        hits.append(kv_cache.prefix_cache_hits - before)
    assert hits == [0, 0, 0, 2 * 16 * len(shared)]


@pytest.mark.parametrize("tensor_parallel_size", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_one_llm_switches_between_adapters_and_the_base_model(setup, tensor_parallel_size):
    """Calls under each adapter in turn, on one engine, with max_cpu_loras=1: an adapter unloaded
    to make room is loaded again when named, and gives its tokens again; also over four ranks,
    which hold two K/V heads two ranks each (the workers load and unload their parts)."""
    model_dir, prompts, _, requests = setup
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              tensor_parallel_size=tensor_parallel_size)
    for name in ("a", "b", None, "a"):
        names = [name] * len(prompts)
        check(setup, generate(llm, prompts, [requests[name]] * len(prompts)), names, str(name))
        assert llm.engine.list_loras() == ({requests[name].lora_int_id} if name else {2})


def test_add_remove_and_list_loras(setup):
    """vLLM's add_lora / remove_lora / list_loras; an id that names another adapter, an adapter of
    a rank above max_lora_rank and a LoRARequest to an engine without enable_lora are refused."""
    model_dir, prompts, _, requests = setup
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=8)
    engine = llm.engine
    assert engine.add_lora(requests["a"]) is True
    assert engine.add_lora(requests["a"]) is False
    assert engine.list_loras() == {1}
    with pytest.raises(ValueError, match="lora_int_id 1 is loaded as 'a'"):
        engine.add_lora(LoRARequest("other", 1, requests["b"].lora_path))
    assert engine.remove_lora(1) is True and engine.remove_lora(1) is False
    assert engine.list_loras() == set()
    small = LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        small.generate("x", greedy(), lora_request=requests["a"])
    assert not small.engine.has_unfinished_requests()
    for name, value in (("max_loras", 0), ("max_lora_rank", -1), ("max_cpu_loras", 1)):
        with pytest.raises(ValueError, match=name):
            LLM(str(model_dir), **{"enable_lora": True, "max_loras": 2, name: value})


def test_an_adapter_removed_while_in_use_serves_its_requests_to_the_end(setup):
    """remove_lora while a request runs under the adapter: the request finishes with the
    adapter's tokens, the adapter is unloaded after, and a new request under the same id loads
    it again."""
    model_dir, prompts, references, requests = setup
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True)
    engine = llm.engine
    engine.add_request("r", prompts[0], greedy(), stream=False, lora_request=requests["a"])
    engine.step()
    assert engine.remove_lora(1) is True and engine.list_loras() == set()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert list(outputs[-1].outputs[0].token_ids) == references["a"][0][0]
    assert engine.lora.layers.loaded_ids == frozenset()
    assert generate(llm, prompts[:1], [requests["a"]]) == [references["a"][0][0]]


def test_lora_names_of_running_and_waiting_requests(setup):
    """What vLLM's lora_requests_info reports: with max_loras=1, a request under b waits while
    those under a run, and runs once they are done."""
    model_dir, prompts, _, requests = setup
    engine = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=1).engine
    for i, name in enumerate(["a", "b", "a", None]):
        engine.add_request(str(i), prompts[i], greedy(), lora_request=requests[name])
    def names():
        return engine.lora_names(RequestStatus.RUNNING), engine.lora_names(RequestStatus.WAITING)

    engine.step()
    assert names() == (["a"], ["b"]) and engine.num_running == 3
    while names()[0] == ["a"]:
        engine.step()
    assert names() == ([], ["b"])
    engine.step()
    assert names() == (["b"], [])


def test_idle_adapters_beyond_max_cpu_loras_are_unloaded_when_their_requests_end(setup):
    """Three adapters named in one call, max_cpu_loras=1: all load (their requests wait or run),
    and once the requests have ended only the most recently named stays; loading another unloads
    that one, and the new one, removed while its request waits, is unloaded when the request is
    aborted."""
    model_dir, prompts, references, requests = setup
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    third = LoRARequest("a again", 3, requests["a"].lora_path)
    tokens = generate(llm, prompts[:3], [requests["a"], requests["b"], third])
    assert tokens == [references["a"][0][0], references["b"][0][1], references["a"][0][2]]
    assert llm.engine.list_loras() == {3} and len(llm.engine.lora.layers.loaded_ids) == 1
    engine = llm.engine
    engine.add_request("r", prompts[0], greedy(), lora_request=requests["b"])  # b in, idle 3 out
    assert engine.remove_lora(2) is True and engine.lora.layers.loaded_ids  # r waits under it
    engine.abort_request("r")
    assert engine.list_loras() == set() and engine.lora.layers.loaded_ids == frozenset()


def test_an_adapter_is_known_by_its_directory_however_the_path_is_spelt(setup, tmp_path):
    """The same id and name with the directory spelt with a trailing slash or through a symbolic
    link is the adapter already loaded; another directory under that id is refused; a
    lora_int_id that is not an integer is a ValueError."""
    model_dir, _, _, requests = setup
    engine = LLM(str(model_dir), dtype="float32", enable_lora=True).engine
    path = requests["a"].lora_path
    (tmp_path / "link").symlink_to(path)
    assert engine.add_lora(requests["a"]) is True
    assert engine.add_lora(LoRARequest("a", 1, path + "/")) is False
    assert engine.add_lora(LoRARequest("a", 1, str(tmp_path / "link"))) is False
    with pytest.raises(ValueError, match="lora_int_id 1 is loaded as 'a'"):
        engine.add_lora(LoRARequest("a", 1, requests["b"].lora_path))
    for bad in ("1", 1.0, None):
        with pytest.raises(ValueError, match="lora_int_id must be an integer"):
            engine.remove_lora(bad)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest, got None"):
        engine.add_lora(None)


def test_a_pinned_adapter_stays_loaded_while_idle(setup):
    """vLLM's pin_lora: with max_cpu_loras=1, a pinned adapter stays loaded while another is used
    (which is then the one unloaded), until it is removed; pinning an id not loaded is refused."""
    model_dir, prompts, references, requests = setup
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    engine.add_lora(requests["a"])
    assert engine.pin_lora(1) is True
    assert generate(llm, prompts[:1], [requests["b"]]) == [references["b"][0][0]]
    assert engine.list_loras() == {1}
    assert generate(llm, prompts[:1], [requests["a"]]) == [references["a"][0][0]]
    assert engine.remove_lora(1) is True and engine.list_loras() == set()
    with pytest.raises(ValueError, match="no LoRA adapter with lora_int_id 1 is loaded"):
        engine.pin_lora(1)


def test_gpt_oss_takes_attention_adapters(tmp_path):
    """gpt-oss (every MLP a mixture of experts, biased q/k/v/o, attention sinks): an adapter on its
    attention projections gives transformers' greedy tokens with the adapter merged, beside
    prompts on the base model in the same call, with and without the CPU fast path."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=256, tie_word_embeddings=False)
    hf = random_hf(transformers.GptOssForCausalLM, config, names=("norm", "bias", "sinks"))
    model_dir = save_with_tokenizer(hf, tmp_path / "model", VOCAB)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    adapter = save_random_adapter(tmp_path / "attention", hf, scale=0.2,
                                  target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 30)]
    merged = transformers_greedy(merge_adapter(copy.deepcopy(hf), adapter), prompts, MAX_TOKENS)
    base = transformers_greedy(hf, prompts, MAX_TOKENS)
    assert merged[0] != base[0]  # the adapter changes what the model says
    request = LoRARequest("attention", 1, str(adapter))
    expected = [merged[0][0], base[0][1], merged[0][2]]
    gaps = torch.stack([merged[1][0], base[1][1], merged[1][2]])
    for engine_args in ({}, {"fast_cpu_kernels": False}):
        llm = LLM(str(model_dir), dtype="float32", enable_lora=True, **engine_args)
        assert_same_tokens(expected, gaps, generate(llm, prompts, [request, None, request]), str(engine_args))
