"""--reasoning-parser (vLLM's): the think-tag parsers on replies cut at every position, against
hand-written splits; and a real server, driven by the official `openai` client, whose reasoning
replies (forced with guided_regex) come back split in chat completions and Responses, whole and
streamed, against the same server's raw text without the flag split by `str.partition`.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import TypeAdapter
from serve_fixtures import kv_bytes_for_blocks
from server_process import MODEL_NAME, in_process

from slipstream.cli import build_parser
from slipstream.serve import protocol
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.reasoning_parsers import REASONING_PARSERS
from slipstream.serve.server import OpenAIServer, ServerConfig, served_engine_config

pytest_plugins = ["serve_fixtures", "server_process"]

CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
SPLITS = [  # parser, chat_template_kwargs, reply, its reasoning and content as vLLM splits them
    ("deepseek_r1", None, "step one\nstep two</think>\n\nAnswer.", "step one\nstep two", "\n\nAnswer."),
    ("deepseek_r1", None, "<think>\nhmm</think>yes", "\nhmm", "yes"),
    ("deepseek_r1", None, "  <think>x</think>", "x", None),
    ("deepseek_r1", None, "cut short while thinking </thi", "cut short while thinking </thi", None),
    ("deepseek_r1", None, "</think>only an answer", None, "only an answer"),
    ("deepseek_r1", None, "a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", None, "<think>is a < b? </th>no</think>so", "is a < b? </th>no", "so"),
    ("qwen3", None, "<think>need the weather" + CALL, "need the weather", CALL),
    ("qwen3", {"enable_thinking": True}, "<think>x</think>y", "x", "y"),
    ("qwen3", {"enable_thinking": False}, "<think>x</think>y", None, "<think>x</think>y"),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>a <b> c<|end|><|start|>assistant<|channel|>final"
     "<|message|>Yes, <|x is 7.", "a <b> c", "Yes, <|x is 7."),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis"
     "<|message|> two<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>", "one two", "ok"),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>cut short", "cut short", None),
    ("openai_gptoss", None, "<|channel|>final<|message|>just this", None, "just this"),
    ("openai_gptoss", None, "plain text, no header", None, "plain text, no header"),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final"
     "<|message|>b<|end|><|start|>assistant<|channel|>analysis<|message|>c", "ac", "b"),
    ("openai_gptoss", None, "<|channel|>final<|message|>b<|end|><|start|>assistant<|channel|>analysis"
     "<|message|>c<|end|>", "c", "b"),
]


def streamed(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    """The reasoning pieces joined and the final content of `text` fed cut at `cuts`; every
    content seen on the way is the start of the final one."""
    stream, pieces, contents = parser.stream(), [], []
    for end in [*cuts, len(text)]:
        piece, content = stream.feed(text[:end], finished=end == len(text))
        pieces.append(piece)
        contents.append(content)
    assert all(contents[-1].startswith(content) for content in contents)
    return "".join(pieces), contents[-1]


@pytest.mark.parametrize(("name", "kwargs", "text", "reasoning", "content"), SPLITS)
def test_think_tag_parsers_split_as_vllm_whole_and_cut_anywhere(name, kwargs, text, reasoning, content):
    """A reply's reasoning and content, whole and fed in pieces cut at every position (one cut,
    and one character at a time), so that each tag arrives split every way: the pieces join to
    exactly the hand-written split, and no part of a tag is ever sent."""
    parser = REASONING_PARSERS[name](kwargs)
    split = parser.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    expected = (reasoning or "", content or "")
    for cut in range(len(text) + 1):
        assert streamed(parser, text, [cut]) == expected, cut
    assert streamed(parser, text, list(range(len(text)))) == expected


def test_harmony_reasoning_after_the_answer_began_is_told_apart():
    """A harmony reply back in its analysis channel after a final message: all its analysis text
    is the reasoning (as vLLM's chat field), and the part after the answer began is told apart
    (Responses' reasoning item after the message); the think-tag formats have none."""
    [late_after_early, late_only] = [text for _, _, text, _, _ in SPLITS[-2:]]
    gptoss = REASONING_PARSERS["openai_gptoss"](None)
    assert gptoss.split(late_after_early).late_reasoning == "c"
    assert gptoss.split(late_only).late_reasoning == "c"
    assert REASONING_PARSERS["qwen3"](None).split("<think>a</think>b<think>c").late_reasoning == ""


def test_reasoning_tokens_are_those_before_the_answer_less_one_token_tags():
    """usage's reasoning_tokens: the tokens up to the one that completes `</think>`, less the tags
    that are one token (vLLM's count), here with `</think>` in two pieces; all of a reply cut
    short while thinking; none with thinking off."""
    pieces = ["<think>", "a", "b", "</th", "ink>", "c", "d"]

    def decode(token_ids):
        return "".join(pieces[i] for i in token_ids)

    ids = list(range(len(pieces)))
    assert REASONING_PARSERS["deepseek_r1"](None).num_reasoning_tokens(ids, decode, {0}) == 4  # a b </th ink>
    assert REASONING_PARSERS["deepseek_r1"](None).num_reasoning_tokens(ids[:4], decode, {0}) == 3
    assert REASONING_PARSERS["qwen3"]({"enable_thinking": False}).num_reasoning_tokens(ids, decode, {0}) == 0
    pieces[:] = ["<think>", "a", "b", "<tool_call>", "{}", "</tool_call>"]  # Qwen3's tags are one token each
    ids = list(range(len(pieces)))  # the <tool_call> that begins the content is not reasoning
    assert REASONING_PARSERS["qwen3"](None).num_reasoning_tokens(ids, decode, {0}) == 2
    pieces[:] = ["<|channel|>", "analysis", "<|message|>", "x", "y", "<|end|>", "<|start|>", "assistant",
                 "<|channel|>", "final", "<|message|>", "z"]
    harmony_ids = {0, 2, 5, 6, 8, 10}  # the markers, one token each
    ids = list(range(len(pieces)))  # up to the final header's <|message|>, less the markers
    assert REASONING_PARSERS["openai_gptoss"](None).num_reasoning_tokens(ids, decode, harmony_ids) == 5
    pieces[:] = ["<|channel|>", "final", "<|message|>", "z", "<|end|>", "<|start|>", "assistant",
                 "<|channel|>", "analysis", "<|message|>", "y"]  # analysis only after the answer: none before
    assert REASONING_PARSERS["openai_gptoss"](None).num_reasoning_tokens(ids[:11], decode, harmony_ids) == 0


def engine_of(model_dir, reasoning_parser=None, in_reasoning=False) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_model_len=256, block_size=8,
                               kv_cache_memory=kv_bytes_for_blocks(256, 8), reasoning_parser=reasoning_parser,
                               structured_outputs_enable_in_reasoning=in_reasoning))


