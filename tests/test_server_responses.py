"""OpenAI's Responses API (POST /v1/responses) as the official `openai` client drives it: greedy
text equal to the chat route's for the same messages, the prompt and usage as transformers' chat
template and tokenizer count them, streamed events in OpenAI's order, incomplete replies, JSON
schema outputs, a function call round trip, vLLM's answers while no response is stored, and
OpenAI-shaped 400s for bad bodies.

One real server process (tests/server_process.py, shared with test_server.py) serves them all.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
import transformers
from lora_fixtures import save_random_adapter
from pydantic import TypeAdapter
from server_process import API_KEY, MAX_MODEL_LEN, MODEL_NAME, in_process, metric_values

from slipstream.serve import protocol
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.request import CompletionOutput, RequestMetrics, RequestOutput
from slipstream.serve.responses import ToolCalls
from slipstream.serve.responses_api import ResponseBuilder
from slipstream.serve.served_models import LoRAModulePath
from slipstream.serve.server import OpenAIServer, ServerConfig

pytest_plugins = ["serve_fixtures", "server_process"]

QUESTION = "Write a haiku about caches."
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
               "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}}
CHAT_WEATHER = {"type": "function", "function": {key: WEATHER[key] for key in ("name", "description",
                                                                              "parameters")}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """transformers' own tokenizer and chat template of the served model: the independent count."""
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def chat_text(client, messages, max_tokens: int, **body) -> str:
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                              max_completion_tokens=max_tokens,
                                              extra_body={"ignore_eos": True} | body)
    return response.choices[0].message.content


def prompt_len(tokenizer, messages, **template_args) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False, **template_args))


def test_text_input_equals_the_chat_reply_and_counts_as_transformers(client, tokenizer):
    """A string input is a user message: greedy output_text equals the chat route's reply to it;
    input_tokens are the chat template's tokens as transformers renders and counts them; a reply
    cut at max_output_tokens is "incomplete" with reason max_output_tokens; settings are echoed
    (tool_choice "auto" when not sent, as OpenAI and vLLM echo it)."""
    messages = [{"role": "user", "content": QUESTION}]
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=8, **GREEDY)
    assert response.output_text == chat_text(client, messages, 8)
    assert response.id.startswith("resp_") and response.object == "response"
    [message] = response.output
    assert (message.type, message.role, message.id[:4], message.status) == ("message", "assistant", "msg_",
                                                                           "incomplete")
    assert (message.content[0].type, message.content[0].annotations) == ("output_text", [])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage.input_tokens == prompt_len(tokenizer, messages)
    assert (usage.output_tokens, usage.total_tokens) == (8, usage.input_tokens + 8)
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    assert (response.model, response.temperature, response.max_output_tokens) == (MODEL_NAME, 0.0, 8)
    assert (response.tools, response.tool_choice, response.text.format.type) == ([], "auto", "text")


def test_instructions_and_message_items_render_as_the_chat(client, tokenizer):
    """instructions become a system message before the input; messages of every role with string
    content or input_text / output_text parts (joined by newlines, as the chat route joins text
    parts) give the chat route's reply and transformers' prompt length."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a cache."},
                                          {"type": "input_text", "text": "One word."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "LRU"}]},
             {"type": "message", "role": "user", "content": QUESTION}]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a cache.\nOne word."},
                {"role": "assistant", "content": "LRU"}, {"role": "user", "content": QUESTION}]
    response = client.responses.create(model=MODEL_NAME, input=items, instructions="Be brief.",
                                       max_output_tokens=10, **GREEDY)
    assert response.output_text == chat_text(client, messages, 10)
    assert response.usage.input_tokens == prompt_len(tokenizer, messages)
    assert response.instructions == "Be brief."


def test_stream_sends_openais_events_in_order(client):
    """stream=True: created, in_progress, the message's added events, one delta per engine update,
    the done events and completed, numbered 0, 1, 2, ...; the deltas make the final text, and the
    completed response equals the non-streamed one (but for ids and times). The client's
    `responses.stream` helper reads it to the same final response."""
    args = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=12, **GREEDY)
    expected = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert 1 <= num_deltas <= 12  # one per engine update that the client had not read yet
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == expected.output_text
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert (final.status, final.usage.output_tokens) == (expected.status, expected.usage.output_tokens)
    with client.responses.stream(**args) as stream:
        assert stream.get_final_response().output_text == expected.output_text


def test_json_schema_format_gives_valid_json(client):
    """text.format json_schema constrains the reply through the structured outputs: it parses and
    is valid under the schema (jsonschema's check), and the reply completes, also for the client's
    `responses.parse` with a pydantic model; json_object gives the chat route's reply under
    response_format json_object."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "required": ["name", "ok"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}}}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=60, temperature=0,
                                       text=text)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"

    class Answer(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=5)
        ok: bool

    parsed = client.responses.parse(model=MODEL_NAME, input=QUESTION, max_output_tokens=60, temperature=0,
                                    text_format=Answer)  # the client's own schema of a pydantic model
    assert isinstance(parsed.output_parsed, Answer) and parsed.status == "completed"
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=20, temperature=0,
                                       text={"format": {"type": "json_object"}})
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=20,
                                          temperature=0, response_format={"type": "json_object"})
    assert response.output_text == chat.choices[0].message.content


