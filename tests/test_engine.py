"""The engine's step loop over a small random model: scheduler and KV invariants under chunking and
preemption, aborts, request metrics, prefix caching, request ids and the streamed text."""

from __future__ import annotations

import codecs
import itertools
import random
import sys

import pytest
from serve_fixtures import VOCAB_SIZE, kv_bytes_for_blocks

from slipstream.serve import engine as engine_module
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.request import RequestOutput, SamplingParams

pytest_plugins = ["serve_fixtures"]  # the model_dir and dense_model fixtures, built once
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_STEPS = 2000
"""Every run here finishes in far fewer steps; more means the loop no longer makes progress."""


def greedy(max_tokens: int = 12, **overrides) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **overrides)


def make_engine(model_dir, **overrides) -> Engine:
    values = dict(max_model_len=128, max_num_batched_tokens=256, block_size=8) | overrides
    return Engine(EngineConfig(model=str(model_dir), **values))


@pytest.fixture(scope="module")
def reference_engine(model_dir) -> Engine:
    """Room for everything, no prefix caching: the outputs other configurations must reproduce."""
    return make_engine(model_dir, enable_prefix_caching=False)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def run(engine: Engine, *, check: bool = True) -> tuple[dict[str, RequestOutput], list[RequestOutput]]:
    """Step until every request finished: (final output per request id, every output in order),
    checking the scheduler's and KV cache's invariants after each step."""
    finals: dict[str, RequestOutput] = {}
    stream: list[RequestOutput] = []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return finals, stream
        for output in engine.step():
            stream.append(output)
            if output.finished:
                assert output.request_id not in finals, "a request finished twice"
                finals[output.request_id] = output
        if check:
            engine.scheduler.check_invariants()
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def generate(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    finals, _ = run(engine)
    return {request_id: finals[request_id].outputs[0].token_ids for request_id in prompts}


# ---- invariants under chunking and preemption ----------------------------------------------------


@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_invariants_hold_every_step_under_chunking_and_preemption(model_dir, reference_engine,
                                                                  num_scheduler_steps):
    """Invariants hold every step under chunking and preemption, and outputs match a roomy engine's;
    also when greedy decodes run several steps at once (whose blocks the short pool often lacks)."""
    rng = random.Random(0)
    lengths = [90, 5, 60, 3, 40, 100, 17, 8]
    prompts = {f"r{i}": random_prompt(rng, n) for i, n in enumerate(lengths)}
    params = greedy(max_tokens=20)
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    engine = make_engine(model_dir, max_num_batched_tokens=24, kv_cache_memory=kv_bytes_for_blocks(18, 8),
                         num_scheduler_steps=num_scheduler_steps)
    assert engine.limits.num_blocks == 18
    late = ["r6", "r7"]
    for request_id in prompts.keys() - set(late):
        engine.add_request(request_id, prompts[request_id], params)
    for _ in range(5):
        engine.step()
        engine.scheduler.check_invariants()
    for request_id in late:
        engine.add_request(request_id, prompts[request_id], params)
    engine.add_request("sampled", prompts["r2"], sampled)
    finals, _ = run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv_cache.num_used_blocks == 0
    assert not engine.scheduler.has_unfinished()
    assert set(finals) == set(prompts) | {"sampled"}
    for output in finals.values():
        for completion in output.outputs:
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == 20
    expected = generate(reference_engine, prompts, params)
    assert {request_id: finals[request_id].outputs[0].token_ids for request_id in prompts} == expected
    # Seeded sampling continues each completion's own random stream across preemptions.
    reference_engine.add_request("sampled", prompts["r2"], sampled)
    expected_sampled = run(reference_engine)[0]["sampled"]
    assert [c.token_ids for c in finals["sampled"].outputs] == [c.token_ids for c in expected_sampled.outputs]


def test_prompt_logprobs_survive_preemption(model_dir):
    """A preempted, recomputed request still has exactly one prompt-logprobs entry per prompt token."""
    rng = random.Random(1)
    engine = make_engine(model_dir, max_num_batched_tokens=32, block_size=4,
                         kv_cache_memory=kv_bytes_for_blocks(36, 4))
    prompts = {f"p{i}": random_prompt(rng, 20) for i in range(4)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(max_tokens=30, prompt_logprobs=1))
    finals, _ = run(engine)
    assert engine.scheduler.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert len(finals[request_id].prompt_logprobs) == len(prompt)


# ---- aborts --------------------------------------------------------------------------------------


def start_two(engine: Engine) -> None:
    """Queue a request to keep and one to abort, and step until the victim has generated tokens."""
    rng = random.Random(2)
    engine.add_request("keep", random_prompt(rng, 30), greedy(max_tokens=10))
    engine.add_request("victim", random_prompt(rng, 40), greedy(max_tokens=50))
    for _ in range(3):
        engine.step()
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_abort_frees_blocks_at_once(model_dir, num_scheduler_steps):
    """abort_request frees the request's blocks at once (those taken for steps ahead too); the
    other request finishes normally."""
    engine = make_engine(model_dir, num_scheduler_steps=num_scheduler_steps)
    start_two(engine)
    kv_cache = engine.scheduler.kv_cache
    used, held = kv_cache.num_used_blocks, engine.num_kv_blocks_held("victim")
    assert held >= 40 // 8
    engine.abort_request("victim")
    assert engine.num_kv_blocks_held("victim") == 0
    assert kv_cache.num_used_blocks == used - held  # the two prompts share no block
    engine.scheduler.check_invariants()
    finals, stream = run(engine)
    assert set(finals) == {"keep"}
    assert all(output.request_id == "keep" for output in stream)
    assert len(finals["keep"].outputs[0].token_ids) == 10
    assert engine.scheduler.kv_cache.num_used_blocks == 0


def test_abort_reports_a_final_abort_output(model_dir):
    """An aborted request gets a final output with finish_reason "abort" and its tokens so far."""
    engine = make_engine(model_dir)
    start_two(engine)
    returned = engine.abort_request("victim") or []
    outputs = [*returned, *engine.step()]
    finals = [output for output in outputs if output.request_id == "victim"]
    assert len(finals) == 1, f"{len(finals)} outputs for the aborted request"
    final = finals[0]
    assert final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) > 0


