"""Structured outputs with a reasoning parser (EngineConfig.reasoning_parser, as vLLM's): the
model thinks freely and only the answer after the reasoning is constrained. The random model is
made to write `</think>` by a logit bias on the tag's pieces (it samples them in random order
until they happen to spell it); the answers are checked with json.loads and jsonschema, a regex
and a grammar's language, against the tag found in the text by str.partition and the tokens
decoded apart; the prompt's say on whether the reply thinks follows vLLM's reading of it.
"""

from __future__ import annotations

import json
import re

import pytest
from serve_fixtures import kv_bytes_for_blocks

from slipstream import LLM, SamplingParams
from slipstream.serve.engine import EngineConfig
from slipstream.serve.fsm import ByteDFA
from slipstream.serve.reasoning_parsers import REASONING_PARSERS, ReasoningGate
from slipstream.serve.structured import Guide, StructuredOutputsParams, Vocabulary

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
QUICK_SEEDS = (7, 11)
"""Seeds under which the biased pieces spell `</think>` within about 20 tokens."""


def llm_of(model_dir, **config) -> LLM:
    defaults = {"max_model_len": 256, "block_size": 8, "kv_cache_memory": kv_bytes_for_blocks(128, 8)}
    return LLM(str(model_dir), **(defaults | config))


@pytest.fixture(scope="module")
def llms(model_dir):
    return {"plain": llm_of(model_dir), "deepseek_r1": llm_of(model_dir, reasoning_parser="deepseek_r1")}


def thinking_params(llm: LLM, structured: StructuredOutputsParams, seed: int, max_tokens: int = 240,
                    ) -> SamplingParams:
    pieces = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structured,
                          logit_bias={token_id: 30.0 for token_id in pieces})


CONSTRAINTS = [  # the constraint, and whether an answer meets it
    (StructuredOutputsParams(json=SCHEMA), lambda text: SCHEMA_CHECK(json.loads(text))),
    (StructuredOutputsParams(regex="[0-9]{2,4}"), lambda text: re.fullmatch("[0-9]{2,4}", text)),
    (StructuredOutputsParams(grammar='root ::= "yes" | "no"'), lambda text: text in ("yes", "no")),
]


def SCHEMA_CHECK(value) -> bool:  # noqa: N802 (read as the constraint it stands for)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, SCHEMA)
    return True


@pytest.mark.parametrize(("structured", "meets"), CONSTRAINTS, ids=["json", "regex", "grammar"])
@pytest.mark.parametrize("seed", QUICK_SEEDS)
def test_the_answer_after_the_reasoning_is_constrained(llms, structured, meets, seed):
    """With deepseek_r1, the reply thinks unconstrained (no JSON, nothing the constraint allows at
    its start) until `</think>`, and the text after it meets the constraint whole; the guide
    started on the token after the tag's last one. Without the parser the same request is
    constrained from its first token: the whole reply meets it."""
    if structured.grammar is not None:
        pytest.importorskip("llguidance")
    llm = llms["deepseek_r1"]
    [output] = llm.generate(["hello"], thinking_params(llm, structured, seed), use_tqdm=False)
    completion = output.outputs[0]
    reasoning, tag, answer = completion.text.partition("</think>")
    assert tag and reasoning and completion.finish_reason == "stop"
    assert not re.fullmatch(r"[\s{0-9yn].*", reasoning, re.DOTALL)  # the constraint would have refused it
    assert meets(answer)
    decode = llm.get_tokenizer().decode
    token_ids = completion.token_ids[:-1]  # less the end-of-sequence token
    ends = [k for k in range(len(token_ids) + 1) if decode(token_ids[:k]).endswith("</think>")]
    assert ends and decode(token_ids[ends[0]:]) == answer
    [plain] = llms["plain"].generate(["hello"], thinking_params(llm, structured, seed), use_tqdm=False)
    assert meets(plain.outputs[0].text)


def test_structured_outputs_enable_in_reasoning_constrains_from_the_first_token(llms, model_dir):
    """structured_outputs_enable_in_reasoning (vLLM's enable_in_reasoning) constrains the reasoning
    too: the reply is the plain engine's, token for token."""
    llm = llm_of(model_dir, reasoning_parser="deepseek_r1", structured_outputs_enable_in_reasoning=True)
    params = thinking_params(llm, StructuredOutputsParams(json=SCHEMA), QUICK_SEEDS[0], max_tokens=40)
    [inside] = llm.generate(["hello"], params, use_tqdm=False)
    [plain] = llms["plain"].generate(["hello"], params, use_tqdm=False)
    assert inside.outputs[0].token_ids == plain.outputs[0].token_ids
    json.loads(inside.outputs[0].text)


