"""The offline `LLM` API as a vLLM user drives it: prompt forms, sampling parameters, stop conditions,
logprobs against a dense forward of the same weights, chat, and input validation.

All tests share one `LLM` over a small random model (see serve_fixtures.py) with a 64-token context
and a 32-token step budget, so prompts longer than 32 tokens are prefilled in chunks.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import tokenizers
import tokenizers.processors
import torch
from serve_fixtures import EOS_TRIGGER_ID, VOCAB_SIZE, dense_logprobs, kv_bytes_for_blocks

from slipstream import LLM, SamplingParams
from slipstream.serve.engine import EngineConfig
from slipstream.serve.llm import OFFLINE_SCHEDULER_STEPS

pytest_plugins = ["serve_fixtures"]  # the model_dir and dense_model fixtures, built once
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 64
LOGPROB_TOL = 1e-4
"""Engine logprobs (paged attention, packed linears, chunked prefill) vs a dense fp32 forward."""

PROMPT = "def fib(n):"


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": 16, "ignore_eos": True} | overrides))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def output_text(tokenizer, token_ids: list[int]) -> str:
    """The text of generated ids as outputs have it: special tokens skipped (SamplingParams'
    default), where the tokenizer's decode keeps them (transformers' default)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def generate_one(llm: LLM, prompt, params: SamplingParams):
    """The single completion of one prompt."""
    [output] = llm.generate(prompt, params, use_tqdm=False)
    return output.outputs[0]


