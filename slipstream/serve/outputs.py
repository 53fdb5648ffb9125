"""Turning generated token ids into text, stop-string matches, logprobs and RequestOutputs.

Each sequence has a `SequenceOutput` that detokenizes incrementally, watches for stop strings in
the text, and keeps the last `max_stop_len - 1` characters back from streaming (they could be the
start of a stop string that must not be shown). A prompt with `n` completions is a
`PromptOutput` holding its `n` sequences; it becomes a `RequestOutput` shaped like vLLM's.
"""

from __future__ import annotations

import dataclasses

from slipstream.model.tokenizer import Tokenizer
from slipstream.serve.request import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)


class SequenceOutput:
    """Text and logprobs of one completion, built token by token."""

    def __init__(self, index: int, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: list[int]):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer(
            prompt_ids=prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def append(
        self, token_id: int, logprobs: PositionLogprobs | None, *, detokenize: bool = True
    ) -> str | None:
        """Add a generated token; returns the stop string if the text now contains one."""
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        delta = self.detokenizer.push(token_id) if detokenize else ""
        num_old_chars = len(self.text)
        self.text += delta
        if not delta or not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        return self._find_stop(num_old_chars)

    def _find_stop(self, num_old_chars: int) -> str | None:
        """The stop string that the new text (past `num_old_chars`) completes first, ties going to
        the earlier one in `stop`; trims the text at it. As in vLLM: the result is that of adding
        the text one character at a time, and a match may start in older text, even in that of
        the first min_tokens tokens, so long as it ends in the new text."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.params.stop:
            start = self.text.find(stop, max(0, num_old_chars - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self.text = self.text[: end if self.params.include_stop_str_in_output else start]
        return stop

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            if stop_reason is None or isinstance(stop_reason, int):
                # Text held back for an incomplete multi-byte character (max_tokens cut it) is
                # dropped, as vLLM does, rather than shown as U+FFFD; it never streamed, so the
                # deltas still add up to the final text. The whole characters held with it (a
                # byte-level token such as b"abc\xc3") are text like any other: a stop string in
                # them ends the completion there.
                num_old_chars = len(self.text)
                self.text += self.detokenizer.flush().rstrip("\ufffd")
                if self.params.stop and len(self.text) > num_old_chars \
                        and len(self.token_ids) > self.params.min_tokens:
                    stop = self._find_stop(num_old_chars)
                    if stop is not None:
                        self.finish_reason, self.stop_reason = "stop", stop

    def streamable_text(self) -> str:
        """Text that may be shown now: all of it once finished, else all but a possible
        stop-string prefix at the end."""
        if self.finish_reason is not None or not self._max_stop_len:
            return self.text
        return self.text[: max(0, len(self.text) - self._max_stop_len + 1)]

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.streamable_text(),
            token_ids=list(self.token_ids),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclasses.dataclass(eq=False)
class PromptOutput:
    """All completions of one prompt and their shared prompt data."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceOutput]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    internal_ids: list[str] = dataclasses.field(default_factory=list)
    """The engine's scheduler ids of the completions, in index order."""
    stream: bool = True
    """Report every step's progress; False reports the prompt only once it has finished."""

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def to_request_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.sequences],
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )
