"""Regular expressions as automata over UTF-8 bytes, for structured outputs. Plain Python.

`ByteDFA(pattern)` compiles a regular expression in Python's syntax, with ASCII meanings for
`\\d`, `\\w` and `\\s` (as `re.ASCII`, and as vLLM's grammar backends read them), into a
Thompson NFA over bytes, whose deterministic states are built as generation reaches them
(subset construction on demand). A state is dead once no byte sequence leads from it to
acceptance; `step` never returns one. The language is that of `re.fullmatch(pattern, text,
re.ASCII)` over the UTF-8 of `text`: the tests check it against `re` itself.

Supported: literals and escapes (`\\n`, `\\t`, `\\xhh`, `\\uhhhh`, escaped punctuation), `.`
(any character but a newline), classes (`[a-z]`, `[^"\\\\]`, `\\d`, `\\w`, `\\s` and their negations),
groups (`(...)`, `(?:...)`, `(?P<name>...)`), alternation, the quantifiers `*`, `+`, `?`,
`{m}`, `{m,}`, `{m,n}` (lazy forms match the same texts), and `^` / `$` at the ends. What a
finite automaton cannot express or this parser does not know (backreferences, lookaround, word
boundaries, flags, possessive quantifiers) is a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import re

MAX_NFA_STATES = 50_000
"""A bound on the automaton's size (counted repetitions such as `{1,5000}` copy their body)."""

