"""The OpenAI-compatible server as the official `openai` client drives it: completions and chat,
streamed and not, n, stop strings, logprobs, usage, auth, /v1/models and /metrics; greedy output
equal to the offline `LLM`'s for the same model and prompt.

One real server process (tests/server_process.py) serves the tests here over the small model of
serve_fixtures.py; a test of a flag serves its own command line on a thread of the test's process
(`serve_in_process`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import shutil

import httpx
import openai
import pytest
from serve_fixtures import dense_logprobs
from server_process import (
    API_KEY,
    ENGINE_ARGS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    metric_values,
    serve_in_process,
    wait_for_idle,
)

from slipstream import LLM, BeamSearchParams, SamplingParams
from slipstream.serve import json_schema, protocol, responses
from slipstream.serve.request import CompletionOutput, RequestMetrics, RequestOutput
from slipstream.serve.server import ServerConfig
from slipstream.serve.structured import StructuredOutputsParams

pytest_plugins = ["serve_fixtures", "server_process"]

PROMPT = "def fib(n):"
MESSAGES = [{"role": "user", "content": "Write a haiku about caches."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """The offline engine over the same model and context length as the server."""
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, block_size=8)


def greedy(max_tokens: int = 16, **overrides) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **overrides)


def test_models_lists_the_served_model(client, model_dir):
    """/v1/models names the served model and its context length, with vLLM's `root` (the model's
    path: vLLM's bench client reads it), `parent` and `permission`."""
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert (models[0].root, models[0].parent) == (str(model_dir), None)
    assert models[0].permission[0]["allow_sampling"] is True
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.models.retrieve("no-such-model")


def test_greedy_completion_equals_offline_generate(client, llm):
    """Greedy text through the server equals `LLM.generate` on the same prompt, text or token ids."""
    [expected] = llm.generate(PROMPT, greedy(24), use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 24
    by_ids = client.completions.create(model=MODEL_NAME, prompt=expected.prompt_token_ids, max_tokens=24,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected.outputs[0].text


def test_greedy_chat_equals_offline_chat(client, llm):
    """A greedy chat reply through the server equals `LLM.chat` (same chat template)."""
    [expected] = llm.chat(MESSAGES, greedy(20), use_tqdm=False)
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=20,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 20


def test_logit_bias_allowed_token_ids_and_bad_words_equal_offline(client, llm):
    """OpenAI's logit_bias (string token ids, values clamped to [-100, 100]) and vLLM's
    allowed_token_ids and bad_words give the offline engine's output for the same values."""
    [plain] = llm.generate(PROMPT, greedy(12), use_tqdm=False)
    first, second = plain.outputs[0].token_ids[:2]
    bias = {first: -100.0, second: 100.0}
    [expected] = llm.generate(PROMPT, greedy(12, logit_bias=bias), use_tqdm=False)
    assert expected.outputs[0].token_ids == [second] * 12
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                         logit_bias={str(first): -500, str(second): 100},
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected.outputs[0].text
    allowed = [first, second, 300, 301]
    [expected] = llm.chat(MESSAGES, greedy(12, allowed_token_ids=allowed), use_tqdm=False)
    assert set(expected.outputs[0].token_ids) <= set(allowed)
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12,
                                              temperature=0,
                                              extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert response.choices[0].message.content == expected.outputs[0].text
    bad_words = [llm.get_tokenizer().decode(plain.outputs[0].token_ids[:1])]  # the first token's word
    [expected] = llm.generate(PROMPT, greedy(12, bad_words=bad_words), use_tqdm=False)
    assert expected.outputs[0].token_ids != plain.outputs[0].token_ids
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True, "bad_words": bad_words})
    assert response.choices[0].text == expected.outputs[0].text



def test_truncation_side_right_keeps_the_prompts_first_tokens(client, llm):
    """vLLM's truncation_side on the generation routes: "right" keeps the first k ids, the default
    ("left") the last k, as the echoed prompt shows."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta")
    assert len(prompt) > 6
    for extra, kept in (({}, prompt[-3:]), ({"truncation_side": "right"}, prompt[:3])):
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, echo=True,
                                             extra_body={"truncate_prompt_tokens": 3, **extra})
        assert response.usage.prompt_tokens == 3
        assert response.choices[0].text.startswith(tokenizer.decode(kept))


def test_truncate_prompt_tokens_equals_offline(client, llm):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context, cut to its last k tokens,
    gives the offline engine's output from those k (and usage counts k), for completions and chat;
    one past the context length is a 400 naming it."""
    tokenizer = llm.get_tokenizer()
    text = "def f(x):\n    return x\n" * 60
    assert len(tokenizer.encode(text)) > MAX_MODEL_LEN
    [expected] = llm.generate(text, greedy(8, truncate_prompt_tokens=30), use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "truncate_prompt_tokens": 30})
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage.prompt_tokens == 30
    messages = [{"role": "user", "content": text}]
    [expected] = llm.chat(messages, greedy(8, truncate_prompt_tokens=40), use_tqdm=False)
    assert len(expected.prompt_token_ids) == 40
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 40})
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == 40
    for value in (MAX_MODEL_LEN + 1, 0):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": value})
        assert error.value.body["param"] == "truncate_prompt_tokens"

