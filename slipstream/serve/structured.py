"""Structured outputs: constrain generation to a regular expression or a set of strings (vLLM's
`regex` and `choice`). Plain Python.

A constraint is a byte automaton (`fsm.ByteDFA`; a choice is the regex of its escaped strings).
The tokenizer's tokens, by their bytes (special tokens left out), form a trie. At a state of the
automaton, a token is allowed when its bytes lead from that state to a state that can still
reach a match; one walk over the token trie, stepping the automaton byte by byte, finds them
all. The end-of-sequence tokens are allowed where the output so far matches. Each state's
allowed tokens are computed the first time an output reaches it and kept with the guide, which
the engine shares between requests with the same constraint.

Token bytes are those each token decodes to alone (`Tokenizer.token_bytes`), exact for byte-level
BPE and byte-fallback tokenizers, which hold a token for every byte, as the guide requires: any
prefix the automaton allows can then be spelt, so an output never strands part-way.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from slipstream.serve.fsm import ByteDFA


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`; of its constraints slipstream implements `choice` and
    `regex` (exactly one of them)."""

    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    regex: str | None = None
    """The output matches this regular expression as a whole (Python syntax, ASCII classes:
    `fsm.py` lists what is supported)."""
    json: Any = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        for name in ("json", "grammar", "json_object"):
            if getattr(self, name) not in (None, False):
                raise ValueError(f"structured_outputs.{name} is not supported (slipstream implements "
                                 "choice and regex, without a grammar library to compile the others)")
        if (self.choice is None) == (self.regex is None):
            raise ValueError("structured_outputs needs one of choice (a list of strings) and regex")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not all(
                    isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                                 f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        else:
            try:
                ByteDFA(self.regex)
            except ValueError as error:
                raise ValueError(f"structured_outputs.regex: {error}") from error

    @property
    def pattern(self) -> str:
        """The constraint as one regular expression."""
        if self.regex is not None:
            return self.regex
        return "|".join(re.escape(choice) for choice in self.choice)


class _Node:
    __slots__ = ("children", "token_ids")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.token_ids: list[int] = []
        """The tokens whose bytes end here."""


class Vocabulary:
    """The tokenizer's tokens as a byte trie (built once per engine, on first use)."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        """`token_bytes[i]` is token i's bytes; None (a special token) or b"" leaves it out. A
        ValueError unless some token is each single byte."""
        self.token_bytes = list(token_bytes)
        self.root = _Node()
        for token_id, data in enumerate(self.token_bytes):
            if data:
                node = self.root
                for byte in data:
                    node = node.children.get(byte) or node.children.setdefault(byte, _Node())
                node.token_ids.append(token_id)
        missing = [byte for byte in range(256)
                   if byte not in self.root.children or not self.root.children[byte].token_ids]
        if missing:
            raise ValueError(f"structured outputs need a token for every byte (byte-level BPE or "
                             f"byte fallback); this tokenizer has none for {len(missing)} bytes, "
                             f"such as {missing[0]:#04x}")


class Guide:
    """One constraint over one vocabulary. A completion's state is the automaton's state its
    output has reached: `start` at first, None once it has left the constraint (with an
    end-of-sequence token)."""

    def __init__(self, dfa: ByteDFA, vocabulary: Vocabulary, eos_token_ids: Sequence[int]) -> None:
        self._dfa = dfa
        self._vocabulary = vocabulary
        self._eos_token_ids = sorted(set(eos_token_ids))
        self._allowed: dict[int, list[int]] = {}
        self.start = dfa.start

    def allowed_token_ids(self, state: int | None) -> list[int]:
        """The tokens that may come next at `state`: those that keep the output able to match, and
        the end-of-sequence ids where it matches (or has left the constraint)."""
        if state is None:
            return self._eos_token_ids
        allowed = self._allowed.get(state)
        if allowed is None:
            found = set(self._eos_token_ids) if self._dfa.accepts(state) else set()
            pending = [(self._vocabulary.root, state)]
            while pending:
                node, dfa_state = pending.pop()
                for byte, child in node.children.items():
                    next_state = self._dfa.step(dfa_state, byte)
                    if next_state is not None:
                        found.update(child.token_ids)
                        if child.children:
                            pending.append((child, next_state))
            allowed = self._allowed[state] = sorted(found)
        return allowed

    def advance(self, state: int | None, token_id: int) -> int | None:
        """The state after `token_id`; None off the constraint (an end-of-sequence token)."""
        token_bytes = self._vocabulary.token_bytes
        data = token_bytes[token_id] if token_id < len(token_bytes) else None
        if not data:
            return None
        for byte in data:
            if state is None:
                return None
            state = self._dfa.step(state, byte)
        return state