def test_a_prompt_that_ends_the_reasoning_is_constrained_from_the_first_token(llms):
    """A prompt whose last tag is `</think>` (Qwen3's template with enable_thinking false) leaves
    no reasoning to the reply, as vLLM reads the prompt: constrained from the first token, as the
    plain engine's. One whose last tag is `<think>` thinks first."""
    llm = llms["deepseek_r1"]
    params = thinking_params(llm, StructuredOutputsParams(json=SCHEMA), QUICK_SEEDS[0], max_tokens=40)
    ended = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    [gated] = llm.generate([ended], params, use_tqdm=False)
    [plain] = llms["plain"].generate([ended], params, use_tqdm=False)
    assert gated.outputs[0].token_ids == plain.outputs[0].token_ids
    [thinks] = llm.generate(["a</think>b<think>"], params, use_tqdm=False)
    assert "</think>" in thinks.outputs[0].text


def test_llm_chat_hands_enable_thinking_to_the_gate(llms, model_dir):
    """`LLM.chat(..., chat_template_kwargs={"enable_thinking": False})` under qwen3 constrains the
    reply from its first token, as the server's requests do, although the test template ignores
    the flag: the plain engine's reply, token for token. With thinking on, the reply thinks first."""
    llm = llm_of(model_dir, reasoning_parser="qwen3")
    params = thinking_params(llm, StructuredOutputsParams(json=SCHEMA), QUICK_SEEDS[0], max_tokens=40)
    messages = [{"role": "user", "content": "hello"}]
    [off] = llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    [plain] = llms["plain"].chat(messages, params, use_tqdm=False)
    assert off.outputs[0].token_ids == plain.outputs[0].token_ids
    json.loads(off.outputs[0].text)
    [on] = llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})
    assert on.outputs[0].token_ids != plain.outputs[0].token_ids


PROMPTS = [  # parser, prompt, whether the reply begins with the answer (as vLLM decides)
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜><think>\n", False),
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜>", False),
    ("deepseek_r1", "<｜Assistant｜>x</think>y<｜User｜>hi<｜Assistant｜>", True),  # the last tag decides
    ("qwen3", "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n<|im_start|>assistant\n", False),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", True),
    ("openai_gptoss", "<|start|>user<|message|>hi<|end|><|start|>assistant", False),
    ("openai_gptoss", "<|start|>assistant<|channel|>final<|message|>", True),
    ("openai_gptoss", "<|start|>assistant<|channel|>analysis<|message|>", False),
    ("openai_gptoss", "<|start|>assistant<|channel|>final<|message|>done<|end|><|start|>assistant", False),
]


@pytest.mark.parametrize(("name", "prompt", "ended"), PROMPTS)
def test_the_prompt_decides_whether_the_reply_thinks_first(name, prompt, ended):
    """As vLLM's is_reasoning_end on the prompt: the last think tag of the last turn (qwen3 stops at
    a ChatML turn marker), or for harmony whether the prompt opens a non-analysis message; qwen3
    with enable_thinking false never thinks."""
    assert REASONING_PARSERS[name]().prompt_ends_reasoning(prompt) is ended
    assert REASONING_PARSERS["qwen3"]({"enable_thinking": False}).prompt_ends_reasoning(prompt)


def test_the_token_that_ends_the_reasoning_may_begin_the_answer():
    """A token that completes the tag and carries more (a tokenizer that merges `</think>` with
    what follows) hands those bytes to the guide as the answer's first; harmony's reasoning ends
    at the final channel's `<|message|>`, and no earlier."""
    gate = ReasoningGate(REASONING_PARSERS["deepseek_r1"]())
    assert [gate.feed(piece) for piece in (b"a <", b"/th", b"ink>{\"")] == [None, None, b'{"']
    tokens = [None, *(bytes([b]) for b in range(256))]
    guide = Guide(ByteDFA(r'\{"a"\}'), Vocabulary(tokens), eos_token_ids=[0])
    assert guide.start_with(b'{"') == guide.advance(guide.advance(guide.start, ord("{") + 1), ord('"') + 1)
    assert guide.start_with(b"\n") is None  # off the constraint: only end-of-sequence remains
    harmony = ReasoningGate(REASONING_PARSERS["openai_gptoss"]())
    pieces = [b"<|channel|>", b"analysis", b"<|message|>", b"x", b"<|end|>", b"<|start|>", b"assistant",
              b"<|channel|>", b"final", b"<|message|>"]
    assert [harmony.feed(piece) for piece in pieces] == [None] * 9 + [b""]