def test_function_call_round_trip(client, tokenizer):
    """A named tool_choice gives a function_call item whose arguments are the chat route's call
    for the same tool (streamed: the item with its name first, then the arguments as they are
    generated, one call_id throughout); sent back with its output,
    the call and result render as the chat route renders them (same greedy reply, transformers'
    prompt length)."""
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=question, tools=[CHAT_WEATHER],
                                          temperature=0, max_completion_tokens=40,
                                          tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}})
    args = dict(model=MODEL_NAME, input=question, tools=[WEATHER], temperature=0, max_output_tokens=40,
                tool_choice={"type": "function", "name": "get_weather"})
    response = client.responses.create(**args)
    [call] = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert call.call_id.startswith("call_") and response.tool_choice.name == "get_weather"
    events = list(client.responses.create(stream=True, **args))
    types = [event.type for event in events]
    num_deltas = types.count("response.function_call_arguments.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * num_deltas,
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert (events[2].item.name, events[2].item.arguments) == ("get_weather", "")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == events[-3].arguments == events[-1].response.output[0].arguments == call.arguments
    assert events[2].item.call_id == events[-2].item.call_id == events[-1].response.output[0].call_id
    with client.responses.stream(**args) as stream:
        assert stream.get_final_response().output[0].arguments == call.arguments
    history = [*question, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=6, **GREEDY)
    messages = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert answer.output_text == chat_text(client, messages, 6, tools=[CHAT_WEATHER], tool_choice="none")
    as_template_sees = [*messages[:1], {**messages[1], "content": "", "tool_calls": [
        {**messages[1]["tool_calls"][0],
         "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
        messages[2]]
    assert answer.usage.input_tokens == prompt_len(tokenizer, as_template_sees, tools=[CHAT_WEATHER])


def test_long_input_is_a_400_and_long_output_is_capped(client, tokenizer):
    """An input the context cannot hold is a 400 naming input with OpenAI's context code, also
    with truncation "auto" when it is one item (only whole items are dropped); an output that asks
    for more than the context leaves is capped there (as vLLM), not refused."""
    long = "cache " * MAX_MODEL_LEN
    assert prompt_len(tokenizer, [{"role": "user", "content": long}]) > MAX_MODEL_LEN
    for truncation in ("disabled", "auto"):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=MODEL_NAME, input=long, max_output_tokens=4, truncation=truncation)
        assert (error.value.body["param"], error.value.body["code"]) == ("input", "context_length_exceeded")
    short = [{"role": "user", "content": "hi"}]
    response = client.responses.create(model=MODEL_NAME, input=short, max_output_tokens=10 * MAX_MODEL_LEN,
                                       **GREEDY)
    assert response.usage.total_tokens == MAX_MODEL_LEN
    assert response.incomplete_details.reason == "max_output_tokens"


def test_truncation_auto_drops_the_first_items_and_keeps_the_instructions(client, tokenizer):
    """truncation "auto" drops the fewest leading items (whole turns, from a user message on) that
    leave the output its reserve, min(max_output_tokens or 4096, half the context), and keeps the
    instructions: input_tokens are those of transformers' rendering of the expected kept chat,
    and the greedy reply is the chat route's to it. Nothing to drop (one long item) is served as
    "disabled" serves it, its output capped at what the context leaves."""
    instructions = {"role": "system", "content": "Be brief."}
    items = [{"role": "user", "content": "cache " * 90}, {"role": "assistant", "content": "Noted."},
             {"role": "user", "content": "store " * 90}, {"role": "assistant", "content": "Noted."},
             {"role": "user", "content": QUESTION}]
    kept_counts = set()
    for max_output_tokens in (4, 40, None, 10 * MAX_MODEL_LEN):
        reserve = min(max_output_tokens or 4096, MAX_MODEL_LEN // 2)
        kept = next(items[cut:] for cut in (0, 2, 4)
                    if prompt_len(tokenizer, [instructions, *items[cut:]]) + reserve <= MAX_MODEL_LEN)
        kept_counts.add(len(kept))
        response = client.responses.create(model=MODEL_NAME, input=items, instructions="Be brief.",
                                           max_output_tokens=max_output_tokens, truncation="auto", **GREEDY)
        assert response.usage.input_tokens == prompt_len(tokenizer, [instructions, *kept])
        expected_output = min(max_output_tokens or MAX_MODEL_LEN, MAX_MODEL_LEN - response.usage.input_tokens)
        assert response.usage.output_tokens == expected_output >= min(reserve, max_output_tokens or reserve)
        if max_output_tokens == 40:
            assert response.output_text == chat_text(client, [instructions, *kept], 40)
    assert kept_counts == {5, 3, 1}  # each rule above decided one request
    one_item = [{"role": "user", "content": "cache " * 200}]
    num_input = prompt_len(tokenizer, one_item)
    assert num_input + 100 > MAX_MODEL_LEN > num_input
    response = client.responses.create(model=MODEL_NAME, input=one_item, max_output_tokens=100,
                                       truncation="auto", **GREEDY)
    assert (response.usage.input_tokens, response.usage.total_tokens) == (num_input, MAX_MODEL_LEN)


def test_truncation_never_orphans_a_tool_result():
    """truncated_messages keeps every system and developer message, starts the kept turns at a user
    message, never keeps a tool result without the call it answers (whatever `fits` is asked
    about), and returns the shortest such chat where none fits."""
    def message(role: str, call: str | None = None) -> protocol.ChatMessage:
        calls = None if call is None or role != "assistant" else [
            protocol.ToolCall(id=call, function=protocol.FunctionCall(name="f", arguments="{}"))]
        return protocol.ChatMessage(role=role, content=role, tool_calls=calls,
                                    tool_call_id=call if role == "tool" else None)

    chat = [message("system"), message("user"), message("developer"), message("assistant", "c1"),
            message("tool", "c1"), message("user"), message("assistant", "c2"), message("user"),
            message("tool", "c2"), message("user")]
    asked = []

    def at_most(limit: int):
        def fits(messages: list[protocol.ChatMessage]) -> bool:
            asked.append(messages)
            return len(messages) <= limit
        return fits

    def indices(messages: list[protocol.ChatMessage]) -> list[int]:
        return [next(i for i, m in enumerate(chat) if m is kept) for kept in messages]

    expected = {10: list(range(10)), 7: [0, 2, 5, 6, 7, 8, 9], 6: [0, 2, 9], 2: [0, 2, 9]}
    for limit, kept in expected.items():
        assert indices(protocol.truncated_messages(chat, at_most(limit))) == kept, limit
    for messages in asked:
        calls = {call.id for m in messages for call in m.tool_calls or ()}
        assert all(m.tool_call_id in calls for m in messages if m.role == "tool")


def test_a_reply_of_text_and_a_call_sent_back_is_one_assistant_turn(client, tokenizer):
    """`input += response.output` of a reply with text and a function call (the client's own
    output types, ids and statuses included), then the call's output: the message and the call are
    one assistant turn, as the chat route renders it (transformers' count, the chat route's greedy
    reply), not two."""
    question = {"role": "user", "content": "Weather in Oslo?"}
    arguments = '{"city": "Oslo", "unit": "C"}'
    said = openai.types.responses.ResponseOutputMessage(
        id="msg_1", type="message", role="assistant", status="completed",
        content=[openai.types.responses.ResponseOutputText(type="output_text", text="Let me see.",
                                                           annotations=[])])
    called = openai.types.responses.ResponseFunctionToolCall(
        id="fc_1", type="function_call", call_id="call_1", name="get_weather", arguments=arguments,
        status="completed")
    items = [question, said, called, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = client.responses.create(model=MODEL_NAME, input=items, tools=[WEATHER], tool_choice="none",
                                       max_output_tokens=6, **GREEDY)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [question, {"role": "assistant", "content": "Let me see.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert response.output_text == chat_text(client, messages, 6, tools=[CHAT_WEATHER], tool_choice="none")
    as_template_sees = [question, {**messages[1], "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": json.loads(arguments)}}]}, messages[2]]
    assert response.usage.input_tokens == prompt_len(tokenizer, as_template_sees, tools=[CHAT_WEATHER])


def test_settings_are_echoed_as_sent(client):
    """tool_choice is echoed as sent (also "none" without tools), text with its verbosity."""
    text = {"format": {"type": "text"}, "verbosity": "low"}
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1,
                                       tool_choice="none", text=text)
    assert (response.tool_choice, response.text.verbosity) == ("none", "low")


def test_logprobs_when_included(client):
    """include ["message.output_text.logprobs"] with top_logprobs: each output token's logprob and
    its alternatives, as the chat route reports them for the same reply."""
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                          max_completion_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=5, temperature=0,
                                       top_logprobs=2, include=["message.output_text.logprobs"])
    logprobs = response.output[0].content[0].logprobs
    assert [(p.token, p.logprob, [t.token for t in p.top_logprobs]) for p in logprobs] == [
        (p.token, p.logprob, [t.token for t in p.top_logprobs]) for p in chat.choices[0].logprobs.content]


def test_nothing_is_stored_as_vllm_by_default(client, server):
    """As vLLM without VLLM_ENABLE_RESPONSES_API_STORE: `store` is ignored (echoed false), an id
    that is a response's is never found (404) and one that is not (no "resp_") is a 400, for
    previous_response_id, GET /v1/responses/{id} and its cancel; background, which needs the
    store, is a 400."""
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=2, store=True)
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL_NAME, input=QUESTION, previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"
    for call in (client.responses.retrieve, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
        with pytest.raises(openai.BadRequestError):
            call("msg_1")
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_NAME, input=QUESTION, background=True)
    assert error.value.body["param"] == "background"


BAD_BODIES = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": 5}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "no"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER]}, "tool_choice"),  # "auto" needs the server's parser
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
     "text"),
    ({"input": "x", "include": ["everything"]}, "include"),
    ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "reasoning": {"effort": "enormous"}}, "reasoning"),
    ({"input": "x", "previous_response_id": "abc"}, "previous_response_id"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_requests_are_400s_naming_the_parameter(client, body, param):
    """Each bad value is a 400 through the client, naming the Responses parameter at fault."""
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_NAME, extra_body=body)
    assert error.value.body["param"] == param, error.value.body