def test_abort_of_unknown_or_finished_ids_is_harmless(model_dir):
    """Aborting ids that were never added, or that already finished, changes nothing."""
    engine = make_engine(model_dir)
    engine.add_request("done", [5, 6, 7], greedy(max_tokens=2))
    run(engine)
    engine.add_request("live", [5, 6, 7, 8], greedy(max_tokens=4))
    engine.step()
    engine.abort_request("never-added")
    engine.abort_request(["done", "also-unknown"])
    engine.scheduler.check_invariants()
    finals, _ = run(engine)
    assert len(finals["live"].outputs[0].token_ids) == 4
    assert engine.scheduler.kv_cache.num_used_blocks == 0


# ---- metrics -------------------------------------------------------------------------------------


def test_request_metrics_are_ordered(model_dir):
    """arrival <= first scheduled <= first token <= finished, also for requests that queued."""
    engine = make_engine(model_dir, max_num_seqs=2, max_num_batched_tokens=16)
    rng = random.Random(3)
    for i in range(5):
        engine.add_request(f"m{i}", random_prompt(rng, 10 + 7 * i), greedy(max_tokens=4))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            # Checked on receipt: outputs of one request share its live metrics record.
            assert (output.metrics.finished_time_s is not None) == output.finished
            if output.finished:
                finals[output.request_id] = output
    assert len(finals) == 5
    for output in finals.values():
        m = output.metrics
        assert m.arrival_time_s <= m.first_scheduled_time_s <= m.first_token_time_s <= m.finished_time_s
        assert m.queue_time_s >= 0
        assert m.time_to_first_token_s >= m.queue_time_s
        assert m.e2e_latency_s >= m.time_to_first_token_s


