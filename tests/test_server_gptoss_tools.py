"""--tool-call-parser openai (gpt-oss's harmony calls) on a real server, driven by the official
`openai` client: a reply forced with guided_regex (analysis, a commentary preamble, then a message
to functions.get_weather) comes back as reasoning, content and a tool call, whole and streamed,
with and without --reasoning-parser openai_gptoss, and as Responses items; the expected texts are
read with str methods from the raw reply of a server without the parsers.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from serve_fixtures import kv_bytes_for_blocks
from server_process import MODEL_NAME, in_process

from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.server import OpenAIServer, ServerConfig

pytest_plugins = ["serve_fixtures", "server_process"]

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_HEADER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
REPLY = (re.escape("<|channel|>analysis<|message|>") + "[a-z ]{4,12}"
         + re.escape("<|end|><|start|>assistant<|channel|>commentary<|message|>") + "[a-z ]{4,12}"
         + re.escape("<|end|><|start|>assistant" + CALL_HEADER + '{"city": "Oslo"}'))
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def urls(model_dir, one_torch_thread):
    """One engine (constraining the reasoning too, so that a regex forces a whole reply out of the
    random model) behind a server without parsers, one with the "openai" tool parser alone, and
    one with it and the openai_gptoss reasoning parser."""
    engine = Engine(EngineConfig(
        model=str(model_dir), max_model_len=256, block_size=8, kv_cache_memory=kv_bytes_for_blocks(256, 8),
        reasoning_parser="openai_gptoss", structured_outputs_enable_in_reasoning=True))
    tools = dict(port=0, served_model_name=MODEL_NAME, enable_auto_tool_choice=True,
                 tool_call_parser="openai")
    with (in_process(OpenAIServer(engine, ServerConfig(port=0, served_model_name=MODEL_NAME))) as plain,
          in_process(OpenAIServer(engine, ServerConfig(**tools))) as alone,
          in_process(OpenAIServer(engine, ServerConfig(**tools, reasoning_parser="openai_gptoss"))) as both):
        yield {"plain": plain, "alone": alone, "both": both}


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def request(**body) -> dict:
    return dict(model=MODEL_NAME, messages=MESSAGES, tools=[TOOL], max_completion_tokens=150, temperature=0,
                extra_body={"guided_regex": REPLY}) | body


def by_hand(urls) -> tuple[str, str]:
    """The forced reply's analysis and preamble texts, from the plain server's raw reply."""
    plain = client_of(urls["plain"]).chat.completions.create(**request(tool_choice="none"))
    raw = plain.choices[0].message.content
    assert re.fullmatch(REPLY, raw)
    analysis, preamble, _ = raw.split("<|end|>")
    return analysis.partition("<|message|>")[2], preamble.partition("<|message|>")[2]


@pytest.mark.parametrize("server", ["alone", "both"])
def test_chat_harmony_call_whole_and_streamed(urls, server):
    """The message to functions.get_weather is a tool call (finish_reason "tool_calls"), the
    preamble the content; the analysis is the reasoning with the reasoning parser and left out
    without (as vLLM); streamed, the deltas join to the same, the call whole in one delta."""
    analysis, preamble = by_hand(urls)
    reasoning = analysis if server == "both" else None
    choice = client_of(urls[server]).chat.completions.create(**request()).choices[0]
    [made] = choice.message.tool_calls
    assert (getattr(choice.message, "reasoning", None), choice.message.content, choice.finish_reason) == (
        reasoning, preamble, "tool_calls")
    assert (made.type, made.function.name, json.loads(made.function.arguments)) == (
        "function", "get_weather", {"city": "Oslo"})
    chunks = list(client_of(urls[server]).chat.completions.create(**request(stream=True)))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == preamble
    [[streamed]] = [d.tool_calls for d in deltas if d.tool_calls]
    assert (streamed.index, streamed.function.name, json.loads(streamed.function.arguments)) == (
        0, "get_weather", {"city": "Oslo"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_harmony_call_is_a_function_call_item(urls):
    """A Response of the same reply: the reasoning item, the preamble's message, then a
    function_call item with the call's name and arguments; streamed, the completed Response has
    the same items."""
    analysis, preamble = by_hand(urls)
    body = {"model": MODEL_NAME, "input": MESSAGES[0]["content"], "max_output_tokens": 150, "temperature": 0,
            "tools": [{"type": "function", "name": "get_weather",
                       "parameters": TOOL["function"]["parameters"]}],
            "structured_outputs": {"regex": REPLY}}
    url = urls["both"] + "/v1/responses"
    response = openai.types.responses.Response.model_validate(httpx.post(url, json=body, timeout=60).json())
    reasoning, message, call = response.output
    assert (reasoning.type, reasoning.content[0].text) == ("reasoning", analysis)
    assert (message.type, message.content[0].text) == ("message", preamble)
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                  {"city": "Oslo"})
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as stream:
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                  if line.startswith("data: ")]
    final = openai.types.responses.Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert (final.output[2].name, json.loads(final.output[2].arguments)) == ("get_weather", {"city": "Oslo"})