BAD_TOOL = {"type": "function", "name": "f", "parameters": {"type": "nonsense"}}
SCHEMA_FORMAT = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}
WORDED_ERRORS = [  # the body, the param, words the message must hold
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", ["structured_outputs.regex"]),
    ({"text": {"format": SCHEMA_FORMAT | {"schema": {"type": "nonsense"}}}}, "text", ["text.format.schema"]),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "text",
     ["structured_outputs and text.format"]),
    ({"text": {"format": SCHEMA_FORMAT}, "tools": [WEATHER], "tool_choice": "required"}, "text",
     ["text.format cannot"]),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools", ["tools[0].name", "null"]),
    ({"tools": [WEATHER, WEATHER | {"parameters": [1]}]}, "tools", ["tools[1].parameters", "[1]"]),
    ({"tools": [WEATHER | {"strict": "yes"}]}, "tools", ["tools[0].strict", '"yes"']),
    ({"tools": [BAD_TOOL], "tool_choice": "required"}, "tools", ["the tools' parameters", "nonsense"]),
    ({"tools": [BAD_TOOL], "tool_choice": {"type": "function", "name": "f"}}, "tools",
     ["the tools' parameters"]),
    ({"text": {"format": "json"}}, "text", ["text.format", '"json"']),
    ({"text": {"format": {"type": "xml"}}}, "text", ["text.format.type", '"xml"']),
    ({"text": {"format": SCHEMA_FORMAT | {"strict": "yes"}}}, "text", ["text.format.strict", '"yes"']),
    ({"text": {"format": SCHEMA_FORMAT | {"name": "an answer"}}}, "text",
     ["text.format.name", '"an answer"']),
    ({"text": {"format": SCHEMA_FORMAT | {"name": "a" * 65}}}, "text", ["text.format.name"]),
    ({"text": {"verbosity": "loud"}}, "text", ["text.verbosity", '"loud"']),
]


@pytest.mark.parametrize(("body", "param", "words"), WORDED_ERRORS,
                         ids=[str(i) for i in range(len(WORDED_ERRORS))])
def test_400s_name_the_responses_field_and_value(client, body, param, words):
    """A 400 of a field the Responses request shares with the chat request it becomes, or of
    text / tools, names the Responses field, in the Responses' words (never the chat's
    response_format, nor structured_outputs for what the client sent as text or tools), with the
    value sent."""
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, extra_body=body)
    message = error.value.body["message"]
    assert error.value.body["param"] == param, error.value.body
    assert all(word in message for word in words) and "response_format" not in message, message
    assert param == "structured_outputs" or "structured_outputs." not in message, message


def test_malformed_bodies_are_400s_and_unknown_models_404s(server):
    """Raw bodies no client would send: not JSON, wrong JSON types, garbage nested deep, numbers
    past any bound: each a 400 (never a 500 or a hang); an unknown model is a 404 as on the chat
    route; the server still answers afterwards."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.url + "/v1/responses"
    bodies = [b"{", b"[]", b'{"model": "tiny-test"}', b'{"input": 5}', b'{"input": [5]}',
              b'{"input": [{"role": "user", "content": [[[{}]]]}]}', b'{"input": "x", "stream": "yes"}',
              b'{"input": "x", "max_output_tokens": 1e400}',
              b'{"input": "x", "seed": 1' + b"0" * 5000 + b"}",
              b'{"input": "x", "temperature": "hot"}', b'{"input": "x", "metadata": {"k": 1}}',
              b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"input": "x", "tools": [5]}',
              b'{"input": "x", "text": {"format": 7}}', b'{"input": "x", "reasoning": "high"}']
    for body in bodies:
        response = httpx.post(url, content=body, headers=headers, timeout=30)
        assert response.status_code == 400, (body[:60], response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(url, json={"model": "no-such-model", "input": "x"}, headers=headers, timeout=30)
    assert response.status_code == 404
    assert httpx.post(url, json={"input": "x"}, timeout=30).status_code == 401
    response = httpx.post(url, json={"model": MODEL_NAME, "input": "x", "max_output_tokens": 2},
                          headers=headers, timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "incomplete"


def test_metrics_count_response_requests(client, server):
    """/metrics counts a Responses request as the other routes' (one finished request, its tokens)."""
    before = metric_values(server)
    client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3, **GREEDY)
    after = metric_values(server)
    finished = "slipstream:request_success_total:length"
    assert after[finished] - before[finished] == 1
    assert after["slipstream:generation_tokens_total"] - before["slipstream:generation_tokens_total"] == 3