def test_streamed_completion_adds_up_to_the_whole(client):
    """Streamed text chunks concatenate to the non-streamed text; include_usage adds a final usage
    chunk with no choices; the last choice chunk carries the finish reason."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "n": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}),
])
def test_streamed_usage_is_null_on_chunks_or_running_with_continuous_usage_stats(server, path, body):
    """With include_usage every chunk but the last has `usage: null` (OpenAI's documented shape;
    the key was missing); with vLLM's continuous_usage_stats too, each chunk carries its choice's
    prompt tokens and the tokens generated so far, up to the choice's whole count."""
    body = body | {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def chunks(options: dict) -> list[dict]:
        response = httpx.post(server.url + path, json=body | {"stream_options": options}, headers=headers,
                              timeout=60)
        lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    final = chunks({"include_usage": True})
    assert all("usage" in c and c["usage"] is None for c in final[:-1]) and final[-1]["choices"] == []
    running = chunks({"include_usage": True, "continuous_usage_stats": True})
    prompt_tokens = final[-1]["usage"]["prompt_tokens"]  # one prompt, counted once
    generated = {}
    for chunk in running[:-1]:
        [choice] = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= generated.get(choice["index"], 0)
        generated[choice["index"]] = usage["completion_tokens"]
    assert generated == {0: 6, 1: 6}
    # The same counts (the second request's prompt hits the prefix cache: its cached tokens differ).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [running[-1]["usage"][k] for k in counts] == [final[-1]["usage"][k] for k in counts]


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field): none the first time a long
    prompt is seen, its whole blocks the second time (the last token is always computed)."""
    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 4
    args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0


def test_cache_salt_keeps_cached_prompt_blocks_to_requests_of_the_same_salt(client):
    """vLLM's cache_salt: a salted prompt finds none of the blocks an unsalted or differently
    salted request cached, and all of those its own salt's did; a salt vLLM refuses is a 400, and
    so is a priority on a server that schedules first come, first served."""
    prompt = "class Tree:\n    def __init__(self, left, right):\n        self.left = left\n" * 4
    args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)

    def cached(**extra) -> int:
        return client.completions.create(**args, extra_body=extra).usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached(cache_salt="tenant-a") == 0 and cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") == cached(cache_salt="tenant-b") == cached() > 0
    for salt in ("", "a/b", "x" * 129):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(**args, extra_body={"cache_salt": salt})
        assert error.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as error:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       extra_body={"priority": 1})
    assert error.value.body["param"] == "priority"


def test_priority_server_takes_the_priority_field(model_dir):
    """`--scheduling-policy priority` takes vLLM's per-request `priority` (the order it gives is
    tested on the engine loop: test_server_engine_loop.py)."""
    with serve_in_process(model_dir, "--scheduling-policy", "priority", *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for priority in (-3, 0, 7):
            response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                                 extra_body={"priority": priority})
            assert response.usage.completion_tokens == 2


def test_streamed_chat_sends_role_then_content(client):
    """A streamed chat reply opens with the assistant role and adds up to the non-streamed one."""
    args = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].object == "chat.completion.chunk"


def test_n_completions_are_seeded_and_indexed(client):
    """n=3 sampled completions come back as choices 0..2, reproducible under a seed, and
    usage counts all of their tokens."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7,
                extra_body={"ignore_eos": True})
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24
    streamed = list(client.completions.create(stream=True, **args))
    for index in range(3):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == index)
        assert text == first.choices[index].text


def test_n_completions_take_the_largest_seed(client):
    """A seed at the top of the int64 range is valid for every n (each completion's own seed wraps)."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=2**63 - 1)
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_chat_continues_the_final_message(client, llm):
    """vLLM's continue_final_message (with add_generation_prompt false) continues the final
    assistant message, as `LLM.chat` does, from the prompt transformers would render; with echo
    the reply starts with that message."""
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one two"}]
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.apply_chat_template(messages, continue_final_message=True, return_dict=False)
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith("one two")
    [expected] = llm.chat(messages, greedy(12), use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True)
    assert expected.prompt_token_ids == prompt_ids
    extra = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=12,
                                              temperature=0, extra_body=extra)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(prompt_ids)
    # vLLM's chat echo: the reply starts with the message it continues, streamed or not.
    args = dict(model=MODEL_NAME, messages=messages, max_completion_tokens=12, temperature=0,
                extra_body=extra | {"echo": True})
    echoed = client.chat.completions.create(n=2, **args)
    assert [c.message.content for c in echoed.choices] == ["one two" + expected.outputs[0].text] * 2
    assert echoed.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.choices[0].message.content
    [expected] = llm.chat(MESSAGES, greedy(4), use_tqdm=False)
    new_reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4,
                                               temperature=0, extra_body={"echo": True, "ignore_eos": True})
    assert new_reply.choices[0].message.content == expected.outputs[0].text  # nothing to echo
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=1,
                                           extra_body={"add_generation_prompt": False})
    no_generation_prompt = tokenizer.apply_chat_template(messages, return_dict=False)
    assert plain.usage.prompt_tokens == len(no_generation_prompt)


def test_batch_of_prompts(client):
    """A list of prompts (text or token ids) answers choices in prompt order, n per prompt."""
    response = client.completions.create(model=MODEL_NAME, prompt=["one", "two two"], max_tokens=4, n=2,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: n copies agree
    assert response.usage.completion_tokens == 16
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                       temperature=0)
    assert by_ids.usage.prompt_tokens == 5 and len(by_ids.choices) == 2


def test_stop_string_ends_the_text(client):
    """A stop string cuts the text before it, finish_reason "stop", streamed or not."""
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:13]
    expected = full[: full.index(stop)]
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"],
                extra_body={"ignore_eos": True})
    response = client.completions.create(**args)
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    """Completions logprobs: one entry per token, the sampled token's logprob is in its top list,
    top lists hold the requested number (plus the sampled token when it is not among them)."""
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logprobs=3, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    positions = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for token, logprob, top in positions:
        assert 3 <= len(top) <= 4 and logprob <= 0
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is the top one
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_prompt_logprobs_are_a_dense_forwards(client, dense_model):
    """vLLM's prompt_logprobs extension: per prompt position (None for the first) the prompt
    token's logprob and rank and the top alternatives, equal to log_softmax of a plain dense
    forward over the prompt; in completions per choice, in chat at the top level; refused when
    streaming (as vLLM does) and above the server's max_logprobs."""
    prompt = [11, 205, 7, 311, 42, 9, 88]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, n=2,
                                         extra_body={"prompt_logprobs": 2})
    expected = dense_logprobs(dense_model, prompt)  # (T, V): row p predicts token p + 1
    for choice in response.choices:
        positions = choice.model_extra["prompt_logprobs"]
        assert len(positions) == len(prompt) and positions[0] is None
        for p, position in enumerate(positions[1:], start=1):
            row = expected[p - 1]
            top = row.topk(2).indices.tolist()
            assert set(position) == {str(t) for t in [prompt[p], *top]}
            for token_id, entry in position.items():
                assert entry["logprob"] == pytest.approx(row[int(token_id)].item(), abs=1e-4)
                assert entry["rank"] == int((row > row[int(token_id)]).sum()) + 1
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    positions = chat.model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == chat.usage.prompt_tokens
    assert all(len(position) == 1 for position in positions[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 1000})



