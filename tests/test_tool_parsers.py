"""The tool-call parsers (slipstream/serve/tool_parsers.py), whole and streamed: the streamed
deltas, fed a reply one character at a time, add up to the whole parse."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slipstream.serve.reasoning_parsers import REASONING_PARSERS
from slipstream.serve.tool_parsers import TOOL_CALL_PARSERS

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
PARIS = ("get_weather", {"city": "Paris", "unit": "C"})
NOOP = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
PLAIN = "Just an answer, with <b>tags</b> and a < sign; [brackets] {braces}."
NO_JSON = "<tool_call>{not json}</tool_call>"
NO_NAME = '<tool_call>{"arguments": {}}</tool_call>'
LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
# parser: {name: (reply, its content, its calls)}
REPLIES = {
    "hermes": {
        "plain text": (PLAIN, PLAIN, []),
        "one call after text": (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.\n",
                                [PARIS]),
        "two calls, no text": (f"<tool_call>{WEATHER}</tool_call>\n{NOOP}", None, [PARIS, ("noop", {})]),
        "an unclosed last call": (f"<tool_call>\n{WEATHER}\n", None, [PARIS]),
        "a call that is no JSON": (NO_JSON, NO_JSON, []),
        "a call without a name": (NO_NAME, NO_NAME, []),
        "a call, then one that is no JSON": (f"<tool_call>{WEATHER}</tool_call>{NO_JSON}",
                                            f"<tool_call>{WEATHER}</tool_call>{NO_JSON}", []),
        "text ending like a tag": ("The answer is <tool", "The answer is <tool", []),
    },
    "llama3_json": {
        "plain text": (PLAIN, PLAIN, []),
        "one call": (LLAMA_WEATHER, None, [PARIS]),
        "a call after the python tag": (f"<|python_tag|>{LLAMA_WEATHER}", None, [PARIS]),
        "two calls and spaces": (f'  {LLAMA_WEATHER}; {{"name": "noop", "parameters": {{}}}}\n', None,
                                 [PARIS, ("noop", {})]),
        "arguments as the key": (WEATHER, None, [PARIS]),
        "a JSON answer that is no call": ('{"answer": 42}', '{"answer": 42}', []),
        "a call then text": (f"{LLAMA_WEATHER} is a call", f"{LLAMA_WEATHER} is a call", []),
        "cut short": ('{"name": "f", "parameters": {"ci', '{"name": "f", "parameters": {"ci', []),
        "text beginning like the tag": ("<|python", "<|python", []),
    },
    "mistral": {
        "plain text": (PLAIN, PLAIN, []),
        "a list of calls (v0.3)": (f'[TOOL_CALLS] [{WEATHER}, {{"name": "noop", "arguments": {{}}}}]', None,
                                   [PARIS, ("noop", {})]),
        "name and args": ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}', "Sure.",
                          [PARIS]),
        "two calls with ids": ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "C"}'
                               '[TOOL_CALLS]noop[ARGS]{}', None, [PARIS, ("noop", {})]),
        "args that are no JSON": ("[TOOL_CALLS]f[ARGS]{nope", "[TOOL_CALLS]f[ARGS]{nope", []),
        "no args": ("[TOOL_CALLS]f", "[TOOL_CALLS]f", []),
        "text ending like the marker": ("See [TOOL", "See [TOOL", []),
    },
}
CASES = [(parser, name) for parser, replies in REPLIES.items() for name in sorted(replies)]


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, name", CASES)
def test_whole_replies_parse_into_content_and_calls(parser, name):
    text, content, calls = REPLIES[parser][name]
    parsed = TOOL_CALL_PARSERS[parser]().parse(text)
    assert (parsed.content, calls_of(parsed.tool_calls)) == (content, calls)
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in parsed.tool_calls)


@pytest.mark.parametrize("parser, name", CASES)
def test_streamed_deltas_add_up_to_the_whole_parse(parser, name):
    """Content arrives until calls may begin (a tail that may start a marker is held back), the
    calls whole at the reply's end, with consecutive indices: the stream says what the whole parse
    says, also of a reply with a call that does not parse (hermes sent the good calls as their
    tags closed and dropped the rest, where the whole parse makes the reply content)."""
    text, content, calls = REPLIES[parser][name]
    stream = TOOL_CALL_PARSERS[parser]().stream()
    deltas = [stream.feed(text[:end], finished=end == len(text)) for end in range(1, len(text) + 1)]
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed == (content or "")
    streamed_calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls_of(streamed_calls) == calls
    assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
    assert stream.num_calls == len(calls)
    for marker in ("<tool", "<|python", "[TOOL"):
        if text.startswith(marker) or (marker in text and not calls):  # held back until the end
            assert marker not in "".join(d.get("content", "") for d in deltas[:-1])


GPT_CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city":"Paris","unit":"C"}')
THOUGHT = "<|channel|>analysis<|message|>need the weather<|end|><|start|>assistant"
HARMONY = {  # reply (raw, special tokens kept; the stop token <|call|> is not in the text), content, calls
    "plain text": (PLAIN, PLAIN, []),
    "a final answer after analysis": (f"{THOUGHT}<|channel|>final<|message|>It is 7.", "It is 7.", []),
    "a call after analysis": (THOUGHT + GPT_CALL, None, [PARIS]),
    "a preamble, then a call ended by <|call|>": (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + GPT_CALL + "<|call|>",
        "Checking.", [PARIS]),
    "the recipient before the channel": (
        '<|start|>assistant to=functions.noop<|channel|>commentary json<|message|>{}', None, [("noop", {})]),
    "the recipient in the role's part, right after the prompt's <|start|>assistant": (
        ' to=functions.noop<|channel|>commentary json<|message|>{}', None, [("noop", {})]),
    "plain text that begins like a recipient": (" tomorrow, to=be sure", " tomorrow, to=be sure", []),
    "two calls": (f"{GPT_CALL}<|call|><|start|>assistant to=functions.noop<|channel|>commentary"
                  "<|message|>{}", None, [PARIS, ("noop", {})]),
    "a built-in tool's call is left out": (
        '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>', None, []),
    "a call cut short": ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"ci',
                         '{"ci', []),
    "a preamble, then arguments that are no JSON": (
        "<|channel|>commentary<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary to=functions.f"
        "<|message|>{nope", "Hm.{nope", []),
    "text ending like a header": ("The answer<|chan", "The answer<|chan", []),
}


def test_openai_is_a_tool_call_parser():
    assert "openai" in TOOL_CALL_PARSERS


@pytest.mark.parametrize("name", sorted(HARMONY))
def test_harmony_replies_whole_and_streamed(name):
    """gpt-oss's harmony (vLLM's "openai" parser, which reads the messages from token ids): a
    message to functions.NAME is a call, final and preamble text the content, analysis and built-in
    tools' messages left out; a call whose arguments do not parse makes the messages' text the
    content. Streamed a character at a time, the deltas add up to the whole parse, with no marker
    text in the content."""
    text, content, calls = HARMONY[name]
    parsed = TOOL_CALL_PARSERS["openai"]().parse(text)
    assert (parsed.content, calls_of(parsed.tool_calls)) == (content, calls)
    stream = TOOL_CALL_PARSERS["openai"]().stream()
    deltas = [stream.feed(text[:end], finished=end == len(text)) for end in range(1, len(text) + 1)]
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    streamed_calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls_of(streamed_calls) == calls
    assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
    assert stream.num_calls == len(calls)
    if calls:
        assert "<|" not in "".join(d.get("content", "") for d in deltas)


@pytest.mark.parametrize("name", sorted(HARMONY))
def test_harmony_calls_read_after_the_reasoning_parser(name):
    """With --reasoning-parser openai_gptoss the reasoning parser (told the tool parser reads
    calls) hands on an answer in which the calls are whole: split, then parsed, a reply gives the
    calls and content that the tool parser alone reads from the raw reply, whole and streamed."""
    text, content, calls = HARMONY[name]
    gptoss = dataclasses.replace(REASONING_PARSERS["openai_gptoss"](None), calls=True)
    answer = gptoss.split(text).content or ""
    parsed = TOOL_CALL_PARSERS["openai"]().parse(answer)
    assert (parsed.content, calls_of(parsed.tool_calls)) == (content, calls)
    reasoning, tools = gptoss.stream(), TOOL_CALL_PARSERS["openai"]().stream()
    deltas = []
    for end in range(1, len(text) + 1):
        _, answer = reasoning.feed(text[:end], finished=end == len(text))
        deltas.append(tools.feed(answer, finished=end == len(text)))
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert calls_of([call for d in deltas for call in d.get("tool_calls", [])]) == calls