_MAX_CODE_POINT = 0x10FFFF
_DIGITS = re.compile("[0-9]*")
"""A count's digits: ASCII ones, as `re` reads them."""
_SURROGATES = (0xD800, 0xDFFF)
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20))
_CLASS_ESCAPES = {"d": (_DIGIT, False), "D": (_DIGIT, True), "w": (_WORD, False), "W": (_WORD, True),
                  "s": (_SPACE, False), "S": (_SPACE, True)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_UNSUPPORTED_ESCAPES = {"b": "word boundaries", "B": "word boundaries", "A": "anchors", "Z": "anchors",
                        "z": "anchors", "G": "anchors", "p": "Unicode property classes",
                        "P": "Unicode property classes"}


# ---- parsing: pattern -> syntax tree ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Chars:
    """One character out of these code point ranges (sorted, disjoint)."""

    ranges: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Concat:
    items: tuple


@dataclasses.dataclass(frozen=True, slots=True)
class _Alternation:
    options: tuple


@dataclasses.dataclass(frozen=True, slots=True)
class _Repeat:
    item: object
    min: int
    max: int | None
    """None: unbounded."""


def _normalise(ranges) -> tuple[tuple[int, int], ...]:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    result, start = [], 0
    for lo, hi in _normalise(ranges):
        if lo > start:
            result.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODE_POINT:
        result.append((start, _MAX_CODE_POINT))
    return tuple(result)


MAX_GROUP_DEPTH = 100
"""Deepest nesting of groups a pattern may have: the parser and the walks over its tree recurse
once per level (5,000 nested groups overflowed Python's stack, a server error)."""


class _Parser:
    """A recursive-descent parser of the supported syntax."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0
        self.depth = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {self.pattern!r} at position {self.pos}: {what}")

    def peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def take(self) -> str:
        if self.pos >= len(self.pattern):
            raise self.error("unexpected end of pattern")
        char = self.pattern[self.pos]
        self.pos += 1
        return char

    def parse(self):
        if self.peek() == "^":
            self.pos += 1
        tree = self.alternation()
        if self.peek() == "$":
            self.pos += 1
        if self.pos != len(self.pattern):
            raise self.error("'$' only at the end, or an unbalanced ')'" if self.peek() in "$)"
                             else f"unexpected {self.peek()!r}")
        return tree

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else _Alternation(tuple(options))

    def concatenation(self):
        items = []
        while (char := self.peek()) is not None and char not in "|)":
            if char == "$" and self.pos == len(self.pattern) - 1:
                break
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else _Concat(tuple(items))

    def quantified(self, item):
        """`item` under the quantifiers that follow it, if any. A quantifier may follow another
        (`a{2}{3}`, `a**`): Python's `re` calls that a multiple repeat, but vLLM serves it (its
        llguidance fallback takes it). Each nests the tree one level deeper, so a run of them counts
        toward MAX_GROUP_DEPTH with the groups around it (1,000 stars were a RecursionError)."""
        stacked = 0
        while (bounds := self.quantifier()) is not None:
            if self.peek() == "?":
                self.pos += 1  # lazy: the same texts match
            elif self.peek() == "+":
                raise self.error("possessive quantifiers are not supported")
            stacked += 1
            if self.depth + stacked > MAX_GROUP_DEPTH:
                raise self.error(f"groups and quantifiers in a row nest deeper than {MAX_GROUP_DEPTH} levels")
            item = _Repeat(item, *bounds)
        return item

    def quantifier(self) -> tuple[int, int | None] | None:
        """The bounds of the quantifier at the position (`*`, `+`, `?` or a count), taken; None where
        there is none."""
        char = self.peek()
        if char == "{":
            return self.counted()
        if char is None or char not in "*+?":
            return None
        self.pos += 1
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]

    def counted(self) -> tuple[int, int | None] | None:
        """{m}, {m,}, {,n}, {m,n} or {,}; None where '{' is a literal (as in Python)."""
        end = self.pattern.find("}", self.pos)
        body = self.pattern[self.pos + 1 : end] if end > 0 else ""
        low, comma, high = body.partition(",")
        if end < 0 or not (_DIGITS.fullmatch(low) and _DIGITS.fullmatch(high) and (low or comma)):
            return None
        if not comma:
            high = low
        self.pos = end + 1
        low_count, high_count = int(low or 0), (int(high) if high else None)
        if high_count is not None and high_count < low_count:
            raise self.error(f"min repeat greater than max repeat in {{{body}}}")
        return low_count, high_count

    def atom(self):
        char = self.take()
        if char == "(":
            return self.group()
        if char == "[":
            return _Chars(self.char_class())
        if char == ".":
            return _Chars(_complement([(0x0A, 0x0A)]))
        if char == "\\":
            return self.escape(in_class=False)
        if char in "*+?":
            raise self.error(f"nothing to repeat before {char!r}")
        if char in "^$":
            raise self.error(f"{char!r} is supported only at the pattern's ends")
        return _Chars(((ord(char), ord(char)),))

    def group(self):
        if self.peek() == "?":
            self.pos += 1
            kind = self.take()
            if kind == "P" and self.peek() == "<":
                end = self.pattern.find(">", self.pos)
                if end < 0:
                    raise self.error("unterminated group name")
                self.pos = end + 1
            elif kind != ":":
                raise self.error(f"'(?{kind}' (lookaround, flags, backreferences) is not supported")
        self.depth += 1
        if self.depth > MAX_GROUP_DEPTH:
            raise self.error(f"groups nest deeper than {MAX_GROUP_DEPTH} levels")
        tree = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.pos += 1
        return tree

    def escape(self, *, in_class: bool):
        """The tree (outside a class) or code point ranges (inside) of an escape after '\\'."""
        char = self.take()
        if char in _CLASS_ESCAPES:
            ranges, negated = _CLASS_ESCAPES[char]
            ranges = _complement(ranges) if negated else ranges
            return ranges if in_class else _Chars(ranges)
        if char in _UNSUPPORTED_ESCAPES or (char.isdigit() and char != "0"):
            what = _UNSUPPORTED_ESCAPES.get(char, "backreferences")
            raise self.error(f"\\{char}: {what} are not supported")
        if char in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[char]
            digits = self.pattern[self.pos : self.pos + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{char} needs {width} hex digits")
            self.pos += width
            code = int(digits, 16)
        elif char in _CHAR_ESCAPES:
            code = ord(_CHAR_ESCAPES[char])
        elif char.isalnum():
            raise self.error(f"unknown escape \\{char}")
        else:
            code = ord(char)  # escaped punctuation, as re.escape writes it
        return ((code, code),) if in_class else _Chars(((code, code),))

    def char_class(self) -> tuple[tuple[int, int], ...]:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            char = self.take()
            if char == "]" and not first:
                break
            first = False
            if char == "\\":
                items = self.escape(in_class=True)
                if len(items) != 1 or items[0][0] != items[0][1]:
                    ranges.extend(items)
                    continue
                low = items[0][0]
            else:
                low = ord(char)
            if self.peek() == "-" and self.pos + 1 < len(self.pattern) and self.pattern[self.pos + 1] != "]":
                self.pos += 1
                end = self.take()
                if end == "\\":
                    items = self.escape(in_class=True)
                    if len(items) != 1 or items[0][0] != items[0][1]:
                        raise self.error("a class escape cannot end a range")
                    high = items[0][0]
                else:
                    high = ord(end)
                if high < low:
                    raise self.error(f"bad character range {chr(low)}-{chr(high)}")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        return _complement(ranges) if negated else _normalise(ranges)


# ---- UTF-8: code point ranges -> byte range sequences ------------------------------------------


def _utf8_length(code: int) -> int:
    return 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4


def utf8_sequences(low: int, high: int) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of code points [low, high] (surrogates left out) as sequences of byte
    ranges: a text's bytes match one sequence exactly when they encode a code point in range."""
    sequences: list[list[tuple[int, int]]] = []
    pending = [(low, high)]
    while pending:
        low, high = pending.pop()
        if low > high:
            continue
        if low <= _SURROGATES[1] and high >= _SURROGATES[0]:  # split out the surrogates
            pending += [(low, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, high)]
            continue
        for boundary in (0x7F, 0x7FF, 0xFFFF):  # one encoding length per range
            if low <= boundary < high:
                pending += [(low, boundary), (boundary + 1, high)]
                break
        else:
            if not _split_for_uniform_bytes(low, high, pending):
                encoded_low, encoded_high = chr(low).encode(), chr(high).encode()
                sequences.append(list(zip(encoded_low, encoded_high, strict=True)))
    return sequences


