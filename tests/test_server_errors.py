"""Malformed and hostile requests get the right 4xx status with OpenAI's error body, never a 500,
and the server keeps serving after all of them."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from server_process import API_KEY, MAX_MODEL_LEN, MODEL_NAME

from slipstream.serve.engine import Engine, EngineConfig
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
    ("stream_options without stream", COMPLETIONS, completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("max_tokens 0 without echo", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens 0 in chat", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("echo not a bool", COMPLETIONS, completion(echo="yes"), 400, "echo"),
    ("unknown model", COMPLETIONS, completion(model="gpt-4"), 404, "model"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages as a string", CHAT, chat(messages="hi"), 400, "messages"),
    ("bad role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
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
    ("tool_choice with guided_json", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice="required", guided_json={}), 400, "guided_json"),
    ("tool_choice unknown", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice="always"), 400, "tool_choice"),
    ("chat longer than the context", CHAT, chat(messages=[{"role": "user", "content": "tok " * 2000}]), 400,
     "messages"),
    ("empty stop string alone", COMPLETIONS, completion(stop=""), 400, "stop"),
    ("beam search with a temperature", COMPLETIONS, completion(use_beam_search=True, temperature=1.0), 400,
     "temperature"),
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
    ("guided_json with multipleOf", CHAT, chat(guided_json={"type": "number", "multipleOf": 2}), 400,
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


def test_a_bug_gets_a_500_that_closes_the_connection(model_dir, monkeypatch):
    """An unexpected exception (a bug) is an OpenAI-shaped 500 that tells the client to close the
    connection, which uvicorn drops after it; the client's next request goes out on a new one."""
    api = OpenAIServer(Engine(EngineConfig(model=str(model_dir), max_model_len=64)), ServerConfig(port=0))

    def broken(*args, **kwargs):
        raise RuntimeError("an injected bug")

    monkeypatch.setattr(api.engine, "add", broken)
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for _ in range(2):
                response = client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
                assert response.status_code == 500
                assert response.headers["connection"] == "close"
                assert response.json()["error"]["code"] == "internal_error"
                assert client.get("/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)