def test_echo_scores_the_prompt_as_a_dense_forward(client, llm, dense_model):
    """OpenAI's echo with max_tokens 0 and logprobs (how lm-evaluation-harness scores a text
    through a completions server): the choice is the prompt alone, its first token without a
    logprob, every other token with log_softmax of a dense forward, its text offsets adding up to
    the text, no completion tokens counted. With max_tokens > 0 the generated text and logprobs
    follow the prompt's, equal to the non-echoed completion's; streamed chunks add up to the
    same."""
    tokenizer = llm.get_tokenizer()
    prompt = [11, 205, 7, 311, 42, 9, 88]
    expected = dense_logprobs(dense_model, prompt)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True,
                                         logprobs=1, temperature=0)
    [choice] = response.choices
    assert choice.text == tokenizer.decode(prompt) and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(prompt)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert logprobs.token_logprobs[p] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=1e-4)
        assert logprobs.top_logprobs[p][logprobs.tokens[p]] == pytest.approx(logprobs.token_logprobs[p])
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:p])) for p in range(len(prompt))]

    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0]
    echoed = client.completions.create(echo=True, **args)
    choice = echoed.choices[0]
    num_prompt = echoed.usage.prompt_tokens
    assert echoed.usage.completion_tokens == 6
    assert choice.text == PROMPT + plain.text
    assert choice.logprobs.tokens[num_prompt:] == plain.logprobs.tokens
    assert choice.logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.logprobs.token_logprobs)
    assert choice.logprobs.text_offset[num_prompt] == len("".join(choice.logprobs.tokens[:num_prompt]))
    chunks = [c for c in client.completions.create(echo=True, stream=True, **args) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == choice.logprobs.tokens
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == choice.logprobs.text_offset
    without_logprobs = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "x = 1"], max_tokens=3,
                                                 temperature=0, echo=True, n=2)
    assert [c.text[:len(PROMPT)] for c in without_logprobs.choices[:2]] == [PROMPT] * 2
    assert [c.text[:5] for c in without_logprobs.choices[2:]] == ["x = 1"] * 2
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert error.value.body["param"] == "max_tokens"


def test_return_tokens_as_token_ids_names_tokens_by_id(client, llm):
    """vLLM's return_tokens_as_token_ids: logprobs tokens (and top-logprob keys) read
    "token_id:{id}" for the ids the offline engine generates, in completions and chat; the texts,
    offsets and bytes stay those of the tokens."""
    [offline] = llm.generate(PROMPT, greedy(5), use_tqdm=False)
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    plain = client.completions.create(extra_body={"ignore_eos": True}, **args).choices[0]
    named = client.completions.create(
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **args).choices[0]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in offline.outputs[0].token_ids]
    assert named.text == plain.text and named.logprobs.text_offset == plain.logprobs.text_offset
    for token, top in zip(named.logprobs.tokens, named.logprobs.top_logprobs, strict=True):
        assert token in top and all(re.fullmatch(r"token_id:\d+", key) for key in top)
    chat_args = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                     top_logprobs=2)
    [offline] = llm.chat(MESSAGES, greedy(5), use_tqdm=False)
    plain = client.chat.completions.create(extra_body={"ignore_eos": True}, **chat_args).choices[0]
    named = client.chat.completions.create(
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **chat_args).choices[0]
    expected_names = [f"token_id:{t}" for t in offline.outputs[0].token_ids]
    assert [e.token for e in named.logprobs.content] == expected_names
    for plain_entry, entry in zip(plain.logprobs.content, named.logprobs.content, strict=True):
        assert entry.bytes == plain_entry.bytes
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token ranks first
        assert all(re.fullmatch(r"token_id:\d+", top.token) for top in entry.top_logprobs)

