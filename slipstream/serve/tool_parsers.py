"""Tool-call parsers: a model's own call format, turned into OpenAI's `tool_calls`. Plain Python.

With `tool_choice` "auto" the model decides whether to call a tool, in the format its chat
template taught it. vLLM reads that format with a parser chosen by `--tool-call-parser`; slipstream
has the ones of the families it serves:

- "hermes" (Hermes 2 Pro, Qwen 2.5 and 3, and the many templates that copied them): each call is
  a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, and
  the text before the first call is the reply's content.
- "llama3_json" (Llama 3.1 to 3.3): the whole reply is the calls, JSON objects `{"name": ...,
  "parameters": {...}}` separated by `;`, perhaps after `<|python_tag|>`.
- "mistral": the calls follow `[TOOL_CALLS]`, as a JSON list of `{"name", "arguments"}` objects
  (Mistral 7B v0.3's tokenizer) or as `name[ARGS]{...}`, one `[TOOL_CALLS]` each (later ones,
  with an optional `[CALL_ID]id` after the name); the text before is the reply's content.

Each parser's `parse(text)` reads a whole reply, and `stream()` gives a reader of one as it grows,
which sends content until calls may begin (holding back what may be the start of a marker). The
hermes reader sends each call whole once its closing tag (or the reply's end) arrives; the others
send their calls at the reply's end, when the whole of them can be read. A reply whose calls do
not all parse (no JSON, or no string `name`) is content, whole, as vLLM's parsers leave it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(rf"{re.escape(START)}(.*?)(?:{re.escape(END)}|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call, with a fresh id."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_of(body: str | Any) -> dict[str, Any] | None:
    """The call a JSON text (or the value read from one) describes, or None if it describes none."""
    if isinstance(body, str):
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
    else:
        value = body
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


class _MarkedCalls:
    """A format whose calls begin at a marker (`MARKER`): where they start, and how much of a
    growing reply's tail may be the marker's beginning."""

    MARKER: str

    def stream(self) -> WholeCallsStream:
        return WholeCallsStream(self)

    def calls_start(self, text: str) -> int | None:
        start = text.find(self.MARKER)
        return None if start < 0 else start

    def held_tail(self, text: str) -> int:
        """The length of the longest tail of `text` that begins the marker."""
        for length in range(min(len(self.MARKER) - 1, len(text)), 0, -1):
            if self.MARKER.startswith(text[-length:]):
                return length
        return 0


class HermesToolParser(_MarkedCalls):
    """The "hermes" format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    MARKER = START

    def parse(self, text: str) -> ParsedReply:
        if START not in text:
            return ParsedReply(text, [])
        calls = [_call_of(match.group(1).strip()) for match in _CALL.finditer(text)]
        if not calls or any(call is None for call in calls):
            return ParsedReply(text, [])
        content = text[: text.index(START)]
        return ParsedReply(content if content.strip() else None, calls)


class _SentContent:
    """How much of a growing reply has gone out as content."""

    def __init__(self) -> None:
        self.end = 0

    def upto(self, text: str, end: int) -> dict[str, Any]:
        """The delta that sends the reply's content up to `end` (empty when it is out already)."""
        if end <= self.end:
            return {}
        piece, self.end = text[self.end:end], end
        return {"content": piece}


class Llama3JsonToolParser:
    """The "llama3_json" format: the reply is `{"name": ..., "parameters": {...}}` objects, `;`
    between them, perhaps after `<|python_tag|>`."""

    def stream(self) -> WholeCallsStream:
        return WholeCallsStream(self)

    def calls_start(self, text: str) -> int | None:
        """0 where the reply is calls (its first non-space characters begin them), else None."""
        return 0 if text.lstrip().startswith(("{", PYTHON_TAG)) else None

    def held_tail(self, text: str) -> int:
        """How much of the end of a reply without calls so far may still begin them: all of it
        while it is spaces or the beginning of `<|python_tag|>`."""
        return len(text) if PYTHON_TAG.startswith(text.lstrip()) else 0

    def parse(self, text: str) -> ParsedReply:
        start = self.calls_start(text)
        if start is None:
            return ParsedReply(text, [])
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedReply(text, [])
            calls.append(_call_of(value))
            position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
        if not calls or None in calls:
            return ParsedReply(text, [])
        return ParsedReply(None, calls)


class MistralToolParser(_MarkedCalls):
    """The "mistral" format: content, then `[TOOL_CALLS]` and a JSON list of calls, or
    `[TOOL_CALLS]name[ARGS]{...}` once per call (`[CALL_ID]id` may follow the name)."""

    MARKER = TOOL_CALLS

    def parse(self, text: str) -> ParsedReply:
        start = self.calls_start(text)
        if start is None:
            return ParsedReply(text, [])
        calls = []
        for piece in text[start:].split(TOOL_CALLS)[1:]:
            piece = piece.strip()
            if piece.startswith("["):
                try:
                    values = json.loads(piece)
                except json.JSONDecodeError:
                    return ParsedReply(text, [])
                calls += [_call_of(value) for value in values] if isinstance(values, list) else [None]
            else:
                name, found, arguments = piece.partition(ARGS)
                name = name.partition(CALL_ID)[0].strip()
                try:
                    calls.append(_call_of({"name": name, "arguments": json.loads(arguments)})
                                 if found and name else None)
                except json.JSONDecodeError:
                    calls.append(None)
        if not calls or None in calls:
            return ParsedReply(text, [])
        content = text[:start]
        return ParsedReply(content if content.strip() else None, calls)


class WholeCallsStream:
    """A reply read as it grows, for formats whose calls are read whole at its end: content goes
    out until the calls begin (a tail that may begin them held back); the rest waits for the end,
    then goes out as calls, or as content where it holds none."""

    def __init__(self, parser: _MarkedCalls | Llama3JsonToolParser) -> None:
        self._parser = parser
        self._content = _SentContent()
        self.num_calls = 0
        """Calls sent."""

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        start = self._parser.calls_start(text)
        if start is None:
            end = len(text) if finished else len(text) - self._parser.held_tail(text)
            return self._content.upto(text, end)
        if not finished:
            return self._content.upto(text, start)
        parsed = self._parser.parse(text)
        if not parsed.tool_calls:
            return self._content.upto(text, len(text))
        delta = self._content.upto(text, start)
        delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(parsed.tool_calls)]
        self.num_calls = len(parsed.tool_calls)
        return delta


TOOL_CALL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                     "mistral": MistralToolParser}
"""--tool-call-parser's choices (vLLM's names)."""