@pytest.fixture(scope="module")
def urls(model_dir, one_torch_thread):
    """Servers without a reasoning parser, with each, and with qwen3 and the hermes tool parser.
    Their engines constrain the reasoning too (structured_outputs_enable_in_reasoning), so that a
    regex can force a whole reply, thinking included, out of the random model."""
    qwen3_engine = engine_of(model_dir, "qwen3", in_reasoning=True)
    plain_server = OpenAIServer(engine_of(model_dir), ServerConfig(port=0, served_model_name=MODEL_NAME))
    r1_server = OpenAIServer(engine_of(model_dir, "deepseek_r1", in_reasoning=True), ServerConfig(
        port=0, served_model_name=MODEL_NAME, reasoning_parser="deepseek_r1", responses_store=True))
    with (in_process(plain_server) as plain, in_process(r1_server) as r1,
          in_process(OpenAIServer(qwen3_engine, ServerConfig(port=0, served_model_name=MODEL_NAME,
                                                             reasoning_parser="qwen3"))) as qwen3,
          in_process(OpenAIServer(engine_of(model_dir, "openai_gptoss", in_reasoning=True), ServerConfig(
              port=0, served_model_name=MODEL_NAME, reasoning_parser="openai_gptoss"))) as gptoss,
          in_process(OpenAIServer(qwen3_engine, ServerConfig(
              port=0, served_model_name=MODEL_NAME, reasoning_parser="qwen3", enable_auto_tool_choice=True,
              tool_call_parser="hermes"))) as tools):
        yield {None: plain, "deepseek_r1": r1, "qwen3": qwen3, "openai_gptoss": gptoss, "tools": tools}


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]
FORCED = {  # parser: a regex of a reply in its model's format
    "deepseek_r1": "[a-z ]{4,12}</think>[a-z ]{4,12}",
    "qwen3": "<think>[a-z ]{4,12}</think>[a-z ]{4,12}",
    "openai_gptoss": re.escape("<|channel|>analysis<|message|>") + "[a-z ]{4,12}" + re.escape(
        "<|end|><|start|>assistant<|channel|>final<|message|>") + "[a-z ]{4,12}",
}