def test_chat_logprobs(client):
    """Chat logprobs: per token its logprob, bytes and exactly top_logprobs alternatives by rank."""
    args = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**args).choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    streamed = list(client.chat.completions.create(stream=True, **args))
    streamed_content = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                        for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed_content] == [e.token for e in content]


def test_chat_logprob_bytes_rebuild_the_reply(client):
    """A token that holds part of a multi-byte character has the text U+FFFD but its own bytes,
    so the bytes of all tokens join to the reply's UTF-8 (why OpenAI sends them)."""
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=1.5, seed=2, logprobs=True,
        extra_body={"ignore_eos": True}).choices[0]
    raw = b"".join(bytes(entry.bytes) for entry in choice.logprobs.content)
    assert raw.decode(errors="replace") == choice.message.content


def test_auth(server, client):
    """With --api-key, /v1 needs the bearer token (401 without it or with a wrong one, in OpenAI's
    error shape); /health and /metrics stay open."""
    for key in ("wrong-key", ""):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as error:
            bad.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        assert error.value.status_code == 401
        assert error.value.body["code"] == "invalid_api_key"
    response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT})
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_metrics_count_requests_and_kv_returns_to_zero(server, client):
    """/metrics has vLLM's metric names under slipstream:, counts prompt and generated tokens and
    finished requests by reason, and shows no KV blocks held once requests are done."""
    before = metric_values(server)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metric_values(server)
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert "slipstream:" + name in after, name
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["slipstream:generation_tokens_total"] == 10
    assert delta["slipstream:prompt_tokens_total"] > 0
    assert delta["slipstream:request_success_total:length"] == 1
    assert delta["slipstream:inter_token_latency_seconds_count"] == 9
    assert after["slipstream:kv_cache_usage_perc"] == 0
    assert after["slipstream:kv_cache_used_blocks"] == 0
    assert after["slipstream:num_requests_running"] == 0


def test_streamed_text_offsets_equal_the_non_streamed(client):
    """Streamed completions logprobs have the non-streamed text_offset, increasing, also while text is
    held back as a possible stop-string start (offsets used to follow the text sent so far, which
    lags the tokens sent: they stepped back, 37 then 34)."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=1,
                stop=["\x01" * 8], extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args)]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    assert whole.text_offset == sorted(whole.text_offset)


def test_multi_step_server_streams_bursts_of_the_same_text(model_dir, llm):
    """A server running greedy decodes four steps at once (--num-scheduler-steps 4) streams the
    offline engine's text in fewer, larger chunks, trims a stop string met inside a burst, counts
    every generated token in /metrics and holds no KV blocks afterwards."""
    with serve_in_process(model_dir, "--num-scheduler-steps", "4", *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        [expected] = llm.generate(PROMPT, greedy(21), use_tqdm=False)
        args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=21, temperature=0,
                    extra_body={"ignore_eos": True})
        chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == expected.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len(chunks) <= 1 + 5 + 1  # the prefill's token, five bursts (4 x 5), the finish
        text = expected.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        response = client.completions.create(**args, stop=[stop])
        stopped = response.choices[0]
        assert (stopped.text, stopped.finish_reason) == (text[: text.find(stop)], "stop")
        values = wait_for_idle(server)
        assert values["slipstream:generation_tokens_total"] == 21 + response.usage.completion_tokens
        assert values["slipstream:request_success_total:length"] == 1
        assert values["slipstream:kv_cache_used_blocks"] == 0


def test_unset_sampling_fields_take_the_generation_config_defaults(model_dir, llm, tmp_path):
    """As vLLM, what a request leaves unset is sampled as the model's generation_config.json says:
    with its top_k of 1 a sampled chat reply is the greedy one, and it has the config's
    max_new_tokens; a request's own top_k still wins."""
    shutil.copytree(model_dir, tmp_path / "model")
    config_path = tmp_path / "model" / "generation_config.json"
    config = json.loads(config_path.read_text()) | {"top_k": 1, "max_new_tokens": 6}
    config_path.write_text(json.dumps(config))
    with serve_in_process(tmp_path / "model", *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        [expected] = llm.chat(MESSAGES, greedy(6), use_tqdm=False)
        reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=3,
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 6
        assert reply.choices[0].message.content == expected.outputs[0].text
        texts = {client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True, "top_k": -1}).choices[0].message.content for seed in range(4)}
        assert len(texts) > 1


def test_return_tokens_as_token_ids_flag_sets_the_servers_default(model_dir, llm):
    """`slipstream serve --return-tokens-as-token-ids` names tokens by id for requests that do not
    say, as vLLM's flag does; a request's own false still gets the tokens' text."""
    with serve_in_process(model_dir, "--return-tokens-as-token-ids", *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        [expected] = llm.generate(PROMPT, greedy(4), use_tqdm=False)
        args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
        named = client.completions.create(extra_body={"ignore_eos": True}, **args).choices[0]
        assert named.logprobs.tokens == [f"token_id:{t}" for t in expected.outputs[0].token_ids]
        texts = client.completions.create(
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False}, **args).choices[0]
        assert "".join(texts.logprobs.tokens) == expected.outputs[0].text


