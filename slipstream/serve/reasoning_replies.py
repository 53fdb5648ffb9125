"""Chat completions of a server with --reasoning-parser: each reply's reasoning in the message's
(or delta's) `reasoning` field, as vLLM 0.32 names it, and `content` the answer alone, which the
tool parser, when there is one, reads for calls; usage counts the reasoning tokens
(`completion_tokens_details.reasoning_tokens`).

The chat bodies and chunks are responses.py's, built from the replies with their text cut to the
answer; this module adds the reasoning to them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from slipstream.serve import responses
from slipstream.serve.reasoning_parsers import (
    HarmonyParser,
    HarmonyStream,
    ReasoningStream,
    SplitReply,
    ThinkTagParser,
)
from slipstream.serve.request import CompletionOutput, RequestOutput


@dataclasses.dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's replies are split."""

    parser: ThinkTagParser | HarmonyParser
    include: bool
    """The request's include_reasoning: False leaves the reasoning out (the content stays the answer)."""
    decode: Callable[[Sequence[int]], str]
    tag_ids: frozenset[int]
    """The ids of the tags that are one token each, which the reasoning tokens leave out."""

    def answers(self, output: RequestOutput) -> tuple[RequestOutput, list[SplitReply]]:
        """The output with each reply's text cut to its answer, and each reply's split."""
        splits = [self.parser.split(completion.text) for completion in output.outputs]
        answers = [dataclasses.replace(completion, text=split.content or "")
                   for completion, split in zip(output.outputs, splits, strict=True)]
        return dataclasses.replace(output, outputs=answers), splits

    def num_tokens(self, completion: CompletionOutput) -> int:
        """The reply's reasoning tokens (reasoning_parsers.num_reasoning_tokens)."""
        return self.parser.num_reasoning_tokens(completion.token_ids, self.decode, self.tag_ids)

    def usage(self, usage: dict[str, Any], outputs: Iterable[RequestOutput]) -> dict[str, Any]:
        num_tokens = sum(self.num_tokens(completion) for output in outputs for completion in output.outputs)
        return usage | {"completion_tokens_details": {"reasoning_tokens": num_tokens}}


def chat_response(reasoning: Reasoning, meta: responses.ResponseMeta, output: RequestOutput,
                  **options: Any) -> dict[str, Any]:
    """responses.chat_response's body, of the answers, with each message's reasoning."""
    answers, splits = reasoning.answers(output)
    body = responses.chat_response(meta, answers, **options)
    for choice, split in zip(body["choices"], splits, strict=True):
        message = choice["message"]
        if split.content is None and message["content"] == "":
            message["content"] = None  # as vLLM: a reply that ended thinking has no content
        message["reasoning"] = split.reasoning if reasoning.include else None
    body["usage"] = reasoning.usage(body["usage"], [output])
    return body


class ReasoningChatStream:
    """A responses.ChatStream of the answers, each choice's reasoning sent before in chunks whose
    delta is `{"reasoning": ...}`."""

    object = responses.ChatStream.object

    def __init__(self, chunks: responses.ChatStream, reasoning: Reasoning, num_prompt_tokens: int) -> None:
        self._chunks = chunks
        self._reasoning = reasoning
        self._num_prompt_tokens = num_prompt_tokens
        self._streams: dict[int, ReasoningStream | HarmonyStream] = {}
        """Per choice, the reader of its reply."""
        self.meta = chunks.meta
        self.usage_mode = chunks.usage_mode

    def opening(self) -> list[str]:
        return self._chunks.opening()

    def usage(self, outputs: Iterable[RequestOutput]) -> dict[str, Any]:
        outputs = list(outputs)
        return self._reasoning.usage(self._chunks.usage(outputs), outputs)

    def events(self, output: RequestOutput) -> list[str]:
        events, answers = [], []
        for completion in output.outputs:
            stream = self._streams.setdefault(completion.index, self._reasoning.parser.stream())
            piece, content = stream.feed(completion.text, completion.finish_reason is not None)
            if piece and self._reasoning.include:
                events.append(self._reasoning_chunk(completion, piece))
            answers.append(dataclasses.replace(completion, text=content))
        return events + self._chunks.events(dataclasses.replace(output, outputs=answers))

    def _reasoning_chunk(self, completion: CompletionOutput, piece: str) -> str:
        choice = {"index": completion.index, "delta": {"reasoning": piece}, "logprobs": None,
                  "finish_reason": None}
        usage = {}
        if self.usage_mode == "final":
            usage = {"usage": None}
        elif self.usage_mode is not None:
            num_tokens = len(completion.token_ids)
            usage = {"usage": {"prompt_tokens": self._num_prompt_tokens, "completion_tokens": num_tokens,
                               "total_tokens": self._num_prompt_tokens + num_tokens}}
        return responses.sse(self.meta.head(self.object) | {"choices": [choice]} | usage)
