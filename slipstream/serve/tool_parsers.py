"""Tool-call parsers: a model's own call format, turned into OpenAI's `tool_calls`. Plain Python.

With `tool_choice` "auto" the model decides whether to call a tool, in the format its chat
template taught it. vLLM reads that format with a parser chosen by `--tool-call-parser`; slipstream
has the "hermes" one (Hermes 2 Pro, Qwen 2.5 and 3, and the many templates that copied them): each
call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`,
and the text before the first call is the reply's content.

`HermesToolParser.parse(text)` reads a whole reply; `HermesStream` reads one as it grows, sending
content until a call begins (holding back what may be the start of a tag), then each call whole
once its closing tag (or the reply's end) arrives. A call that is no valid JSON object with a
string `name` leaves the whole text as content, as vLLM's parser does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(rf"{re.escape(START)}(.*?)(?:{re.escape(END)}|$)", re.DOTALL)

TOOL_CALL_PARSERS = ("hermes",)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call, with a fresh id."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_of(body: str) -> dict[str, Any] | None:
    """The call a tag's JSON body describes, or None if it describes none."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return tool_call(value["name"], arguments if isinstance(arguments, str)
                     else json.dumps(arguments, ensure_ascii=False))


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None
    """The text before the first call (None when there is none), or the whole reply."""
    tool_calls: list[dict[str, Any]]


class HermesToolParser:
    """The "hermes" format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    def parse(self, text: str) -> ParsedReply:
        if START not in text:
            return ParsedReply(text, [])
        calls = [_call_of(match.group(1).strip()) for match in _CALL.finditer(text)]
        if not calls or any(call is None for call in calls):
            return ParsedReply(text, [])
        content = text[: text.index(START)]
        return ParsedReply(content if content.strip() else None, calls)


class HermesStream:
    """One choice's reply read as it grows: `feed(text_so_far, finished)` returns the delta to
    send (content and/or whole tool calls), as OpenAI streams them."""

    def __init__(self) -> None:
        self._content_sent = 0
        self._calls_sent = 0
        """Call bodies read (a body that is no call is read and dropped)."""
        self.num_calls = 0
        """Calls sent."""

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        start = text.find(START)
        if start < 0:
            # Hold back a tail that may begin a tag, unless the reply is over.
            end = len(text) if finished else len(text) - _partial_tag_length(text)
            return self._content(text, end)
        delta = self._content(text, start)
        bodies = [match.group(1) for match in _CALL.finditer(text[start:])]
        closed = text[start:].count(END)
        ready = bodies if finished else bodies[:closed]
        calls = []
        for body in ready[self._calls_sent:]:
            call = _call_of(body.strip())
            if call is not None:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
        self._calls_sent = max(self._calls_sent, len(ready))
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _content(self, text: str, end: int) -> dict[str, Any]:
        if end <= self._content_sent:
            return {}
        piece = text[self._content_sent:end]
        self._content_sent = end
        return {"content": piece}


def _partial_tag_length(text: str) -> int:
    """The length of the longest tail of `text` that begins `<tool_call>`."""
    for length in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]):
            return length
    return 0
