"""Structured outputs: constrain generation to a set of strings, a regular expression, a JSON
schema or any JSON object (vLLM's `choice`, `regex`, `json` and `json_object`). Plain Python.

A constraint is a byte automaton (`fsm.ByteDFA`) of a regular expression: a choice is the regex of
its escaped strings, a JSON schema the regex `json_schema.py` writes for it.
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

import array
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from slipstream.serve.fsm import ByteDFA, compile_pattern
from slipstream.serve.json_schema import json_object_regex, schema_regex


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `choice`, `regex`, `json` and `json_object`
    (`grammar`, a context-free grammar, is not supported)."""

    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    regex: str | None = None
    """The output matches this regular expression as a whole (Python syntax, ASCII classes:
    `fsm.py` lists what is supported)."""
    json: Any = None
    """The output is JSON valid under this schema (a dict or its JSON text; `json_schema.py` lists
    what is supported)."""
    json_object: bool | None = None
    """The output is a JSON object."""
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None:
            raise ValueError("structured_outputs.grammar is not supported (slipstream compiles regular "
                             "expressions and JSON schemas, not context-free grammars)")
        given = [name for name in ("choice", "regex", "json", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of choice, regex, json and json_object, "
                             f"got {given or 'none'}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not all(
                    isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                                 f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        try:
            compile_pattern(self.pattern)
        except ValueError as error:
            raise ValueError(f"structured_outputs.{given[0]}: {error}") from error

    @property
    def pattern(self) -> str:
        """The constraint as one regular expression."""
        if self.regex is not None:
            return self.regex
        if self.json is not None:
            return schema_regex(self.json)
        if self.json_object:
            return json_object_regex()
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
        self._eos_token_ids = array.array("q", sorted(set(eos_token_ids)))
        self._allowed: dict[int, array.array] = {}
        self.start = dfa.start

    def allowed_token_ids(self, state: int | None) -> array.array:
        """The tokens that may come next at `state`, sorted: those that keep the output able to
        match, and the end-of-sequence ids where it matches (or has left the constraint). An int64
        array, which the sampler reads without a copy (`torch.frombuffer`)."""
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
            allowed = self._allowed[state] = array.array("q", sorted(found))
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