def test_preemption_while_thinking_keeps_the_gate(model_dir, llms):
    """Requests preempted (recompute) in the middle of their reasoning, with a KV pool too small
    for them all, end as in a roomy engine: the same tokens, each answer constrained after its
    tag."""
    small = llm_of(model_dir, reasoning_parser="deepseek_r1", max_model_len=128,
                   kv_cache_memory=kv_bytes_for_blocks(16, 8))
    structured = StructuredOutputsParams(json=SCHEMA)
    # Seeds 0 and 1 think past max_tokens; seed 2, admitted last and so preempted first, ends its
    # reasoning after about 100 tokens.
    seeds = (*QUICK_SEEDS, 0, 1, 2)
    params = [thinking_params(small, structured, seed, max_tokens=110) for seed in seeds]
    prompts = ["hello"] * len(params)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    roomy = llms["deepseek_r1"].generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    finish_reasons = [o.outputs[0].finish_reason for o in outputs]
    assert finish_reasons == ["stop", "stop", "length", "length", "stop"]
    for output, reason in zip(outputs, finish_reasons, strict=True):
        if reason == "stop":
            SCHEMA_CHECK(json.loads(output.outputs[0].text.partition("</think>")[2]))


def test_an_unknown_reasoning_parser_is_a_value_error():
    """EngineConfig takes vLLM's parser names only."""
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3, openai_gptoss"):
        EngineConfig(model="m", reasoning_parser="r1")
    with pytest.raises(ValueError, match="structured_outputs_enable_in_reasoning must be True or False"):
        EngineConfig(model="m", structured_outputs_enable_in_reasoning="yes")


def test_vllms_structured_outputs_config_sets_the_engine_fields(model_dir):
    """LLM(structured_outputs_config={...}) as vLLM's: reasoning_parser and enable_in_reasoning set
    the EngineConfig fields; another key, or a field given twice, is a ValueError naming it."""
    llm = LLM(str(model_dir), max_model_len=64, structured_outputs_config={
        "reasoning_parser": "qwen3", "enable_in_reasoning": True})
    assert (llm.engine.config.reasoning_parser, llm.engine.config.structured_outputs_enable_in_reasoning) == (
        "qwen3", True)
    with pytest.raises(ValueError, match="structured_outputs_config.backend is not supported"):
        LLM(str(model_dir), structured_outputs_config={"backend": "xgrammar"})
    with pytest.raises(ValueError, match="structured_outputs_config.reasoning_parser and reasoning_parser"):
        LLM(str(model_dir), reasoning_parser="qwen3", structured_outputs_config={"reasoning_parser": "qwen3"})


@pytest.mark.parametrize("config", [{"num_scheduler_steps": 8},
                                    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
                         ids=["multi-step", "ngram"])
def test_several_tokens_per_step_leave_a_thinking_request_alone(model_dir, llms, config):
    """Beside a plain greedy request that multi-step decoding or ngram speculation would run
    several tokens at a time, a constrained request thinking and then answering gets the tokens
    of an engine without them, and the greedy one its own."""
    fast = llm_of(model_dir, reasoning_parser="deepseek_r1", **config)
    constrained = thinking_params(fast, StructuredOutputsParams(json=SCHEMA), QUICK_SEEDS[0], max_tokens=60)
    params = [constrained, SamplingParams(temperature=0, max_tokens=30)]
    outputs = fast.generate(["hello", "hello there"], params, use_tqdm=False)
    reference = [llms["deepseek_r1"].generate([prompt], p, use_tqdm=False)[0]
                 for prompt, p in zip(["hello", "hello there"], params, strict=True)]
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    SCHEMA_CHECK(json.loads(outputs[0].outputs[0].text.partition("</think>")[2]))
