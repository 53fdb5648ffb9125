"""Malformed and hostile requests get the right 4xx status with OpenAI's error body, never a 500,
and the server keeps serving after all of them."""

from __future__ import annotations

import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import API_KEY, MAX_MODEL_LEN, MODEL_NAME, in_process

from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.protocol import MAX_STOP_STRINGS
from slipstream.serve.server import OpenAIServer, ServerConfig

pytest_plugins = ["serve_fixtures", "server_process"]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def completion(**changes) -> dict:
    return OK_COMPLETION | changes


def chat(**changes) -> dict:
    return OK_CHAT | changes


# (name, path, body: dict (sent as JSON) or bytes (sent raw), expected status, expected param)
CASES = [
    ("bad JSON", COMPLETIONS, b'{"prompt": "hi", ', 400, None),
    ("embeddings from a generating server", "/v1/embeddings", {"input": "hi"}, 400, None),
    ("embedding input of the wrong type", "/v1/embeddings", {"input": [1.5]}, 400, "input"),
    ("body is not an object", COMPLETIONS, b"[1, 2, 3]", 400, None),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe\xfa"}', 400, None),
    ("deeply nested JSON", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("NaN temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("missing prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt"),
    ("max_tokens as a string", COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    ("temperature as a string", COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    ("stream as a number", COMPLETIONS, completion(stream=1), 400, "stream"),
    ("seed as a float", COMPLETIONS, completion(seed=1.5), 400, "seed"),
    ("negative max_tokens", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("huge max_tokens", COMPLETIONS, completion(max_tokens=10**12), 400, "max_tokens"),
    ("negative temperature", COMPLETIONS, completion(temperature=-0.5), 400, "temperature"),
    ("top_p of zero", COMPLETIONS, completion(top_p=0.0), 400, "top_p"),
    ("presence_penalty out of range", COMPLETIONS, completion(presence_penalty=3.0), 400, "presence_penalty"),
    ("n = 0", COMPLETIONS, completion(n=0), 400, "n"),
    ("n far too large", COMPLETIONS, completion(n=100_000), 400, "n"),
    ("logprobs too high", COMPLETIONS, completion(logprobs=1000), 400, "logprobs"),
    ("min_tokens above max_tokens", COMPLETIONS, completion(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("stop of the wrong type", COMPLETIONS, completion(stop=5), 400, "stop"),
    ("empty stop string", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("prompt token id out of the vocabulary", COMPLETIONS, completion(prompt=[1, 2, 10**7]), 400, "prompt"),
    ("negative prompt token id", COMPLETIONS, completion(prompt=[1, -2]), 400, "prompt"),
    ("stop token id out of the vocabulary", COMPLETIONS, completion(stop_token_ids=[10**7]), 400,
     "stop_token_ids"),
    ("prompt of mixed types", COMPLETIONS, completion(prompt=["a", 1]), 400, "prompt"),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt longer than the context", COMPLETIONS, completion(prompt=[7] * (MAX_MODEL_LEN + 10)), 400,
     "prompt"),
    ("text prompt longer than the context", COMPLETIONS, completion(prompt="tok " * 2000), 400, "prompt"),
    ("logit_bias key that is not a token id", COMPLETIONS, completion(logit_bias={"a": 10}), 400,
     "logit_bias"),
    ("logit_bias token out of the vocabulary", COMPLETIONS, completion(logit_bias={"10000000": 10}), 400,
     "logit_bias"),
    ("logit_bias value not a number", CHAT, chat(logit_bias={"5": "x"}), 400, "logit_bias"),
    ("logit_bias key of 5,000 digits, past int()'s limit", COMPLETIONS,
     completion(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    ("more stop strings than a request may give", COMPLETIONS,
     completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400, "stop"),
    ("more bad words than a request may give", COMPLETIONS,
     completion(bad_words=[f"w{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400, "bad_words"),
    ("stream_options without stream", COMPLETIONS, completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stream_options with a null flag without stream", CHAT, chat(stream_options={"include_usage": None}),
     400, "stream_options"),
    ("max_tokens 0 without echo", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens 0 in chat", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("echo not a bool", COMPLETIONS, completion(echo="yes"), 400, "echo"),
    ("unknown model", COMPLETIONS, completion(model="gpt-4"), 404, "model"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages as a string", CHAT, chat(messages="hi"), 400, "messages"),
    ("a role that is no string", CHAT, chat(messages=[{"role": 5, "content": "hi"}]), 400, "messages"),
    ("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages"),
    ("top_logprobs too high", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("tools with the default tool_choice, auto", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice"),
    ("a tool that is not a function", CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    ("tool_choice naming no tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice"),
    ("two tools of one name, one called by name", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2,
          tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tools"),
    ("a chat template in chat_template_kwargs of a server that takes none", CHAT,
     chat(chat_template_kwargs={"chat_template": "{{ messages[0].content }}"}), 400, "chat_template_kwargs"),
    ("a chat template in /tokenize's chat_template_kwargs", "/tokenize",
     {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "x"}}, 400,
     "chat_template_kwargs"),
    ("structured_outputs json of an empty type list", COMPLETIONS,
     completion(structured_outputs={"json": {"type": []}}), 400, "structured_outputs"),
    ("structured_outputs json that is only a reference to itself", COMPLETIONS,
     completion(structured_outputs={"json": {"$ref": "#"}}), 400, "structured_outputs"),
    ("tool_choice with guided_json", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice="required", guided_json={}), 400, "guided_json"),
    ("tool_choice unknown", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice="always"), 400, "tool_choice"),
    ("chat longer than the context", CHAT, chat(messages=[{"role": "user", "content": "tok " * 2000}]), 400,
     "messages"),
    ("empty stop string alone", COMPLETIONS, completion(stop=""), 400, "stop"),
    ("beam search with min_tokens", CHAT, chat(use_beam_search=True, min_tokens=2), 400, "min_tokens"),
    ("beam search with more beams than max_logprobs / 2", COMPLETIONS,
     completion(use_beam_search=True, n=11), 400, "n"),
    ("length_penalty without beam search", COMPLETIONS, completion(length_penalty=0.5), 400,
     "length_penalty"),
    ("use_beam_search not a bool", COMPLETIONS, completion(use_beam_search="yes"), 400, "use_beam_search"),
    ("guided_choice not a list", CHAT, chat(guided_choice="yes"), 400, "guided_choice"),
    ("guided_choice with an empty string", CHAT, chat(guided_choice=["yes", ""]), 400, "guided_choice"),
    ("structured_outputs json with uniqueItems", COMPLETIONS,
     completion(structured_outputs={"json": {"type": "array", "uniqueItems": True}}), 400,
     "structured_outputs"),
    ("structured_outputs grammar", COMPLETIONS, completion(structured_outputs={"grammar": "root ::= 'a'"}),
     400, "structured_outputs"),
    ("guided_choice and structured_outputs", CHAT,
     chat(guided_choice=["a"], structured_outputs={"choice": ["b"]}), 400, "guided_choice"),
    ("guided_regex with a backreference", CHAT, chat(guided_regex="(a)\\1"), 400, "guided_regex"),
    ("guided_regex and guided_choice", CHAT, chat(guided_regex="a", guided_choice=["a"]), 400,
     "guided_regex"),
    ("guided_json with uniqueItems", CHAT, chat(guided_json={"type": "array", "uniqueItems": True}), 400,
     "guided_json"),
    ("guided_json with a pattern that is a number", CHAT,
     chat(guided_json={"type": "string", "pattern": 1e308}), 400, "guided_json"),
    ("guided_json with no number within its bounds", CHAT,
     chat(guided_json={"type": "integer", "exclusiveMinimum": 0, "maximum": 0.5}), 400, "guided_json"),
    ("response_format json_schema without a schema", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format"),
    ("response_format and guided_json", CHAT,
     chat(response_format={"type": "json_object"}, guided_json={}), 400, "response_format"),
    ("empty allowed_token_ids", COMPLETIONS, completion(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("allowed_token_ids out of the vocabulary", COMPLETIONS, completion(allowed_token_ids=[10**7]), 400,
     "allowed_token_ids"),
    ("blank bad word", COMPLETIONS, completion(bad_words=["x", "  "]), 400, "bad_words"),
    ("bad_words as a string", COMPLETIONS, completion(bad_words="x"), 400, "bad_words"),
    ("truncate_prompt_tokens past the context", COMPLETIONS,
     completion(truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens below -1", CHAT, chat(truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens a string", COMPLETIONS, completion(truncate_prompt_tokens="4"), 400,
     "truncate_prompt_tokens"),
    ("functions", CHAT, chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions"),
    ("tool_choice without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("a tool call without arguments in the history", CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}]),
     400, "messages"),
    ("continue_final_message with a generation prompt", CHAT, chat(continue_final_message=True), 400,
     "continue_final_message"),
    ("min_tokens past the context, max_tokens unset", CHAT,
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "min_tokens": MAX_MODEL_LEN}, 400,
     "min_tokens"),
    ("min_tokens past the context, max_tokens null", COMPLETIONS,
     completion(max_tokens=None, min_tokens=MAX_MODEL_LEN), 400, "min_tokens"),
    ("max_completion_tokens past the context", CHAT, chat(max_tokens=None, max_completion_tokens=10**5), 400,
     "max_completion_tokens"),
    ("10 MB body", COMPLETIONS, completion(prompt="x" * 10 * 2**20), 413, None),
    ("unknown route", "/v1/engines", {}, 404, None),
    # a run of 1,000 quantifiers: nested too deep (a 400), not a RecursionError
    *((f"regex of 'a' and {quantifier!r} x 1000", COMPLETIONS,
       completion(structured_outputs={"regex": "a" + quantifier * 1000}), 400, "structured_outputs")
      for quantifier in ("*", "{1}", "{0,1}")),
    ("schema pattern of 'a' and '*' x 1000", CHAT, chat(response_format={"type": "json_schema", "json_schema":
        {"name": "x", "schema": {"type": "string", "pattern": "a" + "*" * 1000}}}), 400, "response_format"),
    ("tool parameter pattern of 'a' and '*' x 1000, streamed", CHAT, chat(
        stream=True, tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "a" + "*" * 1000}}}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tool_choice"),
    # hostile JSON inside string fields, and numbers past float's range
    ("guided_json as a string of JSON nested 2,000 deep", COMPLETIONS,
     completion(guided_json="[" * 2000 + "]" * 2000), 400, "guided_json"),
    ("structured_outputs json as a string of JSON nested 2,000 deep", COMPLETIONS,
     completion(structured_outputs={"json": "[" * 2000 + "]" * 2000}), 400, "structured_outputs"),
    *((f"tool call arguments {name}{where}", path, body | {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]},
       400, "messages")
      for name, arguments in (("nested 2,000 deep", "[" * 2000 + "]" * 2000), ("of 5,000 digits", "1" * 5000))
      for where, path, body in (("", CHAT, OK_CHAT), (" on /tokenize", "/tokenize", {}))),
    ("schema minimum past float's range", COMPLETIONS,
     completion(structured_outputs={"json": {"type": "integer", "minimum": 10**400}}), 400,
     "structured_outputs"),
    ("schema maximum past float's range", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "number", "maximum": 10**400}}}), 400, "response_format"),
    # a schema an output can start but never finish: a property that is only a $ref to itself
    ("structured_outputs json with a property that is itself", COMPLETIONS,
     completion(structured_outputs={"json": {"type": "object", "required": ["a"],
                                             "properties": {"a": {"$ref": "#/properties/a"}}}}),
     400, "structured_outputs"),
]


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("name, path, body, status, param", CASES, ids=[case[0] for case in CASES])
def test_bad_request_gets_an_openai_error(http, name, path, body, status, param):
    """Each malformed or hostile request gets its 4xx with OpenAI's error body and the param named."""
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert_openai_error(response, status, param)


def test_auth_errors_and_methods(server, http):
    """A missing or wrong bearer token is a 401, a wrong method a 405, both in OpenAI's shape."""
    assert_openai_error(httpx.post(server.url + COMPLETIONS, json=OK_COMPLETION), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(httpx.post(server.url + COMPLETIONS, json=OK_COMPLETION, headers=wrong), 401)
    assert_openai_error(http.get(COMPLETIONS), 405)


def test_server_still_serves_after_bad_requests(http):
    """After every kind of bad input the engine still answers (runs after the cases above)."""
    for path, body in ((COMPLETIONS, OK_COMPLETION), (CHAT, OK_CHAT)):
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1


def test_null_fields_take_their_defaults(http):
    """OpenAI's optional fields are nullable and vLLM reads a null as the default: `stream`, `n`,
    `echo`, chat's `logprobs` and `stream_options`' flags are 200s, and completions'
    `"max_tokens": null` is the default 16 tokens, not the rest of the context."""
    nulls = dict.fromkeys(("stream", "n", "echo", "ignore_eos", "min_tokens", "skip_special_tokens"))
    response = http.post(COMPLETIONS, json=completion(max_tokens=None, temperature=0, **nulls))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 16
    response = http.post(CHAT, json=chat(max_tokens=2, stream=None, n=None, logprobs=None,
                                         add_generation_prompt=None))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    response = http.post(CHAT, json=chat(max_tokens=None, stream=True,
                                         stream_options={"include_usage": None}))
    assert response.status_code == 200, response.text
    response = http.post(COMPLETIONS, json=completion(prompt=None))
    assert_openai_error(response, 400, "prompt")


def test_what_vllm_accepts_is_accepted(http):
    """vLLM 0.32 takes messages of any role (its custom-role messages: Llama 3.1's "ipython"),
    top_logprobs 0 without logprobs (it refuses only a positive one) and an empty stream_options
    without stream (it refuses only a non-empty one)."""
    for path, body in ((CHAT, chat(messages=[{"role": "user", "content": "hi"},
                                             {"role": "ipython", "content": "42"}])),
                       (CHAT, chat(top_logprobs=0)), (CHAT, chat(stream_options={})),
                       (COMPLETIONS, completion(stream_options={})),
                       ("/tokenize", {"messages": [{"role": "function", "content": "x"}]})):
        response = http.post(path, json=body)
        assert response.status_code == 200, (body, response.text)


def test_context_overflow_is_worded_as_openai_and_vllm(http):
    """Clients detect an overflow by OpenAI's code or by the phrase "maximum context length is N
    tokens" (vLLM's and OpenAI's wording), and read N from it."""
    for body, param in ((completion(prompt=[7] * (MAX_MODEL_LEN + 10)), "prompt"),
                        (completion(prompt=[7] * 10, max_tokens=MAX_MODEL_LEN), "max_tokens"),
                        (chat(max_tokens=None, max_completion_tokens=10**5), "max_completion_tokens")):
        response = http.post(COMPLETIONS if "prompt" in body else CHAT, json=body)
        error = assert_openai_error(response, 400, param)
        assert error["code"] == "context_length_exceeded"
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_a_bug_gets_a_500_that_closes_the_connection(model_dir, monkeypatch):
    """An unexpected exception (a bug) is an OpenAI-shaped 500 that tells the client to close the
    connection, which uvicorn drops after it; the client's next request goes out on a new one."""
    api = OpenAIServer(Engine(EngineConfig(model=str(model_dir), max_model_len=64)), ServerConfig(port=0))

    def broken(*args, **kwargs):
        raise RuntimeError("an injected bug")

    monkeypatch.setattr(api.engine, "add", broken)
    with in_process(api) as url, httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(2):
            response = client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
            assert response.status_code == 500
            assert response.headers["connection"] == "close"
            assert response.json()["error"]["code"] == "internal_error"
            assert client.get("/health").status_code == 200


def test_health_says_when_the_engine_has_stopped(model_dir, monkeypatch):
    """/health is 503 once the engine's thread is gone, saying so (not that the server is shutting
    down, which a dead engine does not mean)."""
    api = OpenAIServer(Engine(EngineConfig(model=str(model_dir), max_model_len=64)), ServerConfig(port=0))
    with in_process(api) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        monkeypatch.setattr(type(api.engine), "is_alive", property(lambda self: False))
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["error"] == {"message": "the engine has stopped", "type": "server_error",
                                             "param": None, "code": "unavailable"}


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hello"}),
                                        ("/detokenize", {"tokens": [5, 6]})])
def test_tokenize_routes_leave_the_event_loop_free(model_dir, monkeypatch, path, body):
    """/tokenize and /detokenize, open without an API key, work off the event loop: while one is
    held inside the tokenizer (as by a megabytes-long text), /health still answers."""
    api = OpenAIServer(Engine(EngineConfig(model=str(model_dir), max_model_len=64)), ServerConfig(port=0))
    entered, release = threading.Event(), threading.Event()
    name = "encode" if path == "/tokenize" else "decode"
    work = getattr(api.tokenizer, name)

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return work(*args, **kwargs)

    monkeypatch.setattr(api.tokenizer, name, held)
    with in_process(api) as url, httpx.Client(base_url=url, timeout=30) as client:
        result = {}
        call = threading.Thread(target=lambda: result.update(response=client.post(path, json=body)))
        call.start()
        try:
            assert entered.wait(30)
            assert client.get("/health", timeout=5).status_code == 200
        finally:
            release.set()
            call.join(30)
        assert result["response"].status_code == 200, result["response"].text


@pytest.mark.parametrize("template, error", [
    ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),
    ("{{ range(2**62) | list }}", "OverflowError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "RecursionError"),
    ("{{ '%(a)s' % {} }}", "KeyError"),
    ("{{ 'abc' | truncate(-5) }}", "AssertionError"),  # any exception at all: jinja asserts too
    ("{{ '\\udcff' }}", "can't encode character"),  # a lone surrogate is no text to tokenize
    ("{{ '{0}'.format() }}", "IndexError"),
    ("{{ 'x' * 10**6 }}", "rendered 1,000,000 characters"),
    ("{{ 'x' * 10**10 }}", "repeating a sequence of 1 10,000,000,000 times"),  # it took the memory
])
def test_a_failing_request_template_is_a_400_naming_it(model_dir, template, error):
    """A trusted request's chat template that fails in Python (the sandbox's range limit, a
    division by zero, a missing key or index), recurses without end, or writes more text than 4
    characters per byte a body may hold is a 400 naming the template, on chat and /tokenize, and the
    server serves on; a long rendering that truncate_prompt_tokens cuts to the context is served."""
    api = OpenAIServer(Engine(EngineConfig(model=str(model_dir), max_model_len=64)),
                       ServerConfig(port=0, trust_request_chat_template=True, max_body_bytes=2**16))
    messages = [{"role": "user", "content": "hi"}]
    with in_process(api) as url, httpx.Client(base_url=url, timeout=60) as client:
        for path, body in ((CHAT, {"messages": messages, "max_tokens": 2, "chat_template": template}),
                           ("/tokenize", {"messages": messages, "chat_template": template}),
                           ("/tokenize", {"messages": messages,
                                          "chat_template_kwargs": {"chat_template": template}})):
            param = "chat_template_kwargs" if "chat_template_kwargs" in body else "chat_template"
            message = assert_openai_error(client.post(path, json=body), 400, param)["message"]
            assert "request's chat template" in message and error in message
        assert client.post(CHAT, json={"messages": messages, "max_tokens": 2}).status_code == 200
        long = [{"role": "user", "content": "word " * 1000}]
        response = client.post(CHAT, json={"messages": long, "max_tokens": 2, "truncate_prompt_tokens": 32,
                                           "chat_template": api.tokenizer.template_source(None, None)})
        assert response.status_code == 200, response.text


# ---- fuzzing: random bodies over the fields the routes know ------------------------------------

SCHEMA_KEYS = ["type", "properties", "items", "required", "enum", "const", "anyOf", "allOf", "$ref",
               "$defs", "minimum", "exclusiveMaximum", "pattern", "format", "minItems", "maxLength",
               "additionalProperties", "prefixItems", "role", "content", "name", "function", "parameters",
               "json_schema", "schema", "choice", "regex", "json", "json_object", "grammar", "text"]
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(SCHEMA_KEYS) | st.text(max_size=4), children, max_size=4),
    max_leaves=12)
SCHEMA = st.recursive(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object"]) | ANY_JSON,
        **{key: ANY_JSON for key in ("pattern", "format", "minLength", "maxLength", "minimum",
                                     "exclusiveMaximum", "enum", "const", "anyOf", "$ref")}}),
    lambda children: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=3), children, max_size=3)},
        optional={"required": ANY_JSON, "additionalProperties": children})
    | st.fixed_dictionaries({"type": st.just("array"), "items": children},
                            optional={"minItems": ANY_JSON, "prefixItems": ANY_JSON}),
    max_leaves=6)
TOOL = st.fixed_dictionaries({"name": st.text(min_size=1, max_size=4), "parameters": SCHEMA | ANY_JSON})
FIELD_VALUES = {
    "n": st.sampled_from([1, 2, 0, 129]), "temperature": st.sampled_from([0, 0.7, 2.5, -1, 1e-30]),
    "top_p": st.sampled_from([1, 0.5, 1e-30, 0]), "top_k": st.sampled_from([-1, 0, 5, 2**63]),
    "min_p": st.sampled_from([0, 0.5, 1.1]), "seed": st.sampled_from([0, -1, 2**63 - 1, 2**63]),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "logit_bias": st.dictionaries(st.text(max_size=4) | st.integers(-5, 10**6).map(str),
                                  st.floats(allow_nan=False, allow_infinity=False), max_size=2),
    "presence_penalty": st.sampled_from([0, 2, -2.5]),
    "repetition_penalty": st.sampled_from([1, 0.5, 0, 1e10]),
    "min_tokens": st.sampled_from([0, 1, 10**9]), "max_tokens": st.sampled_from([1, 3, 0, -1, 10**9]),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(-1, 10**6), max_size=2),
    "logprobs": st.sampled_from([0, 5, 21, True]), "top_logprobs": st.sampled_from([0, 5, 21]),
    "prompt_logprobs": st.sampled_from([0, 3, 21]), "echo": st.booleans(), "stream": st.booleans(),
    "allowed_token_ids": st.lists(st.integers(-1, 10**6), max_size=3),
    "bad_words": st.lists(st.text(max_size=4), max_size=2),
    "truncate_prompt_tokens": st.sampled_from([-2, -1, 1]),
    "structured_outputs": ANY_JSON | st.fixed_dictionaries({"json": SCHEMA}) | st.fixed_dictionaries(
        {"regex": st.text(max_size=6)}) | st.fixed_dictionaries({"grammar": st.text(max_size=12)}),
    "guided_json": SCHEMA | ANY_JSON, "guided_regex": st.text(max_size=6),
    "guided_grammar": st.text(max_size=12),
    "response_format": ANY_JSON | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                                        st.fixed_dictionaries({"name": st.just("x"),
                                                                               "schema": SCHEMA})}),
    "use_beam_search": st.booleans(), "length_penalty": st.sampled_from([1.0, -1e308, 1e308]),
    "tools": ANY_JSON | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": TOOL}),
                                 max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | ANY_JSON,
    "chat_template_kwargs": ANY_JSON, "stream_options": ANY_JSON,
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"])},
                                optional={"content": st.text(max_size=8) | ANY_JSON, "tool_calls": ANY_JSON,
                                          "name": ANY_JSON})


@st.composite
def request_bodies(draw):
    chat = draw(st.booleans())
    fields = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=5, unique=True))
    body = {name: draw(FIELD_VALUES[name]) for name in fields}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3
    if chat:
        body["messages"] = draw(st.lists(MESSAGE, max_size=3) | ANY_JSON)
    else:
        body["prompt"] = draw(st.text(max_size=12) | st.lists(st.integers(-1, 10**6), max_size=4) | ANY_JSON)
    return (CHAT if chat else COMPLETIONS), body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=request_bodies())
