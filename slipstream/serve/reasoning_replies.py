"""Chat completions of a server with --reasoning-parser: each reply's reasoning in the message's
(or delta's) `reasoning` field, as vLLM 0.32 names it, and `content` the answer alone, which the
tool parser, when there is one, reads for calls; usage counts the reasoning tokens
(`completion_tokens_details.reasoning_tokens`).

The chat bodies are responses.py's, built from the replies with their text cut to the answer;
this module adds the reasoning to them (responses.ChatStream, given a `Reasoning`, splits a
stream's replies itself). With include_reasoning false the logprobs are left out too, as vLLM
does: their tokens would show the reasoning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from slipstream.serve import responses
from slipstream.serve.reasoning_parsers import HarmonyParser, SplitReply, ThinkTagParser
from slipstream.serve.request import CompletionOutput, RequestOutput


@dataclasses.dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's replies are split."""

    parser: ThinkTagParser | HarmonyParser
    include: bool
    """The request's include_reasoning: False leaves the reasoning out (the content stays the answer)."""
    decode: Callable[[Sequence[int]], str]
    marker_ids: frozenset[int]
    """The ids of the parser's markers that are one token each, which the reasoning tokens leave
    out."""

    def answers(self, output: RequestOutput) -> tuple[RequestOutput, list[SplitReply]]:
        """The output with each reply's text cut to its answer, and each reply's split."""
        splits = [self.parser.split(completion.text) for completion in output.outputs]
        answers = [dataclasses.replace(completion, text=split.content or "")
                   for completion, split in zip(output.outputs, splits, strict=True)]
        return dataclasses.replace(output, outputs=answers), splits

    def num_tokens(self, completion: CompletionOutput) -> int:
        """The reply's reasoning tokens (reasoning_parsers.num_reasoning_tokens)."""
        return self.parser.num_reasoning_tokens(completion.token_ids, self.decode, self.marker_ids)

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
        if not reasoning.include:
            choice["logprobs"] = None
    body["usage"] = reasoning.usage(body["usage"], [output])
    return body