# ---- prefix caching ------------------------------------------------------------------------------


def shared_prefix_prompts() -> dict[str, list[int]]:
    rng = random.Random(4)
    prefix = random_prompt(rng, 45)
    return {"first": prefix + random_prompt(rng, 6), "second": prefix + random_prompt(rng, 9)}


def test_prefix_cache_hits_keep_outputs_identical(model_dir, reference_engine):
    """A shared prompt prefix hits the prefix cache and gives the same greedy tokens as no caching."""
    engine = make_engine(model_dir)
    prompts = shared_prefix_prompts()
    outputs = {}
    for request_id, prompt in prompts.items():
        outputs |= generate(engine, {request_id: prompt}, greedy())
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.prefix_cache_hits >= 40  # the 5 full blocks of the shared 45-token prefix
    assert kv_cache.prefix_cache_queries == sum(len(p) for p in prompts.values())
    assert outputs == generate(reference_engine, prompts, greedy())
    # The same prompt again hits everything but its last block, and still agrees.
    again = generate(engine, {"again": prompts["second"]}, greedy())
    assert again["again"] == outputs["second"]
    assert kv_cache.num_used_blocks == 0
    engine.scheduler.check_invariants()


def test_num_cached_tokens_reports_prefix_hits(model_dir):
    """RequestOutput.num_cached_tokens reports the prompt tokens served from the prefix cache (vLLM)."""
    engine = make_engine(model_dir)
    prompts = shared_prefix_prompts()
    engine.add_request("first", prompts["first"], greedy())
    first, _ = run(engine)
    engine.add_request("second", prompts["second"], greedy())
    second, _ = run(engine)
    assert first["first"].num_cached_tokens == 0
    assert second["second"].num_cached_tokens == 40



def test_cache_salt_shares_cached_blocks_only_within_a_salt(model_dir, reference_engine):
    """vLLM's cache_salt: the same prompt under two salts shares no cached block, under one salt it
    shares as usual, and without a salt as before; the tokens never depend on the salt."""
    engine = make_engine(model_dir)
    prompt = shared_prefix_prompts()["first"]  # 51 tokens: 6 full blocks of 8 can hit
    expected = generate(reference_engine, {"r": prompt}, greedy())["r"]
    for request_id, salt, num_cached in (("a", "tenant-1", 0), ("b", "tenant-2", 0), ("c", None, 0),
                                         ("d", "tenant-1", 48), ("e", "tenant-2", 48), ("f", None, 48)):
        engine.add_request(request_id, prompt, greedy(), cache_salt=salt)
        finals, _ = run(engine)
        assert (finals[request_id].num_cached_tokens, finals[request_id].outputs[0].token_ids) == (
            num_cached, expected), request_id
    with pytest.raises(ValueError, match="cache_salt must be a string or None, got 3"):
        engine.add_request("bad", prompt, greedy(), cache_salt=3)
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_requests_are_not_prefix_cache_queries(model_dir):
    """A request that wants prompt logprobs skips the prefix cache, so (as in vLLM) its tokens are
    not counted as queries, which would lower the hit rate the metrics report."""
    engine = make_engine(model_dir)
    kv_cache = engine.scheduler.kv_cache
    prompt = shared_prefix_prompts()["first"]
    generate(engine, {"warm": prompt}, greedy(max_tokens=2))
    generate(engine, {"logprobs": prompt}, greedy(max_tokens=2, prompt_logprobs=1))
    assert (kv_cache.prefix_cache_queries, kv_cache.prefix_cache_hits) == (len(prompt), 0)
    generate(engine, {"again": prompt}, greedy(max_tokens=2))
    assert (kv_cache.prefix_cache_queries, kv_cache.prefix_cache_hits) == (2 * len(prompt), 48)

