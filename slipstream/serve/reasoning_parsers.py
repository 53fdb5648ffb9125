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
- "openai_gptoss" (gpt-oss): OpenAI's harmony format, a reply of messages
  `<|channel|>NAME<|message|>TEXT<|end|>`, the next after `<|start|>assistant`: the `analysis`
  channel's text is the reasoning, the others' (`final`, `commentary`) the content. Its markers
  are special tokens, so the server keeps special tokens in these replies' text
  (`keeps_special_tokens`). vLLM reads the channels from the token ids with openai_harmony; here
  the text is read, the same way as the tags.

The tags are read in the text, not as token ids, so that a tag split over several tokens (a
tokenizer without them as special tokens) is found too. A stream sends the reasoning as it grows,
holding back a tail that may be the start of a tag, so no piece of a tag goes out as text; its
reasoning and content, joined, are the whole reply's.

The engine reads replies with the same parsers (`EngineConfig.reasoning_parser`): a request with
structured outputs is constrained only from where its answer begins (`ReasoningGate`), unless its
prompt already ended the reasoning (`prompt_ends_reasoning`), as vLLM applies a grammar after the
reasoning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, Set

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"


@dataclasses.dataclass(frozen=True, slots=True)
class SplitReply:
    reasoning: str | None
    """The thinking (None when there is none)."""
    content: str | None
    """The answer after it (None when the reply ended while thinking, or right after)."""
    late_reasoning: str = ""
    """The end of `reasoning` that came after the answer began (a harmony reply may go back to its
    analysis channel after a final message); empty for the think-tag formats."""