def split_by_hand(name: str, raw: str) -> tuple[str, str]:
    """The reasoning and answer of a forced reply, read with str methods."""
    if name == "openai_gptoss":
        analysis, _, final = raw.partition("<|end|>")
        return analysis.partition("<|message|>")[2], final.partition("<|message|>")[2]
    thinking, _, answer = raw.removeprefix("<think>").partition("</think>")
    return thinking, answer


def chat(url: str, regex: str, **body):
    return client_of(url).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=150, temperature=0,
        extra_body={"guided_regex": regex} | body)


@pytest.mark.parametrize("name", sorted(FORCED))
def test_chat_reasoning_whole_and_streamed(urls, name):
    """With --reasoning-parser, a reply's thinking is the message's `reasoning` and its content the
    answer alone: the plain server's content (tags kept, as vLLM without the flag) cut at
    `</think>` (or, for harmony, read by channel); streamed, the deltas' reasoning and content join
    to the same, no tag text in them; include_reasoning false drops the reasoning only; usage
    counts reasoning tokens."""
    raw = chat(urls[None], FORCED[name]).choices[0].message.content
    assert re.fullmatch(FORCED[name], raw)
    thinking, answer = split_by_hand(name, raw)
    response = chat(urls[name], FORCED[name])
    message = response.choices[0].message
    assert (message.reasoning, message.content) == (thinking, answer)
    details = response.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.completion_tokens
    chunks = list(client_of(urls[name]).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=150, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"guided_regex": FORCED[name]}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    hidden = chat(urls[name], FORCED[name], include_reasoning=False).choices[0].message
    assert (hidden.reasoning, hidden.content) == (None, answer)


