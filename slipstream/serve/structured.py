"""Structured outputs: constrain generation to a set of strings, a regular expression, a JSON
schema, any JSON object or a context-free grammar (vLLM's `choice`, `regex`, `json`,
`json_object` and `grammar`).

A constraint is a byte automaton (`fsm.ByteDFA`) of a regular expression: a choice is the regex of
its escaped strings, a JSON schema the regex `json_schema.py` writes for it.
The tokenizer's tokens, by their bytes (special tokens left out), form a trie. At a state of the
automaton, a token is allowed when its bytes lead from that state to a state that can still
reach a match; one walk over the token trie, stepping the automaton byte by byte, finds them
all. The end-of-sequence tokens are allowed where the output so far matches. Each state's
allowed tokens are computed the first time an output reaches it and kept with the guide, which
the engine shares between requests with the same constraint.

Token bytes are those each token stands for inside a text (`Tokenizer.token_bytes`), exact for byte-level
BPE and byte-fallback tokenizers, which hold a token for every byte, as the guide requires: any
prefix the automaton allows can then be spelt, so an output never strands part-way.

A grammar's language is no regular one, so no automaton with finitely many states holds it: a
`GrammarGuide` hands it to llguidance (the Rust library behind vLLM's "guidance" backend, an
optional dependency), whose Earley parser computes each step's allowed tokens as a bitmask.
"""

from __future__ import annotations

import array
import contextlib
import copy
import dataclasses
import functools
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from slipstream.serve.fsm import ByteDFA, compile_pattern
from slipstream.serve.json_schema import check_self_references, json_object_regex, schema_regex

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `choice`, `regex`, `json`, `json_object` and
    `grammar`."""

    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    regex: str | None = None
    """The output matches this regular expression as a whole (Python syntax, ASCII classes:
    `fsm.py` lists what is supported)."""
    json: Any = None
    """The output is JSON valid under this schema (a dict or its JSON text; `json_schema.py` lists
    what the byte automaton enforces, and llguidance, where installed, takes most of the rest)."""
    json_object: bool | None = None
    """The output is a JSON object."""
    grammar: str | None = None
    """The output is a sentence of this context-free grammar, in GBNF (llama.cpp's, which vLLM's
    xgrammar backend takes) or Lark syntax (vLLM's guidance backend); needs the llguidance package
    (`pip install 'slipstream[grammar]'`)."""
    _key: tuple[str, str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("choice", "regex", "json", "json_object", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of choice, regex, json, json_object and "
                             f"grammar, got {given or 'none'}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not all(
                    isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                                 f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        # Built once, here: a ValueError names the field and what is wrong with it, and the engine
        # takes the key without compiling the constraint again.
        object.__setattr__(self, "_key", self._checked_key())

    @property
    def guide_key(self) -> tuple[str, str]:
        """What enforces the constraint, and from what: ("regex", pattern) for the byte automaton,
        ("llguidance", definition) for a grammar, and for a JSON schema the automaton cannot hold
        where llguidance is installed (as vLLM's "auto" backend falls back from xgrammar to
        guidance). Requests with the same key share a guide."""
        return self._key

    def _checked_key(self) -> tuple[str, str]:
        """`_guide_key`, where a constraint nested past Python's stack (the parsers and writers
        recurse once per level) is a ValueError too, not a server error."""
        try:
            return self._guide_key()
        except RecursionError:
            field = next(name for name in ("choice", "regex", "json", "json_object", "grammar")
                         if getattr(self, name) not in (None, False))
            raise ValueError(f"structured_outputs.{field} nests too deeply to compile") from None

    def _guide_key(self) -> tuple[str, str]:
        if self.grammar is not None:
            return "llguidance", compile_grammar(self.grammar)
        if self.json is not None:
            try:
                check_self_references(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json: {error}") from None
        try:
            pattern = self.pattern
            compile_pattern(pattern)
            return "regex", pattern
        except ValueError as error:
            if self.json is None:
                field = "regex" if self.regex is not None else "choice"
                raise ValueError(f"structured_outputs.{field}: {error}") from error
            return "llguidance", json_schema_grammar(self.json, error)

    @property
    def pattern(self) -> str:
        """The constraint as one regular expression (any but a grammar)."""
        assert self.grammar is None, "a grammar is no regular expression"
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
        return self._step(state, data) if data else None

    def start_with(self, data: bytes) -> int | None:
        """The state of an output that begins with `data` (the answer's first bytes, which the
        token that ended the reasoning carried); None where they leave the constraint, which
        then ends the output."""
        return self._step(self.start, data)

    def _step(self, state: int | None, data: bytes) -> int | None:
        for byte in data:
            if state is None:
                return None
            state = self._dfa.step(state, byte)
        return state


MAX_GRAMMAR_RULES = 1_000
"""Most rules a grammar may define: llguidance's Rust code recurses once per link of a chain of
rules, compiling it and matching with it, and a chain of 2,500 overflowed an 8 MiB thread stack
(the server process died); 2,000 passed."""
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.-]*\s*(?:::=|:)", re.MULTILINE)


@functools.lru_cache(maxsize=64)
def compile_grammar(grammar: str) -> str:
    """A GBNF or Lark grammar as llguidance's grammar definition; a ValueError naming what is wrong
    with it, or that llguidance is missing."""
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured_outputs.grammar needs the llguidance package: "
                         "pip install 'slipstream[grammar]'") from None
    rules = len(_RULE.findall(grammar))
    if rules > MAX_GRAMMAR_RULES:
        raise ValueError(f"structured_outputs.grammar defines {rules:,} rules, more than the "
                         f"{MAX_GRAMMAR_RULES:,} a grammar may have")

    try:
        with _panics_as_value_errors():
            definition = llguidance.grammar_from("grammar", grammar)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition)
    except ValueError as error:  # GBNF that does not convert to Lark
        raise ValueError(f"structured_outputs.grammar: {error}") from None
    if is_error:
        raise ValueError(f"structured_outputs.grammar: {messages[0]}")
    return definition


@contextlib.contextmanager
def _panics_as_value_errors() -> Iterator[None]:
    """A panic inside llguidance's Rust code (pyo3's PanicException, a BaseException: one formats
    its error message by cutting a schema's text inside a UTF-8 character) as a ValueError, so
    that the input it failed on is a 400 rather than a 500."""
    try:
        yield
    except BaseException as error:
        if type(error).__name__ != "PanicException":
            raise
        raise ValueError(f"llguidance failed on it ({str(error).splitlines()[0][:200]})") from None


_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON as `json.dumps` lays it out: by default it allows any whitespace anywhere,
which a model can fill without end."""