def _split_for_uniform_bytes(low: int, high: int, pending: list[tuple[int, int]]) -> bool:
    """Split [low, high] (one encoding length) where its continuation bytes would not each span a
    whole range; False when no split is needed."""
    for trailing in range(1, _utf8_length(low)):
        mask = (1 << (6 * trailing)) - 1
        if low & ~mask != high & ~mask:
            if low & mask:
                pending += [(low, low | mask), ((low | mask) + 1, high)]
                return True
            if high & mask != mask:
                pending += [(low, (high & ~mask) - 1), (high & ~mask, high)]
                return True
    return False


# ---- JSON strings: a pattern over a string's value -> one over its JSON text -------------------

_JSON_MUST_ESCAPE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
"""Code points a JSON string cannot hold as themselves: controls, '"' and '\\'."""
_JSON_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r",
                       0x09: "\\t"}


def json_string_regex(pattern: str) -> str:
    """The regex of the JSON texts (quotes included) of the strings that match `pattern` whole.

    A character JSON must escape is matched in the one form `json.dumps` writes it (`\\"`,
    `\\n`, `\\u001f`, ...), every other character as itself, so every match is a valid JSON
    string whose value matches the pattern."""
    return f'"{_regex_text(_json_encoded(_Parser(pattern).parse()))}"'


def _json_encoded(tree):
    if isinstance(tree, _Chars):
        plain = _subtract(tree.ranges, _JSON_MUST_ESCAPE)
        escaped = [code for low, high in _intersect(tree.ranges, _JSON_MUST_ESCAPE)
                   for code in range(low, high + 1)]
        options = ([_Chars(plain)] if plain else []) + [
            _Concat(tuple(_Chars(((ord(char), ord(char)),)) for char in _json_escape(code)))
            for code in escaped]
        return options[0] if len(options) == 1 else _Alternation(tuple(options)) if options else tree
    if isinstance(tree, _Concat):
        return _Concat(tuple(_json_encoded(item) for item in tree.items))
    if isinstance(tree, _Alternation):
        return _Alternation(tuple(_json_encoded(option) for option in tree.options))
    return _Repeat(_json_encoded(tree.item), tree.min, tree.max)


def _json_escape(code: int) -> str:
    return _JSON_SHORT_ESCAPES.get(code, f"\\u{code:04x}")


def _intersect(ranges, others) -> tuple[tuple[int, int], ...]:
    return _normalise((max(lo, other_lo), min(hi, other_hi))
                      for lo, hi in ranges for other_lo, other_hi in others
                      if max(lo, other_lo) <= min(hi, other_hi))


def _subtract(ranges, others) -> tuple[tuple[int, int], ...]:
    return _intersect(ranges, _complement(others))


def _regex_text(tree) -> str:
    """A tree written back as a pattern the parser reads as the same tree."""
    if isinstance(tree, _Chars):
        if not tree.ranges:
            return f"[^\\x00-\\U{_MAX_CODE_POINT:08x}]"
        return "[" + "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}"
                             for lo, hi in tree.ranges) + "]"
    if isinstance(tree, _Concat):
        return "(?:" + "".join(_regex_text(item) for item in tree.items) + ")"
    if isinstance(tree, _Alternation):
        return "(?:" + "|".join(_regex_text(option) for option in tree.options) + ")"
    return f"(?:{_regex_text(tree.item)}){{{tree.min},{'' if tree.max is None else tree.max}}}"


# ---- automata ------------------------------------------------------------------------------------


