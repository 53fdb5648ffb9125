"""Reasoning parsers: a reasoning model's thinking, split from its answer. Plain Python.

A reasoning model writes its thinking before its answer, between tags its chat template taught
it. vLLM splits the two with a parser chosen by `--reasoning-parser`: the thinking goes out in the
message's `reasoning` field (and a Responses `reasoning` item), the answer alone in `content`.
slipstream has the think-tag ones, under vLLM's names:

- "deepseek_r1" (DeepSeek-R1 and its distills): the reasoning is between `<think>` and
  `</think>`. The template opens the block in the prompt, so a reply without `<think>` is
  reasoning up to `</think>`, and all reasoning when it never closes (cut short).
- "qwen3" (Qwen3, QwQ): the same tags; a `<tool_call>` also ends the reasoning (the call is the
  content, for the tool parser); with the request's `chat_template_kwargs` `enable_thinking`
  false the template skips the thinking and the reply is all content.

The tags are read in the text, not as token ids, so that a tag split over several tokens (a
tokenizer without them as special tokens) is found too. A stream sends the reasoning as it grows,
holding back a tail that may be the start of a tag, so no piece of a tag goes out as text; its
reasoning and content, joined, are the whole reply's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"


@dataclasses.dataclass(frozen=True, slots=True)
class SplitReply:
    reasoning: str | None
    """The thinking (None when there is none)."""
    content: str | None
    """The answer after it (None when the reply ended while thinking, or right after)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ThinkTagParser:
    """A format whose reasoning opens the reply, optionally after `<think>`, and ends at the first
    of `ends` (the first of which, `</think>`, is dropped; others begin the content)."""

    ends: tuple[str, ...] = (THINK_END,)
    thinking: bool = True
    """False: the request turned thinking off (Qwen3's enable_thinking), the reply is content."""

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> SplitReply:
        """A whole reply's reasoning and content (as its stream would send them)."""
        reasoning, content = self.stream().feed(text, finished=True)
        return SplitReply(reasoning or None, content or None)

    def num_reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                             tag_ids: set[int]) -> int:
        """How many of a reply's tokens came before its content (all where it never ended its
        reasoning), less the tags' own tokens (`tag_ids`: those that are one token), as vLLM
        counts `completion_tokens_details.reasoning_tokens`. The first prefix whose text ends the
        reasoning is found by bisection: a few decodes, not one per token."""
        if not self.thinking:
            return 0
        low, high = 0, len(token_ids)  # the first `high` tokens end the reasoning, `low` do not
        if not self.stream().ended(decode(token_ids)):
            low = high
        while high - low > 1:
            middle = (low + high) // 2
            if self.stream().ended(decode(token_ids[:middle])):
                high = middle
            else:
                low = middle
        return sum(1 for token_id in token_ids[:high] if token_id not in tag_ids)


class ReasoningStream:
    """One reply read as it grows: `feed` the text so far, get the reasoning new since the last
    call and the content so far (the text after the reasoning, which a tool parser may read)."""

    def __init__(self, parser: ThinkTagParser) -> None:
        self._parser = parser
        self._body_start: int | None = None
        """Where the reasoning begins, once known (after a leading `<think>`)."""
        self._sent = 0
        """The end of the reasoning sent."""
        self._content_start: int | None = None
        """Where the content begins, once the reasoning has ended."""

    def ended(self, text: str) -> bool:
        """Whether this (fresh) stream's reply has ended its reasoning within `text`."""
        self.feed(text, finished=False)
        return self._content_start is not None

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        if not self._parser.thinking:
            return "", text
        if self._content_start is not None:
            return "", text[self._content_start:]
        if self._body_start is None:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self._body_start = len(text) - len(stripped) + len(THINK_START)
            elif not finished and THINK_START.startswith(stripped):
                return "", ""  # the reply may yet open with <think>
            else:
                self._body_start = 0
            self._sent = self._body_start
        return self._reasoning(text, finished)

    def _reasoning(self, text: str, finished: bool) -> tuple[str, str]:
        longest = max(len(end) for end in self._parser.ends)
        scan_from = max(self._body_start, self._sent - longest)
        found = [(text.find(end, scan_from), end) for end in self._parser.ends]
        found = [(at, end) for at, end in found if at >= 0]
        if found:
            at, end = min(found)
            self._content_start = at + len(end) if end == THINK_END else at
            piece, self._sent = text[self._sent:at], at
            return piece, text[self._content_start:]
        safe_end = len(text) if finished else max(self._sent, len(text) - self._held_tail(text))
        piece, self._sent = text[self._sent:safe_end], safe_end
        return piece, ""

    def _held_tail(self, text: str) -> int:
        """The length of the longest tail of `text` that begins one of the ending tags."""
        for length in range(max(len(end) for end in self._parser.ends) - 1, 0, -1):
            if any(end.startswith(text[-length:]) for end in self._parser.ends if len(end) > length):
                return length
        return 0


def deepseek_r1(chat_template_kwargs: dict | None = None) -> ThinkTagParser:
    return ThinkTagParser()


def qwen3(chat_template_kwargs: dict | None = None) -> ThinkTagParser:
    thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return ThinkTagParser(ends=(THINK_END, TOOL_CALL_START), thinking=thinking)


REASONING_PARSERS = {"deepseek_r1": deepseek_r1, "qwen3": qwen3}
"""--reasoning-parser's choices (vLLM's names): each makes the parser of one request from its
chat_template_kwargs."""
