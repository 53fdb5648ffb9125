"""Speculative decoding by n-gram lookup: the proposer and the acceptance rule on hand-made
sequences, and the engine's greedy outputs with it equal to those without it, on a model whose
greedy output falls into loops (so that many guesses are confirmed), through the stop
conditions a confirmed run can cross."""

from __future__ import annotations

import random

import pytest
from serve_fixtures import EOS_TRIGGER_ID

from slipstream import LLM, SamplingParams
from slipstream.serve.speculative import SpeculativeConfig, accepted_tokens

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_proposals_follow_the_latest_occurrence_of_the_longest_ngram():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    assert config.propose(tokens, 10) == [7, 8, 2]  # "2 3" last seen at 5..6, then 7 8 2
    assert config.propose(tokens, 2) == [7, 8]  # no more than the request may still generate
    assert config.propose([5, 6, 7], 4) == []  # nothing recurs
    assert config.propose([4, 4, 4, 4], 4) == [4]  # "4 4 4" at 0..2 is followed by one 4
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2).propose([1, 2, 5, 2], 4) == []



def latest_ngram_reference(config: SpeculativeConfig, tokens: list[int], max_tokens: int) -> list[int]:
    """The proposal rule written out over lists."""
    limit, end = min(max_tokens, config.num_speculative_tokens), len(tokens)
    for n in range(min(config.prompt_lookup_max, end - 1), config.prompt_lookup_min - 1, -1):
        for start in range(end - n - 1, -1, -1):
            if limit > 0 and tokens[start:start + n] == tokens[end - n:]:
                return tokens[start + n:start + n + limit]
    return []


def test_proposals_equal_a_list_search_on_random_sequences():
    """The byte search finds what a search over the lists finds, with ids whose int32 bytes
    could match across id boundaries (0, 1, 256, 2**24, ...)."""
    rng = random.Random(0)
    alphabets = [[0, 1, 2, 3], [0, 1, 256, 65536, 2**24, 2**24 + 1, 16777472]]
    for _ in range(3000):
        tokens = [rng.choice(rng.choice(alphabets)) for _ in range(rng.randint(0, 30))]
        config = SpeculativeConfig(num_speculative_tokens=rng.randint(1, 5),
                                   prompt_lookup_max=rng.randint(2, 5), prompt_lookup_min=rng.randint(1, 2))
        max_tokens = rng.randint(0, 6)
        expected = latest_ngram_reference(config, tokens, max_tokens)
        assert config.propose(tokens, max_tokens) == expected, tokens

def test_accepted_tokens_run_to_the_first_wrong_guess():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all confirmed, plus the next
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the model's choice replaces the miss
    assert accepted_tokens([], [3]) == [3]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'ngram'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5}, r"prompt_lookup_min \(5\) exceeds"),
    ({"num_speculative_tokens": 2, "model": "x"}, r"keys \['model'\] are not supported"),
    ("{nope", "not valid JSON"),
])
def test_bad_speculative_configs_are_value_errors(model_dir, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, speculative_config=config)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 8000) for _ in range(rng.randint(5, 60))] for _ in range(12)]


def generate(model_dir, prompts, params, **engine_args):
    llm = LLM(model_dir, max_model_len=256, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    return [o.outputs[0] for o in outputs], llm.engine


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_seqs=2), dict(num_scheduler_steps=4),
                                         dict(max_num_batched_tokens=24)],
                         ids=["batched", "two at a time", "with multi-step", "tight token budget"])
def test_speculative_outputs_equal_plain_greedy(model_dir, prompts, engine_args):
    """Identical tokens, text and finish reasons to the engine without speculation, with over
    half of the guesses confirmed."""
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    plain, _ = generate(model_dir, prompts, params, **engine_args)
    spec, engine = generate(model_dir, prompts, params, speculative_config=SPEC, **engine_args)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.text for c in spec] == [c.text for c in plain]
    print(f"{engine.num_accepted_tokens} of {engine.num_draft_tokens} guesses confirmed")
    assert engine.num_accepted_tokens > 0.5 * engine.num_draft_tokens


def test_a_confirmed_run_stops_where_plain_decoding_does(model_dir, prompts):
    """max_tokens, a stop token, a stop string and end-of-sequence (the fixture model answers it
    after EOS_TRIGGER_ID) end the output at the same token as without speculation, though several
    tokens are recorded per step."""
    plain, _ = generate(model_dir, prompts[:4], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    looped = plain[0].token_ids
    cases = [
        (SamplingParams(temperature=0, max_tokens=37, ignore_eos=True), prompts),
        (SamplingParams(temperature=0, max_tokens=80, stop_token_ids=[looped[50]]), prompts[:1]),
        (SamplingParams(temperature=0, max_tokens=80, stop=[plain[1].text[-12:-6]]), prompts[1:2]),
        (SamplingParams(temperature=0, max_tokens=80), [p + [EOS_TRIGGER_ID] for p in prompts[:4]]),
    ]
    for params, batch in cases:
        expected, _ = generate(model_dir, batch, params)
        got, _ = generate(model_dir, batch, params, speculative_config=SPEC)
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in got] == [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in expected]


def test_sampled_requests_run_without_speculation(model_dir, prompts):
    """A step with a sampled (non-greedy) request runs as usual: seeded samples are those of the
    engine without speculation."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    plain, _ = generate(model_dir, prompts[:3], params)
    spec, engine = generate(model_dir, prompts[:3], params, speculative_config=SPEC)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert engine.num_draft_tokens == 0


def test_disable_by_batch_size_turns_guessing_off_for_larger_steps(model_dir, prompts):
    """As vLLM's: no guesses in a step of more running requests than disable_by_batch_size; the
    last requests of a batch, once the others finished, guess again."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small_batches_only = SPEC | {"disable_by_batch_size": 3}
    _, engine = generate(model_dir, prompts[:4], params, speculative_config=small_batches_only)
    assert engine.num_draft_tokens == 0
    short = [params.replace(max_tokens=4)] * 3 + [params]
    llm = LLM(model_dir, max_model_len=256, speculative_config=SPEC | {"disable_by_batch_size": 1})
    llm.generate(prompts[:4], short, use_tqdm=False)
    assert llm.engine.num_draft_tokens > 0


def test_guesses_are_checked_through_the_cpu_decode_graph(model_dir, prompts, monkeypatch):
    """Each checked position is a decode row of its own, so the check runs in the C decode graph
    (more rows than running requests) and still gives plain greedy decoding's tokens."""
    from slipstream.ops.decode_graph import CpuDecodeGraph

    rows_per_call = []
    call = CpuDecodeGraph.__call__

    def counting(self, token_ids, positions, batch, **kwargs):
        rows_per_call.append(token_ids.shape[0])
        return call(self, token_ids, positions, batch, **kwargs)

    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain, _ = generate(model_dir, prompts[:1], params)
    monkeypatch.setattr(CpuDecodeGraph, "__call__", counting)
    spec, engine = generate(model_dir, prompts[:1], params, speculative_config=SPEC)
    assert engine.runner.decode_graph is not None and max(rows_per_call) > 1
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
