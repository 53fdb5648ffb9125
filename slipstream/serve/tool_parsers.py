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
- "openai" (gpt-oss): OpenAI's harmony messages (`<|channel|>NAME[ to=RECIPIENT]...<|message|>TEXT`,
  ended by `<|end|>`, `<|call|>` or the next header); a message addressed to `functions.NAME` (the
  recipient in the header, before or after the channel) is a call, its text the JSON arguments. As
  vLLM: final messages and commentary without a recipient (a preamble) are the content, joined;
  analysis (reasoning) and messages to other recipients (built-in tools) are left out. With
  `--reasoning-parser openai_gptoss` the reasoning parser reads the reply first and keeps the
  messages to functions whole in the content it hands on (`HarmonyParser.calls`).

Each parser's `parse(text)` reads a whole reply, and `stream()` gives a reader of one as it grows,
which sends content until calls may begin (holding back what may be the start of a marker). The
hermes reader sends each call whole once its closing tag (or the reply's end) arrives; the others
send their calls at the reply's end, when the whole of them can be read. A reply whose calls do
not all parse (no JSON, or no string `name`) is content, whole, as vLLM's parsers leave it; a
harmony reply so is its messages' text, the calls' arguments included (vLLM would send them as
the arguments).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from slipstream.serve.reasoning_parsers import (
    HARMONY_ENDS,
    HARMONY_HEADS,
    HARMONY_MESSAGE,
    HARMONY_OPENINGS,
    held_tail,
)

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


FUNCTIONS = "functions."
"""The prefix of a harmony recipient that is one of the request's functions."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Message:
    """A harmony message read so far: its channel, recipient and content type (from the header;
    None where it has none), its text, and whether it ended."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str
    ended: bool


def harmony_header(header: str) -> tuple[str | None, str | None, str | None]:
    """A harmony header's channel, recipient and content type: `[<|start|>ROLE][ to=RECIPIENT]
    <|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE | TYPE]`."""
    words = header.replace("<|constrain|>", " ").replace("<|channel|>", " <|channel|>").split()
    if words and words[0].startswith("<|start|>"):
        words = words[1:]
    recipient = next((word[3:] for word in words if word.startswith("to=")), None)
    channel = next((word[len("<|channel|>"):] for word in words if word.startswith("<|channel|>")), None)
    rest = [word for word in words if not word.startswith(("to=", "<|channel|>"))]
    return channel, recipient, rest[-1] if rest else None


def _harmony_messages(text: str, finished: bool) -> list[str | _Message]:
    """A reply's text outside messages (a plain reply, a reasoning parser's content) and its
    messages, in order; a growing reply's last piece holds back a tail that may begin a marker.
    The reply itself may open with the rest of its first header (`HARMONY_OPENINGS`)."""
    if not finished and any(opening.startswith(text) for opening in HARMONY_OPENINGS):
        return []
    pieces: list[str | _Message] = []
    read = 0
    while read < len(text):
        heads = [at for at in (text.find(head, read) for head in HARMONY_HEADS) if at >= 0]
        head = 0 if read == 0 and text.startswith(HARMONY_OPENINGS) else min(heads, default=-1)
        if head != read:
            end = len(text) if head < 0 else head
            if head < 0 and not finished:
                end -= held_tail(text[read:], HARMONY_HEADS)
            pieces.append(text[read:end])
            if head < 0:
                break
        body = text.find(HARMONY_MESSAGE, head)
        if body < 0:
            break  # the header is not whole yet
        channel, recipient, content_type = harmony_header(text[head:body])
        body += len(HARMONY_MESSAGE)
        found = [(at, marker) for at, marker in ((text.find(marker, body), marker)
                                                 for marker in (*HARMONY_ENDS, *HARMONY_HEADS)) if at >= 0]
        if found:
            at, marker = min(found)
            pieces.append(_Message(channel, recipient, content_type, text[body:at], True))
            read = at + len(marker) if marker in HARMONY_ENDS else at
            continue
        end = len(text) if finished else len(text) - held_tail(text[body:], (*HARMONY_ENDS, *HARMONY_HEADS))
        pieces.append(_Message(channel, recipient, content_type, text[body:end], finished))
        break
    return pieces


def _is_call(piece: str | _Message) -> bool:
    return isinstance(piece, _Message) and (piece.recipient or "").startswith(FUNCTIONS)


def _content_of(piece: str | _Message) -> str:
    """What a piece adds to the content: text outside messages, a final or a preamble's text."""
    if isinstance(piece, str):
        return piece
    if piece.recipient is None and piece.channel in ("final", "commentary"):
        return piece.text
    return ""


def _harmony_call(message: _Message) -> dict[str, Any] | None:
    """A call message as an OpenAI call (arguments re-written from their JSON, as the other
    formats'; as they are where the content type is not JSON); None where they are no JSON."""
    arguments = message.text
    if message.content_type is None or "json" in message.content_type:
        try:
            arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
        except json.JSONDecodeError:
            return None
    return tool_call(message.recipient[len(FUNCTIONS):], arguments)


class OpenAIToolParser:
    """The "openai" format (gpt-oss's harmony): a message to `functions.NAME` is a call."""

    def stream(self) -> HarmonyCallsStream:
        return HarmonyCallsStream(self)

    def parse(self, text: str) -> ParsedReply:
        pieces = _harmony_messages(text, finished=True)
        calls = [_harmony_call(piece) for piece in pieces if _is_call(piece)]
        if None in calls:
            content = "".join(piece.text if _is_call(piece) else _content_of(piece) for piece in pieces)
            return ParsedReply(content or None, [])
        return ParsedReply("".join(map(_content_of, pieces)) or None, calls)


class HarmonyCallsStream:
    """A harmony reply read as it grows: the content goes out as it comes until the first call
    begins; the rest waits for the reply's end, then goes out as the calls and the content after
    them (or, where a call does not parse, as content)."""

    def __init__(self, parser: OpenAIToolParser) -> None:
        self._parser = parser
        self._content = _SentContent()
        self.num_calls = 0
        """Calls sent."""

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        if not finished:
            content = ""
            for piece in _harmony_messages(text, finished=False):
                if _is_call(piece):
                    break
                content += _content_of(piece)
            return self._content.upto(content, len(content))
        parsed = self._parser.parse(text)
        content = parsed.content or ""
        delta = self._content.upto(content, len(content))
        if parsed.tool_calls:
            delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(parsed.tool_calls)]
            self.num_calls = len(parsed.tool_calls)
        return delta


TOOL_CALL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                     "mistral": MistralToolParser, "openai": OpenAIToolParser}
"""--tool-call-parser's choices (vLLM's names)."""
