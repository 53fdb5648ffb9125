"""Structured outputs (vLLM's `choice`): the guide's allowed tokens on a hand-made vocabulary, and
generation that spells one of the choices, greedy equal to a dense reference that masks by brute
force."""

from __future__ import annotations

import pytest
import torch
from serve_fixtures import dense_logprobs

from slipstream import LLM, SamplingParams
from slipstream.serve.structured import ChoiceGuide, StructuredOutputsParams, Vocabulary

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

EURO = "€"  # three bytes: e2 82 ac
TOKENS = [None, b"a", b"b", b"ab", b"abc", b"c", b"\xe2", b"\x82\xac", b"x", b"\xe2\x82"]
EOS = 0


def guide(*choices: str) -> ChoiceGuide:
    return ChoiceGuide(choices, Vocabulary(TOKENS), eos_token_ids=[EOS])


def walk(g: ChoiceGuide, token_ids: list[int]):
    state = g.root
    for token_id in token_ids:
        state = g.advance(state, token_id)
    return state


def test_allowed_tokens_keep_the_output_on_a_choice():
    """At each point the allowed tokens are exactly those whose bytes continue some choice, with
    end-of-sequence where a choice is complete; a multi-byte character may be split over tokens."""
    g = guide("ab", "abc", EURO)
    # a, ab, abc, e2 (then 82 ac); not e2 82, after which no token spells the last byte, ac
    assert g.allowed_token_ids(g.root) == [1, 3, 4, 6]
    assert g.allowed_token_ids(walk(g, [1])) == [2]  # "a" -> "b"
    assert g.allowed_token_ids(walk(g, [3])) == [EOS, 5]  # "ab" is complete, or "c" follows
    assert g.allowed_token_ids(walk(g, [4])) == [EOS]
    assert g.allowed_token_ids(walk(g, [6])) == [7]  # e2 -> 82 ac
    assert walk(g, [1, 2]) is walk(g, [3])  # the same node, however it was spelt
    assert walk(g, [3, EOS]) is None and g.allowed_token_ids(None) == [EOS]


def test_choices_no_token_can_finish_are_never_started():
    """A choice whose last byte no token spells is left out from its first token; if none is
    left, the guide is a ValueError."""
    g = guide("ay", "x")
    assert g.allowed_token_ids(g.root) == [8]
    with pytest.raises(ValueError, match="no choice can be spelt"):
        guide("ay", "cy")


@pytest.mark.parametrize("params, message", [
    (dict(regex="[a-z]+"), "structured_outputs.regex is not supported"),
    (dict(json={"type": "object"}), "structured_outputs.json is not supported"),
    (dict(), "structured_outputs needs choice"),
    (dict(choice=[]), "non-empty list of non-empty strings"),
    (dict(choice="yes"), "non-empty list of non-empty strings"),
    (dict(choice=["yes", ""]), "non-empty list of non-empty strings"),
])
def test_bad_structured_outputs_are_value_errors(params, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**params)


@pytest.mark.parametrize("conflict", [dict(ignore_eos=True), dict(min_tokens=2), dict(allowed_token_ids=[5])])
def test_structured_outputs_conflicts_are_value_errors(conflict):
    with pytest.raises(ValueError, match="cannot be used with structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]), **conflict)


CHOICES = ["positive", "negative", "neutral 😀", "positively", "no"]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=128, num_scheduler_steps=4)


def dense_guided_greedy(model, tokenizer, prompt: list[int], choices: list[str], eos_ids, max_tokens: int):
    """Greedy decoding of a dense forward where each step allows, by brute force over the
    vocabulary, the tokens whose bytes keep the output a prefix of some choice's, and
    end-of-sequence once it equals one."""
    targets = [choice.encode() for choice in choices]
    specials = {t for t, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    token_bytes = [b"" if t in specials else tokenizer.token_bytes(t) for t in range(len(tokenizer))]
    output, spelt = [], b""
    for _ in range(max_tokens):
        allowed = [t for t, data in enumerate(token_bytes)
                   if data and any(target.startswith(spelt + data) for target in targets)]
        if spelt in targets:
            allowed += list(eos_ids)
        logprobs = dense_logprobs(model, prompt + output)[-1]
        token = allowed[int(logprobs[allowed].argmax())]
        output.append(token)
        if token in eos_ids:
            break
        spelt += token_bytes[token]
    return output


def test_greedy_choice_equals_a_dense_brute_force_reference(llm, dense_model):
    tokenizer = llm.get_tokenizer()
    structured = StructuredOutputsParams(choice=CHOICES)
    prompts = ["Review: good. Sentiment:", "x", "def f(): return"]
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=structured)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        [completion] = output.outputs
        expected = dense_guided_greedy(dense_model, tokenizer, tokenizer.encode(prompt), CHOICES,
                                       set(llm.engine.limits.eos_token_ids), 20)
        assert completion.token_ids == expected
        assert completion.text in CHOICES and completion.finish_reason == "stop"


def test_sampled_outputs_are_always_a_choice(llm):
    """Sampling at a high temperature over many seeds (n choices each) only ever spells choices, and
    reaches more than one of them."""
    params = SamplingParams(temperature=2.0, seed=3, n=8, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
    assert {c.finish_reason for o in outputs for c in o.outputs} == {"stop"}
    truncated = llm.generate("a", params.replace(max_tokens=1, n=1), use_tqdm=False)[0].outputs[0]
    assert truncated.finish_reason in ("length", "stop")
    assert any(choice.startswith(truncated.text) for choice in CHOICES)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    assert torch.get_num_threads() == 1