def engine_output(text: str, finish_reason: str | None) -> RequestOutput:
    """The engine's output of a reply of `text`, about four characters a token, from 3 prompt tokens."""
    completion = CompletionOutput(index=0, text=text, token_ids=[5] * max(1, len(text) // 4),
                                  finish_reason=finish_reason)
    return RequestOutput(request_id="r-0", prompt=None, prompt_token_ids=[1, 2, 3], outputs=[completion],
                         finished=finish_reason is not None, metrics=RequestMetrics(arrival_time_s=0.0))


def stream_events(lines: list[str]) -> list[Any]:
    """A stream's server-sent events as the `openai` package's types (validating each), each named
    by its type, numbered 0, 1, 2, ..."""
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = []
    for line in lines:
        name, data = line.strip().split("\n")
        events.append(adapter.validate_python(json.loads(data.removeprefix("data: "))))
        assert name == f"event: {events[-1].type}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def test_auto_tool_call_reply_as_items_and_events_openai_validates():
    """An "auto" reply read by the hermes parser (the server's --tool-call-parser): its text before
    the call is a message item, the call a function_call item with the call's JSON arguments; the
    Response and every stream event validate as the `openai` package's own types, in order."""
    call_text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    text = f"Let me see.<tool_call>{call_text}</tool_call>"
    settings = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 1.0}
    builder = ResponseBuilder(MODEL_NAME, settings, num_logprobs=None, tool_calls=ToolCalls("auto"))
    partial, final = engine_output(text[:20], None), engine_output(text, "stop")
    response = openai.types.responses.Response.model_validate(builder.response(final))
    message, call = response.output
    assert (message.type, message.content[0].text) == ("message", "Let me see.")
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                   {"city": "Oslo", "unit": "C"})
    assert response.status == "completed" and response.usage.input_tokens == 3
    events = stream_events([*builder.opening(), *builder.update(partial), *builder.closing(final)])
    assert [event.type for event in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[-1].response.output[1].arguments == events[-3].arguments


def test_an_empty_reply_that_may_be_calls_is_an_empty_message():
    """A "required" or "auto" reply with neither text nor a call (EOS at once) is the empty message
    a plain text reply is, not `output: []`: the Response and its events (validated as the
    `openai` package's types) are those of a request without tools, ids aside."""
    final = engine_output("", "stop")

    def answer(tool_calls: ToolCalls | None) -> tuple[Any, list[Any]]:
        settings = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True}
        builder = ResponseBuilder(MODEL_NAME, settings, num_logprobs=None, tool_calls=tool_calls)
        response = openai.types.responses.Response.model_validate(builder.response(final))
        return response, stream_events([*builder.opening(), *builder.update(final), *builder.closing(final)])

    def shape(response) -> list[tuple[str, str, str]]:
        return [(item.type, item.status, item.content[0].text) for item in response.output]

    plain, plain_events = answer(None)
    assert shape(plain) == [("message", "completed", "")]
    for mode in ("auto", "required"):
        response, events = answer(ToolCalls(mode))
        assert shape(response) == shape(events[-1].response) == shape(plain), mode
        assert [event.type for event in events] == [event.type for event in plain_events], mode


