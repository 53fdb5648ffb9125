"""Beam search (`LLM.beam_search`, vLLM's API): equal to transformers' `generate(num_beams=...)`
where no beam ends early, to a dense reference search where beams end with end-of-sequence, and
the search rules checked on hand-made candidates without an engine."""

from __future__ import annotations

import math

import pytest
import torch
from serve_fixtures import EOS_TRIGGER_ID, dense_logprobs

from slipstream import LLM, BeamSearchParams, SamplingParams
from slipstream.serve.beam_search import BeamSearch
from slipstream.serve.request import Logprob

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 96
PROMPTS = [[523, 1054, 68, 10, 80, 289], [11, 205, 7, 311, 42, 9, 88, 97, 12, 3000, 17]]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, block_size=4)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_equals_transformers_num_beams(llm, model_dir, length_penalty):
    """With no beam ending early (ignore_eos; transformers with no end-of-sequence id), the beams
    and their scores (cumulative log-probability over generated length ** length_penalty) equal
    transformers' beam search, for two prompts searched together."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    width, steps = 4, 10
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True,
                              length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=width, num_return_sequences=width, max_new_tokens=steps, do_sample=False,
                length_penalty=length_penalty, eos_token_id=None, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)
        assert [beam.tokens for beam in output.sequences] == expected.sequences.tolist()
        scores = [beam.cum_logprob / steps**length_penalty for beam in output.sequences]
        assert scores == pytest.approx(expected.sequences_scores.tolist(), abs=1e-4)
        assert {beam.finish_reason for beam in output.sequences} == {"length"}
        assert {len(beam.logprobs) for beam in output.sequences} == {steps}
        assert [beam.text for beam in output.sequences] == [
            llm.get_tokenizer().decode(beam.tokens, skip_special_tokens=True) for beam in output.sequences]


def dense_beam_search(model, prompt: list[int], width: int, steps: int, eos_ids: set[int],
                      length_penalty: float) -> list[tuple[list[int], float]]:
    """The documented search over a dense forward of every beam: each running beam extended by its
    2 x width most likely tokens, end-of-sequence children complete, the best width of the rest
    run on; the best width of all, by cumulative logprob / generated length ** length_penalty."""
    def score(beam):
        return beam[1] / (len(beam[0]) - len(prompt)) ** length_penalty

    running, completed = [(prompt, 0.0)], []
    for _ in range(steps):
        extended = []
        for tokens, cum in running:
            top = dense_logprobs(model, tokens)[-1].topk(2 * width)
            for logprob, token_id in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = ([*tokens, token_id], cum + logprob)
                (completed if token_id in eos_ids else extended).append(child)
        running = sorted(extended, key=score, reverse=True)[:width]
    return sorted(completed + running, key=score, reverse=True)[:width]


def test_beams_that_end_with_eos_complete_as_in_a_dense_reference(llm, dense_model):
    """A prompt after which end-of-sequence is the likeliest token: that child completes at once
    (finish reason "stop"), the others run on, and the result equals the dense reference search;
    the engine holds no request or KV block afterwards."""
    prompt = [11, 12, EOS_TRIGGER_ID]
    width, steps = 3, 6
    eos_ids = set(llm.engine.limits.eos_token_ids)
    [output] = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=steps))
    expected = dense_beam_search(dense_model, prompt, width, steps, eos_ids, 1.0)
    assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in expected]
    cum_logprobs = [beam.cum_logprob for beam in output.sequences]
    assert cum_logprobs == pytest.approx([cum for _, cum in expected], abs=1e-4)
    stopped = [beam for beam in output.sequences if beam.finish_reason == "stop"]
    assert stopped
    assert all(beam.tokens[-1] in eos_ids and beam.stop_reason == beam.tokens[-1] for beam in stopped)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0


def test_beam_search_reuses_the_beams_shared_prefix(model_dir):
    """Each step's beams share their earlier tokens, which prefix caching keeps computed: most
    prompt tokens of the step requests are cache hits."""
    llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, block_size=4)
    kv_cache = llm.engine.scheduler.kv_cache
    llm.beam_search([PROMPTS[1] * 3], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert kv_cache.prefix_cache_hits > 0.7 * kv_cache.prefix_cache_queries


def test_beams_stop_where_the_context_ends(llm):
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 3))
    [output] = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=10,
                                                                             ignore_eos=True))
    assert [len(beam.tokens) for beam in output.sequences] == [MAX_MODEL_LEN] * 2
    assert {beam.finish_reason for beam in output.sequences} == {"length"}


def test_text_prompts_are_tokenized_as_generate_does(llm):
    [from_text] = llm.beam_search("def fib(n):", BeamSearchParams(beam_width=2, max_tokens=3))
    [from_ids] = llm.beam_search([llm.get_tokenizer().encode("def fib(n):")],
                                 BeamSearchParams(beam_width=2, max_tokens=3))
    assert [b.tokens for b in from_text.sequences] == [b.tokens for b in from_ids.sequences]


@pytest.mark.parametrize("changes, message", [
    (dict(beam_width=0), "beam_width must be a positive integer"),
    (dict(max_tokens=1.5), "max_tokens must be a positive integer"),
    (dict(temperature=-0.5), r"temperature must be a number in \[0, 10000\], got -0.5"),
    (dict(temperature=math.nan), "temperature must be a number"),
    (dict(skip_special_tokens="no"), "skip_special_tokens must be True or False"),
    (dict(length_penalty=math.inf), "length_penalty must be a finite number"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
])
def test_bad_beam_search_params_are_value_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**(dict(beam_width=2, max_tokens=4) | changes))


def test_beam_search_params_take_vllms_fields_by_position():
    assert BeamSearchParams(2, 8, True, 0.0, 0.5, False) == BeamSearchParams(
        beam_width=2, max_tokens=8, ignore_eos=True, length_penalty=0.5)
    with pytest.raises(TypeError):
        BeamSearchParams(2, 8, True, 0.0, 0.5, False, False)


def test_beam_search_refuses_what_the_engine_cannot_serve(llm):
    with pytest.raises(ValueError, match=r"beam_width=11 asks for 22 logprobs per step, more than the "
                                         r"engine's max_logprobs \(20\)"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["x"], SamplingParams())
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def position(**logprobs: float) -> dict[int, Logprob]:
    """Candidates {token id: logprob} from keywords t<id>=logprob."""
    return {int(name[1:]): Logprob(logprob=value, rank=rank)
            for rank, (name, value) in enumerate(sorted(logprobs.items(), key=lambda kv: -kv[1]), start=1)}


def test_search_rules_on_hand_made_candidates():
    """Without an engine: end-of-sequence children complete and leave the running beams, running
    beams are the best `beam_width` by score, and the result ranks completed and running beams by
    score, where the length penalty can put a short completed beam first or last."""
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    search = BeamSearch([7], params, eos_token_ids={0}, max_model_len=100)
    search.step([position(t0=-0.5, t1=-1.0, t2=-2.0, t3=-3.0)])
    assert [beam.tokens for beam in search.completed] == [[7, 0]]
    assert [beam.tokens for beam in search.running] == [[7, 1], [7, 2]]
    assert not search.done
    search.step([position(t4=-0.1, t5=-0.2, t0=-4.0, t6=-5.0), position(t4=-0.1, t5=-3.0, t6=-4.0, t7=-5.0)])
    assert search.done
    # scores: [7, 0] -0.5/1; [7, 1, 4] -1.1/2; [7, 1, 5] -1.2/2; [7, 2, 4] -2.1/2; [7, 1, 0] -5/2
    assert [beam.tokens for beam in search.best()] == [[7, 0], [7, 1, 4]]
    long_first = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=3.0),
                            eos_token_ids={0}, max_model_len=100)
    long_first.step([position(t0=-0.5, t1=-1.0, t2=-2.0, t3=-3.0)])
    long_first.step([position(t4=-0.1, t5=-0.2), position(t4=-0.1, t5=-3.0)])
    # with length_penalty 3: [7, 1, 4] -1.1/8 beats [7, 0] -0.5/1
    assert [beam.tokens for beam in long_first.best()] == [[7, 1, 4], [7, 1, 5]]
    assert [beam.finish_reason for beam in long_first.best()] == ["length", "length"]


@pytest.mark.parametrize("length_penalty, best_length", [(1e308, 2), (-1e308, 1)])
def test_an_extreme_length_penalty_ranks_without_overflow(length_penalty, best_length):
    """A finite length_penalty whose power of the length overflows a float (a 500 at the server
    once) still ranks beams: a huge positive one puts the longest first, a huge negative one the
    shortest."""
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty),
                        eos_token_ids={0}, max_model_len=100)
    search.step([position(t0=-0.5, t1=-1.0, t2=-2.0)])
    search.step([position(t4=-0.1, t5=-0.2), position(t4=-0.1, t5=-3.0)])
    assert len(search.best()[0].tokens) - 1 == best_length



def test_beam_text_skips_special_tokens_by_default_and_temperature_changes_no_beam(llm):
    """As vLLM's beam_search: a beam's text is its tokens decoded with special tokens skipped
    (BeamSearchParams.skip_special_tokens, default True), and temperature, which in vLLM only
    changes the token each step samples (unused by the search), leaves the beams as they are."""
    prompt = [[11, 12, EOS_TRIGGER_ID]]  # the model answers <|im_end|>; ignore_eos searches past it
    tokenizer = llm.get_tokenizer()
    base = dict(beam_width=2, max_tokens=4, ignore_eos=True)
    [skipped] = llm.beam_search(prompt, BeamSearchParams(**base))
    [kept] = llm.beam_search(prompt, BeamSearchParams(**base, skip_special_tokens=False))
    [warm] = llm.beam_search(prompt, BeamSearchParams(**base, temperature=0.8))
    assert any(2 in beam.tokens for beam in skipped.sequences)  # <|im_end|> among the tokens
    assert [b.tokens for b in skipped.sequences] == [b.tokens for b in kept.sequences] == [
        b.tokens for b in warm.sequences]
    assert [b.text for b in skipped.sequences] == [
        tokenizer.decode(b.tokens, skip_special_tokens=True) for b in skipped.sequences]
    assert [b.text for b in kept.sequences] == [tokenizer.decode(b.tokens) for b in kept.sequences]
    assert any("<|im_end|>" in b.text for b in kept.sequences)
    assert not any("<|im_end|>" in b.text for b in skipped.sequences)


def test_beam_search_takes_vllms_lora_request_none_and_use_tqdm_positionally(llm):
    """vLLM's order, beam_search(prompts, params, lora_request, use_tqdm): None is taken, anything
    but a LoRARequest is refused."""
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    [output] = llm.beam_search(["x"], params, None, False)
    assert len(output.sequences) == 2
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or None"):
        llm.beam_search(["x"], params, lora_request=object())