def json_schema_grammar(schema: Any, regex_error: ValueError) -> str:
    """llguidance's grammar of a JSON schema that the byte automaton cannot enforce (the reason:
    `regex_error`); a ValueError with both reasons where llguidance cannot either or is missing."""
    try:
        import llguidance
    except ImportError:
        raise ValueError(f"structured_outputs.json: {regex_error} (the optional llguidance package "
                         "enforces more of JSON Schema)") from None
    try:
        with _panics_as_value_errors():
            definition = llguidance.LLMatcher.grammar_from_json_schema(_whole_patterns(schema),
                                                                       defaults=_JSON_LAYOUT)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition)
    except (ValueError, TypeError) as error:  # not a schema at all
        is_error, messages = True, [str(error)]
    if is_error:
        raise ValueError(f"structured_outputs.json: {regex_error}; nor can llguidance: {messages[0]}")
    return definition


_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _whole_patterns(schema: Any) -> Any:
    """The schema with each string `pattern` anchored at both ends: llguidance reads a pattern as
    JSON Schema does, as a search, and the byte automaton as vLLM's backends do, as a match of the
    whole string; anchored, a schema means the same whichever enforces it. Only subschemas are
    walked (not `const`, `enum` or a property that happens to be named "pattern")."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = f"^(?:{out['pattern']})$"
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _whole_patterns(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_whole_patterns(sub) for sub in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _whole_patterns(sub) for name, sub in out[key].items()}
    return out


def grammar_tokenizer(backend: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a `tokenizers.Tokenizer` (read from its JSON, without padding or
    truncation); `vocab_size` covers every id the model's logits have."""
    import llguidance

    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarGuide:
    """One grammar over one vocabulary, as `Guide` is for a pattern. A completion's state is a
    matcher of its own (a parser's state, which completions cannot share), None once the output
    has left the grammar (with an end-of-sequence token)."""

    def __init__(self, definition: str, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        """`definition`: `compile_grammar`'s; `tokenizer`: `grammar_tokenizer`'s; `vocab_size`: the
        model's (the tokenizer may hold more)."""
        self._definition = definition
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = array.array("q", sorted(set(eos_token_ids)))
        # Some grammars validate but leave the parser nothing to start from (a schema that is only
        # a reference to itself): a ValueError now, not an empty output that looks finished.
        probe = self.start
        probe.compute_bitmask()
        if probe.is_error():
            raise ValueError(f"structured_outputs: llguidance finds no output that could start this "
                             f"schema or grammar ({probe.get_error().splitlines()[0]})")

    @property
    def start(self) -> Any:
        """A new completion's state: a fresh matcher."""
        import llguidance

        return llguidance.LLMatcher(self._tokenizer, self._definition, log_level=0)

    def start_with(self, data: bytes) -> Any:
        """A matcher that has read `data` (as `Guide.start_with`), spelt with the tokenizer's
        tokens: the parser reads bytes, so any spelling of them leaves it in the same state."""
        matcher = self.start
        if data:
            matcher.consume_tokens(self._tokenizer.tokenize_bytes(data))
        return matcher

    def allowed_token_ids(self, matcher: Any) -> array.array | np.ndarray:
        """The tokens that may come next (with the end-of-sequence ids where the output is a
        sentence): the parser's bitmask unpacked to a bool mask over the vocabulary (True where
        allowed), which the sampler applies as it is; once the output has ended, the sorted
        end-of-sequence ids as an int64 array. The mask saves listing the allowed ids, often most
        of the vocabulary (a string's contents): 0.07 of 0.09 ms per row and step on a Zen 5."""
        if matcher is None:
            return self._eos_token_ids
        mask = None if matcher.is_error() else matcher.compute_bitmask()
        if matcher.is_error():
            # A parser limit reached, or no token that goes on (a rule that never produces a value):
            # the output ends where it is, as vLLM's guidance backend ends it, with a warning.
            logger.warning("structured_outputs: llguidance stopped (%s); ending the output unfinished",
                           matcher.get_error().splitlines()[0])
            return self._eos_token_ids
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        return bits[: self._vocab_size].view(np.bool_)

    def advance(self, matcher: Any, token_id: int) -> Any:
        """The state after `token_id` (the matcher, moved on); None off the grammar."""
        if matcher is None or token_id in self._eos_token_ids:
            return None
        matcher.consume_token(token_id)  # a token it refuses leaves it in its error state
        return matcher

