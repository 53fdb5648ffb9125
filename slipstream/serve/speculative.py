"""Speculative decoding by n-gram lookup (vLLM's "ngram" method, prompt lookup). Plain Python.

A greedy decode that repeats text it has seen (code under edit, a document it summarises or
quotes) is guessed from its own context: the longest n-gram (`prompt_lookup_min` to
`prompt_lookup_max` tokens) that ends the sequence and also occurs earlier proposes the tokens
that followed its latest earlier occurrence, up to `num_speculative_tokens`. The engine checks
the guesses in one forward pass (the last token plus the guesses, as a short prefill), keeps the
longest run of guesses that equal the model's own greedy choices, and adds the model's next
choice after them: each step yields between 1 and 1 + k tokens, all of them the model's argmax,
for about the cost of reading the weights once.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from slipstream.serve.json_config import config_fields


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the "ngram" method."""

    method: str = "ngram"
    num_speculative_tokens: int
    """Most guessed tokens checked per sequence and step."""
    prompt_lookup_max: int = 4
    """Longest n-gram to look up."""
    prompt_lookup_min: int = 1
    """Shortest n-gram to look up."""
    disable_by_batch_size: int | None = None
    """As vLLM's: no guesses in a step of more running requests than this. Checking k guesses for
    each of b requests is a forward pass over b(1 + k) tokens, which stops being bound by reading the
    weights, and so stops being nearly free, once b(1 + k) passes the machine's flops-to-bandwidth
    ratio (about 16 fp32 tokens on the development CPU; hundreds on a GPU)."""

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram' (slipstream has no draft models), "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer, got "
                             f"{self.disable_by_batch_size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a SpeculativeConfig, a dict or its JSON text (vLLM's --speculative-config)."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = config_fields(value, cls, "speculative_config")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` (and num_speculative_tokens) guesses of what follows `token_ids`:
        the tokens after the latest earlier occurrence of the longest n-gram that ends them; none
        if no n-gram recurs. The search runs over the ids as int32 bytes (`bytes.rfind`, in C):
        a step's lookups cost microseconds even over long contexts."""
        limit = min(max_tokens, self.num_speculative_tokens)
        end = len(token_ids)
        if limit <= 0 or end < 2:
            return []
        data = array.array("i", token_ids).tobytes()
        for n in range(min(self.prompt_lookup_max, end - 1), self.prompt_lookup_min - 1, -1):
            start = _rfind_aligned(data, data[-4 * n:], 4 * (end - 1))
            if start >= 0:
                return list(token_ids[start + n:start + n + limit])
        return []


def _rfind_aligned(data: bytes, pattern: bytes, stop: int) -> int:
    """The token index of the last occurrence of `pattern` (whole int32 ids) that ends by byte
    `stop`, or -1."""
    while (found := data.rfind(pattern, 0, stop)) >= 0:
        if found % 4 == 0:
            return found // 4
        stop = found + len(pattern) - 1  # a misaligned match: look for one that starts earlier
    return -1


def accepted_tokens(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a checked guess yields: the model's choices `targets` (one per checked position,
    len(draft) + 1) up to and including the first where the guess differs from them."""
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return list(targets[: num_accepted + 1])