def test_beam_search_equals_offline(client, llm):
    """vLLM's use_beam_search: the n choices are the offline `LLM.beam_search`'s best n beams, best
    first, their generated text (no end-of-sequence token) and tokens' logprobs; streamed, the
    same choices arrive whole; in chat too. A temperature is taken and changes no beam, as in
    vLLM, where it only sets the unused sampling of each step; fields beam search cannot honour
    are a 400."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    [expected] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    texts = []
    for beam in expected.sequences:
        generated = beam.tokens[len(prompt):]
        texts.append(tokenizer.decode(generated[:-1] if beam.finish_reason == "stop" else generated,
                                      skip_special_tokens=True))
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3, logprobs=1,
                extra_body={"use_beam_search": True, "length_penalty": 0.5})
    response = client.completions.create(**args)
    assert [c.text for c in response.choices] == texts
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, beam in zip(response.choices, expected.sequences, strict=True):
        assert choice.finish_reason == beam.finish_reason
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-3)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens == sum(len(b.tokens) - len(prompt) for b in expected.sequences)
    chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
    assert sorted((c.choices[0].index, c.choices[0].text) for c in chunks) == list(enumerate(texts))

    [expected] = llm.beam_search([tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                return_dict=False)],
                                 BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, n=2,
                                          extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.message.content for c in chat.choices] == [
        tokenizer.decode(b.tokens[-5:], skip_special_tokens=True) for b in expected.sequences]

    with_temperature = client.completions.create(**args | {"temperature": 0.7})  # as vLLM: no beam changes
    assert [c.text for c in with_temperature.choices] == texts
    refused = {"top_p": 0.5, "stop": ["x"], "n": 11, "echo": True}
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                      extra_body={"use_beam_search": True, name: value})
        assert error.value.body["param"] == name
    with pytest.raises(openai.BadRequestError, match="length_penalty applies only with use_beam_search"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                  extra_body={"length_penalty": 2.0})


def test_structured_outputs_equal_offline(client, llm):
    """vLLM's structured_outputs {"choice": [...]}, {"regex": ...}, {"json": schema} or
    {"json_object": true}, the older guided_choice, guided_regex and guided_json, and OpenAI's
    response_format give the offline engine's output, greedy and seeded; the constraints slipstream
    cannot compile are a 400."""
    choices = ["positive", "negative", "neutral"]
    structured = StructuredOutputsParams(choice=choices)
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=structured)
    [greedy_output] = llm.generate(PROMPT, params, use_tqdm=False)
    [sampled] = llm.generate(PROMPT, params.replace(temperature=1.5, seed=5), use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                         extra_body={"structured_outputs": {"choice": choices}})
    assert response.choices[0].text == greedy_output.outputs[0].text
    assert response.choices[0].finish_reason == "stop"
    seeded = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=1.5,
                                       seed=5, extra_body={"guided_choice": choices})
    assert seeded.choices[0].text == sampled.outputs[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, n=4,
                                          temperature=1.5, extra_body={"guided_choice": choices})
    assert {c.message.content for c in chat.choices} <= set(choices)
    pattern = r"[a-z]{2,6}-[0-9]{1,3}"
    regex = StructuredOutputsParams(regex=pattern)
    [expected] = llm.generate(PROMPT, params.replace(structured_outputs=regex), use_tqdm=False)
    assert re.fullmatch(pattern, expected.outputs[0].text)
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                             extra_body=body)
        assert response.choices[0].text == expected.outputs[0].text
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | "(" expr ")" "+" expr'
    grammar_params = params.replace(max_tokens=20,
                                    structured_outputs=StructuredOutputsParams(grammar=grammar))
    [expected] = llm.generate(PROMPT, grammar_params, use_tqdm=False)
    for body in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                             extra_body=body)
        assert response.choices[0].text == expected.outputs[0].text
        assert response.choices[0].text.startswith("(")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for structured, bodies in (
            (StructuredOutputsParams(json=schema), (
                {"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)},
                {"response_format": json_schema})),
            (StructuredOutputsParams(json_object=True), (
                {"structured_outputs": {"json_object": True}},
                {"response_format": {"type": "json_object"}}))):
        [expected] = llm.chat(MESSAGES, params.replace(max_tokens=30, structured_outputs=structured),
                              use_tqdm=False)
        for body in bodies:
            chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                                  max_completion_tokens=30, extra_body=body)
            assert chat.choices[0].message.content == expected.outputs[0].text, body
    for body, param in (({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
                        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
                        ({"structured_outputs": {"choices": choices}}, "structured_outputs"),
                        ({"guided_choice": []}, None),
                        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
                        ({"guided_regex": "(?=a)"}, "guided_regex"),
                        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                         "response_format"),
                        ({"response_format": {"type": "yaml"}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body=body)
        if param is not None:
            assert error.value.body["param"] == param, body


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}


def constrained(max_tokens: int, schema: dict) -> SamplingParams:
    """Greedy under a JSON schema, stopping at end-of-sequence."""
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=schema))


def test_named_tool_choice_calls_the_function_with_constrained_arguments(client, llm):
    """vLLM's named tool_choice: the reply is a call of that function, its arguments the offline
    engine's output under the function's parameter schema (so valid under it), content null,
    finish reason "stop"; streamed, the first chunk names the call and the arguments follow. Cut
    short by max_tokens, the call holds the arguments so far in both forms (as vLLM)."""
    jsonschema = pytest.importorskip("jsonschema")
    parameters = WEATHER["function"]["parameters"]
    for max_tokens, finish_reason in ((40, "stop"), (4, "length")):
        [expected] = llm.chat(MESSAGES, constrained(max_tokens, parameters), tools=[WEATHER, PICK],
                              use_tqdm=False)
        args = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, PICK], temperature=0,
                    max_completion_tokens=max_tokens,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = client.chat.completions.create(**args).choices[0]
        [call] = choice.message.tool_calls
        assert (call.function.name, call.type, choice.message.content) == ("get_weather", "function", None)
        assert call.function.arguments == expected.outputs[0].text and call.id.startswith("chatcmpl-tool-")
        assert choice.finish_reason == expected.outputs[0].finish_reason == finish_reason
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(call.function.arguments), parameters)
        chunks = client.chat.completions.create(stream=True, **args)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        assert (calls[0].function.name, calls[0].id is not None) == ("get_weather", True)
        assert all(c.id is None and c.function.name is None for c in calls[1:])
        assert "".join(c.function.arguments for c in calls) == call.function.arguments


def test_required_tool_choice_returns_the_calls_of_the_constrained_list(client, llm):
    """vLLM's "required": the output is a JSON list of {"name", "parameters"} calls, each of one of
    the tools (the offline engine under vLLM's schema gives the same text), returned as tool_calls
    with JSON arguments and finish reason "tool_calls"; a list cut short by max_tokens is content."""
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"],
         "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": tool["function"]["parameters"]}}
        for tool in (WEATHER, PICK)]}}
    for max_tokens in (60, 4):
        [expected] = llm.chat(MESSAGES, constrained(max_tokens, schema), tools=[WEATHER, PICK],
                              use_tqdm=False)
        choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, PICK],
                                                tool_choice="required", max_completion_tokens=max_tokens,
                                                temperature=0).choices[0]
        text = expected.outputs[0].text
        if expected.outputs[0].finish_reason == "stop":
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
            assert calls == [(call["name"], call["parameters"]) for call in json.loads(text)]
        else:
            assert choice.finish_reason == "length"
            assert (choice.message.content, choice.message.tool_calls) == (text, None)


def test_tool_calls_and_results_in_the_history_reach_the_chat_template(client, llm, model_dir):
    """An assistant's earlier calls (arguments as JSON text, as OpenAI sends them; a dict to the
    template, as transformers' tool templates expect) and the tool's answer render as transformers
    renders them, with the tools: through a template that shows them, and as the server counts the
    prompt under the model's own."""
    transformers = pytest.importorskip("transformers")
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
                "[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}"
                "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}<assistant>")
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call1", "content": "sunny"}]
    as_template_sees = [history[0], {**history[1], "content": "", "tool_calls": [
        {"id": "call1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]}, history[2]]
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    body = protocol.ChatCompletionRequest.model_validate(
        {"messages": history, "tools": [WEATHER, PICK], "tool_choice": "none"})
    messages = [m.template_message() for m in body.messages]
    expected = hf.apply_chat_template(as_template_sees, tools=[WEATHER, PICK], chat_template=template,
                                      tokenize=False)
    assert "[get_weather(Paris)]" in expected and "#call1" in expected and "pick;" in expected
    ours = llm.get_tokenizer().apply_chat_template(messages, tools=body.template_tools(),
                                                   chat_template=template, tokenize=False)
    assert ours == expected
    response = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER, PICK],
                                              tool_choice="none", max_completion_tokens=1)
    prompt = hf.apply_chat_template(as_template_sees, tools=[WEATHER, PICK], add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
    assert response.usage.prompt_tokens == len(prompt)


CITY_MODEL = {"type": "object", "properties": {"name": {"enum": ["Oslo", "Rome"]}}, "required": ["name"]}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {  # as pydantic writes a model
    "$defs": {"City": CITY_MODEL}, "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
    "required": ["city"]}}}


def required_schema(**body) -> dict:
    request = protocol.ChatCompletionRequest(messages=MESSAGES, tool_choice="required", **body)
    request.check_supported()
    return request.tool_schema()


def test_required_tool_choice_schema_compiles_without_llguidance():
    """The "required" list's schema is one the built-in automaton holds (no llguidance needed):
    each item one tool's call; a tool's `$defs` (pydantic's, openai.pydantic_function_tool's)
    move to the root, where its references point, as vLLM moves them; parallel_tool_calls false
    allows one call; two tools defining one name differently are a 400."""
    pattern = re.compile(json_schema.schema_regex(required_schema(tools=[WEATHER, PICK, BOOK])))
    calls = [{"name": "book", "parameters": {"city": {"name": "Rome"}}},
             {"name": "pick", "parameters": {"x": 2}}]
    assert pattern.fullmatch(json.dumps(calls))
    assert not pattern.fullmatch(json.dumps([{"name": "book", "parameters": {"city": {"name": "Paris"}}}]))
    one_call = required_schema(tools=[PICK, BOOK], parallel_tool_calls=False)
    single = re.compile(json_schema.schema_regex(one_call))
    assert single.fullmatch(json.dumps(calls[:1])) and not single.fullmatch(json.dumps(calls))
    other_city = json.loads(json.dumps(BOOK))
    other_city["function"] |= {"name": "book2"}
    other_city["function"]["parameters"]["$defs"]["City"]["required"] = []
    with pytest.raises(protocol.APIError, match="define \\$defs/City differently"):
        required_schema(tools=[BOOK, other_city])


def test_parallel_tool_calls_false_keeps_the_first_auto_call():
    """As vLLM: with parallel_tool_calls false an "auto" reply's calls are cut to the first, in
    the response and in the stream's deltas."""
    text = ('<tool_call>{"name": "pick", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "pick", "arguments": {"x": 2}}</tool_call>')
    done = CompletionOutput(index=0, text=text, token_ids=[1], finish_reason="stop")
    assert len(responses.ToolCalls("auto").message(done)["tool_calls"]) == 2
    one = responses.ToolCalls("auto", parallel=False)
    [call] = one.message(done)["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"x": 1}
    assert one.finish(done)["finish_reason"] == "tool_calls"
    stream = responses.ChatStream(responses.ResponseMeta.new("chatcmpl", "m"), n=1, num_logprobs=None,
                                  tool_calls=one)
    output = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], finished=True,
                           metrics=RequestMetrics(arrival_time_s=0.0), outputs=[done])
    streamed = [json.loads(event[6:])["choices"][0]["delta"] for event in stream.events(output)]
    assert {c["index"] for d in streamed for c in d.get("tool_calls", [])} == {0}


