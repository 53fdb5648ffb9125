"""OpenAI's Responses API, response side: a `Response` object and its stream of server-sent events.

A Response's `output` holds a message item (one output_text part) and/or function_call items. A
reply that ran out of tokens is "incomplete" with reason "max_output_tokens", as vLLM reports a
length finish. A stream sends, in OpenAI's order, each event named by its type and numbered by
`sequence_number`: response.created and response.in_progress at once; for a text reply the
message's output_item.added and content_part.added with the engine's first output, one
output_text.delta per engine update that added text (or, with logprobs, tokens), and at the end
output_text.done, content_part.done and output_item.done; then response.completed with the whole
Response (incomplete ones too, as vLLM, so that the `openai` client's stream helpers finish). A
named tool call streams the same way, its arguments in function_call_arguments.delta events; a
reply that may be calls or text ("required", "auto") can be read only once whole: its items'
events all come at the end.

With a reasoning parser (reasoning_replies.py), the reply's thinking is a `reasoning` item before
the others (`summary` empty, its text a reasoning_text part, as vLLM's), the rest of the reply
its answer; streamed, its output_item.added, content_part.added and reasoning_text.delta events
come as it grows, and its done events as the answer begins; the answer's items follow at output
index 1. A reply that is reasoning alone has no message (as vLLM). A harmony reply may go back to
its analysis channel after its answer began: that reasoning is a second reasoning item after the
answer's items (vLLM makes an item of each harmony message, in order), which a stream sends whole
at the end, after the answer's done events, so that every item's events stay together and in
output order. With include_reasoning false there are no reasoning items and no logprobs (their
tokens would show the reasoning; vLLM hides them too).

With VLLM_ENABLE_RESPONSES_API_STORE, `ResponseStore` keeps the Responses (and the conversations
that produced them) that GET /v1/responses/{id}, previous_response_id and cancel read, and a
streamed background response's events, which GET /v1/responses/{id}?stream=true replays.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from slipstream.serve.reasoning_replies import Reasoning
from slipstream.serve.request import CompletionOutput, RequestOutput
from slipstream.serve.responses import ToolCalls, chat_logprobs


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: "resp_...", "msg_...", "fc_...", "call_..."."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The Response of one request, whole (`response`) or as a stream's events (`opening`, `update`,
    `closing`); `settings` are the request's, as the Response echoes them."""

    def __init__(self, model: str, settings: dict[str, Any], *, num_logprobs: int | None,
                 as_token_ids: bool = False, tool_calls: ToolCalls | None = None,
                 reasoning: Reasoning | None = None) -> None:
        self.id = new_id("resp")
        self._head = {"id": self.id, "object": "response", "created_at": int(time.time()), "model": model}
        self._settings = settings
        self._num_logprobs = num_logprobs
        self._with_logprobs = num_logprobs is not None and (reasoning is None or reasoning.include)
        """Whether logprobs are sent: asked for, and not hiding the reasoning (its tokens would show
        it). Hidden ones are empty lists where asked for."""
        self._as_token_ids = as_token_ids
        self._tool_calls = tool_calls
        self._message_id = new_id("msg")
        self._call_ids: list[tuple[str, str]] = []
        """Per function call of the reply, in order, its item id and call_id (made once, so that a
        stream's events and its final Response name each call alike)."""
        self._sequence_number = 0
        self._num_chars_sent = 0
        self._num_tokens_sent = 0
        self._item_open = False
        """Whether a stream opened the reply's first item as it grew (a text reply's message, a
        named call)."""
        self._reasoning = reasoning
        self._reasoning_stream = None if reasoning is None else reasoning.parser.stream()
        self._reasoning_id = new_id("rs")
        self._late_reasoning_id = new_id("rs")
        """The id of the reasoning item after the answer (harmony analysis after a final message)."""
        self._reasoning_sent = ""
        """The reasoning a stream has sent."""
        self._reasoning_open = False
        """Whether a stream's reasoning item is open (added, not yet done)."""
        self._first_index = 0
        """The output index of the answer's first item: 1 after a reasoning item."""

    # ---- whole responses ----------------------------------------------------------------------

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The Response of a finished reply."""
        [completion] = output.outputs
        return self._body(completion, self._all_items(completion), output)

    def _body(self, completion: CompletionOutput | None, items: list[dict[str, Any]],
              output: RequestOutput | None) -> dict[str, Any]:
        status, incomplete, error = "in_progress", None, None
        if completion is not None:
            status = _status(completion)
            if completion.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            elif completion.finish_reason == "abort":
                error = {"code": "server_error", "message": "the server stopped before the response finished"}
        usage = None
        if output is not None:
            usage = _usage(output, 0 if self._reasoning is None else self._reasoning.num_tokens(completion))
        return self._head | {"status": status, "error": error, "incomplete_details": incomplete,
                             "output": items, "usage": usage} | self._settings

    def _all_items(self, completion: CompletionOutput) -> list[dict[str, Any]]:
        """The reply's items: its reasoning's (where a parser splits it off and it has any), then
        its answer's, then the reasoning that came after the answer began; a message without text
        after the reasoning is left out."""
        if self._reasoning is None:
            return self._items(completion)
        split = self._reasoning.parser.split(completion.text)
        items = self._items(dataclasses.replace(completion, text=split.content or ""))
        if not (split.reasoning and self._reasoning.include):
            return items
        early = split.reasoning[:len(split.reasoning) - len(split.late_reasoning)]
        if early:
            if items[0]["type"] == "message" and not items[0]["content"][0]["text"]:
                items = items[1:]
            status = "completed" if split.content is not None else _item_status(completion)
            items = [self._reasoning_item(self._reasoning_id, early, status), *items]
        if split.late_reasoning:
            items.append(self._reasoning_item(self._late_reasoning_id, split.late_reasoning,
                                              _item_status(completion)))
        return items

    def _reasoning_item(self, item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def _items(self, completion: CompletionOutput) -> list[dict[str, Any]]:
        """The message (its text, with logprobs where asked) and/or the function calls of a reply:
        a reply without calls is a message, if empty (as a text reply is); one with calls has a
        message only for text before them."""
        status = _item_status(completion)
        if self._tool_calls is None:
            logprobs = None
            if self._num_logprobs is not None:
                logprobs = self._logprobs(completion, 0, len(completion.token_ids))
            return [self._message(completion.text, status, logprobs)]
        message = self._tool_calls.message(completion)
        calls = message.get("tool_calls", [])
        text = message["content"] or ""
        items = [self._message(text, status, None)] if text or not calls else []
        for index, call in enumerate(calls):
            items.append(self._call(index, call["function"]["name"], call["function"]["arguments"], status))
        return items

    def _call(self, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        """The reply's `index`-th function call as an item."""
        while len(self._call_ids) <= index:
            self._call_ids.append((new_id("fc"), new_id("call")))
        item_id, call_id = self._call_ids[index]
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def _message(self, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {"type": "message", "id": self._message_id, "role": "assistant", "status": status,
                "content": [_text_part(text, logprobs)]}

    def _logprobs(self, completion: CompletionOutput, start: int, end: int) -> list[dict[str, Any]]:
        """OpenAI's logprobs of tokens [start, end): each token's and its top alternatives'; none
        where the request leaves its reasoning out."""
        if not self._with_logprobs:
            return []
        logprobs = chat_logprobs(completion, start, end, self._num_logprobs, as_token_ids=self._as_token_ids)
        return logprobs["content"]

    def pending(self, status: str) -> dict[str, Any]:
        """The Response of a background request not finished yet ("queued", "in_progress"): no
        output, no usage."""
        return self._body(None, [], None) | {"status": status}

    # ---- streams ------------------------------------------------------------------------------

    def opening(self) -> list[str]:
        """response.created and response.in_progress, before the engine's first output."""
        return [self.created("in_progress"), self.in_progress()]

    def created(self, status: str) -> str:
        """response.created: "in_progress" for a stream, "queued" for a background one (as OpenAI's),
        whose response.in_progress waits for the engine's first output."""
        return self._event("response.created", response=self.pending(status))

    def in_progress(self) -> str:
        return self._event("response.in_progress", response=self.pending("in_progress"))

    def update(self, output: RequestOutput) -> list[str]:
        """The events of the reply's news since the last update: its reasoning, then a text reply's
        text, a named call's arguments (none for a reply that may be calls or text, read only once
        whole)."""
        [completion] = output.outputs
        events = []
        if self._reasoning is not None:
            events, completion = self._reasoning_update(completion)
            if completion is None:
                return events
        if self._tool_calls is not None:
            return events + (self._named_call_update(completion) if self._tool_calls.mode == "named" else [])
        if not self._item_open:
            events += self._open_message(self._first_index)
        self._item_open = True
        start, end = self._num_tokens_sent, len(completion.token_ids)
        text = completion.text[self._num_chars_sent:]
        if text or (self._with_logprobs and end > start):
            logprobs = [] if self._num_logprobs is None else self._logprobs(completion, start, end)
            events.append(self._event("response.output_text.delta", item_id=self._message_id,
                                      output_index=self._first_index, content_index=0, delta=text,
                                      logprobs=logprobs))
            self._num_chars_sent += len(text)
            self._num_tokens_sent = end
        return events

    def _reasoning_update(self, completion: CompletionOutput) -> tuple[list[str], CompletionOutput | None]:
        """The reasoning's news (its item opened with its first text, done once the answer begins or
        the reply ends), and the reply cut to its answer (None while that has no text: an empty
        answer after reasoning has no message, and closing sends what items it has). Reasoning
        after the answer began waits for closing."""
        finished = completion.finish_reason is not None
        stream = self._reasoning_stream
        num_late = len(stream.late_reasoning)
        piece, content = stream.feed(completion.text, finished)
        piece = piece[:len(piece) - (len(stream.late_reasoning) - num_late)]
        events = []
        if piece and self._reasoning.include:
            if not self._reasoning_sent:
                self._reasoning_open = True
                item = self._reasoning_item(self._reasoning_id, "", "in_progress") | {"content": []}
                events += [self._event("response.output_item.added", output_index=0, item=item),
                           self._event("response.content_part.added", item_id=self._reasoning_id,
                                       output_index=0, content_index=0,
                                       part={"type": "reasoning_text", "text": ""})]
                self._first_index = 1
            events.append(self._event("response.reasoning_text.delta", item_id=self._reasoning_id,
                                      output_index=0, content_index=0, delta=piece))
            self._reasoning_sent += piece
        if self._reasoning_open and (stream.content_start is not None or finished):
            self._reasoning_open = False
            events += self._reasoning_done("completed" if stream.content_start is not None
                                           else _item_status(completion))
        return events, dataclasses.replace(completion, text=content) if content else None

    def _reasoning_done(self, status: str) -> list[str]:
        return self._reasoning_done_events(0, self._reasoning_item(self._reasoning_id, self._reasoning_sent,
                                                                   status))

    def _reasoning_done_events(self, index: int, item: dict[str, Any]) -> list[str]:
        [part] = item["content"]
        common = dict(item_id=item["id"], output_index=index, content_index=0)
        return [self._event("response.reasoning_text.done", **common, text=part["text"]),
                self._event("response.content_part.done", **common, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _late_reasoning_events(self, index: int, item: dict[str, Any]) -> list[str]:
        """The reasoning item after the answer, whole: its added events, its text in one delta,
        then its done events."""
        added = item | {"status": "in_progress", "content": []}
        common = dict(item_id=item["id"], output_index=index, content_index=0)
        part = {"type": "reasoning_text", "text": ""}
        return [self._event("response.output_item.added", output_index=index, item=added),
                self._event("response.content_part.added", **common, part=part),
                self._event("response.reasoning_text.delta", **common, delta=item["content"][0]["text"]),
                *self._reasoning_done_events(index, item)]

    def _named_call_update(self, completion: CompletionOutput) -> list[str]:
        """A named call's news: the item with its name first, then the arguments as they grow."""
        item = self._call(0, self._tool_calls.function, "", "in_progress")
        events = []
        if not self._item_open:
            events.append(self._event("response.output_item.added", output_index=self._first_index,
                                      item=item))
        self._item_open = True
        arguments = completion.text[self._num_chars_sent:]
        if arguments:
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._first_index, delta=arguments))
            self._num_chars_sent += len(arguments)
        return events

    def closing(self, output: RequestOutput) -> list[str]:
        """The done events of every item, then response.completed (or, for a reply the server
        aborted, response.failed) with the whole Response."""
        [completion] = output.outputs
        events = self.update(output)
        items = self._all_items(completion)
        for index, item in enumerate(items):
            if item["type"] == "reasoning":
                if item["id"] == self._late_reasoning_id:
                    events += self._late_reasoning_events(index, item)
                continue  # the one before the answer is done in update
            if item["type"] == "message":
                events += self._message_events(index, item)
            else:
                events += self._call_events(index, item)
        final = "response.failed" if completion.finish_reason == "abort" else "response.completed"
        return [*events, self._event(final, response=self._body(completion, items, output))]

    def error(self, message: str) -> str:
        """An error event: the stream failed (the engine stopped)."""
        return self._event("error", code="server_error", message=message, param=None)

    def _open_message(self, index: int) -> list[str]:
        item = {"type": "message", "id": self._message_id, "role": "assistant", "status": "in_progress",
                "content": []}
        part = _text_part("", [] if self._num_logprobs is not None else None)
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                            content_index=0, part=part)]

    def _message_events(self, index: int, item: dict[str, Any]) -> list[str]:
        """A message's remaining events: its text whole where no update sent it (a tool call reply's
        content; no delta for an empty one, as for a text reply), then the done events."""
        [part] = item["content"]
        events = []
        if not (index == self._first_index and self._item_open):
            events += self._open_message(index)
            if part["text"]:
                events.append(self._event("response.output_text.delta", item_id=item["id"],
                                          output_index=index, content_index=0, delta=part["text"],
                                          logprobs=[]))
        common = dict(item_id=item["id"], output_index=index, content_index=0)
        return [*events,
                self._event("response.output_text.done", **common, text=part["text"],
                            logprobs=part.get("logprobs") or []),
                self._event("response.content_part.done", **common, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_events(self, index: int, item: dict[str, Any]) -> list[str]:
        """A call's remaining events: its item and arguments whole where no update sent them (a
        reply read only once whole), then the done events."""
        common = dict(item_id=item["id"], output_index=index)
        events = []
        if not (index == self._first_index and self._item_open):
            added = item | {"arguments": "", "status": "in_progress"}
            events = [self._event("response.output_item.added", output_index=index, item=added),
                      self._event("response.function_call_arguments.delta", **common,
                                  delta=item["arguments"])]
        return [*events,
                self._event("response.function_call_arguments.done", **common, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, type: str, **fields: Any) -> str:
        """One server-sent event, named by its type, as OpenAI sends them."""
        data = {"type": type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return part if logprobs is None else part | {"logprobs": logprobs}


def _status(completion: CompletionOutput) -> str:
    return {"length": "incomplete", "abort": "failed"}.get(completion.finish_reason, "completed")


def _item_status(completion: CompletionOutput) -> str:
    return "completed" if completion.finish_reason not in ("length", "abort") else "incomplete"


def _usage(output: RequestOutput, num_reasoning_tokens: int) -> dict[str, Any]:
    """Tokens in and out, of which the prefix cache held `cached_tokens`, and `reasoning_tokens`
    those of the reasoning (0 without a reasoning parser). `cache_write_tokens` is 0 (OpenAI's
    count of tokens it wrote to a cache kept for a paid retention, which this server has not)."""
    [completion] = output.outputs
    num_input, num_output = len(output.prompt_token_ids), len(completion.token_ids)
    details = {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": num_input, "input_tokens_details": details,
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": num_input + num_output}


RESPONSES_STORE_SIZE = 1024
"""How many Responses the store keeps by default (`serve --responses-store-size`). vLLM's store is
unbounded, and so grows with every request for as long as the server runs; this one forgets the
least recently used Response (created, read or continued) beyond its size."""
UNFINISHED = ("queued", "in_progress")


@dataclasses.dataclass
class StoredResponse:
    response: dict[str, Any]
    """The Response as GET /v1/responses/{id} returns it (a background one's changes as it runs)."""
    conversation: list[dict[str, Any]]
    """The input items that produced it as rendered, without the instructions: those truncation "auto"
    dropped are not kept (`ResponsesRequest.conversation`)."""
    task: asyncio.Task | None = None
    """A background response's run, which cancelling it cancels."""
    events: list[str] | None = None
    """A streamed background response's events so far, each numbered by its index (its
    sequence_number), for GET /v1/responses/{id}?stream=true; None for any other response (as vLLM
    and OpenAI, only those are replayed). All are kept while the entry is, at most a few more than
    the reply's tokens (one delta per engine step, and ten or so for the items and the Response), and
    go with it when the store forgets it."""
    _news: asyncio.Future | None = None
    """Resolved (and replaced) when an event is added or the run ends: what followers wait on."""

    @property
    def unfinished(self) -> bool:
        return self.response["status"] in UNFINISHED

    def add_events(self, events: list[str]) -> None:
        self.events.extend(events)
        self.wake()

    def wake(self) -> None:
        """Wake every follower waiting for news."""
        news, self._news = self._news, None
        if news is not None and not news.done():
            news.set_result(None)

    async def follow(self, starting_after: int) -> AsyncIterator[str]:
        """The events numbered after `starting_after`, then the live ones until the run ends (its
        last event, or a cancel, which OpenAI names no event for: the stream just ends, and GET says
        "cancelled"). A follower leaving (the client disconnected) leaves the run going."""
        index = starting_after + 1
        while True:
            if self._news is None:
                self._news = asyncio.get_running_loop().create_future()
            news = self._news
            while index < len(self.events):
                index += 1
                yield self.events[index - 1]
            if self.task.done():
                return
            await asyncio.wait([news])  # not `await news`: a follower cancelled must not cancel the others'

    def history(self) -> list[dict[str, Any]]:
        """What a request continuing from this response (its previous_response_id) puts before its
        input: the conversation, then the output items (messages and function calls are input
        items too)."""
        return [*self.conversation, *self.response["output"]]


class ResponseStore:
    """The stored Responses by id, at most `size`, least recently used first out. Used from the
    server's event loop only, so it needs no lock."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"responses_store_size must be positive, got {size}")
        self.size = size
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Store `entry`, forgetting the least recently used beyond the size. A forgotten background
        response still running is cancelled: nobody could read its result any more."""
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.size:
            _, evicted = self._entries.popitem(last=False)
            if evicted.task is not None and evicted.unfinished:
                evicted.task.cancel()