class _NFA:
    """Thompson's construction: states with epsilon edges and byte-range edges."""

    def __init__(self) -> None:
        self.epsilon: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise ValueError(f"regex too large: its automaton passes {MAX_NFA_STATES} states")
        self.epsilon.append([])
        self.edges.append([])
        return len(self.edges) - 1

    def build(self, tree, start: int) -> int:
        """Add `tree` from state `start`; returns the state where it ends."""
        if isinstance(tree, _Chars):
            end = self.state()
            for low, high in tree.ranges:
                for sequence in utf8_sequences(low, high):
                    state = start
                    for index, (byte_low, byte_high) in enumerate(sequence):
                        target = end if index == len(sequence) - 1 else self.state()
                        self.edges[state].append((byte_low, byte_high, target))
                        state = target
            return end
        if isinstance(tree, _Concat):
            for item in tree.items:
                start = self.build(item, start)
            return start
        if isinstance(tree, _Alternation):
            end = self.state()
            for option in tree.options:
                branch = self.state()
                self.epsilon[start].append(branch)
                self.epsilon[self.build(option, branch)].append(end)
            return end
        if isinstance(tree, _Repeat):
            for _ in range(tree.min):
                start = self.build(tree.item, start)
            if tree.max is None:  # a loop: start -> body -> start
                body = self.state()
                self.epsilon[start].append(body)
                self.epsilon[self.build(tree.item, body)].append(start)
                return start
            end = self.state()
            for _ in range(tree.max - tree.min):
                self.epsilon[start].append(end)
                start = self.build(tree.item, start)
            self.epsilon[start].append(end)
            return end
        raise TypeError(tree)


class ByteDFA:
    """A regular expression's deterministic automaton over bytes, built as it is walked.

    States are ints: `start`, then whatever `step` returns (None: no text that goes on this way
    can match). `accepts(state)`: the bytes so far match the whole pattern."""

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise ValueError(f"regex must be a string, got {pattern!r}")
        nfa = _NFA()
        start = nfa.state()
        self._accept_nfa = nfa.build(_Parser(pattern).parse(), start)
        self._nfa = nfa
        self._live = self._live_nfa_states()
        self._ids: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        self._transitions: list[dict[int, int | None]] = []
        closure = self._closure({start})
        if not closure:
            raise ValueError(f"regex {pattern!r} matches no text")
        self.start = self._intern(closure)

    def _live_nfa_states(self) -> list[bool]:
        """Which NFA states can still reach acceptance (a backward search from it)."""
        predecessors: list[list[int]] = [[] for _ in self._nfa.edges]
        for state, (epsilon, edges) in enumerate(zip(self._nfa.epsilon, self._nfa.edges, strict=True)):
            for target in epsilon:
                predecessors[target].append(state)
            for _, _, target in edges:
                predecessors[target].append(state)
        live = [False] * len(self._nfa.edges)
        live[self._accept_nfa] = True
        pending = [self._accept_nfa]
        while pending:
            for state in predecessors[pending.pop()]:
                if not live[state]:
                    live[state] = True
                    pending.append(state)
        return live

    def _closure(self, states) -> frozenset[int]:
        """The live states reachable from `states` by epsilon edges."""
        seen, pending = set(states), list(states)
        while pending:
            for target in self._nfa.epsilon[pending.pop()]:
                if target not in seen:
                    seen.add(target)
                    pending.append(target)
        return frozenset(state for state in seen if self._live[state])

    def _intern(self, states: frozenset[int]) -> int:
        state_id = self._ids.get(states)
        if state_id is None:
            state_id = self._ids[states] = len(self._sets)
            self._sets.append(states)
            self._transitions.append({})
        return state_id

    def step(self, state: int, byte: int) -> int | None:
        transitions = self._transitions[state]
        if byte not in transitions:
            targets = {target for nfa_state in self._sets[state]
                       for low, high, target in self._nfa.edges[nfa_state] if low <= byte <= high}
            closure = self._closure(targets)
            transitions[byte] = self._intern(closure) if closure else None
        return transitions[byte]

    def accepts(self, state: int) -> bool:
        return self._accept_nfa in self._sets[state]

    def matches(self, data: bytes) -> bool:
        """Whether `data` as a whole matches (what `re.fullmatch` says of its text)."""
        state: int | None = self.start
        for byte in data:
            state = self.step(state, byte)
            if state is None:
                return False
        return self.accepts(state)


@functools.lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> ByteDFA:
    """`ByteDFA(pattern)`, kept for the next request with the same pattern (an automaton's states
    and transitions, built as texts reach them, serve every text alike)."""
    return ByteDFA(pattern)