# ---- request ids ---------------------------------------------------------------------------------


def test_request_id_in_use_is_a_value_error(model_dir):
    """Reusing an active id is a ValueError that leaves the active request alone; a finished id is free."""
    engine = make_engine(model_dir)
    engine.add_request("r", [5, 6, 7], greedy(max_tokens=6))
    engine.step()
    with pytest.raises(ValueError, match="'r'"):
        engine.add_request("r", [9, 9, 9], greedy(max_tokens=2))
    finals, _ = run(engine)
    assert finals["r"].prompt_token_ids == [5, 6, 7]
    assert len(finals["r"].outputs[0].token_ids) == 6
    engine.add_request("r", [9, 9, 9], greedy(max_tokens=2))
    finals, _ = run(engine)
    assert len(finals["r"].outputs[0].token_ids) == 2


def test_user_ids_never_collide_with_completion_ids(model_dir):
    """An id that looks like another prompt's completion ("a#0") is just another request: both
    finish with their own outputs."""
    engine = make_engine(model_dir)
    engine.add_request("a", [5, 6, 7], greedy(max_tokens=3, n=2))
    engine.add_request("a#0", [8, 9], greedy(max_tokens=4))
    finals, _ = run(engine)
    assert [len(c.token_ids) for c in finals["a"].outputs] == [3, 3]
    assert finals["a#0"].prompt_token_ids == [8, 9]
    assert [len(c.token_ids) for c in finals["a#0"].outputs] == [4]


# ---- streaming -----------------------------------------------------------------------------------