def random_prompts(num: int, seed: int, *, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def stop_string_in(text: str, *, length: int, min_start: int) -> tuple[int, str]:
    """(k, s): a letters-only substring s of `text` whose first occurrence starts at k >= min_start."""
    for k in range(min_start, len(text) - length + 1):
        s = text[k : k + length]
        if s.isascii() and s.isalpha() and text.find(s) == k:
            return k, s
    raise AssertionError(f"no usable stop string in {text!r}")


# ---- prompt forms and output shape ---------------------------------------------------------------


def test_single_string_prompt_gives_one_output(llm, tokenizer):
    """A bare string is one prompt; the output carries the prompt, its ids and a decoded completion."""
    outputs = llm.generate(PROMPT, greedy(max_tokens=5), use_tqdm=False)
    assert len(outputs) == 1
    output = outputs[0]
    assert output.finished
    assert output.prompt == PROMPT
    assert output.prompt_token_ids == tokenizer.encode(PROMPT)
    [completion] = output.outputs
    assert completion.index == 0
    assert len(completion.token_ids) == 5
    assert completion.text == output_text(tokenizer, completion.token_ids)
    assert completion.finish_reason == "length"


def test_prompt_forms_are_equivalent_and_outputs_keep_input_order(llm, tokenizer):
    """Strings, token-id lists and prompt dicts mean the same prompt; outputs keep input order."""
    texts = ["import os\n", "hello world", PROMPT, "class Foo:"]
    ids = [tokenizer.encode(t) for t in texts]
    alone = [generate_one(llm, t, greedy()).token_ids for t in texts]
    prompts = [texts[0], ids[1], {"prompt_token_ids": ids[2]}, {"prompt": texts[3]}]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == ids
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert [o.prompt for o in outputs] == [texts[0], None, None, texts[3]]
    # A flat list of ints is one prompt given as token ids, not several prompts.
    [single] = llm.generate(ids[2], greedy(), use_tqdm=False)
    assert single.outputs[0].token_ids == alone[2]


def test_prompt_dict_with_text_and_ids_generates_from_the_ids_and_reports_the_text(llm, tokenizer):
    """As vLLM: {"prompt": text, "prompt_token_ids": ids} generates from the ids; output.prompt is
    the text."""
    ids = tokenizer.encode("class Foo:")
    [output] = llm.generate({"prompt": "some text", "prompt_token_ids": ids}, greedy(), use_tqdm=False)
    assert (output.prompt, output.prompt_token_ids) == ("some text", ids)
    assert output.outputs[0].token_ids == generate_one(llm, [ids], greedy()).token_ids



def test_truncate_prompt_tokens_keeps_the_prompts_end(llm, tokenizer):
    """As vLLM: truncate_prompt_tokens=k generates from the last k prompt ids (so a prompt longer
    than the context can be generated from), as the truncated ids given whole do; -1 means the
    context length, which a short prompt fits untouched."""
    ids = random_prompts(1, seed=11, min_len=90, max_len=90)[0]  # longer than the context (64)
    text = tokenizer.decode(ids)
    for prompt in (ids, text):
        with pytest.raises(ValueError, match="context length"):
            llm.generate(prompt, greedy(), use_tqdm=False)
        [output] = llm.generate(prompt, greedy(truncate_prompt_tokens=20), use_tqdm=False)
        expected = (ids if prompt is ids else tokenizer.encode(text))[-20:]
        assert output.prompt_token_ids == expected
        assert output.outputs[0].token_ids == generate_one(llm, [expected], greedy()).token_ids
    [whole] = llm.generate(PROMPT, greedy(truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole.prompt_token_ids == tokenizer.encode(PROMPT)


def test_truncate_prompt_tokens_keeps_a_text_prompts_bos_as_transformers(model_dir, tmp_path):
    """A text prompt is cut before the tokenizer adds its special tokens, so its BOS stays: the ids
    are transformers' left truncation (vLLM's tokenizer truncates on the left)."""
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos_id = backend.token_to_id("<|im_start|>")
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_id)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": "<|im_start|>"}))
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(tmp_path, truncation_side="left")
    llm = LLM(tmp_path, max_model_len=MAX_MODEL_LEN)
    text = "word " * 100
    expected = hf(text, truncation=True, max_length=12).input_ids
    assert expected[0] == bos_id and len(expected) == 12
    [output] = llm.generate(text, greedy(max_tokens=3, truncate_prompt_tokens=12), use_tqdm=False)
    assert output.prompt_token_ids == expected
    assert llm.get_tokenizer().truncation_side == "left"


@pytest.mark.parametrize("value, message", [
    (0, "truncate_prompt_tokens must be >= 1, or -1"), (-2, "truncate_prompt_tokens must be >= -1"),
    (2.5, "truncate_prompt_tokens must be an integer"),
    (MAX_MODEL_LEN + 1, r"truncate_prompt_tokens \(65\) is greater than the model's context length \(64\)"),
])
def test_bad_truncate_prompt_tokens_is_a_value_error(llm, value, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, greedy(truncate_prompt_tokens=value), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

def test_per_prompt_sampling_params(llm):
    """A list of SamplingParams applies one per prompt, in order; a list of the wrong length is refused."""
    params = [greedy(max_tokens=1), greedy(max_tokens=7), greedy(max_tokens=3)]
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 7, 3]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"lengths of prompts \(2\) and sampling_params \(0\)"):
        llm.generate(["a", "b"], [], use_tqdm=False)  # not the defaults, as vLLM


@pytest.mark.parametrize("params", [[None], {"temperature": 0}, "greedy", [greedy(), 0.5]],
                         ids=["[None]", "dict", "str", "list with a float"])
def test_sampling_params_that_are_not_sampling_params_are_a_type_error(llm, params):
    """Anything but a SamplingParams (or a list of them) is a TypeError naming sampling_params."""
    prompts = ["a", "b"] if isinstance(params, list) and len(params) == 2 else ["a"]
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(prompts, params, use_tqdm=False)


def test_priority_is_one_int_or_one_per_prompt(llm):
    """priority takes an int for every prompt or a list of one int per prompt (as vLLM), in
    generate and chat; anything else is refused."""
    expected = [generate_one(llm, p, greedy(max_tokens=3)).token_ids for p in ("a", "b")]
    for priority in (0, 5, [1, 0], (0, 0)):
        outputs = llm.generate(["a", "b"], greedy(max_tokens=3), priority=priority, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    conversation = [{"role": "user", "content": "Hi"}]
    assert llm.chat(conversation, greedy(max_tokens=3), priority=1, use_tqdm=False)[0].finished
    bad = ((["x", 0], TypeError), ([0, True], TypeError), (0.5, TypeError), ([0], ValueError))
    for priority, error in bad:
        with pytest.raises(error, match="priority"):
            llm.generate(["a", "b"], greedy(), priority=priority, use_tqdm=False)


def test_default_sampling_params_come_from_generation_config(model_dir, tmp_path):
    """As vLLM's default generation_config="auto": sampling_params=None samples with the sampling
    values of generation_config.json (max_new_tokens as max_tokens; other keys ignored);
    generation_config="vllm" keeps SamplingParams()."""
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config |= {"temperature": 0.0, "repetition_penalty": 1.5, "max_new_tokens": 5, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(tmp_path, max_model_len=MAX_MODEL_LEN)
    expected = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=5)
    assert llm.get_default_sampling_params() == expected
    outputs = llm.generate(["a", PROMPT], use_tqdm=False)
    explicit = llm.generate(["a", PROMPT], expected, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) <= 5 for o in outputs)
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) <= 5
    neutral = LLM(tmp_path, max_model_len=MAX_MODEL_LEN, generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()


def test_n_completions_seeded_differ_and_reproduce(llm):
    """n=3 gives completions 0..2 that differ; with a seed they reproduce, alone or batched."""
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    [first] = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    tokens = [tuple(c.token_ids) for c in first.outputs]
    assert all(len(t) == 8 for t in tokens)
    assert len(set(tokens)) == 3
    [again] = llm.generate(PROMPT, params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == tokens
    others = SamplingParams(temperature=1.0, max_tokens=8)
    batched = llm.generate(["x = 1", PROMPT, "y = 2"], [others, params, others], use_tqdm=False)
    assert [tuple(c.token_ids) for c in batched[1].outputs] == tokens


def test_engine_seed_makes_unseeded_sampling_reproducible(model_dir):
    """As vLLM's LLM(seed=...) (default 0): a fresh engine with the same seed samples the same tokens
    for the same unseeded requests, in order; another seed samples others."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def two_samples(**seed) -> list[list[int]]:
        llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, **seed)
        return [generate_one(llm, PROMPT, params).token_ids for _ in range(2)]

    first = two_samples()
    assert first[0] != first[1]
    assert two_samples(seed=0) == first
    assert two_samples(seed=1) != first
    with pytest.raises(ValueError, match="seed"):
        LLM(model_dir, seed="0")


def test_offline_llm_runs_several_greedy_steps_at_once_unless_told(model_dir):
    """LLM's engine runs up to OFFLINE_SCHEDULER_STEPS greedy decode steps per engine step unless
    num_scheduler_steps is given or it speculates (the engine's own default, and the server's, is
    1); both give the same tokens and text, a stop string and the length limit landing inside a
    burst included."""
    default = LLM(model_dir, max_model_len=MAX_MODEL_LEN)
    single = LLM(model_dir, max_model_len=MAX_MODEL_LEN, num_scheduler_steps=1)
    assert default.engine.config.num_scheduler_steps == OFFLINE_SCHEDULER_STEPS > 1
    assert single.engine.config.num_scheduler_steps == 1
    assert EngineConfig(model=str(model_dir)).num_scheduler_steps == 1
    speculating = LLM(model_dir, max_model_len=MAX_MODEL_LEN,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert speculating.engine.config.num_scheduler_steps == 1
    probe = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = generate_one(single, PROMPT, probe).text
    stop = text[len(text) // 2 :][:2]  # a stop string met part-way through the greedy text
    for params in (probe, SamplingParams(temperature=0.0, max_tokens=13, stop=[stop]),
                   SamplingParams(temperature=0.0, max_tokens=11)):
        got, expected = generate_one(default, PROMPT, params), generate_one(single, PROMPT, params)
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids, expected.text, expected.finish_reason)


def test_greedy_is_deterministic_and_batch_invariant(llm):
    """Greedy tokens of a prompt do not depend on the call or on the other prompts in the batch."""
    prompts = random_prompts(10, seed=1)
    alone = [generate_one(llm, p, greedy()).token_ids for p in prompts]
    batched = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert generate_one(llm, prompts[4], greedy()).token_ids == alone[4]


# ---- length, eos, stop conditions ----------------------------------------------------------------


def test_max_tokens_finishes_with_length(llm):
    """max_tokens gives exactly that many tokens and finish_reason "length" with no stop_reason."""
    for max_tokens in (1, 7):
        completion = generate_one(llm, PROMPT, greedy(max_tokens=max_tokens))
        assert len(completion.token_ids) == max_tokens
        assert (completion.finish_reason, completion.stop_reason) == ("length", None)


def test_context_length_caps_the_output(llm):
    """A prompt one token short of the context length still gets its one token, ending with "length"."""
    completion = generate_one(llm, [[7] * (MAX_MODEL_LEN - 1)], greedy(max_tokens=16))
    assert len(completion.token_ids) == 1
    assert completion.finish_reason == "length"


def test_eos_stops_and_ignore_eos_continues(llm):
    """End-of-sequence ends generation with "stop" (and no text); ignore_eos generates past it."""
    prompt = [[11, 12, EOS_TRIGGER_ID]]  # the model answers <|im_end|> after EOS_TRIGGER_ID
    stopped = generate_one(llm, prompt, greedy(ignore_eos=False))
    assert stopped.token_ids == [2]
    # <|im_end|> is an end-of-sequence id of generation_config.json, not the tokenizer's own (0):
    # vLLM adds those to stop_token_ids, so it is the stop_reason; the tokenizer's EOS is none.
    assert (stopped.finish_reason, stopped.stop_reason, stopped.text) == ("stop", 2, "")
    own_eos = generate_one(llm, prompt, greedy(ignore_eos=False, logit_bias={0: 100.0}))
    assert (own_eos.token_ids, own_eos.finish_reason, own_eos.stop_reason) == ([0], "stop", None)
    # vLLM tests the tokenizer's EOS before stop_token_ids: listed there too, it is no stop_reason
    listed = generate_one(llm, prompt, greedy(ignore_eos=False, logit_bias={0: 100.0}, stop_token_ids=[0]))
    assert (listed.token_ids, listed.stop_reason) == ([0], None)
    # under ignore_eos it is no end-of-sequence, so as a stop token id it is the stop_reason
    ignoring = generate_one(llm, prompt, greedy(ignore_eos=True, logit_bias={0: 100.0}, stop_token_ids=[0]))
    assert (ignoring.token_ids, ignoring.finish_reason, ignoring.stop_reason) == ([0], "stop", 0)
    ignored = generate_one(llm, prompt, greedy(ignore_eos=True, max_tokens=6))
    assert ignored.token_ids[0] == 2
    assert len(ignored.token_ids) == 6
    assert ignored.finish_reason == "length"


def test_stop_string_is_trimmed_from_text(llm, tokenizer):
    """A stop string in the text ends generation and is cut off (kept with include_stop_str_in_output)."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=24))
    k, stop = stop_string_in(reference.text, length=4, min_start=len(reference.text) // 3)
    completion = generate_one(llm, PROMPT, greedy(max_tokens=24, stop=[stop]))
    assert completion.text == reference.text[:k]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    # It stopped at the token that completed the stop string.
    num = len(completion.token_ids)
    assert completion.token_ids == reference.token_ids[:num]
    assert stop in output_text(tokenizer, completion.token_ids)
    assert stop not in output_text(tokenizer, completion.token_ids[:-1])
    kept = generate_one(llm, PROMPT, greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))
    assert kept.text == reference.text[: k + len(stop)]
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    # Of several stop strings, the one completed first wins (here also the one starting first).
    late_k, late = stop_string_in(reference.text, length=3, min_start=k + len(stop))
    either = generate_one(llm, PROMPT, greedy(max_tokens=24, stop=[late, stop]))
    assert (either.text, either.stop_reason) == (reference.text[:k], stop)


def test_stop_string_on_last_token_reports_stop(llm):
    """A stop string completed by the max_tokens-th token still finishes with "stop" (as in vLLM)."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=5))
    stop = reference.text[-3:]
    assert reference.text.find(stop) == len(reference.text) - 3
    completion = generate_one(llm, PROMPT, greedy(max_tokens=5, stop=[stop]))
    assert completion.text == reference.text[:-3]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def first_stop_char_by_char(text: str, stops: list[str]) -> tuple[int, str]:
    """(start, stop string) of the stop that streaming `text` one character at a time meets first,
    ties going to the earlier in `stops`: the rule vLLM states (and applies to any step size)."""
    for end in range(1, len(text) + 1):
        for stop in stops:
            if text[:end].endswith(stop):
                return end - len(stop), stop
    raise AssertionError(f"none of {stops} in {text!r}")


def test_of_overlapping_stop_strings_the_one_completed_first_wins(llm):
    """Of two stop strings, the one whose end comes first ends generation even if the other starts
    earlier; with equal ends the earlier in the list wins (vLLM's rule, that of char-by-char)."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=24)).text
    k = next(k for k in range(len(reference) - 6) if reference[k : k + 6].isalpha()
             and reference.find(reference[k : k + 6]) == k
             and reference.find(reference[k + 2 : k + 4]) == k + 2)
    outer, inner, tail = reference[k : k + 6], reference[k + 2 : k + 4], reference[k : k + 4]
    for stops in ([outer, inner], [tail, inner], [inner, tail]):
        start, winner = first_stop_char_by_char(reference, stops)
        for include in (False, True):
            completion = generate_one(llm, PROMPT, greedy(max_tokens=24, stop=stops,
                                                         include_stop_str_in_output=include))
            end = start + len(winner) if include else start
            assert (completion.text, completion.stop_reason) == (reference[:end], winner), stops
    assert first_stop_char_by_char(reference, [outer, inner])[1] == inner  # the case is the overlap


def test_stop_string_may_start_inside_the_min_tokens_text(llm, tokenizer):
    """As in vLLM, a stop string counts once it ends after the text of the first min_tokens tokens,
    even if it starts inside that text."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=24))
    text, token_ids = reference.text, reference.token_ids
    for m in range(2, len(token_ids) - 1):
        head = output_text(tokenizer, token_ids[:m])
        e = len(head)
        if (text.startswith(head) and not head.endswith("\ufffd") and e >= 2
                and len(output_text(tokenizer, token_ids[: m + 1])) >= e + 2
                and text.find(text[e - 2 : e + 2]) == e - 2):
            break
    else:
        raise AssertionError(f"no usable min_tokens boundary in {text!r}")
    stop = text[e - 2 : e + 2]
    completion = generate_one(llm, PROMPT, greedy(max_tokens=24, min_tokens=m, stop=[stop]))
    assert (completion.text, completion.stop_reason) == (text[: e - 2], stop)
    assert completion.token_ids == token_ids[: m + 1]


def word_token_position(token_ids: list[int], tokenizer) -> int:
    """Position (>= 2) of the first occurrence of a token that decodes to a plain word, after text
    that decodes completely (no partial UTF-8 character before it)."""
    return next(
        i for i in range(2, len(token_ids))
        if token_ids.index(token_ids[i]) == i
        and output_text(tokenizer, token_ids[i : i + 1]).strip().isalpha()
        and not output_text(tokenizer, token_ids[:i]).endswith("\ufffd")
    )


def test_stop_token_ids_end_generation(llm, tokenizer):
    """A stop token id ends generation at its first occurrence, with stop_reason set to that id."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=24)).token_ids
    j = word_token_position(reference, tokenizer)
    completion = generate_one(llm, PROMPT, greedy(max_tokens=24, stop_token_ids=[reference[j]]))
    assert completion.token_ids == reference[: j + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", reference[j])


def test_stop_token_text_is_not_in_output(llm, tokenizer):
    """As in vLLM, a stop token's own text is not in the output text."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=24)).token_ids
    j = word_token_position(reference, tokenizer)
    completion = generate_one(llm, PROMPT, greedy(max_tokens=24, stop_token_ids=[reference[j]]))
    assert completion.text == output_text(tokenizer, reference[:j])


def test_min_tokens_suppresses_eos_and_stop_token_ids(llm):
    """Before min_tokens outputs, neither end-of-sequence nor stop token ids can be chosen."""
    eos_prompt = [[11, 12, EOS_TRIGGER_ID]]
    completion = generate_one(llm, eos_prompt, greedy(ignore_eos=False, min_tokens=3, max_tokens=8))
    assert len(completion.token_ids) >= 3
    assert not {0, 2} & set(completion.token_ids[:3])
    first = generate_one(llm, PROMPT, greedy(max_tokens=1)).token_ids[0]
    completion = generate_one(llm, PROMPT, greedy(stop_token_ids=[first], min_tokens=4, max_tokens=8))
    assert len(completion.token_ids) >= 4
    assert first not in completion.token_ids[:4]


def test_min_tokens_defers_stop_strings(llm):
    """As in vLLM, stop strings in the text of the first min_tokens tokens do not end generation."""
    reference = generate_one(llm, PROMPT, greedy(max_tokens=8))
    first_text = output_text(llm.get_tokenizer(), reference.token_ids[:1]).strip()
    assert first_text
    completion = generate_one(llm, PROMPT, greedy(max_tokens=8, min_tokens=5, stop=[first_text]))
    assert len(completion.token_ids) >= 5


# ---- logprobs ------------------------------------------------------------------------------------


def check_position(position: dict, reference, chosen: int, num_top: int, tokenizer) -> float:
    """Assert one position's logprobs match `reference` (V,) log-probabilities; return the max diff."""
    assert chosen in position
    assert num_top <= len(position) <= num_top + 1
    diff = max(abs(lp.logprob - reference[t].item()) for t, lp in position.items())
    assert diff <= LOGPROB_TOL
    top = sorted((lp.logprob for lp in position.values() if lp.rank <= num_top), reverse=True)
    assert top == pytest.approx(reference.topk(num_top).values.tolist(), abs=LOGPROB_TOL)
    assert position[chosen].rank == int((reference >= reference[chosen]).sum())
    for token, lp in position.items():
        assert lp.decoded_token == tokenizer.decode([token], skip_special_tokens=False)
    return diff


def test_sample_logprobs_match_a_dense_forward(llm, tokenizer, dense_model):
    """logprobs=3 gives the chosen token and top 3 per position, equal to a dense forward's."""
    prompts = [tokenizer.encode(PROMPT), random_prompts(1, seed=3, min_len=40, max_len=40)[0]]
    params = [greedy(max_tokens=6, logprobs=3),
              SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=3)]
    max_diff = 0.0
    for output, p in zip(llm.generate(prompts, params, use_tqdm=False), params, strict=True):
        completion = output.outputs[0]
        reference = dense_logprobs(dense_model, output.prompt_token_ids + completion.token_ids)
        first = len(output.prompt_token_ids) - 1
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for i, (position, chosen) in enumerate(zip(completion.logprobs, completion.token_ids, strict=True)):
            max_diff = max(max_diff, check_position(position, reference[first + i], chosen, 3, tokenizer))
            if p.temperature == 0:
                assert position[chosen].rank == 1
        expected = sum(reference[first + i, t].item() for i, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected, abs=6 * LOGPROB_TOL)
    print(f"sample logprobs: max |engine - dense| = {max_diff:.2e} (tolerance {LOGPROB_TOL})")


def test_prompt_logprobs_match_a_dense_forward(llm, tokenizer, dense_model):
    """prompt_logprobs=2 gives None, then per prompt token the dense forward's logprobs and top 2."""
    prompt = random_prompts(1, seed=4, min_len=45, max_len=45)[0]
    [output] = llm.generate([prompt], greedy(max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    reference = dense_logprobs(dense_model, prompt)
    assert len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    max_diff = 0.0
    for p in range(1, len(prompt)):
        position = output.prompt_logprobs[p]
        max_diff = max(max_diff, check_position(position, reference[p - 1], prompt[p], 2, tokenizer))
    print(f"prompt logprobs: max |engine - dense| = {max_diff:.2e} (tolerance {LOGPROB_TOL})")


def test_logprobs_minus_one_is_the_whole_vocabulary_as_in_vllm(model_dir, llm, tokenizer, dense_model):
    """vLLM's -1 asks for every token's logprob: past the default max_logprobs it is a ValueError
    saying so; with max_logprobs=-1 (no limit) each position has the whole vocabulary, equal to a
    dense forward's log-softmax."""
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, 8192\) exceeds the "
                                         r"engine's max_logprobs \(20\)"):
        llm.generate(PROMPT, greedy(max_tokens=2, logprobs=-1), use_tqdm=False)
    prompt = random_prompts(1, seed=6, min_len=12, max_len=12)[0]
    unlimited = LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_logprobs=-1)
    [output] = unlimited.generate([prompt], greedy(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                                  use_tqdm=False)
    completion = output.outputs[0]
    reference = dense_logprobs(dense_model, prompt + completion.token_ids)
    for p in range(1, len(prompt)):
        check_position(output.prompt_logprobs[p], reference[p - 1], prompt[p], VOCAB_SIZE, tokenizer)
    for i, (position, chosen) in enumerate(zip(completion.logprobs, completion.token_ids, strict=True)):
        check_position(position, reference[len(prompt) - 1 + i], chosen, VOCAB_SIZE, tokenizer)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1 for no limit"):
        LLM(model_dir, max_logprobs=-2)


# ---- chat ----------------------------------------------------------------------------------------


def test_chat_renders_through_the_chat_template(llm, tokenizer):
    """chat() prompts through the chat template with the generation prompt, for one or many chats."""
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    [output] = llm.chat(conversation, greedy(max_tokens=4), use_tqdm=False)
    assert output.prompt_token_ids == expected
    assert tokenizer.decode(expected, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert output.outputs[0].token_ids == generate_one(llm, [expected], greedy(max_tokens=4)).token_ids
    other = [{"role": "user", "content": "What is 2 + 2?"}]
    outputs = llm.chat([conversation, other], greedy(max_tokens=4), use_tqdm=False)
    assert outputs[1].prompt_token_ids == tokenizer.apply_chat_template(
        other, add_generation_prompt=True, return_dict=False
    )
    assert outputs[0].outputs[0].token_ids == output.outputs[0].token_ids


def chatml(*turns: tuple[str, str], generation_prompt: bool = True) -> str:
    """The tiny preset's ChatML template written out by hand."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def test_chat_reports_the_rendered_prompt_and_takes_openai_messages(llm, tokenizer):
    """As vLLM's LLM.chat: output.prompt is the rendered text; content may be a list of text parts
    (joined by newlines) and an assistant turn may have content None (as the HTTP server reads them)."""
    expected = chatml(("user", "Hi\nthere"))
    cases = {
        "string": [{"role": "user", "content": "Hi\nthere"}],
        "text parts": [{"role": "user", "content": [{"type": "text", "text": "Hi"},  # joined by "\n", as vLLM
                                                     {"type": "text", "text": "there"}]}],
    }
    for name, conversation in cases.items():
        [output] = llm.chat(conversation, greedy(max_tokens=2), use_tqdm=False)
        assert output.prompt == expected, name
        assert output.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    none = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    [output] = llm.chat(none, greedy(max_tokens=2), add_generation_prompt=False, use_tqdm=False)
    assert output.prompt == chatml(("user", "Hi"), ("assistant", ""), generation_prompt=False)
    with pytest.raises(ValueError, match="text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], use_tqdm=False)


def test_named_arguments_win_over_chat_template_kwargs_and_template_and_tools_reach_the_template(llm):
    """The named arguments win over chat_template_kwargs (vLLM's LLM.chat merges them over the
    kwargs; tools only when not None), a chat_template source replaces the tokenizer's, and tools
    reach it."""
    conversation = [{"role": "user", "content": "Hi"}]
    [output] = llm.chat(conversation, greedy(max_tokens=2), use_tqdm=False,
                        chat_template_kwargs={"add_generation_prompt": False})
    assert output.prompt == chatml(("user", "Hi"))
    [output] = llm.chat(conversation, greedy(max_tokens=2), use_tqdm=False, add_generation_prompt=False,
                        chat_template_kwargs={"add_generation_prompt": True})
    assert output.prompt == chatml(("user", "Hi"), generation_prompt=False)
    template = ("{% for t in tools or [] %}[{{ t['name'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ greeting }}")
    [output] = llm.chat(conversation, greedy(max_tokens=2), chat_template=template, use_tqdm=False,
                        tools=[{"name": "search"}], chat_template_kwargs={"greeting": "Bot:"})
    assert output.prompt == "[search]user: Hi\nBot:"


# ---- as in vLLM: the tokenizer and the engine arguments ------------------------------------------


def test_outputs_skip_special_tokens_and_get_tokenizer_decodes_as_transformers(llm, model_dir):
    """With a special token among the generated ids, the output text skips it (SamplingParams'
    default, as vLLM) or keeps it (skip_special_tokens=False), equal to transformers' decode either
    way; llm.get_tokenizer().decode keeps it by default, as transformers' decode does."""
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(model_dir)
    prompt = [[11, 12, EOS_TRIGGER_ID]]  # the model answers <|im_end|>; ignore_eos generates past it
    skipped = generate_one(llm, prompt, greedy(max_tokens=6))
    ids = skipped.token_ids
    assert ids[0] == 2
    kept = generate_one(llm, prompt, greedy(max_tokens=6, skip_special_tokens=False))
    assert kept.token_ids == ids
    assert skipped.text == hf.decode(ids, skip_special_tokens=True)
    assert kept.text == hf.decode(ids) and kept.text.startswith("<|im_end|>")
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(ids) == kept.text
    assert tokenizer.batch_decode([ids, ids[1:]]) == hf.batch_decode([ids, ids[1:]])
    assert tokenizer(PROMPT).input_ids == hf(PROMPT).input_ids == tokenizer.encode(PROMPT)


def test_vllm_engine_arguments_that_mean_what_slipstream_does_are_accepted(model_dir):
    """vLLM's LLM(...) arguments at values that mean what slipstream does anyway (one device, no
    quantization, the model's own tokenizer, chunked prefill, ...), and None where vLLM's None
    means "choose for me", build the engine config of slipstream's own arguments;
    kv_cache_memory_bytes is kv_cache_memory."""
    kv_bytes = kv_bytes_for_blocks(64, 16)
    llm = LLM(
        model_dir, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=1, pipeline_parallel_size=1,
        data_parallel_size=1, trust_remote_code=True, tokenizer=str(model_dir), tokenizer_mode="auto",
        quantization=None, kv_cache_dtype="auto", cpu_offload_gb=0, enable_chunked_prefill=True,
        disable_log_stats=True, skip_tokenizer_init=False, revision=None, tokenizer_revision=None,
        download_dir=None, max_num_seqs=None, max_num_batched_tokens=None, block_size=None,
        enable_prefix_caching=None, kv_cache_memory_bytes=kv_bytes,
    )
    expected = EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory=kv_bytes,
                            num_scheduler_steps=OFFLINE_SCHEDULER_STEPS)
    assert llm.engine.config == expected
    assert llm.engine.limits.num_blocks == 64
    assert len(generate_one(llm, PROMPT, greedy(max_tokens=3)).token_ids) == 3


UNSUPPORTED_VLLM_ARGS = {
    "pipeline_parallel_size": 2, "data_parallel_size": 2,
    "kv_cache_dtype": "fp8_inc", "cpu_offload_gb": 4,
    "enable_chunked_prefill": False, "disable_log_stats": False, "skip_tokenizer_init": True,
    "tokenizer_mode": "mistral", "trust_remote_code": "yes", "revision": "main",
    "tokenizer_revision": "v2", "download_dir": "/tmp/models", "tokenizer": "/elsewhere/tokenizer",
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_VLLM_ARGS))
def test_vllm_engine_arguments_slipstream_cannot_honour_are_value_errors(model_dir, name):
    """A vLLM argument asking for what slipstream does not do (pipeline stages, Intel's fp8 KV cache,
    unchunked prefill, a hub revision, another tokenizer, ...) is a ValueError naming it and its
    value, never silently ignored (a quantization slipstream lacks: test_quant_serving.py)."""
    value = UNSUPPORTED_VLLM_ARGS[name]
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is not supported")):
        LLM(model_dir, **{name: value})


def test_unknown_engine_arguments_are_type_errors(model_dir):
    """An argument neither slipstream's nor vLLM's is a TypeError naming it, as vLLM 0.32 raises for
    unknown engine arguments (swap_space among them: vLLM's v1 engine dropped it), with the
    closest valid name when there is one."""
    with pytest.raises(TypeError, match="'swap_space'"):
        LLM(model_dir, swap_space=4)
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(model_dir, max_num_seq=8)


@pytest.mark.parametrize("args, match", [
    (dict(max_model_len=40.0), "max_model_len must be an integer of at least 2, got 40.0"),
    (dict(max_model_len="40"), "max_model_len must be an integer"),
    (dict(kv_cache_memory=float("nan")), "kv_cache_memory must be a positive number of bytes, got nan"),
    (dict(kv_cache_memory=2**70), "kv_cache_memory of .* GiB is more than the .* GiB of memory"),
    (dict(enable_prefix_caching="false"), "enable_prefix_caching must be True or False, got 'false'"),
    (dict(enforce_eager="no"), "enforce_eager must be True or False"),
    (dict(fast_cpu_kernels=0), "fast_cpu_kernels must be True or False"),
    (dict(device="garbage"), "device must be 'cpu', 'cuda' or 'cuda:N', got 'garbage'"),
    (dict(device="meta"), "device must be 'cpu', 'cuda' or 'cuda:N'"),
    (dict(generation_config="/no/such/dir"), "generation_config '/no/such/dir' is no directory"),
    (dict(generation_config=None), "generation_config must be 'auto', 'vllm' or a directory"),
    (dict(tokenizer=1), "tokenizer=1 is not supported"),
])
def test_bad_engine_arguments_are_value_errors_naming_them(model_dir, args, match):
    """Engine arguments of the wrong type or out of range are a ValueError naming them, not a
    TypeError or AssertionError from deep inside torch, a cache the machine cannot allocate, or a
    string such as "false" read as True."""
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **args)


def test_a_model_that_is_no_local_directory_is_named_plainly(model_dir, tmp_path):
    """slipstream downloads nothing: a hub id, a missing path and a file are each said to be what
    they are, not reported as a directory lacking tokenizer.json."""
    with pytest.raises(ValueError, match=r"'meta-llama/Llama-3.2-1B' does not exist: it looks like a "
                                         r"Hugging Face hub id.*download it first"):
        LLM("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match=r"model directory '.*/missing' does not exist$"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        LLM(str(Path(model_dir) / "config.json"))
    with pytest.raises(TypeError, match="model must be the path of a model directory, got None"):
        LLM(None)


def test_generate_and_chat_options_of_the_wrong_kind_are_value_errors(llm):
    """A string where generate or chat takes a bool ("no" is truthy), malformed conversations,
    a template that is no string or does not parse, and chat_template_kwargs that would override
    the call's own arguments are ValueErrors naming them; nothing stays queued."""
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (lambda: llm.generate(PROMPT, greedy(), use_tqdm="no"), "use_tqdm must be True, False or a callable"),
        (lambda: llm.chat(messages, greedy(), add_generation_prompt="no"), "add_generation_prompt must be"),
        (lambda: llm.chat(None, greedy()), "messages must be a non-empty list of message dicts"),
        (lambda: llm.chat("hello", greedy()), "messages must be a non-empty list of message dicts"),
        (lambda: llm.chat([None], greedy()), "messages must be a non-empty list of message dicts"),
        (lambda: llm.chat([{"role": "user", "content": [{"type": "text"}]}], greedy()),
         "only text content parts"),
        (lambda: llm.chat(messages, greedy(), chat_template=5), "chat_template must be the template's"),
        (lambda: llm.chat(messages, greedy(), chat_template="{{ x"), "the chat template rejected"),
        (lambda: llm.chat(messages, greedy(), chat_template_kwargs={"tokenize": True}),
         "chat_template_kwargs cannot set tokenize"),
        (lambda: llm.chat(messages, greedy(), chat_template_kwargs=[1]), "chat_template_kwargs must be"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("args, match", [
    (dict(kv_cache_memory_bytes=2**24, kv_cache_memory=2**24), "same setting"),
    (dict(gpu_memory_utilization=0.5, kv_cache_memory_bytes=2**24), "both size the KV cache"),
    (dict(gpu_memory_utilization=0), r"fraction in \(0, 1\], got 0"),
    (dict(gpu_memory_utilization=1.5), r"fraction in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization="0.9"), r"fraction in \(0, 1\], got '0.9'"),
    (dict(gpu_memory_utilization=1e-9), r"gpu_memory_utilization=1e-09 gives .* raise it"),
], ids=["kv bytes twice", "utilization and kv bytes", "zero", "over one", "a string", "too small"])
def test_conflicting_or_bad_kv_cache_sizes_are_value_errors(model_dir, args, match):
    """The KV cache is sized one way at a time, and gpu_memory_utilization is a fraction in (0, 1]
    that leaves room for a KV cache after the weights."""
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, max_model_len=MAX_MODEL_LEN, **args)


def resident_bytes() -> int:
    """This process's resident memory, from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def test_gpu_memory_utilization_on_a_cpu_is_a_fraction_of_ram_as_in_vllm(model_dir):
    """As vLLM's CPU backend reads gpu_memory_utilization: that fraction of the machine's RAM is
    the instance's, and the KV cache gets it less the process's resident memory and the weights
    (here the safetensors file's size). The fraction aims at 16 MiB of KV cache; the process's
    memory moves a little between the test's measurement and the engine's (tolerance 2 MiB)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    weights = (model_dir / "model.safetensors").stat().st_size
    target = 16 * 2**20
    utilization = (resident_bytes() + weights + target) / total
    llm = LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=utilization)
    kv_bytes = llm.engine.limits.num_blocks * kv_bytes_for_blocks(1, 16)
    print(f"gpu_memory_utilization={utilization:.6f}: KV cache {kv_bytes / 2**20:.2f} MiB, "
          f"aimed at {target / 2**20:.0f} MiB (tolerance 2 MiB)")
    assert abs(kv_bytes - target) <= 2 * 2**20
    assert len(generate_one(llm, PROMPT, greedy(max_tokens=3)).token_ids) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_utilization_on_cuda_is_a_fraction_of_device_memory_as_in_vllm(model_dir):
    """As vLLM: gpu_memory_utilization of the GPU's total memory is the instance's, and the KV
    cache gets it less the weights (the safetensors file's size) and what torch already holds on
    the device; exact to one block."""
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved()
    weights = (model_dir / "model.safetensors").stat().st_size
    utilization = round((held + 0.1 * free) / total, 4)
    llm = LLM(model_dir, device="cuda", max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=utilization)
    block_bytes = kv_bytes_for_blocks(1, 16)
    expected = int(utilization * total) - held - weights
    kv_bytes = llm.engine.limits.num_blocks * block_bytes
    print(f"gpu_memory_utilization={utilization}: KV cache {kv_bytes / 2**30:.3f} GiB, expected "
          f"{expected / 2**30:.3f} GiB (tolerance: the safetensors header and one block)")
    assert expected - block_bytes <= kv_bytes <= expected + 2**20
    assert len(generate_one(llm, PROMPT, greedy(max_tokens=3)).token_ids) == 3


# ---- validation ----------------------------------------------------------------------------------

BAD_PROMPTS = {
    "empty string": ("", "prompt"),
    "empty token ids": ({"prompt_token_ids": []}, "prompt"),
    "filling the context": ([[5] * MAX_MODEL_LEN], "prompt.*context length"),
    "longer than the context": ("word " * 100, "prompt.*context length"),
    "dict without a prompt": ({"text": "hi"}, "prompt"),
    "token id past the vocabulary": ([[5, VOCAB_SIZE]], "prompt token id"),
    "negative token id": ([[5, -1]], "prompt token id"),
    "float token id": ([5, 6.0], "integers, got 6.0"),
    "dict with keys it would drop": ({"prompt": "hi", "multi_modal_data": {}}, "not supported"),
    "no prompts at all": (None, "prompts must be a prompt or a list of prompts"),
    "a set of prompts, in no order": ({"a", "b"}, "prompts must be a prompt or a list of prompts"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_bad_prompt_is_a_value_error(llm, case):
    """An empty prompt, one that fills the context, or an out-of-vocabulary id is a ValueError."""
    prompt, message = BAD_PROMPTS[case]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)


BAD_PROMPT_TYPES = {
    "bytes": (b"hi", "bytes"),  # a Sequence of ints, but not token ids
    "bytes in a list": ([b"hi", "ok"], "bytes"),
    "dict prompt not a string": ({"prompt": 5}, "'prompt'"),
    "dict token ids not a list": ({"prompt_token_ids": 5}, "'prompt_token_ids'"),
    "int among text prompts": (["a", 5], "token ids"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPT_TYPES))
def test_prompt_of_the_wrong_type_is_a_type_error(llm, case):
    """A prompt that is not a string, a list of token ids or a prompt dict is a TypeError saying
    which part is wrong (vLLM refuses bytes too), before anything is queued."""
    prompt, message = BAD_PROMPT_TYPES[case]
    with pytest.raises(TypeError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


BAD_PARAMS = {
    "max_tokens": dict(max_tokens=0),
    "temperature": dict(temperature=-0.5),
    "top_p": dict(top_p=0.0),
    "top_p ": dict(top_p=1.5),
    "n": dict(n=0),
    "repetition_penalty": dict(repetition_penalty=0.0),
    "repetition_penalty ": dict(repetition_penalty=1e39),  # inf in float32: NaN logits
    "temperature ": dict(temperature=1e39),  # likewise: -inf / inf is NaN
    "ignore_eos": dict(ignore_eos="false"),  # a truthy string
    "include_stop_str_in_output": dict(include_stop_str_in_output=1),
    "skip_special_tokens": dict(skip_special_tokens="no"),
    "stop": dict(stop={"a": 1}),  # not its keys
    "stop ": dict(stop={"a", "b"}),
    "n  ": dict(n=4097),  # each completion is a request, built at once
}


@pytest.mark.parametrize("name", sorted(BAD_PARAMS))
def test_bad_sampling_params_are_value_errors(name):
    """Out-of-range sampling parameters are refused when built, naming the parameter."""
    with pytest.raises(ValueError, match=name.strip()):
        SamplingParams(**BAD_PARAMS[name])


def test_numpy_scalars_are_taken_as_python_numbers():
    """NumPy scalars (what a sweep over np.linspace passes) are taken as the Python numbers they
    hold, as vLLM takes them; NaN stays refused whatever its type."""
    np = pytest.importorskip("numpy")
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), seed=np.int64(3),
                            max_tokens=np.int32(8), top_p=np.float64(0.9))
    assert (params.temperature, params.top_k, params.seed, params.max_tokens) == (0.5, 5, 3, 8)
    assert type(params.temperature) is float and type(params.top_k) is int
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.float32("nan"))


@pytest.mark.parametrize(
    "name, params",
    [("logprobs", dict(logprobs=21)), ("prompt_logprobs", dict(prompt_logprobs=21)),
     ("stop_token_ids", dict(stop_token_ids=[VOCAB_SIZE])),
     ("min_tokens", dict(max_tokens=None, min_tokens=MAX_MODEL_LEN))],
)
def test_params_beyond_engine_limits_are_value_errors(llm, name, params):
    """logprobs above max_logprobs (20), stop ids outside the vocabulary and a min_tokens the
    context cannot hold (it would silently go unmet) are refused by generate."""
    with pytest.raises(ValueError, match=name):
        llm.generate(PROMPT, greedy(**params), use_tqdm=False)


def test_min_tokens_past_the_context_with_max_tokens_runs_to_the_context(llm):
    """As vLLM: with an explicit max_tokens, a min_tokens the context cannot hold is no error; the
    completion fills the context (3 tokens here) and ends with "length"."""
    params = greedy(max_tokens=8, min_tokens=8, ignore_eos=False)
    completion = generate_one(llm, [[7] * (MAX_MODEL_LEN - 3)], params)
    assert (len(completion.token_ids), completion.finish_reason) == (3, "length")


def test_seed_minus_one_means_unseeded(llm):
    """As vLLM, seed=-1 is no seed: two samples differ (a seeded pair would be equal)."""
    params = SamplingParams(seed=-1, temperature=1.0, max_tokens=8, ignore_eos=True)
    assert params.seed is None
    first, second = (generate_one(llm, PROMPT, params).token_ids for _ in range(2))
    assert first != second


def test_n_completions_take_any_int64_seed(llm):
    """n > 1 derives completion i's seed as seed + i, wrapped into int64: the largest seed is valid,
    and its second completion samples as seed -2**63 does."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2, seed=2**63 - 1)
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    wrapped = generate_one(llm, PROMPT, params.replace(n=1, seed=-(2**63)))
    assert output.outputs[1].token_ids == wrapped.token_ids


def test_engine_recovers_after_a_failed_generate(llm):
    """After a generate fails on a bad prompt, nothing is queued or held and generation still works."""
    before = generate_one(llm, PROMPT, greedy()).token_ids
    with pytest.raises(ValueError, match="prompt token id"):
        llm.generate([PROMPT, "hello", [5, VOCAB_SIZE]], greedy(), use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    assert engine.scheduler.kv_cache.num_used_blocks == 0
    engine.scheduler.check_invariants()
    assert generate_one(llm, PROMPT, greedy()).token_ids == before


def test_out_of_range_seed_is_refused_and_engine_keeps_working(llm):
    """A seed outside the 64-bit range is a ValueError naming `seed`, and the engine still serves."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    outputs = llm.generate([[5, 6, 7]], SamplingParams(seed=2**63 - 1, max_tokens=3), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3


def test_serve_gpu_memory_utilization_flag_sizes_the_kv_cache_as_the_argument(model_dir, monkeypatch,
                                                                              capsys):
    """`slipstream serve --gpu-memory-utilization F` hands the server the KV cache vLLM's formula
    gives (aimed at 16 MiB, as above); outside (0, 1] it is a one-line error, exit status 2."""
    from slipstream import cli
    from slipstream.serve import server

    started = []
    monkeypatch.setattr(server, "run_server", lambda engine, srv, log_level: started.append(engine))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    weights = (model_dir / "model.safetensors").stat().st_size
    target = 16 * 2**20
    utilization = (resident_bytes() + weights + target) / total
    assert cli.main(["serve", str(model_dir), "--device", "cpu",
                     "--gpu-memory-utilization", repr(utilization)]) == 0
    (engine_config,) = started
    print(f"--gpu-memory-utilization {utilization:.6f}: kv_cache_memory "
          f"{engine_config.kv_cache_memory / 2**20:.2f} MiB, aimed at 16 MiB")
    assert abs(engine_config.kv_cache_memory - target) <= 2 * 2**20
    assert cli.main(["serve", str(model_dir), "--gpu-memory-utilization", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("slipstream serve: error: gpu_memory_utilization must be a fraction in "
                           "(0, 1], got 1.5")


def dense_greedy(model, prompt: list[int], num_tokens: int, *, logit_bias=None, allowed=None,
                 bad_words=()) -> list[int]:
    """Greedy decoding by dense forwards of the whole sequence, with the bias added to and the tokens
    outside `allowed` masked from each step's log-probabilities (the same argmax as the logits'), and
    the last token of each `bad_words` id sequence masked where the output ends with its others."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        scores = dense_logprobs(model, tokens)[-1].double()  # (V,)
        output = tokens[len(prompt):]
        for word in bad_words:
            if len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == list(word[:-1]):
                scores[word[-1]] = -math.inf
        for token_id, bias in (logit_bias or {}).items():
            scores[token_id] += bias
        if allowed is not None:
            keep = torch.zeros_like(scores, dtype=torch.bool)
            keep[list(allowed)] = True
            scores = scores.masked_fill(~keep, -math.inf)
        tokens.append(int(scores.argmax()))
    return tokens[len(prompt):]


def test_logit_bias_and_allowed_token_ids_match_a_dense_reference(llm, dense_model):
    """Greedy generation with logit_bias, allowed_token_ids or both equals dense greedy decoding with
    the same bias and mask; each changes the output, and no token outside the allowed set appears."""
    prompts = random_prompts(3, seed=11)
    gen = random.Random(5)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens=10), use_tqdm=False)]
    bias = {plain[0][0]: -3.0, plain[1][2]: -2.5, gen.randrange(VOCAB_SIZE): 4.0}
    allowed = gen.sample(range(VOCAB_SIZE), 7)
    for overrides in (dict(logit_bias=bias), dict(allowed_token_ids=allowed),
                      dict(logit_bias=bias, allowed_token_ids=allowed)):
        outputs = llm.generate(prompts, greedy(max_tokens=10, **overrides), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outputs]
        expected = [dense_greedy(dense_model, p, 10, logit_bias=overrides.get("logit_bias"),
                                 allowed=overrides.get("allowed_token_ids")) for p in prompts]
        assert got == expected, overrides
        assert got != plain, overrides
        if "allowed_token_ids" in overrides:
            assert all(t in allowed for tokens in got for t in tokens)


@pytest.mark.parametrize("params, match", [
    (dict(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, VOCAB_SIZE + 3]), "allowed_token_ids"),
    (dict(allowed_token_ids=[2, 3], stop_token_ids=[3], min_tokens=2, ignore_eos=False),  # 2: <|im_end|>
     "allowed_token_ids"),
])
def test_logit_bias_and_allowed_token_ids_beyond_the_engine_are_value_errors(llm, params, match):
    """Token ids outside the vocabulary are refused, and so is an allowed set that min_tokens masks
    whole (only stop tokens)."""
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPT, greedy(**params), use_tqdm=False)


def test_an_allowed_set_that_bad_words_mask_whole_is_a_value_error(llm, tokenizer):
    """Allowed tokens that are all one-token bad words leave nothing to sample: refused up front
    (the sampler would otherwise draw from all -inf logits); repeated ids are kept once."""
    token_id = next(t for t in range(3, len(tokenizer)) if tokenizer.decode([t]).strip()
                    and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    word = tokenizer.decode([token_id])
    with pytest.raises(ValueError, match=r"allowed_token_ids .* are all masked \(bad_words\)"):
        llm.generate(PROMPT, greedy(allowed_token_ids=[token_id] * 3, bad_words=[word]), use_tqdm=False)
    assert SamplingParams(allowed_token_ids=[5, 3, 5, 3, 9]).allowed_token_ids == (5, 3, 9)
    [output] = llm.generate(PROMPT, greedy(max_tokens=3, allowed_token_ids=[token_id] * 1000), use_tqdm=False)
    assert output.outputs[0].token_ids == [token_id] * 3


def test_bad_words_match_a_dense_reference(llm, tokenizer, dense_model):
    """A bad word made of two tokens the plain greedy output contains, and a one-token word, change
    the output to dense greedy decoding with vLLM's rule: each word as it begins a text and after a
    space (when that changes its first token but not its length) never completed."""
    prompts = random_prompts(3, seed=12)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens=12), use_tqdm=False)]
    words = [tokenizer.decode(plain[0][3:5]), tokenizer.decode(plain[1][:1])]
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    outputs = llm.generate(prompts, greedy(max_tokens=12, bad_words=words), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == [dense_greedy(dense_model, p, 12, bad_words=sequences) for p in prompts]
    assert got[0] != plain[0] and got[1] != plain[1]


def test_prompt_dicts_take_vllms_cache_salt(llm):
    """vLLM's TokensPrompt/TextPrompt `cache_salt`: a salted prompt hits only the prefix-cache
    blocks its own salt cached, and the tokens are those of an unsalted run."""
    ids = random_prompts(1, seed=11, min_len=40, max_len=40)[0]

    def run(**salt) -> tuple[int, list[int]]:
        [output] = llm.generate({"prompt_token_ids": ids, **salt}, greedy(max_tokens=4), use_tqdm=False)
        return output.num_cached_tokens, output.outputs[0].token_ids

    plain = run()
    first, again, other = run(cache_salt="a"), run(cache_salt="a"), run(cache_salt="b")
    assert first[0] == other[0] == 0 and again[0] == 32  # two whole blocks of 16
    assert plain[1] == first[1] == again[1] == other[1]
    with pytest.raises(ValueError, match="'multi_modal_data'"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, use_tqdm=False)
