"""--reasoning-parser (vLLM's): the think-tag parsers on replies cut at every position, against
hand-written splits; and a real server, driven by the official `openai` client, whose reasoning
replies (forced with guided_regex) come back split in chat completions and Responses, whole and
streamed, against the same server's raw text without the flag split by `str.partition`.
"""

from __future__ import annotations

import openai
import pytest
from server_process import MODEL_NAME, in_process

from slipstream.cli import build_parser
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.reasoning_parsers import REASONING_PARSERS
from slipstream.serve.server import OpenAIServer, ServerConfig

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


@pytest.fixture(scope="module")
def urls(model_dir, one_torch_thread):
    """One engine served three ways: without a reasoning parser, with deepseek_r1, with qwen3."""
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=256, block_size=8))
    with (in_process(OpenAIServer(engine, ServerConfig(port=0, served_model_name=MODEL_NAME))) as plain,
          in_process(OpenAIServer(engine, ServerConfig(port=0, served_model_name=MODEL_NAME,
                                                       reasoning_parser="deepseek_r1"))) as r1,
          in_process(OpenAIServer(engine, ServerConfig(port=0, served_model_name=MODEL_NAME,
                                                       reasoning_parser="qwen3"))) as qwen3):
        yield {None: plain, "deepseek_r1": r1, "qwen3": qwen3}


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]
FORCED = {  # parser: a regex of a reply in its model's format
    "deepseek_r1": "[a-z ]{4,12}</think>[a-z ]{4,12}",
    "qwen3": "<think>[a-z ]{4,12}</think>[a-z ]{4,12}",
}


def chat(url: str, regex: str, **body):
    return client_of(url).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=60, temperature=0,
        extra_body={"guided_regex": regex} | body)


@pytest.mark.parametrize("name", sorted(FORCED))
def test_chat_reasoning_whole_and_streamed(urls, name):
    """With --reasoning-parser, a reply's thinking is the message's `reasoning` and its content the
    answer alone: the plain server's content (tags kept, as vLLM without the flag) cut at
    `</think>`; streamed, the deltas' reasoning and content join to the same, no tag text in them;
    include_reasoning false drops the reasoning only; usage counts reasoning tokens."""
    raw = chat(urls[None], FORCED[name]).choices[0].message.content
    assert "</think>" in raw
    thinking, _, answer = raw.removeprefix("<think>").partition("</think>")
    response = chat(urls[name], FORCED[name])
    message = response.choices[0].message
    assert (message.reasoning, message.content) == (thinking, answer)
    details = response.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.completion_tokens
    chunks = list(client_of(urls[name]).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=60, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"guided_regex": FORCED[name]}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    hidden = chat(urls[name], FORCED[name], include_reasoning=False).choices[0].message
    assert (hidden.reasoning, hidden.content) == (None, answer)


def test_qwen3_with_thinking_off_has_no_reasoning(urls):
    """Qwen3 with chat_template_kwargs enable_thinking false: no reasoning, the content is the
    reply whole, as the plain server's."""
    regex = "[a-z]{3,8}</think>[a-z]{3,8}"
    raw = chat(urls[None], regex).choices[0].message.content
    off = chat(urls["qwen3"], regex, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert (getattr(off, "reasoning", None), off.content) == (None, raw)


def test_an_unknown_reasoning_parser_is_refused_at_start_up(capsys):
    """`--reasoning-parser` takes vLLM's names only: the CLI and ServerConfig name the flag and list
    the valid ones."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "model", "--reasoning-parser", "deepseek"])
    error = capsys.readouterr().err
    assert "--reasoning-parser" in error and "deepseek_r1" in error and "qwen3" in error
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3, got 'x'"):
        ServerConfig(reasoning_parser="x")