def test_a_complete_required_list_becomes_tool_calls_whole_or_streamed():
    """The "required" reply's JSON list, once complete, is OpenAI's tool_calls (JSON arguments,
    finish reason "tool_calls"), in the response and as one streamed chunk at the end."""
    text = '[{"name": "pick", "parameters": {"x": 2}}, {"name": "get_weather", "parameters": {"city": "é"}}]'
    tool_calls = responses.ToolCalls("required")
    done = CompletionOutput(index=0, text=text, token_ids=[1], finish_reason="stop")
    message = tool_calls.message(done)
    assert message["content"] is None and tool_calls.finish(done)["finish_reason"] == "tool_calls"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("pick", {"x": 2}), ("get_weather", {"city": "é"})]
    stream = responses.ChatStream(responses.ResponseMeta.new("chatcmpl", "m"), n=1, num_logprobs=None,
                                  tool_calls=tool_calls)
    output = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], finished=False,
                           metrics=RequestMetrics(arrival_time_s=0.0),
                           outputs=[CompletionOutput(index=0, text=text[:20], token_ids=[1])])
    assert stream.events(output) == []  # nothing to say until the list is complete
    output.outputs = [dataclasses.replace(done, token_ids=[1, 2])]
    [event] = stream.events(output)
    choice = json.loads(event[6:])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["index"] for c in choice["delta"]["tool_calls"]] == [0, 1]


