"""OpenAI's response side: completions and chat completions as whole JSON bodies or as server-sent
event chunks, with usage and logprobs in OpenAI's two formats (legacy completions, chat), and
embeddings.

A stream sends each choice's news as its own chunk: the text added since the last chunk (the
engine already holds back a possible stop-string prefix), the logprobs of the new tokens, and the
finish reason on the last one. Chunks with nothing to say are not sent.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from slipstream.serve.pooling import EmbeddingRequestOutput
from slipstream.serve.request import CompletionOutput, Logprob, RequestOutput
from slipstream.serve.tool_parsers import TOOL_CALL_PARSERS, WholeCallsStream, tool_call

if TYPE_CHECKING:  # reasoning_replies builds on this module
    from slipstream.serve.reasoning_parsers import HarmonyStream, ReasoningStream
    from slipstream.serve.reasoning_replies import Reasoning

MIN_LOGPROB = -9999.0
"""-inf is not JSON; like vLLM, report impossible tokens with this floor."""


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every response and chunk of one API call starts with."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)

    def head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}


def embedding_response(meta: ResponseMeta, outputs: list[EmbeddingRequestOutput],
                       encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings list: one entry per input, in order; base64 is the little-endian float32
    bytes of each vector."""
    def encoded(vector: list[float]) -> list[float] | str:
        if encoding_format == "float":
            return vector
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")

    data = [{"object": "embedding", "index": index, "embedding": encoded(output.outputs.embedding)}
            for index, output in enumerate(outputs)]
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"id": meta.id, "object": "list", "created": meta.created, "model": meta.model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def usage(outputs: Iterable[RequestOutput], echo: Echo | None = None) -> dict[str, Any]:
    """Prompt tokens (once per prompt), of which the prefix cache held `cached_tokens`, and
    generated tokens (over all choices; none for an echo of the prompt alone)."""
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0
    if echo is None or echo.generate:
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