class _ReplyParser:
    """What the parsers share: a whole reply read as its stream reads it, and its token count."""

    __slots__ = ()

    def split(self, text: str) -> SplitReply:
        """A whole reply's reasoning and content (as its stream would send them)."""
        stream = self.stream()
        reasoning, content = stream.feed(text, finished=True)
        return SplitReply(reasoning or None, content or None, stream.late_reasoning)

    def num_reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                             marker_ids: Set[int]) -> int:
        return num_reasoning_tokens(self, token_ids, decode, marker_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class ThinkTagParser(_ReplyParser):
    """A format whose reasoning opens the reply, optionally after `<think>`, and ends at the first
    of `ends` (the first of which, `</think>`, is dropped; others begin the content)."""

    ends: tuple[str, ...] = (THINK_END,)
    thinking: bool = True
    """False: the request turned thinking off (Qwen3's enable_thinking), the reply is content."""
    turn_starts: tuple[str, ...] = ()
    """Markers between a prompt's turns: tags before the last one belong to earlier turns."""
    keeps_special_tokens = False
    """Whether the server must keep special tokens in the reply's text for the parser to read."""
    markers = (THINK_START, THINK_END)
    """The tags whose tokens, where one tag is one token, are not reasoning tokens."""

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def prompt_ends_reasoning(self, prompt: str) -> bool:
        """Whether the reply to this prompt (its text, special tokens kept) begins with the answer,
        as vLLM reads the prompt's ids: the last tag of the prompt's last turn (after a
        `turn_starts` marker) decides; with neither tag there, the reply thinks unless thinking is
        off (Qwen3's enable_thinking false template ends the prompt with an empty think block)."""
        if not self.thinking:
            return True
        turn = prompt[max((prompt.rfind(start) for start in self.turn_starts), default=-1) + 1:]
        return turn.rfind(THINK_END) > turn.rfind(THINK_START)


HARMONY_HEADS = ("<|start|>", "<|channel|>")
"""Harmony markers that begin a message's header, which `<|message|>` ends."""
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_MESSAGE = "<|message|>"
HARMONY_OPENINGS = (*HARMONY_HEADS, " to=")
"""How a reply may open its first header: the prompt ends with `<|start|>assistant`, and the
header goes on with a channel or, in the role's part, a recipient (`<|start|>assistant
to=functions.NAME<|channel|>...`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class HarmonyParser(_ReplyParser):
    """The "openai_gptoss" format: harmony messages, whose analysis channel is the reasoning."""

    thinking: bool = True
    """False: the reply is plain text (a constrained one), all content."""
    calls: bool = False
    """True: the "openai" tool parser reads the content, so a message to a function (`to=functions.
    NAME` in its header, whatever its channel) stays whole in it, header and end marker kept, as
    the raw reply has it; without, its text is content (or reasoning, in the analysis channel)."""
    keeps_special_tokens = True
    markers = (*HARMONY_HEADS, *HARMONY_ENDS, HARMONY_MESSAGE)

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)

    def prompt_ends_reasoning(self, prompt: str) -> bool:
        """Whether the prompt (its text, special tokens kept) ends inside a message of a channel
        other than analysis, which the reply continues: its answer. vLLM rewrites a constrained
        gpt-oss request's grammar into a structural tag that lets analysis messages come first and
        constrains the final message's text; a prompt ending at `<|start|>assistant` leaves the
        reply to open its messages, so its reasoning goes first."""
        if not self.thinking:
            return True
        last = max(prompt.rfind(head) for head in HARMONY_HEADS)
        message = prompt.find(HARMONY_MESSAGE, max(last, 0))
        if last < 0 or message < 0 or any(end in prompt[message:] for end in HARMONY_ENDS):
            return False
        _, _, channel = prompt[last:message].partition("<|channel|>")
        return (channel.split() or ["final"])[0].partition("<|")[0] != "analysis"


class _ReplyStream:
    """What the streams share: where the reply's content begins, and the reasoning after it."""

    def __init__(self, thinking: bool) -> None:
        self.content_start: int | None = None if thinking else 0
        """Where the content begins in the text, once known (at once where thinking is off)."""
        self.late_reasoning = ""
        """The reasoning read after the content began (harmony's analysis after a final message;
        the think-tag formats have none)."""

    def ended(self, text: str) -> bool:
        """Whether this (fresh) stream's reply has begun its content within `text` (read by the
        stream's own `feed`)."""
        self.feed(text, finished=False)
        return self.content_start is not None


class HarmonyStream(_ReplyStream):
    """One harmony reply read as it grows (ReasoningStream's interface). The prompt ends with
    `<|start|>assistant`; a reply that does not go on with the rest of a header (`HARMONY_OPENINGS`)
    is plain text: content. Its content begins with the first message not of the analysis channel."""

    def __init__(self, parser: HarmonyParser) -> None:
        super().__init__(parser.thinking)
        self._parser = parser
        self._read = 0
        """How much of the text is read."""
        self._channel: str | None = None
        """The channel of the message whose text is being read; None while reading a header."""
        self._content = ""
        self._began = False
        """Whether the reply has shown whether it opens with a header."""
        self._ended_by = ""
        """The end marker of the last message that ended (empty where a header ended it)."""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        if not self._parser.thinking:
            return "", text
        if not self._began:
            if not finished and any(opening.startswith(text) for opening in HARMONY_OPENINGS):
                return "", ""  # the reply may yet open with a header
            self._began = True
            if not text.startswith(HARMONY_OPENINGS):
                self._channel = "final"
        reasoning = []
        while True:
            if self._channel is None and not self._header(text):
                break
            if self._channel != "analysis" and self.content_start is None:
                self.content_start = self._read
            piece, done = self._body(text, finished)
            if self._channel != "analysis":
                self._content += piece + (self._ended_by if done and self._channel == "call" else "")
            else:
                reasoning.append(piece)
                if self.content_start is not None:
                    self.late_reasoning += piece
            if not done:
                break
            self._channel = None
        return "".join(reasoning), self._content

    def _header(self, text: str) -> bool:
        """Read a whole header (`[<|start|>ROLE][ to=RECIPIENT]<|channel|>NAME[ to=RECIPIENT]...
        <|message|>`) if the text holds one; the channel is the name's first word."""
        end = text.find(HARMONY_MESSAGE, self._read)
        if end < 0:
            return False
        header = text[self._read:end]
        _, _, channel = header.partition("<|channel|>")
        self._channel = (channel.split() or ["final"])[0].partition("<|")[0]
        if self._parser.calls and " to=functions." in header.replace("<|", " <|"):
            self._channel = "call"
            self._content += text[self._read:end + len(HARMONY_MESSAGE)]
        self._read = end + len(HARMONY_MESSAGE)
        return True

    def _body(self, text: str, finished: bool) -> tuple[str, bool]:
        """The message text read now, and whether the message ended (at an end marker, dropped and
        kept in `_ended_by`, or where a header begins)."""
        found = [(text.find(marker, self._read), marker) for marker in (*HARMONY_ENDS, *HARMONY_HEADS)]
        found = [(at, marker) for at, marker in found if at >= 0]
        if found:
            at, marker = min(found)
            piece = text[self._read:at]
            self._ended_by = marker if marker in HARMONY_ENDS else ""
            self._read = at + len(self._ended_by)
            return piece, True
        end = len(text) if finished else len(text) - held_tail(text[self._read:], (*HARMONY_ENDS,
                                                                                     *HARMONY_HEADS))
        piece, self._read = text[self._read:end], end
        return piece, False


def num_reasoning_tokens(parser: ThinkTagParser | HarmonyParser, token_ids: Sequence[int],
                         decode: Callable[[Sequence[int]], str], marker_ids: Set[int]) -> int:
    """How many of a reply's tokens are its reasoning: those whose text ends by where its content
    begins (all of a reply that never ended its reasoning; none of one that has no reasoning before
    its content), less the parser's markers that are one token each (`marker_ids`), so that a
    `<tool_call>` that begins the content is not counted. How many tokens' text ends there is
    found by bisection over the prefixes' decoded lengths: a few decodes, not one per token."""
    text = decode(token_ids)
    stream = parser.stream()
    reasoning, _ = stream.feed(text, finished=True)
    if len(reasoning) == len(stream.late_reasoning):
        return 0
    start = stream.content_start
    low, high = 0, len(token_ids)  # the text of the first `low` tokens ends by `start`; not so `high`
    if start is None or len(text) <= start:
        low = high
    while high - low > 1:
        middle = (low + high) // 2
        if len(decode(token_ids[:middle])) <= start:
            low = middle
        else:
            high = middle
    return sum(1 for token_id in token_ids[:low] if token_id not in marker_ids)


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that begins one of `markers`."""
    for length in range(min(max(len(marker) for marker in markers) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers if len(marker) > length):
            return length
    return 0


class ReasoningStream(_ReplyStream):
    """One reply read as it grows: `feed` the text so far, get the reasoning new since the last
    call and the content so far (the text after the reasoning, which a tool parser may read)."""

    def __init__(self, parser: ThinkTagParser) -> None:
        super().__init__(parser.thinking)
        self._parser = parser
        self._body_start: int | None = None
        """Where the reasoning begins, once known (after a leading `<think>`)."""
        self._sent = 0
        """The end of the reasoning sent."""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        if not self._parser.thinking:
            return "", text
        if self.content_start is not None:
            return "", text[self.content_start:]
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
            self.content_start = at + len(end) if end == THINK_END else at
            piece, self._sent = text[self._sent:at], at
            return piece, text[self.content_start:]
        safe_end = len(text) if finished else len(text) - held_tail(text[self._sent:], self._parser.ends)
        piece, self._sent = text[self._sent:safe_end], safe_end
        return piece, ""


class ReasoningGate:
    """Where a constrained reply's answer begins, read as it is generated (vLLM applies a
    request's structured output from the token after its reasoning ends, so the model thinks
    freely first). It reads the reply as the server's parser splits it: the tokens' bytes, special
    tokens' text included, one character per byte (the markers are ASCII), so a marker split over
    several tokens is found as surely as a one-token one, and the guide starts exactly where the
    reply's content does. The bytes the ending token carries past the marker (a tokenizer that
    merges `</think>` with what follows) are the answer's first ones, which the guide is handed
    as its start."""

    def __init__(self, parser: ThinkTagParser | HarmonyParser) -> None:
        self._stream = parser.stream()
        self._text = ""

    def feed(self, token_bytes: bytes) -> bytes | None:
        """The next token's bytes: None while the reasoning goes on; once this token ends it, the
        answer's bytes so far (those past the marker, often none)."""
        self._text += token_bytes.decode("latin-1")
        if not self._stream.ended(self._text):
            return None
        return self._stream.feed(self._text, finished=False)[1].encode("latin-1")


def deepseek_r1(chat_template_kwargs: dict | None = None) -> ThinkTagParser:
    return ThinkTagParser()


def qwen3(chat_template_kwargs: dict | None = None) -> ThinkTagParser:
    thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return ThinkTagParser(ends=(THINK_END, TOOL_CALL_START), thinking=thinking,
                          turn_starts=("<|im_start|>", "<|im_end|>"))


def openai_gptoss(chat_template_kwargs: dict | None = None) -> HarmonyParser:
    return HarmonyParser()


REASONING_PARSERS = {"deepseek_r1": deepseek_r1, "qwen3": qwen3, "openai_gptoss": openai_gptoss}
"""--reasoning-parser's choices (vLLM's names): each makes the parser of one request from its
chat_template_kwargs."""