def test_auto_tool_choice_with_the_hermes_parser(model_dir, llm):
    """`slipstream serve --enable-auto-tool-choice --tool-call-parser hermes` takes tools with the
    default tool_choice, auto: the model's reply (which this one never makes a call) comes back as
    the offline chat's text, special tokens kept as vLLM keeps them for the parser; without the
    flags, auto is a 400."""
    with serve_in_process(model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        [expected] = llm.chat(MESSAGES, greedy(12, skip_special_tokens=False), tools=[WEATHER],
                              use_tqdm=False)
        choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                                max_completion_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True}).choices[0]
        assert (choice.message.content, choice.message.tool_calls) == (expected.outputs[0].text, None)
        assert choice.finish_reason == "length"
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="pythonic")


CITY = '[A-Z][a-z]{1,6}'
CALL_FORMATS = {  # parser: a regex of one get_weather call in its format
    "hermes": rf'<tool_call>\{{"name": "get_weather", "arguments": \{{"city": "{CITY}", "unit": "C"\}}\}}'
              '</tool_call>',
    "llama3_json": rf'\{{"name": "get_weather", "parameters": \{{"city": "{CITY}", "unit": "C"\}}\}}',
    "mistral": rf'\[TOOL_CALLS\]get_weather\[ARGS\]\{{"city": "{CITY}", "unit": "C"\}}',
}