def sse_chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as stream:
        lines = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_chat_reasoning_stream_shape_logprobs_and_usage(urls):
    """As vLLM streams a reasoning reply: each step's logprobs ride in the chunk of its reasoning
    or content delta, and no chunk has a `content` key before the answer's text begins (a client
    may take one as the answer begun); every token's logprobs come once, the plain server's
    (reference: its whole reply's). With continuous_usage_stats each chunk counts the reasoning
    tokens so far, the last as the whole reply's. include_reasoning false leaves out the logprobs,
    whole and streamed (they would show the reasoning, so vLLM hides them), the answer kept."""
    regex = FORCED["deepseek_r1"]
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_completion_tokens": 150, "temperature": 0,
            "guided_regex": regex, "logprobs": True, "top_logprobs": 1}
    plain = httpx.post(urls[None] + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    thinking, answer = split_by_hand("deepseek_r1", plain["message"]["content"])
    whole = httpx.post(urls["deepseek_r1"] + "/v1/chat/completions", json=body, timeout=60).json()
    chunks = sse_chunks(urls["deepseek_r1"], body | {"stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    choices = [chunk["choices"][0] for chunk in chunks[1:] if chunk["choices"]]
    tokens = [token["token"] for choice in choices if choice["logprobs"]
              for token in choice["logprobs"]["content"]]
    assert tokens == [token["token"] for token in plain["logprobs"]["content"]]
    first_text = next(i for i, choice in enumerate(choices) if choice["delta"].get("content"))
    assert not any("content" in choice["delta"] for choice in choices[:first_text])
    assert "".join(choice["delta"].get("reasoning") or "" for choice in choices) == thinking
    assert "".join(choice["delta"].get("content") or "" for choice in choices) == answer
    counts = [chunk["usage"]["completion_tokens_details"]["reasoning_tokens"] for chunk in chunks]
    num_tokens = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert counts == sorted(counts) and counts[-1] == counts[-2] == num_tokens > 0
    hidden = body | {"include_reasoning": False}
    [whole] = httpx.post(urls["deepseek_r1"] + "/v1/chat/completions", json=hidden,
                         timeout=60).json()["choices"]
    assert (whole["message"]["content"], whole["logprobs"]) == (answer, None)
    chunks = sse_chunks(urls["deepseek_r1"], hidden | {"stream": True})
    choices = [chunk["choices"][0] for chunk in chunks[1:]]
    assert all(choice["logprobs"] is None and "reasoning" not in choice["delta"] for choice in choices)
    assert "".join(choice["delta"].get("content") or "" for choice in choices) == answer


def test_qwen3_with_thinking_off_has_no_reasoning(urls):
    """Qwen3 with chat_template_kwargs enable_thinking false: no reasoning, the content is the
    reply whole, as the plain server's."""
    regex = "[a-z]{3,8}</think>[a-z]{3,8}"
    raw = chat(urls[None], regex).choices[0].message.content
    off = chat(urls["qwen3"], regex, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert (getattr(off, "reasoning", None), off.content) == (None, raw)


def test_tool_calls_are_read_from_the_answer_only(urls):
    """qwen3 with the hermes tool parser: a call after the thinking is a tool call, whole and
    streamed, the reasoning apart and no content."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    regex = "<think>[a-z ]{4,12}</think>" + re.escape(call)
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=[tool], max_completion_tokens=80, temperature=0,
                   extra_body={"guided_regex": regex})
    plain = client_of(urls[None]).chat.completions.create(**request, tool_choice="none")  # the same prompt
    raw = plain.choices[0].message.content
    thinking = raw.removeprefix("<think>").partition("</think>")[0]
    choice = client_of(urls["tools"]).chat.completions.create(**request).choices[0]
    [made] = choice.message.tool_calls
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (thinking, None,
                                                                                          "tool_calls")
    assert (made.function.name, json.loads(made.function.arguments)) == ("get_weather", {"city": "Oslo"})
    chunks = list(client_of(urls["tools"]).chat.completions.create(**request, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thinking
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]
    assert not "".join(d.content or "" for d in deltas)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def gated_urls(model_dir, one_torch_thread):
    """deepseek_r1 and qwen3 servers whose engines constrain the answer only (as vLLM's)."""
    with (in_process(OpenAIServer(engine_of(model_dir, "deepseek_r1"), ServerConfig(
              port=0, served_model_name=MODEL_NAME, reasoning_parser="deepseek_r1"))) as r1,
          in_process(OpenAIServer(engine_of(model_dir, "qwen3"), ServerConfig(
              port=0, served_model_name=MODEL_NAME, reasoning_parser="qwen3"))) as qwen3):
        yield {"deepseek_r1": r1, "qwen3": qwen3}


def tag_bias(url: str) -> dict[str, int]:
    """A logit bias on the pieces of `</think>`: the random model samples them in random order,
    and under a seed below spells the tag within about 20 tokens."""
    pieces = httpx.post(url + "/tokenize", timeout=60, json={
        "model": MODEL_NAME, "prompt": "</think>", "add_special_tokens": False}).json()
    return {str(token_id): 30 for token_id in pieces["tokens"]}


@pytest.mark.parametrize(("name", "seed"), [("deepseek_r1", 7), ("qwen3", 11)])
def test_response_format_constrains_the_answer_after_the_reasoning(gated_urls, name, seed):
    """response_format json_schema with a reasoning parser: the model thinks freely (here a logit
    bias on the pieces of `</think>` makes it write them in random order until they happen to
    spell the tag) and the answer after the tag is JSON valid under the schema (json.loads and
    jsonschema): the message has both, the reasoning no JSON at all."""
    jsonschema = pytest.importorskip("jsonschema")
    client = client_of(gated_urls[name])
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=240, temperature=1, seed=seed,
        logit_bias=tag_bias(gated_urls[name]),
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "stop"
    assert message.reasoning and "</think>" not in message.reasoning
    with pytest.raises(json.JSONDecodeError):
        json.loads(message.reasoning)
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert 0 < response.usage.completion_tokens_details.reasoning_tokens < response.usage.completion_tokens


def test_a_named_tool_call_is_made_after_the_reasoning(gated_urls):
    """A named tool_choice (its arguments constrained to the function's parameters) with a reasoning
    parser: the reasoning, then the call, whose arguments are JSON valid under the parameters."""
    jsonschema = pytest.importorskip("jsonschema")
    url = gated_urls["deepseek_r1"]
    tool = {"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}
    choice = client_of(url).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=240, temperature=1, seed=7,
        logit_bias=tag_bias(url), tools=[tool],
        tool_choice={"type": "function", "function": {"name": "answer"}}).choices[0]
    [call] = choice.message.tool_calls
    assert choice.message.reasoning and choice.message.content is None
    assert call.function.name == "answer"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_qwen3_with_thinking_off_is_constrained_from_the_first_token(gated_urls):
    """Qwen3 with chat_template_kwargs enable_thinking false, whose template (the test model's)
    ignores the flag: the server reads the reply as all answer, so the engine constrains it from
    its first token too (as vLLM reads the request's flag): the content is JSON valid under the
    schema, no reasoning."""
    jsonschema = pytest.importorskip("jsonschema")
    message = client_of(gated_urls["qwen3"]).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=40, temperature=1, seed=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    ).choices[0].message
    assert getattr(message, "reasoning", None) is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_constrained_reply_cut_short_while_thinking(gated_urls):
    """A constrained reply that never ends its reasoning (max_tokens): finish_reason length, all
    reasoning, content null."""
    response = client_of(gated_urls["deepseek_r1"]).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0,
        logit_bias={"0": -100, "2": -100}, response_format={"type": "json_object"})  # no end-of-sequence
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("length", None)
    assert choice.message.reasoning and response.usage.completion_tokens == 8


def test_an_unknown_reasoning_parser_is_refused_at_start_up(capsys):
    """`--reasoning-parser` takes vLLM's names only: the CLI and ServerConfig name the flag and list
    the valid ones."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "model", "--reasoning-parser", "deepseek"])
    error = capsys.readouterr().err
    assert "--reasoning-parser" in error and "deepseek_r1" in error and "qwen3" in error
    with pytest.raises(ValueError, match="must be one of deepseek_r1, qwen3, openai_gptoss, got 'x'"):
        ServerConfig(reasoning_parser="x")


def test_a_server_parser_needs_the_engines(model_dir):
    """`slipstream serve --reasoning-parser` hands the parser to the engine (run_server's config),
    and a server's reasoning parser must be its engine's, which constrains replies after their
    reasoning: otherwise a ValueError naming both."""
    args = build_parser().parse_args(["serve", str(model_dir), "--reasoning-parser", "qwen3"])
    engine_config = EngineConfig(model=args.model_dir)
    served = served_engine_config(engine_config, ServerConfig(reasoning_parser=args.reasoning_parser))
    unparsed = served_engine_config(engine_config, ServerConfig())
    assert (served.reasoning_parser, unparsed.reasoning_parser) == ("qwen3", None)
    with pytest.raises(ValueError, match=r"reasoning_parser 'qwen3' needs an engine with the same "
                                         r"reasoning_parser \(it has None\)"):
        OpenAIServer(engine_of(model_dir), ServerConfig(port=0, reasoning_parser="qwen3"))


def responses_body(regex: str, **body) -> dict:
    return {"model": MODEL_NAME, "input": MESSAGES[0]["content"], "max_output_tokens": 150, "temperature": 0,
            "structured_outputs": {"regex": regex}} | body


@pytest.mark.parametrize("name", ["deepseek_r1", "openai_gptoss"])
def test_responses_reasoning_item_whole_and_streamed(urls, name):
    """A Response of a reasoning reply: a `reasoning` item (summary empty, one reasoning_text part)
    before the message, their texts the plain chat reply cut at `</think>`, reasoning tokens
    counted as the chat route counts them; streamed, the reasoning item's events and then the
    message's, in OpenAI's order, every event and the Responses valid as the `openai` package's
    types; include_reasoning false leaves the item out."""
    regex = FORCED[name]
    thinking, answer = split_by_hand(name, chat(urls[None], regex).choices[0].message.content)
    chat_usage = chat(urls[name], regex).usage
    url = urls[name] + "/v1/responses"
    raw = httpx.post(url, json=responses_body(regex), timeout=60).json()
    response = openai.types.responses.Response.model_validate(raw)
    reasoning, message = response.output
    assert (reasoning.type, reasoning.summary, [part.type for part in reasoning.content]) == (
        "reasoning", [], ["reasoning_text"])
    assert (reasoning.content[0].text, message.type, response.output_text) == (thinking, "message", answer)
    num_tokens = chat_usage.completion_tokens_details.reasoning_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == num_tokens > 0

    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    with httpx.stream("POST", url, json=responses_body(regex, stream=True), timeout=60) as stream:
        events = [adapter.validate_python(json.loads(line.removeprefix("data: ")))
                  for line in stream.iter_lines() if line.startswith("data: ")]
    kinds = [event.type.removeprefix("response.") for event in events]
    kinds = [kind for i, kind in enumerate(kinds) if not (kind.endswith(".delta") and kinds[i - 1] == kind)]
    assert kinds == ["created", "in_progress",
                     "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done",
                     "content_part.done", "output_item.done",
                     "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
                     "content_part.done", "output_item.done", "completed"]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    final = events[-1].response
    assert (final.output[0].content[0].text, final.output_text) == (thinking, answer)
    hidden = httpx.post(url, json=responses_body(regex, include_reasoning=False), timeout=60).json()
    assert [item["type"] for item in hidden["output"]] == ["message"]


HARMONY = {name: re.escape(text) for name, text in [("analysis", "<|channel|>analysis<|message|>"),
                                                   ("final", "<|channel|>final<|message|>"),
                                                   ("next", "<|end|><|start|>assistant")]}
LATE_ANALYSIS = [  # a harmony reply back in its analysis channel after its answer began
    HARMONY["analysis"] + "[a-z]{3}" + HARMONY["next"] + HARMONY["final"] + "[a-z]{3}" + HARMONY["next"]
    + HARMONY["analysis"] + "[a-z]{3}",
    HARMONY["final"] + "[a-z]{3}" + HARMONY["next"] + HARMONY["analysis"] + "[a-z]{3}",
]


@pytest.mark.parametrize("regex", LATE_ANALYSIS, ids=["analysis-final-analysis", "final-analysis"])
def test_responses_reasoning_after_the_answer_is_an_item_after_it(urls, regex):
    """A gpt-oss reply that goes back to its analysis channel after its final message: as vLLM's
    items follow the harmony messages, the Response has the reasoning before the answer (if any),
    the message, then a reasoning item of the later analysis (texts read from the plain server's
    raw reply by hand); streamed, each item's events come together in output order, added before
    done, the deltas joining to the done text, and the final Response is the whole one. With
    include_reasoning false the message's logprobs are empty, whole and streamed."""
    raw = chat(urls[None], regex).choices[0].message.content
    messages = [message.partition("<|message|>") for message in raw.split("<|end|><|start|>assistant")]
    expected = [("reasoning" if header.endswith("analysis") else "message", text)
                for header, _, text in messages]
    url = urls["openai_gptoss"] + "/v1/responses"
    whole = httpx.post(url, json=responses_body(regex), timeout=60).json()

    def texts(output):
        return [(item["type"], item["content"][0]["text"]) for item in output]

    assert texts(whole["output"]) == expected
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    with httpx.stream("POST", url, json=responses_body(regex, stream=True), timeout=60) as stream:
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                  if line.startswith("data: ")]
    for event in events:
        adapter.validate_python(event)
    indexes = [event["output_index"] for event in events if "output_index" in event]
    assert indexes == sorted(indexes) and set(indexes) == set(range(len(expected)))
    for index, (_, text) in enumerate(expected):
        of_item = [event for event in events if event.get("output_index") == index]
        added, done = of_item[0]["type"], of_item[-1]["type"]
        assert (added, done) == ("response.output_item.added", "response.output_item.done")
        deltas = "".join(event["delta"] for event in of_item if event["type"].endswith("text.delta"))
        [done] = [event for event in of_item if event["type"].endswith("text.done")]
        assert deltas == done["text"] == text
    assert texts(events[-1]["response"]["output"]) == expected
    hidden = responses_body(regex, include_reasoning=False, include=["message.output_text.logprobs"])
    whole = httpx.post(url, json=hidden, timeout=60).json()
    assert [item["content"][0]["logprobs"] for item in whole["output"]] == [[]]
    with httpx.stream("POST", url, json=hidden | {"stream": True}, timeout=60) as stream:
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                  if line.startswith("data: ")]
    assert [event["logprobs"] for event in events if event["type"] == "response.output_text.delta"] == [[]]


def test_reasoning_items_in_the_input_are_the_assistant_turns_reasoning(urls):
    """As vLLM renders them: a reasoning item and the assistant message after it are one assistant
    turn whose `reasoning` the chat template sees (as chat messages' reasoning, or its older name
    reasoning_content); previous_response_id renders a stored reasoning Response as its output
    items sent back as input do; an encrypted one is a 400 naming input."""
    turn = [{"role": "user", "content": "Is 7 prime?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "divisors"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
            {"role": "user", "content": "And 9?"}]
    request = protocol.ResponsesRequest.model_validate({"model": MODEL_NAME, "input": turn})
    assert [m.template_message() for m in request.chat_request().messages] == [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "yes", "reasoning": "divisors"},
        {"role": "user", "content": "And 9?"}]
    old_name = protocol.ChatCompletionRequest.model_validate({"model": MODEL_NAME, "messages": [
        {"role": "assistant", "content": "yes", "reasoning_content": "d"}]})
    assert old_name.messages[0].reasoning == "d"
    url = urls["deepseek_r1"] + "/v1/responses"
    first = httpx.post(url, json=responses_body(FORCED["deepseek_r1"], input=turn[:1]), timeout=60).json()
    assert first["output"][0]["type"] == "reasoning"
    follow_up = {"role": "user", "content": "And 9?"}
    continued = httpx.post(url, timeout=60, json=responses_body(
        FORCED["deepseek_r1"], input=[follow_up], previous_response_id=first["id"])).json()
    spelled_out = httpx.post(url, timeout=60, json=responses_body(
        FORCED["deepseek_r1"], input=[*turn[:1], *first["output"], follow_up])).json()
    assert continued["usage"]["input_tokens"] == spelled_out["usage"]["input_tokens"]
    encrypted = [{**turn[1], "encrypted_content": "gAAA"}]
    error = httpx.post(urls["deepseek_r1"] + "/v1/responses", json=responses_body("a", input=encrypted),
                       timeout=60)
    assert (error.status_code, error.json()["error"]["param"]) == (400, "input")