def _chunk_usage(mode: str | None, num_prompt_tokens: int, num_completion_tokens: int,
                 num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The `usage` of a streamed choice's chunk: absent unless asked for; null with include_usage
    (the last chunk carries it, as OpenAI documents); with vLLM's continuous_usage_stats, the
    choice's tokens so far, and with a reasoning parser its reasoning tokens so far (as vLLM)."""
    if mode is None:
        return {}
    if mode == "final":
        return {"usage": None}
    usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
             "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return {"usage": usage}


@dataclasses.dataclass(frozen=True, slots=True)
class Echo:
    """Completions' `echo`: every choice starts with its prompt (the text, the ids and, when
    logprobs are asked for, the prompt's logprobs: None for the first token, which nothing
    predicts). Without `generate` (`max_tokens` 0) a choice is the prompt alone, as in vLLM,
    which scoring harnesses (lm-evaluation-harness) use to read a text's log-likelihood."""

    prompt_texts: dict[str, str]
    """Request id -> the text echoed."""
    first_tokens: dict[str, str]
    """Request id -> the text of the prompt's first token (its logprobs entry has no position)."""
    generate: bool
    with_logprobs: bool

    def choice(self, output: RequestOutput, completion: CompletionOutput) -> CompletionOutput | None:
        """The choice as the client sees it; None while the prompt's logprobs are still being
        computed (a chunked prefill), so that a stream sends the prompt whole."""
        logprobs = None
        if self.with_logprobs:
            scored = output.prompt_logprobs or []
            if len(scored) < len(output.prompt_token_ids):
                return None
            logprobs = [*scored, *(completion.logprobs if self.generate else [])]
        prompt_text = self.prompt_texts[output.request_id]
        if not self.generate:
            finish = None if completion.finish_reason is None else "length"
            return CompletionOutput(index=completion.index, text=prompt_text,
                                    token_ids=list(output.prompt_token_ids), logprobs=logprobs,
                                    finish_reason=finish)
        return dataclasses.replace(completion, text=prompt_text + completion.text,
                                   token_ids=[*output.prompt_token_ids, *completion.token_ids],
                                   logprobs=logprobs)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCalls:
    """A reply that is, or may be, a tool call. "named" and "required" (vLLM's forced
    tool_choice): the engine constrained the text to JSON, a named function's arguments or a list
    of {"name", "parameters"} calls; the reply becomes OpenAI's `tool_calls`, its content null.
    A named call's arguments are its text even where max_tokens cut it short (as vLLM, and as the
    stream sends them); a "required" text cut short, which holds no complete list, stays the
    content. "auto": the model's own call format, read by the server's `--tool-call-parser`
    (tool_parsers.py)."""

    mode: str
    """"named", "required" or "auto"."""
    function: str | None = None
    """The named function."""
    parser: str = "hermes"
    """"auto"'s: a name in tool_parsers.TOOL_CALL_PARSERS."""
    parallel: bool = True
    """False: an "auto" reply keeps only its first call (the request's parallel_tool_calls)."""

    def stream(self) -> WholeCallsStream:
        """A reader of one "auto" reply as it grows."""
        return TOOL_CALL_PARSERS[self.parser]().stream()

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The calls of a reply's text; None where it is no complete call."""
        if self.mode == "auto":
            return self._kept(TOOL_CALL_PARSERS[self.parser]().parse(text).tool_calls) or None
        if self.mode == "named":
            return [tool_call(self.function, text)]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]

    def message(self, completion: CompletionOutput) -> dict[str, Any]:
        if self.mode == "auto":
            parsed = TOOL_CALL_PARSERS[self.parser]().parse(completion.text)
            message = {"role": "assistant", "content": parsed.content}
            return message | ({"tool_calls": self._kept(parsed.tool_calls)} if parsed.tool_calls else {})
        calls = self.calls(completion.text)
        if calls is None:
            return {"role": "assistant", "content": completion.text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def kept_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        """A streamed "auto" delta without the calls past the first, unless parallel (as vLLM)."""
        if self.parallel or "tool_calls" not in delta:
            return delta
        kept = {key: value for key, value in delta.items() if key != "tool_calls"}
        calls = [call for call in delta["tool_calls"] if call["index"] == 0]
        return kept | ({"tool_calls": calls} if calls else {})

    def _kept(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return calls if self.parallel else calls[:1]

    def finish(self, completion: CompletionOutput) -> dict[str, Any]:
        """As vLLM: "tool_calls" where a "required" reply ended as a complete list of calls, or an
        "auto" one called a tool."""
        finish = _finish(completion)
        if self.mode != "named" and completion.finish_reason == "stop" and self.calls(completion.text):
            finish["finish_reason"] = "tool_calls"
        return finish


# ---- logprobs -------------------------------------------------------------------------------


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _positions(completion: CompletionOutput, start: int, end: int):
    return zip(completion.token_ids[start:end], completion.logprobs[start:end], strict=True)


def completion_logprobs(completion: CompletionOutput, start: int, end: int, text_offset: int, *,
                        first_token: str = "", as_token_ids: bool = False) -> tuple[dict, int]:
    """Legacy completions logprobs of tokens [start, end): the sampled token's and the top ones',
    and the text offset past them.
    A position without logprobs (an echoed prompt's first token, whose text is `first_token`) has
    None for both, as in vLLM. With `as_token_ids` (vLLM's return_tokens_as_token_ids) tokens are
    named "token_id:{id}"; text offsets still count the tokens' text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in _positions(completion, start, end):
        offsets.append(text_offset)
        if position is None:
            text = first_token
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            text = position[token_id].decoded_token or ""
            token_logprobs.append(_logprob(position[token_id].logprob))
            top_logprobs.append({_token_name(i, p, as_token_ids): _logprob(p.logprob)
                                 for i, p in position.items()})
        tokens.append(f"token_id:{token_id}" if as_token_ids else text)
        text_offset += len(text)
    logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
    return logprobs, text_offset


def chat_logprobs(completion: CompletionOutput, start: int, end: int, num_top: int, *,
                  as_token_ids: bool = False) -> dict:
    """Chat logprobs of tokens [start, end): each token with its `num_top` most likely alternatives
    (named "token_id:{id}" with `as_token_ids`; `bytes` stay the token's own)."""
    content = []
    for token_id, position in _positions(completion, start, end):
        top = sorted((item for item in position.items() if item[1].rank <= num_top),
                     key=lambda item: item[1].rank)
        content.append(_chat_token(token_id, position[token_id], as_token_ids)
                       | {"top_logprobs": [_chat_token(i, p, as_token_ids) for i, p in top]})
    return {"content": content}


def _token_name(token_id: int, logprob: Logprob, as_token_ids: bool) -> str:
    return f"token_id:{token_id}" if as_token_ids else logprob.decoded_token or ""


def _chat_token(token_id: int, logprob: Logprob, as_token_ids: bool) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    raw = text.encode() if logprob.token_bytes is None else logprob.token_bytes
    return {"token": _token_name(token_id, logprob, as_token_ids), "logprob": _logprob(logprob.logprob),
            "bytes": list(raw)}


def prompt_logprobs(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt position, None for the first, else token id -> its
    logprob, rank and text, for the prompt's token and the most likely alternatives."""
    return [None if position is None else {
        str(token_id): {"logprob": _logprob(p.logprob), "rank": p.rank, "decoded_token": p.decoded_token}
        for token_id, p in position.items()
    } for position in output.prompt_logprobs]


# ---- whole responses ------------------------------------------------------------------------


def completion_response(meta: ResponseMeta, outputs: Sequence[RequestOutput], *, n: int,
                        logprobs: int | None, echo: Echo | None = None, as_token_ids: bool = False,
                        ) -> dict:
    """The body of a non-streamed completions call: prompt i's choices are i*n .. i*n + n-1."""
    choices = []
    for prompt_index, output in enumerate(outputs):
        first_token = echo.first_tokens[output.request_id] if echo is not None else ""
        for completion in output.outputs:
            if echo is not None:
                completion = echo.choice(output, completion)
            choice_logprobs = None
            if logprobs is not None:
                choice_logprobs, _ = completion_logprobs(completion, 0, len(completion.token_ids), 0,
                                                         first_token=first_token, as_token_ids=as_token_ids)
            choice = {"index": prompt_index * n + completion.index, "text": completion.text,
                      "logprobs": choice_logprobs} | _finish(completion)
            if output.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(output)
            choices.append(choice)
    return meta.head("text_completion") | {"choices": choices, "usage": usage(outputs, echo)}


def chat_response(meta: ResponseMeta, output: RequestOutput, *, num_logprobs: int | None,
                  as_token_ids: bool = False, echo: str = "", tool_calls: ToolCalls | None = None) -> dict:
    """The body of a non-streamed chat completion (`num_logprobs` None: no logprobs); each reply
    starts with `echo`, or is a tool call."""
    choices = []
    for completion in output.outputs:
        logprobs = None
        if num_logprobs is not None:
            logprobs = chat_logprobs(completion, 0, len(completion.token_ids), num_logprobs,
                                     as_token_ids=as_token_ids)
        if tool_calls is None:
            message, finish = {"role": "assistant", "content": echo + completion.text}, _finish(completion)
        else:
            message, finish = tool_calls.message(completion), tool_calls.finish(completion)
        choices.append({"index": completion.index, "message": message, "logprobs": logprobs} | finish)
    body = meta.head("chat.completion") | {"choices": choices, "usage": usage([output])}
    if output.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(output)
    return body


def _finish(completion: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


# ---- streams --------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Sent:
    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _News:
    """What a choice gained since its last chunk: text, and the new tokens [start, end)."""

    text: str
    start: int
    end: int


class _Deltas:
    """Remembers how much of each choice a stream has sent, and says what is new."""

    def __init__(self, *, with_logprobs: bool) -> None:
        self._with_logprobs = with_logprobs
        self._sent: dict[int, _Sent] = {}

    def news(self, index: int, completion: CompletionOutput) -> _News | None:
        """The choice's news, or None when nothing is worth a chunk: no text, no finish, and no new
        token whose logprobs were asked for."""
        sent = self._sent.setdefault(index, _Sent())
        if sent.finished:
            return None
        news = _News(completion.text[sent.num_chars:], sent.num_tokens, len(completion.token_ids))
        if not news.text and completion.finish_reason is None and not (
            self._with_logprobs and news.end > news.start
        ):
            return None
        sent.num_chars += len(news.text)
        sent.num_tokens = news.end
        sent.finished = completion.finish_reason is not None
        return news


class CompletionStream:
    """The chunks of a streamed completions call (one or several prompts, n choices each)."""

    object = "text_completion"

    def __init__(self, meta: ResponseMeta, request_ids: Sequence[str], *, n: int, logprobs: int | None,
                 echo: Echo | None = None, as_token_ids: bool = False, usage: str | None = None) -> None:
        self.meta = meta
        self.echo = echo
        self.usage_mode = usage
        """protocol.GenerationBody.usage_mode."""
        self._logprobs = logprobs
        self._as_token_ids = as_token_ids
        self._deltas = _Deltas(with_logprobs=logprobs is not None)
        self._first_index = {request_id: i * n for i, request_id in enumerate(request_ids)}
        self._text_offsets: dict[int, int] = {}
        """Per choice, the text_offset of its next token: the length of the tokens sent before."""

    def opening(self) -> list[str]:
        return []

    def usage(self, outputs: Iterable[RequestOutput]) -> dict[str, Any]:
        return usage(outputs, self.echo)

    def events(self, output: RequestOutput) -> list[str]:
        events = []
        first_token = self.echo.first_tokens[output.request_id] if self.echo is not None else ""
        for completion in output.outputs:
            index = self._first_index[output.request_id] + completion.index
            generated = len(completion.token_ids) if self.echo is None or self.echo.generate else 0
            if self.echo is not None:
                completion = self.echo.choice(output, completion)
                if completion is None:
                    continue
            news = self._deltas.news(index, completion)
            if news is None:
                continue
            logprobs = None
            if self._logprobs is not None:
                # Offsets continue from the tokens already sent, not from the text: text held back
                # (a possible stop-string start, an incomplete character) has had its tokens sent,
                # so the text would lag them and offsets would step back. Counted over the tokens,
                # they equal the non-streamed response's.
                offset = self._text_offsets.get(index, 0)
                logprobs, self._text_offsets[index] = completion_logprobs(
                    completion, news.start, news.end, offset, first_token=first_token,
                    as_token_ids=self._as_token_ids)
            choice = {"index": index, "text": news.text, "logprobs": logprobs} | _finish(completion)
            usage = _chunk_usage(self.usage_mode, len(output.prompt_token_ids), generated)
            events.append(sse(self.meta.head(self.object) | {"choices": [choice]} | usage))
        return events


class ChatStream:
    """The chunks of a streamed chat completion: first the assistant role of every choice (and
    the echoed text), then each choice's news. With a reasoning parser, a choice's reasoning goes
    out in its delta's `reasoning` and only the answer in `content`, which has no key until the
    answer has text (as vLLM's deltas: a client may read a `content` key as the answer begun);
    the new tokens' logprobs ride in the same chunk, and none are sent when the request leaves its
    reasoning out (include_reasoning false: they would show it, so vLLM hides them)."""

    object = "chat.completion.chunk"

    def __init__(self, meta: ResponseMeta, *, n: int, num_logprobs: int | None,
                 as_token_ids: bool = False, echo: str = "", tool_calls: ToolCalls | None = None,
                 usage: str | None = None, num_prompt_tokens: int = 0,
                 reasoning: Reasoning | None = None) -> None:
        self.meta = meta
        self.usage_mode = usage
        """protocol.GenerationBody.usage_mode."""
        self._num_prompt_tokens = num_prompt_tokens
        self._echoed_text = echo
        self._tool_calls = tool_calls
        self._call_ids: dict[int, str] = {}
        """Per choice, the id of its named call, once its first chunk is out."""
        self._parsers: dict[int, WholeCallsStream] = {}
        """Per choice, the reader of its "auto" reply."""
        self._reasoning = reasoning
        self._reasoning_streams: dict[int, ReasoningStream | HarmonyStream] = {}
        """Per choice, the reader of its reasoning."""
        self._num_reasoning_tokens: dict[int, int] = {}
        """Per choice, its reasoning tokens, counted once its answer has begun (they are then fixed)."""
        self._thinking_tokens: dict[int, tuple[int, int]] = {}
        """Per choice, while its answer has not begun: (tokens looked at, how many were no marker)."""
        self._n = n
        if reasoning is not None and not reasoning.include:
            num_logprobs = None
        self._num_logprobs = num_logprobs
        self._as_token_ids = as_token_ids
        self._deltas = _Deltas(with_logprobs=num_logprobs is not None)

    def opening(self) -> list[str]:
        """The assistant role of every choice, then, with echo, the echoed text of each."""
        events = [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self._n)]
        if self._echoed_text:
            events += [self._chunk(i, {"content": self._echoed_text}, None, None) for i in range(self._n)]
        return events

    def usage(self, outputs: Iterable[RequestOutput]) -> dict[str, Any]:
        outputs = list(outputs)
        return usage(outputs) if self._reasoning is None else self._reasoning.usage(usage(outputs), outputs)

    def events(self, output: RequestOutput) -> list[str]:
        events = []
        for completion in output.outputs:
            reasoning = ""
            if self._reasoning is not None:
                reasoning, completion = self._split(completion)
            news = self._deltas.news(completion.index, completion)
            if news is None and not reasoning:
                continue
            logprobs = None
            if news is not None and self._num_logprobs is not None:
                logprobs = chat_logprobs(completion, news.start, news.end, self._num_logprobs,
                                         as_token_ids=self._as_token_ids)
            delta = {} if news is None else self._delta(completion, news)
            if reasoning:
                delta = {"reasoning": reasoning} | delta
            if delta or logprobs is not None or completion.finish_reason is not None:
                events.append(self._chunk(completion.index, delta, logprobs, completion))
        return events

    def _split(self, completion: CompletionOutput) -> tuple[str, CompletionOutput]:
        """The reasoning new in a choice's reply (none where the request leaves it out), and the
        reply cut to its answer so far."""
        stream = self._reasoning_streams.get(completion.index)
        if stream is None:
            stream = self._reasoning_streams[completion.index] = self._reasoning.parser.stream()
        piece, content = stream.feed(completion.text, completion.finish_reason is not None)
        return piece if self._reasoning.include else "", dataclasses.replace(completion, text=content)

    def _delta(self, completion: CompletionOutput, news: _News) -> dict[str, Any]:
        if self._tool_calls is not None:
            return self._call_delta(completion, news)
        if self._reasoning is not None and not news.text:
            return {}
        return {"content": news.text}

    def _call_delta(self, completion: CompletionOutput, news: _News) -> dict[str, Any]:
        """A forced call's delta, as OpenAI streams calls: a named call's id and name with its first
        arguments text, then more arguments; "required" calls whole once the reply is complete
        (their list is only known then), or the text as content if it is no complete call."""
        tool_calls = self._tool_calls
        if tool_calls.mode == "auto":
            parser = self._parsers.get(completion.index)
            if parser is None:
                parser = self._parsers[completion.index] = tool_calls.stream()
            return tool_calls.kept_delta(parser.feed(completion.text, completion.finish_reason is not None))
        if tool_calls.mode == "named":
            if not news.text:
                return {}
            if completion.index not in self._call_ids:
                call = tool_call(tool_calls.function, news.text)
                self._call_ids[completion.index] = call["id"]
                return {"tool_calls": [{"index": 0, **call}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": news.text}}]}
        if completion.finish_reason is None:
            return {}
        calls = tool_calls.calls(completion.text)
        if calls is None:
            return {"content": completion.text}
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}

    def _chunk(self, index: int, delta: dict, logprobs: dict | None,
               completion: CompletionOutput | None) -> str:
        finish = {"finish_reason": None}
        if completion is not None:
            finish = _finish(completion) if self._tool_calls is None else self._tool_calls.finish(completion)
        choice = {"index": index, "delta": delta, "logprobs": logprobs} | finish
        generated = 0 if completion is None else len(completion.token_ids)
        num_reasoning = None
        if self._reasoning is not None and self.usage_mode not in (None, "final"):
            num_reasoning = 0 if completion is None else self._reasoning_tokens_so_far(completion)
        usage = _chunk_usage(self.usage_mode, self._num_prompt_tokens, generated, num_reasoning)
        return sse(self.meta.head(self.object) | {"choices": [choice]} | usage)

    def _reasoning_tokens_so_far(self, completion: CompletionOutput) -> int:
        """A choice's reasoning tokens so far: while its answer has not begun, all its tokens but the
        markers (no decoding; only the tokens new since the last chunk are looked at); once it has,
        their count, made once."""
        if completion.index in self._num_reasoning_tokens:
            return self._num_reasoning_tokens[completion.index]
        if self._reasoning_streams[completion.index].content_start is None:
            seen, count = self._thinking_tokens.get(completion.index, (0, 0))
            markers = self._reasoning.marker_ids
            count += sum(1 for token_id in completion.token_ids[seen:] if token_id not in markers)
            self._thinking_tokens[completion.index] = (len(completion.token_ids), count)
            return count
        count = self._num_reasoning_tokens[completion.index] = self._reasoning.num_tokens(completion)
        return count


def usage_event(stream: CompletionStream | ChatStream, outputs: Iterable[RequestOutput]) -> str:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return sse(stream.meta.head(stream.object) | {"choices": [], "usage": stream.usage(outputs)})
