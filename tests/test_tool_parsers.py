"""The "hermes" tool-call parser (slipstream/serve/tool_parsers.py), whole and streamed: the
streamed deltas, fed a reply one character at a time, add up to the whole parse."""

from __future__ import annotations

import json

import pytest

from slipstream.serve.tool_parsers import HermesStream, HermesToolParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
PARIS = ("get_weather", {"city": "Paris", "unit": "C"})
NOOP = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
PLAIN = "Just an answer, with <b>tags</b> and a < sign."
NO_JSON = "<tool_call>{not json}</tool_call>"
NO_NAME = '<tool_call>{"arguments": {}}</tool_call>'
# name: (reply, its content, its calls)
REPLIES = {
    "plain text": (PLAIN, PLAIN, []),
    "one call after text": (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.\n",
                            [PARIS]),
    "two calls, no text": (f"<tool_call>{WEATHER}</tool_call>\n{NOOP}", None, [PARIS, ("noop", {})]),
    "an unclosed last call": (f"<tool_call>\n{WEATHER}\n", None, [PARIS]),
    "a call that is no JSON": (NO_JSON, NO_JSON, []),
    "a call without a name": (NO_NAME, NO_NAME, []),
    "text ending like a tag": ("The answer is <tool", "The answer is <tool", []),
}


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_whole_replies_parse_into_content_and_calls(name):
    text, content, calls = REPLIES[name]
    parsed = HermesToolParser().parse(text)
    assert (parsed.content, calls_of(parsed.tool_calls)) == (content, calls)
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in parsed.tool_calls)


@pytest.mark.parametrize("name", sorted(set(REPLIES) - {"a call that is no JSON", "a call without a name"}))
def test_streamed_deltas_add_up_to_the_whole_parse(name):
    """Content arrives until a call begins (a tail that may start a tag is held back), each call
    whole, with consecutive indices, once its closing tag or the reply's end arrives."""
    text, content, calls = REPLIES[name]
    stream = HermesStream()
    deltas = [stream.feed(text[:end], finished=end == len(text)) for end in range(1, len(text) + 1)]
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed == (content or "")
    streamed_calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls_of(streamed_calls) == calls
    assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
    assert stream.num_calls == len(calls)
    if "<tool" in text and not calls:  # held back until the end showed it was no tag
        assert "<tool" not in "".join(d.get("content", "") for d in deltas[:-1])