def test_random_requests_never_get_a_server_error(http, case):
    """Whatever mix of fields and values a body holds, the answer is a 200 (a stream that ends with
    [DONE]) or a 4xx in OpenAI's error shape, never a 5xx: each 500 this found was a fix."""
    path, body = case
    response = http.post(path, json=body)
    if response.status_code == 200:
        assert body.get("stream") is not True or response.text.rstrip().endswith("data: [DONE]"), body
    else:
        assert 400 <= response.status_code < 500, (body, response.text)
        assert response.json()["error"]["message"]


@pytest.mark.parametrize("changes, message", [
    (dict(host=""), "host must not be empty"),
    (dict(drain_timeout_s=float("nan")), "drain_timeout_s must be >= 0, got nan"),
    (dict(api_key="clé"), "api_key must be printable ASCII"),
])
def test_server_settings_that_would_expose_lock_or_misread_are_refused(changes, message):
    """An empty host (uvicorn listens on every interface), a NaN drain timeout (read as 0) and an
    API key no HTTP client can send (every /v1 route locked) are refused at startup."""
    with pytest.raises(ValueError, match=message):
        ServerConfig(**changes)


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(model_dir, capsys):
    """The address is bound before the engine is built: a port in use is one line and status 2
    (uvicorn loaded the model, logged four lines and exited with status 3)."""
    import socket

    from slipstream.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(model_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"slipstream serve: error: cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