def test_streamed_text_only_grows_and_never_shows_a_stop_string(model_dir, reference_engine):
    """Streamed text only grows and never shows any part of a stop string that completes later."""
    prompt = random.Random(5).sample(range(3, VOCAB_SIZE), 8)
    reference_engine.add_request("ref", prompt, greedy(max_tokens=30))
    reference = run(reference_engine)[0]["ref"].outputs[0]
    def decode(ids):  # the output text's decoding (SamplingParams.skip_special_tokens=True)
        return reference_engine.tokenizer.decode(ids, skip_special_tokens=True)

    token_ends = {len(decode(reference.token_ids[: i + 1])) for i in range(len(reference.token_ids))}
    text = reference.text
    # A 6-letter stop string first appearing in the second half, spread over more than one token.
    k = next(
        k for k in range(len(text) // 2, len(text) - 6)
        if text[k : k + 6].isascii() and text[k : k + 6].isalpha() and text.find(text[k : k + 6]) == k
        and any(k < end < k + 6 for end in token_ends)
    )
    stop = text[k : k + 6]
    engine = make_engine(model_dir)
    engine.add_request("s", prompt, greedy(max_tokens=30, stop=[stop]))
    finals, stream = run(engine)
    final = finals["s"].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (text[:k], "stop", stop)
    texts = [output.outputs[0].text for output in stream]
    assert len(texts) > 3
    for earlier, later in itertools.pairwise(texts):
        assert later.startswith(earlier)
    for shown in texts:
        assert final.text.startswith(shown)
    # The hold-back was exercised: some intermediate output had generated the stop string's start.
    assert any(decode(output.outputs[0].token_ids)[k:k + 1] == stop[0] for output in stream[:-1])


def test_output_cut_inside_a_character_drops_its_bytes(model_dir, reference_engine):
    """A completion that max_tokens ends inside a multi-byte character ends with the text before it
    (vLLM drops the incomplete bytes), not U+FFFD, and the streamed text adds up to it. Reference:
    Python's incremental UTF-8 decoder, which holds an incomplete tail back."""
    tokenizer = reference_engine.tokenizer
    reference_engine.add_request("ref", "class Foo:", greedy(max_tokens=40))
    token_ids = run(reference_engine)[0]["ref"].outputs[0].token_ids
    pieces = [tokenizer.token_bytes(t) for t in token_ids]
    # The first token that ends with the lead byte of a multi-byte character (0xc2-0xf4).
    cut = next(i for i, piece in enumerate(pieces) if 0xC2 <= piece[-1] <= 0xF4)
    expected = codecs.getincrementaldecoder("utf-8")().decode(b"".join(pieces[: cut + 1]), final=False)
    engine = make_engine(model_dir)
    engine.add_request("cut", "class Foo:", greedy(max_tokens=cut + 1))
    finals, stream = run(engine)
    final = finals["cut"].outputs[0]
    assert (final.token_ids, final.text, final.finish_reason) == (token_ids[: cut + 1], expected, "length")
    assert expected and not expected.endswith("\ufffd")
    assert all(expected.startswith(output.outputs[0].text) for output in stream)


# ---- several decode steps at once -----------------------------------------------------------------


def test_multi_step_decoding_runs_bursts_of_the_same_tokens(model_dir, reference_engine):
    """num_scheduler_steps=8: a greedy request of 20 tokens takes 4 engine steps (its prefill, then
    8, 8 and 3 decode steps: never past max_tokens), and requests of several lengths together get
    the tokens of one step at a time; every block returns to the pool."""
    rng = random.Random(11)
    prompts = {f"m{i}": random_prompt(rng, n) for i, n in enumerate([10, 33, 4, 61])}
    engine = make_engine(model_dir, num_scheduler_steps=8)
    engine.add_request("m0", prompts["m0"], greedy(max_tokens=20))
    assert len(run(engine)[1]) == 4  # one streamed output per step: each step adds a token
    lengths = {"m0": 20, "m1": 13, "m2": 9, "m3": 26}
    for request_id, n in lengths.items():
        engine.add_request(request_id, prompts[request_id], greedy(max_tokens=n))
    finals, _ = run(engine)
    got = {request_id: finals[request_id].outputs[0].token_ids for request_id in lengths}
    expected = {}
    for request_id, n in lengths.items():
        expected |= generate(reference_engine, {request_id: prompts[request_id]}, greedy(max_tokens=n))
    assert got == expected
    assert engine.scheduler.kv_cache.num_used_blocks == 0


def test_multi_step_decoding_stops_mid_burst(model_dir, reference_engine):
    """A stop token id or a stop string reached inside a burst ends the request there, as one step
    at a time would: the tokens computed after it are dropped, the stop string is trimmed, the
    streamed text only grows, and every block returns to the pool."""
    prompt = random.Random(12).sample(range(3, VOCAB_SIZE), 9)
    reference_engine.add_request("ref", prompt, greedy(max_tokens=30))
    reference = run(reference_engine)[0]["ref"].outputs[0]
    stop_token = reference.token_ids[10]
    end = reference.token_ids.index(stop_token)
    engine = make_engine(model_dir, num_scheduler_steps=8)
    engine.add_request("token", prompt, greedy(max_tokens=30, stop_token_ids=[stop_token]))
    final = run(engine)[0]["token"].outputs[0]
    assert final.token_ids == reference.token_ids[: end + 1]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop_token)

    text = reference.text
    k = next(k for k in range(len(text) // 3, len(text) - 4)
             if text[k : k + 4].strip() == text[k : k + 4] and text.find(text[k : k + 4]) == k)
    stop = text[k : k + 4]
    engine.add_request("string", prompt, greedy(max_tokens=30, stop=[stop]))
    finals, stream = run(engine)
    final = finals["string"].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (text[:k], "stop", stop)
    assert len(final.token_ids) < len(reference.token_ids)
    # Tokens 1-8 come from the first burst, 9-16 from the second: each stop came before its burst's end.
    assert end % 8 != 0 and (len(final.token_ids) - 1) % 8 != 0
    texts = [output.outputs[0].text for output in stream]
    for earlier, later in itertools.pairwise(texts):
        assert later.startswith(earlier)
    assert engine.scheduler.kv_cache.num_used_blocks == 0


def test_multi_step_decoding_leaves_rows_that_need_each_step_alone(model_dir):
    """Rows whose sampling needs every step's logits (a random sample, logprobs, min_tokens still
    masking a stop token) run one step at a time, with the tokens, logprobs and seeded samples of
    an engine without multi-step; min_tokens allows bursts once reached."""
    rng = random.Random(13)
    prompt = random_prompt(rng, 12)
    cases = {
        "sampled": (SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True), 12),
        "logprobs": (greedy(max_tokens=12, logprobs=2), 12),
        # Stop token 0 is masked for the first 10 tokens (one step each), then 2 bursts: 8 and 2.
        "min_tokens": (greedy(max_tokens=20, min_tokens=10, stop_token_ids=[0]), 1 + 9 + 2),
    }
    for request_id, (params, num_steps) in cases.items():
        single, multi = make_engine(model_dir), make_engine(model_dir, num_scheduler_steps=8)
        single.add_request(request_id, prompt, params)
        multi.add_request(request_id, prompt, params)
        finals, stream = run(multi)
        assert len(stream) == num_steps, request_id  # one streamed output per step
        expected, got = run(single)[0][request_id].outputs[0], finals[request_id].outputs[0]
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs


def test_multi_step_decoding_runs_one_step_at_a_time_while_a_request_waits(model_dir, reference_engine):
    """With room for one running request, the second waits: meanwhile the first decodes one step
    per engine step (so the second is admitted the step after the first ends, not at a burst's
    end); alone, the second runs in bursts (its prefill, then 8 and 3 steps). Same tokens."""
    rng = random.Random(15)
    prompts = {"first": random_prompt(rng, 10), "second": random_prompt(rng, 7)}
    engine = make_engine(model_dir, num_scheduler_steps=8, max_num_seqs=1)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(max_tokens=12))
    finals, stream = run(engine)
    assert [output.request_id for output in stream] == ["first"] * 12 + ["second"] * 3
    expected = generate(reference_engine, prompts, greedy(max_tokens=12))
    assert {request_id: finals[request_id].outputs[0].token_ids for request_id in prompts} == expected


def test_plain_greedy_decodes_skip_the_sampler(model_dir, monkeypatch):
    """One step at a time (the default), a decode step whose rows all take a plain argmax gets its
    tokens from the runner: the sampler sees only the prefill; a row that wants logprobs goes
    through it every step, with the same tokens."""
    rows_sampled = []
    real_sample = engine_module.sample

    def counting_sample(logits, batch):
        rows_sampled.append(logits.shape[0])
        return real_sample(logits, batch)

    monkeypatch.setattr(engine_module, "sample", counting_sample)
    prompt = random_prompt(random.Random(14), 12)
    engine = make_engine(model_dir)
    engine.add_request("plain", prompt, greedy(max_tokens=12))
    plain = run(engine)[0]["plain"].outputs[0]
    assert rows_sampled == [1]
    rows_sampled.clear()
    engine.add_request("logprobs", prompt, greedy(max_tokens=12, logprobs=1))
    with_logprobs = run(engine)[0]["logprobs"].outputs[0]
    assert rows_sampled == [1] * 12
    assert with_logprobs.token_ids == plain.token_ids


def test_num_scheduler_steps_must_be_a_positive_integer(model_dir):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineConfig(model=str(model_dir), num_scheduler_steps=bad)


# ---- process state -------------------------------------------------------------------------------

def test_engine_leaves_subnormal_floats_working(model_dir):
    """Serving leaves the process's floating-point mode alone: subnormal numbers still exist."""
    engine = make_engine(model_dir)
    engine.add_request("x", [5, 6, 7], greedy(max_tokens=3))
    run(engine)
    tiny = sys.float_info.min  # the smallest normal double
    assert tiny / 2 > 0