def test_raw_response_and_events_validate_as_openais_types(server):
    """What the server sends, read raw (the client parses leniently): the Response and every event
    of its stream, logprobs included, validate as the `openai` package's own types."""
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 6, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"], "metadata": {"run": "1"},
            "reasoning": {"effort": "low"}, "user": "u"}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    raw = httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=30).json()
    response = openai.types.responses.Response.model_validate(raw)
    assert len(response.output[0].content[0].logprobs) == 6 and response.metadata == {"run": "1"}
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    with httpx.stream("POST", server.url + "/v1/responses", json=body | {"stream": True}, headers=headers,
                      timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    events = [adapter.validate_python(json.loads(line.removeprefix("data: "))) for line in lines]
    assert events[-1].type == "response.completed"
    assert sum(len(e.logprobs) for e in events if e.type == "response.output_text.delta") == 6


def test_a_lora_adapter_answers_under_its_name(model_dir, tmp_path):
    """`model` may name a LoRA adapter, resolved as on the chat route: the greedy Response equals
    the chat route's reply under that adapter (which differs from the base model's) and names it;
    a name not served is a 404."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    adapter = save_random_adapter(tmp_path / "A", hf, rank=8, seed=1, scale=0.5)
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=64, enable_lora=True))
    try:
        config = ServerConfig(port=0, served_model_name=MODEL_NAME,
                              lora_modules=(LoRAModulePath(name="A", path=str(adapter)),))
        with in_process(OpenAIServer(engine, config)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            replies = {}
            for model in (MODEL_NAME, "A"):
                response = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, **GREEDY)
                messages = [{"role": "user", "content": QUESTION}]
                chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8,
                                                      **GREEDY)
                assert response.output_text == chat.choices[0].message.content and response.model == model
                replies[model] = response.output_text
            assert replies["A"] != replies[MODEL_NAME]
            with pytest.raises(openai.NotFoundError):
                client.responses.create(model="B", input=QUESTION)
    finally:
        engine.shutdown()