@pytest.mark.parametrize("parser", sorted(CALL_FORMATS))
def test_auto_tool_choice_reads_each_parsers_call_format(model_dir, parser):
    """With --tool-call-parser, a reply in the model's call format (forced here with guided_regex,
    which "auto" allows) comes back as OpenAI's tool_calls, whole and streamed, finish reason
    "tool_calls", through the official client."""
    with serve_in_process(model_dir, "--enable-auto-tool-choice", "--tool-call-parser", parser,
                          *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        request = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_completion_tokens=60,
                       temperature=0, extra_body={"guided_regex": CALL_FORMATS[parser]})
        choice = client.chat.completions.create(**request).choices[0]
        [call] = choice.message.tool_calls
        assert (choice.message.content, choice.finish_reason, call.function.name) == (None, "tool_calls",
                                                                                      "get_weather")
        assert re.fullmatch(CITY, json.loads(call.function.arguments)["city"])
        chunks = list(client.chat.completions.create(**request, stream=True))
        [streamed] = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name,
                                                                         call.function.arguments)
        assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_template_kwargs_reach_the_template_and_request_templates_need_trust(client, model_dir):
    """vLLM's chat_template_kwargs override the named template arguments and add variables (such
    as Qwen 3's enable_thinking), and documents reach the template, rendered as transformers
    renders them; a request's own chat_template needs --trust-request-chat-template."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    no_prompt = {"chat_template_kwargs": {"add_generation_prompt": False}}
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=1,
                                              extra_body=no_prompt)
    assert response.usage.prompt_tokens == len(hf.apply_chat_template(MESSAGES, add_generation_prompt=False,
                                                                      tokenize=True, return_dict=False))
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
                "{% if enable_thinking %}<think>{% else %}<no-think>{% endif %}")
    documents = [{"title": "caches", "text": "LRU evicts the least recently used block."}]
    for extra, param in (({"chat_template": template}, "chat_template"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=1,
                                           extra_body=extra)
        assert error.value.body["param"] == param
    with serve_in_process(model_dir, "--trust-request-chat-template", *ENGINE_ARGS) as server:
        trusting = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for thinking in (True, False):
            expected = hf.apply_chat_template(MESSAGES, chat_template=template, documents=documents,
                                              enable_thinking=thinking, tokenize=True, return_dict=False)
            response = trusting.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=1,
                extra_body={"chat_template": template, "documents": documents,
                            "chat_template_kwargs": {"enable_thinking": thinking}})
            assert response.usage.prompt_tokens == len(expected)


def test_speculative_server_equals_plain_greedy_and_counts_guesses(model_dir, llm):
    """`slipstream serve --speculative-config` (vLLM's JSON) serves plain greedy decoding's text,
    and /metrics counts the guesses checked and confirmed under vLLM's names."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    with serve_in_process(model_dir, "--speculative-config", spec, *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        rng = random.Random(0)
        prompt = [rng.randrange(3, 8000) for _ in range(59)]  # its greedy output soon loops
        [expected] = llm.generate([prompt], greedy(100), use_tqdm=False)
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=100, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert response.choices[0].text == expected.outputs[0].text
        values = wait_for_idle(server)
        drafts = values["slipstream:spec_decode_num_draft_tokens_total"]
        assert 0 < values["slipstream:spec_decode_num_accepted_tokens_total"] <= drafts
        assert values["slipstream:generation_tokens_total"] == 100


def test_tokenize_detokenize_and_version(server, model_dir):
    """vLLM's /tokenize (a prompt with or without special tokens; a chat as transformers renders
    its template), /detokenize and /version, outside /v1 and so open without the API key, as in
    vLLM; bad bodies are 400s."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        prompt = "def fib(n):\n    return n"
        response = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
        expected = hf(prompt)["input_ids"]
        assert response == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected,
                            "token_strs": hf.convert_ids_to_tokens(expected)}
        bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
        assert bare["tokens"] == hf(prompt, add_special_tokens=False)["input_ids"]
        assert bare["token_strs"] is None
        chat = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
        assert chat["tokens"] == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
        parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        chat = http.post("/tokenize", json={"model": MODEL_NAME, "messages": parts}).json()
        joined = [{"role": "user", "content": "a\nb"}]  # as vLLM joins text parts
        assert chat["tokens"] == hf.apply_chat_template(joined, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
        text = http.post("/detokenize", json={"tokens": expected}).json()
        assert text == {"prompt": hf.decode(expected)}
        assert http.get("/version").json()["version"]
        for path, body, param in (("/tokenize", {}, "prompt"),
                                  ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
                                  ("/tokenize", {"messages": [{"role": "user"}], "chat_template": "x"}, None),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                                  ("/detokenize", {"tokens": [10**9]}, "tokens")):
            response = http.post(path, json=body)
            assert response.status_code == 400, (body, response.text)
            if param is not None:
                assert response.json()["error"]["param"] == param
        assert http.post("/detokenize", json={"model": "other", "tokens": [1]}).status_code == 404


def test_add_special_tokens_as_vllm(model_dir, tmp_path):
    """vLLM's add_special_tokens on a tokenizer that adds a BOS: completions add it by default and
    not when false (a prompt that already holds it gets one, not two); chat takes the template's
    ids by default and adds the BOS on top when true."""
    bos_dir = tmp_path / "bos-model"
    shutil.copytree(model_dir, bos_dir)
    spec = json.loads((bos_dir / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    (bos_dir / "tokenizer.json").write_text(json.dumps(spec))
    with serve_in_process(bos_dir, *ENGINE_ARGS) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            plain = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False})
        plain = plain.json()["tokens"]
        assert plain[0] != bos_id

        def prompt_tokens(prompt="hello", **extra):
            return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                             extra_body=extra).usage.prompt_tokens

        assert prompt_tokens() == len(plain) + 1
        assert prompt_tokens(add_special_tokens=False) == len(plain)
        assert prompt_tokens(prompt=bos + "hello", add_special_tokens=False) == len(plain) + 1

        def chat_tokens(**extra):
            return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
                                                  extra_body=extra).usage.prompt_tokens

        templated = chat_tokens()
        assert chat_tokens(add_special_tokens=True) == templated + 1


def test_a_streamed_chat_opens_with_the_engines_first_output():
    """As vLLM, the role chunk of a streamed chat goes out with the engine's first output, not on
    arrival, so that a client timing its first chunk (vLLM's bench serve, slipstream's) times the
    prefill: nothing is sent while the prompt is still being computed."""
    from slipstream.serve.server import OpenAIServer

    first_output = asyncio.Event()

    class PrefillingStream:  # a RequestStream whose first output comes when the test says
        request_ids = ["r"]

        async def __aiter__(self):
            await first_output.wait()
            yield [RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], finished=True,
                                 metrics=RequestMetrics(arrival_time_s=0.0),
                                 outputs=[CompletionOutput(index=0, text="hi", token_ids=[5],
                                                           finish_reason="stop")])]

        def close(self) -> None:
            pass

    async def main():
        chunks = responses.ChatStream(responses.ResponseMeta.new("chatcmpl", "m"), n=1, num_logprobs=None)
        events = OpenAIServer._events(None, PrefillingStream(), chunks)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pending := asyncio.ensure_future(anext(events))), 0.2)
        first_output.set()
        return [await pending] + [event async for event in events]

    events = asyncio.run(main())
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1]["content"] == "hi"
    assert events[-1] == "data: [DONE]\n\n"
